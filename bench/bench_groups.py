"""Servers on groups of GPUs (issue 22 §1, Proof): 8 simulated GPUs as 2 TP4 servers of a 70B-class
dense model (dense-70b-96gb: its 131 GB of weights fit no single 96 GB GPU), beside the same 8 GPUs as
8 TP1 servers of the seed's 27B hybrid (seed-27b-96gb), measured in the same run, same prompts.

Each fleet: real `rq worker` processes on queues `<run>.gpu0-3`, `<run>.gpu4-7` (or `<run>.gpuN`), each
owning a simulated SGLang server it starts with CUDA_VISIBLE_DEVICES of its group and `--tp-size 4`.
The workers are started and serving before the prompts are enqueued (the head feeds the rest, as in
a run), so the clock runs from the enqueue to the last result.

For each fleet it prints, per server:
- capacity predicted: the simulator's memory model (sglang_sim.memory.plan_memory on the server's
  layout, as SGLang sizes it), summed over DP ranks;
- capacity the worker read at start (`effective_max_running_requests_per_dp` of /server_info, summed
  over DP ranks: the worker's status record);
- capacity measured: the most requests the server ever ran at once (the simulator's record);
and for the fleet: tokens/s (completion tokens per wall second, and per simulated second = the GPU
figure), the tokens/s the step model predicts at capacity, and every prompt exactly once (export:
lost, duplicated).

    .venv/bin/python bench/bench_groups.py [--prompts 1024] [--tokens 128] [--time-scale 2]
        [--max-running 128]

`--max-running` is BATCHFLEET_MAX_RUNNING_REQUESTS for the 70B servers (SGLang's own estimate lets a
TP4 server of this model run ~2,000 at once, more than this box can keep in flight); 0 leaves it unset.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchfleet.records import WorkerState  # noqa: E402
from bench.bench_seed import exactly_once, write_seed_prompts  # noqa: E402
from fleetrun.redisproc import PrivateRedis  # noqa: E402
from sglang_sim.memory import plan_memory, slots_per_request  # noqa: E402
from sglang_sim.parallel import Layout  # noqa: E402
from sglang_sim.profiles import get_profile  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

FLEETS = {
    # name -> (profile, GPU groups)
    "70B dense, 2 x TP4": ("dense-70b-96gb", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    "27B hybrid, 8 x TP1": ("seed-27b-96gb", [(g,) for g in range(8)]),
}


def label(group: tuple[int, ...]) -> str:
    return f"gpu{group[0]}" if len(group) == 1 else f"gpu{group[0]}-{group[-1]}"


def predicted(profile_name: str, tp: int, max_running: int | None) -> dict[str, float]:
    """Capacity and tokens/s of one server as the simulator's memory and step models size it (the same
    formulas the simulated server runs; no request is sent)."""
    prof = get_profile(profile_name)
    layout = Layout(tp=tp)
    ratio = slots_per_request("extra_buffer", overlap=True, radix=True) if prof.hybrid else 1
    flags = {"max_running_requests": max_running} if max_running else {}
    plan = plan_memory(prof, flags, ratio=ratio, layout=layout)
    cap = plan.effective_max_running * layout.num_dp_ranks
    step = prof.decode_step_s(cap) * layout.step_factor
    return {"capacity": cap, "tokens_per_s": cap / step, "weight_gb": plan.weight_gb, "kv_gb": plan.kv_gb}


def run_fleet(tmp: Path, redis_url: str, name: str, *, prompts: int, tokens: int, time_scale: float,
              max_running: int | None, tag: str) -> dict[str, Any]:
    profile, groups = FLEETS[name]
    env = {"SGLANG_SIM_PROFILE": profile, "BATCHFLEET_MODEL_PATH": get_profile(profile).model_path,
           "SGLANG_SIM_TIME_SCALE": str(time_scale), "SGLANG_SIM_STARTUP_S": "0.5", "SGLANG_SIM_NUM_GPUS": "8",
           "BATCHFLEET_SHUTDOWN_GRACE_S": "5",
           "BATCHFLEET_HEALTH_INTERVAL_S": "30", "BATCHFLEET_STATUS_INTERVAL_S": "0.5"}
    tp = len(groups[0])
    if max_running and tp > 1:
        env["BATCHFLEET_MAX_RUNNING_REQUESTS"] = str(max_running)
    work = tmp / tag
    work.mkdir()
    fleet = Fleet(work, redis_url, run=f"groups-{tag}", prefix=f"{tag}.", gpus=8, env=env)
    write_seed_prompts(work / "prompts.jsonl", prompts, min_tokens=tokens, max_tokens=tokens)
    try:
        for g in groups:
            fleet.start_worker(label(g))
        fleet.wait_for(lambda: sum(s.state is WorkerState.SERVING for s in fleet.statuses()) == len(groups), 180,
                       f"{len(groups)} workers serving")
        statuses = {s.queue: s for s in fleet.statuses()}
        fleet.start_head()  # feeds each queue its window (2 x its server's capacity) until the run is fed
        queues = ",".join(fleet.queue(label(g)) for g in groups)
        t0 = time.monotonic()
        fleet.producer("enqueue", "prompts.jsonl", "--queues", queues)
        fleet.wait_for(lambda: fleet.finished() >= prompts, 1800, f"all {prompts} prompts")
        wall = time.monotonic() - t0
        fleet.stop_all()
    finally:
        fleet.kill_all()
    lost, duplicated = exactly_once(fleet, prompts)
    servers = []
    for g in groups:
        rec = fleet.sim_record(label(g))
        st = statuses[fleet.queue(label(g))]
        servers.append({"queue": st.queue, "read": st.effective_max, "measured": rec["peak_running"],
                        "gpus": rec["gpu_indices"], "tp": rec["flags"].get("tp_size") or 1,
                        "served": sum(rec["requests_by_endpoint"].values())})
    return {"name": name, "profile": profile, "tp": tp, "servers": servers, "wall": wall,
            "tokens": prompts * tokens, "prompts": prompts, "lost": lost, "duplicated": duplicated,
            "succeeded": fleet.stats().get("succeeded", 0),
            "predicted": predicted(profile, tp, max_running if tp > 1 else None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per prompt (ignore_eos)")
    ap.add_argument("--time-scale", type=float, default=2.0, help="simulated seconds per wall second")
    ap.add_argument("--max-running", type=int, default=128, help="BATCHFLEET_MAX_RUNNING_REQUESTS of the TP4 "
                    "servers (0: unset)")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores); 8 simulated GPUs, {args.prompts} prompts "
          f"x {args.tokens} tokens per fleet, time scale {args.time_scale:g}")
    results = []
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory(prefix="bench-groups-") as tmp:
        for i, name in enumerate(FLEETS):
            results.append(run_fleet(Path(tmp), redis_proc.url, name, prompts=args.prompts, tokens=args.tokens,
                                     time_scale=args.time_scale, max_running=args.max_running or None,
                                     tag=f"f{i}"))
    ok = True
    for res in results:
        pred = res["predicted"]
        per_s = res["tokens"] / res["wall"]
        res["model_tokens_per_s"] = per_s / args.time_scale
        print(f"{res['name']} ({res['profile']}): {pred['weight_gb']:.1f} GB of weights and {pred['kv_gb']:.1f} GB "
              f"of KV per GPU")
        for s in res["servers"]:
            print(f"  {s['queue']:<12} GPUs {','.join(map(str, s['gpus']))} --tp-size {s['tp']}: capacity predicted "
                  f"{pred['capacity']:.0f}, read by the worker {s['read']}, measured (peak running) {s['measured']}; "
                  f"{s['served']} prompts")
        fleet_pred = pred["tokens_per_s"] * len(res["servers"])
        print(f"  fleet: capacity predicted {pred['capacity'] * len(res['servers']):.0f}, read "
              f"{sum(s['read'] for s in res['servers'])}, measured {sum(s['measured'] for s in res['servers'])}; "
              f"{per_s:,.0f} tokens/s wall = {res['model_tokens_per_s']:,.0f} per simulated second "
              f"(step model at capacity: {fleet_pred:,.0f}); {res['wall']:.1f} s")
        print(f"  prompts: {res['succeeded']}/{res['prompts']} succeeded, lost {res['lost']}, "
              f"duplicated {res['duplicated']}")
        ok &= res["lost"] == 0 and res["duplicated"] == 0 and res["succeeded"] == res["prompts"]
        ok &= all(s["measured"] <= s["read"] == pred["capacity"] for s in res["servers"])
    big, base = results
    tps = big["model_tokens_per_s"] / base["model_tokens_per_s"]
    cap = sum(s["read"] for s in big["servers"]) / sum(s["read"] for s in base["servers"])
    print(f"ratio 70B on 2 x TP4 / 27B on 8 x TP1 (same GPUs): tokens/s x{tps:.2f}, capacity x{cap:.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

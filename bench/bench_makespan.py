"""Time to finish the whole job (issue 9 §6, issue 22 §4): the seed scenario's makespan four ways, same
prompts, same simulated GPUs, one after the other:

    (a) none      no supervisor: the fleet stays on the default strategy (37 slots per GPU)
    (b) watch     `supervisor watch` from the default start: it must find the stall, canary, roll out
    (b2) again    a second supervised run of the same model on the same GPUs, SGLang version and shape,
                  in the same Redis as (b): it starts on what (b) verified (the fleet's memory)
    (c) oracle    workers started on the best spec (no_buffer, mem 0.90, max 128: 72 slots)

Goals: (b) <= 1.15 x (c); (b2) <= 1.03 x (c). Makespan is from the moment the workers are started
(servers start included, as in a real run) until the last prompt has a result; every run is checked
exactly-once. (a) and (c) get a fresh private Redis each; (b) and (b2) share one (b2 after b), and
their workers share a state dir (the same hosts: each worker knows the kind of its last server).

    python bench/bench_makespan.py [--gpus 8] [--prompts 6000] [--time-scale 1.5] [--only b,b2,c]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_seed import SUPERVISOR_ARGS, SupervisorProc, exactly_once, seed_env, write_seed_prompts  # noqa: E402
from tests.fleet import BIN, Fleet  # noqa: E402

ORACLE = {"BATCHFLEET_STRATEGY": "no_buffer", "BATCHFLEET_MEM_FRACTION_STATIC": "0.9",
          "BATCHFLEET_MAX_RUNNING_REQUESTS": "128"}
MODES = {"a": "none", "b": "watch", "b2": "again", "c": "oracle"}


def run_mode(mode: str, tmp: Path, redis_url: str, *, gpus: int, prompts: int, time_scale: float,
             tokens: tuple[int, int], window_s: float, rollout_batch: int, png: Path | None,
             state_dir: Path | None = None) -> dict[str, Any]:
    env = {**seed_env(time_scale), **(ORACLE if mode == "c" else {}),
           **({"BATCHFLEET_STATE_DIR": str(state_dir)} if state_dir else {})}
    fleet = Fleet(tmp, redis_url, run=f"makespan-{mode}", gpus=gpus, env=env)
    write_seed_prompts(tmp / "prompts.jsonl", prompts, min_tokens=tokens[0], max_tokens=tokens[1])
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    sup = None
    try:
        t0, t0_wall = time.monotonic(), time.time()
        for g in range(gpus):
            fleet.start_worker(g)
        if mode in ("b", "b2"):
            sup = SupervisorProc(fleet, *SUPERVISOR_ARGS, "--window", str(window_s), "--verify-windows", "2",
                                 "--rollout-batch", str(rollout_batch))
        fleet.wait_for(lambda: fleet.finished() >= prompts, 3600, f"all {prompts} prompts")
        makespan = time.monotonic() - t0
        slots = sorted({s.effective_max for s in fleet.statuses()})
        if mode == "b" and sup is not None and png is not None:
            done = subprocess.run([str(BIN / "supervisor"), "report", str(png), "--title",
                                   f"makespan (b): {gpus} simulated GPUs, supervisor watch from the default start"],
                                  env=fleet.env, capture_output=True, text=True, check=True)
            print(done.stdout.strip())
    finally:
        if sup is not None:
            sup.stop()
        fleet.stop_all()
    lost, duplicated = exactly_once(fleet, prompts)
    out: dict[str, Any] = {"mode": MODES[mode], "makespan_s": makespan, "slots_at_end": slots, "lost": lost,
                           "duplicated": duplicated}
    if sup is not None:
        decision = next((e for e in sup.events("decision") if "windows" in e.data), None)
        recalled = next((e for e in sup.events("decision") if e.data.get("recalled")), None)
        canary = next(iter(sup.events("canary")), None)
        rolled = next(iter(sup.events("rolled_out")), None)
        out.update(
            decided_after_s=None if decision is None else decision.ts - t0_wall,
            canary=None if canary is None else canary.message,
            rolled_out_after_s=None if rolled is None else rolled.ts - t0_wall,
            recalled_after_s=None if recalled is None else recalled.ts - t0_wall,
            recalled=None if recalled is None else recalled.message,
            restarts=len(sup.events("restarted")), log=sup.output())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6000)
    parser.add_argument("--tokens", type=int, nargs=2, default=(400, 800), metavar=("MIN", "MAX"))
    # 8 workers + 8 simulators on 2 cores: at 1.5 simulated seconds per wall second the workers keep
    # 8 x 72 requests in flight (bench_seed's finding); faster and our side becomes the bottleneck.
    parser.add_argument("--time-scale", type=float, default=1.5)
    parser.add_argument("--window", type=float, default=4.0)
    parser.add_argument("--rollout-batch", type=int, default=2)
    parser.add_argument("--only", default="a,b,c", help="modes to run, e.g. b,c")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "makespan-supervised.png")
    args = parser.parse_args()
    from fleetrun.redisproc import PrivateRedis

    results = {}
    with contextlib.ExitStack() as shared:
        supervised = None  # (b) and (b2) meet in one Redis: it holds the fleet's memory between them
        hosts = Path(shared.enter_context(tempfile.TemporaryDirectory(prefix="bench-makespan-hosts-")))
        for mode in args.only.split(","):
            with contextlib.ExitStack() as own, tempfile.TemporaryDirectory(prefix=f"bench-makespan-{mode}-") as tmp:
                if mode in ("b", "b2"):
                    supervised = supervised or shared.enter_context(PrivateRedis())
                    url = supervised.url
                else:
                    url = own.enter_context(PrivateRedis()).url
                res = run_mode(mode, Path(tmp), url, gpus=args.gpus, prompts=args.prompts,
                               time_scale=args.time_scale, tokens=tuple(args.tokens), window_s=args.window,
                               rollout_batch=args.rollout_batch, png=args.png,
                               state_dir=hosts / "state" if mode in ("b", "b2") else None)
            results[mode] = res
            print(f"({mode}) {res['mode']}: makespan {res['makespan_s']:.1f} s, slots {res['slots_at_end']}, "
                  f"lost {res['lost']}, duplicated {res['duplicated']}", flush=True)
            if "log" in res:
                print(res.pop("log"))
    print(f"\nmakespan, {args.gpus} simulated GPUs (seed-27b-96gb), {args.prompts} prompts of {args.tokens[0]}-"
          f"{args.tokens[1]} tokens, time scale {args.time_scale:g}:")
    oracle = results.get("c", {}).get("makespan_s")
    for mode, res in results.items():
        ratio = f"  {res['makespan_s'] / oracle:.3f} x (c)" if oracle else ""
        print(f"  ({mode:<2}) {res['mode']:<7} {res['makespan_s']:8.1f} s{ratio}")
    if "b" in results:
        b = results["b"]
        print(f"  (b) decided after {b['decided_after_s']:.0f} s, rolled out after {b['rolled_out_after_s']:.0f} s, "
              f"{b['restarts']} restarts; {b['canary']}")
    if "b2" in results:
        b2 = results["b2"]
        when = "never" if b2["recalled_after_s"] is None else f"after {b2['recalled_after_s']:.0f} s"
        print(f"  (b2) recalled {when}, {b2['restarts']} restarts; {b2['recalled']}")
    ok = all(r["lost"] == 0 and r["duplicated"] == 0 for r in results.values())
    if oracle and "b" in results:
        ok = ok and results["b"]["makespan_s"] <= 1.15 * oracle
    if oracle and "b2" in results:
        ok = ok and results["b2"]["makespan_s"] <= 1.03 * oracle
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

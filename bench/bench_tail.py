"""The tail of a run (issue 11 §3): makespan against its lower bound on mixed max_tokens 16/256/4000
(4000: tiny-hybrid's context is 4,096 tokens).

lower bound = max(total slot-time / fleet slots, the longest single generation), all in the
simulator's model time, from its own record (`slot_fill`: occupied slot-seconds and the longest
admission-to-finish per rank); makespan = from the first admission on any server to the last
finish on any server (wall clock x time scale, as the servers' model clocks start apart).

Real `rq worker` processes, simulated GPUs (tiny-hybrid: 12 slots each), prompts fed by the
producer (longest expected work first). Baseline and surplus (the default) runs interleaved.

    python bench/bench_tail.py [--gpus 2] [--rounds 2] [--time-scale 20] [--scale 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.redisproc import PrivateRedis  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

MIX = {16: 400, 256: 100, 4000: 8}  # prompts per GPU for each max_tokens (4000: the sim context is 4,096)


def write(path: Path, mix: dict[int, int], seed: int = 5) -> int:
    rows = [tokens for tokens, count in mix.items() for _ in range(count)]
    random.Random(seed).shuffle(rows)  # input order is not the feed order: the head feeds longest first
    with path.open("wb") as f:
        for i, tokens in enumerate(rows):
            f.write(orjson.dumps({"id": f"t{i}", "prompt": f"{i}: tell me about {tokens}", "ignore_eos": True,
                                  "max_tokens": tokens}) + b"\n")
    return len(rows)


def run_once(tmp: Path, redis_url: str, *, gpus: int, surplus: str, time_scale: float, scale: float,
             tag: str) -> dict:
    mix = {t: max(1, round(c * gpus * scale)) for t, c in MIX.items()}
    env = {"SGLANG_SIM_TIME_SCALE": str(time_scale), "BATCHFLEET_SHUTDOWN_GRACE_S": "5",
           "BATCHFLEET_HEALTH_INTERVAL_S": "30", "BATCHFLEET_WINDOW_DEFAULT": str(sum(mix.values()))}
    if surplus:
        env["BATCHFLEET_SURPLUS"] = surplus
    work = tmp / tag
    work.mkdir()
    fleet = Fleet(work, redis_url, run=f"tail-{tag}", prefix=f"{tag}.", gpus=gpus, env=env)
    n = write(work / "prompts.jsonl", mix)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    try:
        for g in range(gpus):
            fleet.start_worker(g)
        fleet.wait_for(lambda: fleet.finished() >= n, 3600, f"all {n} prompts")
        fleet.stop_all()
    finally:
        fleet.kill_all()
    recs = [fleet.sim_record(g) for g in range(gpus)]
    ranks = [rank for rec in recs for rank in rec["slot_fill"]]
    slot_time = sum(rank["slot_s"] for rank in ranks)
    slots = sum(rank["cap"] for rank in ranks)
    longest = max(rank["longest_s"] for rank in ranks)
    first = min(rec["first_admit_wall"] for rec in recs if rec.get("first_admit_wall"))
    last = max(rec["last_finish_wall"] for rec in recs if rec.get("last_finish_wall"))
    makespan = (last - first) * time_scale
    bound = max(slot_time / slots, longest)
    return {"makespan": makespan, "bound": bound, "ratio": makespan / bound, "slot_bound": slot_time / slots,
            "longest": longest, "n": n, "ok": fleet.stats().get("succeeded", 0) == n, "mix": mix}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the prompt counts")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores); {args.gpus} simulated GPUs, "
          f"time scale {args.time_scale}")
    labels = (("baseline (surplus 0)", "0"), ("surplus (from turnover)", ""))
    rows: dict[str, list[dict]] = {label: [] for label, _ in labels}
    t0 = time.monotonic()
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label, surplus in labels:
                rows[label].append(run_once(Path(tmp), redis_proc.url, gpus=args.gpus, surplus=surplus,
                                            time_scale=args.time_scale, scale=args.scale,
                                            tag=f"r{i}{'s' if surplus == '' else 'b'}"))
    mix = next(iter(rows.values()))[0]["mix"]
    print(f"max_tokens -> prompts: {mix} ({sum(mix.values())} prompts), model seconds")
    for label, runs in rows.items():
        for run in runs:
            print(f"  {label:<24}: makespan {run['makespan']:7.1f}  bound {run['bound']:7.1f} (slot-time/slots "
                  f"{run['slot_bound']:.1f}, longest {run['longest']:.1f})  ratio {run['ratio']:.3f}"
                  f"{'' if run['ok'] else '  NOT ALL SUCCEEDED'}")
    print(f"({time.monotonic() - t0:.0f} s) load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

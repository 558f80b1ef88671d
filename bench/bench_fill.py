"""Slot fill (issue 11 §4): how busy the servers' slots are while work remains, read from the
simulator's own record (`slot_fill`: occupied slot-seconds in model time, per rank).

fill = occupied slot-seconds / (capacity x model seconds), until its last admission of a prompt (after
that no work remained for it), from two starts: the moment a server first ran its capacity ("from
full", the figure of issue 11), and its first request ("from the first request", ramp included:
issue 22 §3, where the worker's first claim fills the capacity plus its initial surplus).

Each workload runs twice, interleaved, on fresh fleets of real `rq worker` processes with simulated
GPUs (tiny-hybrid: 12 slots each), same prompts: the baseline keeps exactly the capacity in flight
(`BATCHFLEET_SURPLUS=0`), the other keeps the surplus sized from turnover (the default).

    python bench/bench_fill.py [--gpus 2] [--rounds 2] [--time-scale 1] [--only short,long,mixed]
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

from fleetrun.redisproc import PrivateRedis  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

# name -> (prompts per GPU, max_tokens choices)
WORKLOADS = {"short": (300, (16,)), "long": (40, (256,)), "mixed": (120, (16, 64, 256))}


def write(path: Path, n: int, choices: tuple[int, ...], seed: int = 11) -> None:
    rng = random.Random(seed)
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"f{i}", "prompt": f"{i}: write about {rng.random():.6f}",
                                  "ignore_eos": True, "max_tokens": rng.choice(choices)}) + b"\n")


def fill_of(rec: dict, start: str = "full_at") -> tuple[float, float]:
    """(fill, seconds measured) of one server, summed over its ranks, from `start` ("full_at": the
    moment it first ran its capacity; "first_admit": its first request) to its last admission."""
    slot_s = cap_s = span = 0.0
    for rank in rec.get("slot_fill") or []:
        full, last = rank.get(start), rank["last_admit"]
        if not full or not last or last[0] <= full[0]:
            continue
        slot_s += last[1] - full[1]
        cap_s += rank["cap"] * (last[0] - full[0])
        span = max(span, last[0] - full[0])
    return (slot_s / cap_s if cap_s else float("nan")), span


def run_once(tmp: Path, redis_url: str, name: str, *, gpus: int, surplus: str, time_scale: float,
             tag: str) -> dict:
    per_gpu, choices = WORKLOADS[name]
    n = per_gpu * gpus
    env = {"SGLANG_SIM_TIME_SCALE": str(time_scale), "BATCHFLEET_WINDOW_DEFAULT": str(n),
           "BATCHFLEET_SHUTDOWN_GRACE_S": "5", "BATCHFLEET_HEALTH_INTERVAL_S": "30"}
    if surplus:
        env["BATCHFLEET_SURPLUS"] = surplus
    work = tmp / tag
    work.mkdir()
    fleet = Fleet(work, redis_url, run=f"fill-{tag}", prefix=f"{tag}.", gpus=gpus, env=env)
    write(work / "prompts.jsonl", n, choices)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    try:
        t0 = time.monotonic()
        for g in range(gpus):
            fleet.start_worker(g)
        fleet.wait_for(lambda: fleet.finished() >= n, 1800, f"all {n} prompts")
        wall = time.monotonic() - t0
        surpluses = sorted({s.surplus for s in fleet.statuses()})
        fleet.stop_all()
    finally:
        fleet.kill_all()
    fills = [fill_of(fleet.sim_record(g)) for g in range(gpus)]
    firsts = [fill_of(fleet.sim_record(g), "first_admit") for g in range(gpus)]
    return {"fill": [f for f, _ in fills], "span": [s for _, s in fills], "wall": wall, "surplus": surpluses,
            "first": [f for f, _ in firsts],
            "succeeded": fleet.stats().get("succeeded", 0), "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--only", default="short,long,mixed")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores); {args.gpus} simulated GPUs, "
          f"time scale {args.time_scale}")
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            rows: dict[str, list[dict]] = {"baseline (surplus 0)": [], "surplus (from turnover)": []}
            for i in range(args.rounds):
                for label, surplus in (("baseline (surplus 0)", "0"), ("surplus (from turnover)", "")):
                    tag = f"{name}{i}{'b' if surplus else 's'}"
                    rows[label].append(run_once(Path(tmp), redis_proc.url, name, gpus=args.gpus, surplus=surplus,
                                                time_scale=args.time_scale, tag=tag))
            per_gpu, choices = WORKLOADS[name]
            print(f"{name}: max_tokens {'/'.join(map(str, choices))}, {per_gpu * args.gpus} prompts")
            for label, runs in rows.items():
                fills = [f for run in runs for f in run["fill"]]
                firsts = [f for run in runs for f in run["first"]]
                spans = [s for run in runs for s in run["span"]]
                surpluses = sorted({s for run in runs for s in run["surplus"]})
                ok = all(run["succeeded"] == run["n"] for run in runs)
                walls = " ".join(f"{run['wall']:.1f}" for run in runs)
                print(f"  {label:<24}: from the first request: fill min {min(firsts):.4f}, mean "
                      f"{sum(firsts) / len(firsts):.4f}; from full: min {min(fills):.4f}, mean "
                      f"{sum(fills) / len(fills):.4f}; {len(fills)} servers ({min(spans):.1f}-{max(spans):.1f} s "
                      "each); wall "
                      f"{walls} s; surplus at the end {surpluses}"
                      f"{'' if ok else '  NOT ALL SUCCEEDED'}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""LoRA adapters per line (issue 30): time to finish the whole job when every prompt names one of 20
adapters, fed grouped by adapter (the plan) against input order, and against the same prompts on the
base model alone; on simulated GPUs serving as SGLang 0.5.23 does (docs/simulator.md, LoRA: a running
batch holds at most `--max-loras-per-batch` adapters, the base counting; a load into a GPU slot costs
model time on its forward).

The workload: `--adapters` (20) x `--per-adapter` (500) prompts (completions of 30-80 words, 64-192
token answers), shuffled; adapters of rank 16 on q/k/v/o_proj (PEFT directories), half the lines
naming theirs as `model: "<base>:<adapter>"`, half as `lora_path`. Feeds, each from a fresh private
Redis on `--gpus` (4) simulated GPUs (`llama-8b-a100`), the workers started together with the head:

    grouped   producer enqueue (the plan: an adapter's prompts together, whole units to one server),
              servers with BATCHFLEET_LORA_PATHS and --max-loras-per-batch `--slots` (4)
    input     producer enqueue --no-plan (longest first, then input order: the shuffled file's), the
              same servers
    base      the same prompts without an adapter, on servers without LoRA

Makespan is from the workers' start (servers' start included) to the last result, in wall seconds at
`--time-scale` simulated seconds per wall second; every run is checked exactly once (each custom_id
once in the export, succeeded); "serving" is from the fleet's first admission to its last result (the
servers' start, noisy on a busy machine, aside). Printed per feed: median and range over `--rounds`, the adapter loads
into GPU slots (from the simulators' records: the first load of each adapter on each server counts)
and the evictions among them (a load that pushed another adapter out: a switch), the most adapters
one forward ran with; then the ratios grouped/base (goal <= 1.1), input/base and input/grouped.

    python bench/bench_lora.py [--feeds grouped,input,base] [--rounds 3] [--gpus 4] [--slots 4]
                               [--adapters 20] [--per-adapter 500] [--time-scale 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_prefix import exactly_once  # noqa: E402
from fleetrun.redisproc import PrivateRedis  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VOCAB = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "po", "ru", "sa", "ti", "vu", "we", "xo", "ya", "zu")
         for b in ("n", "r", "s", "t", "l", "m", "k", "p", "d", "g", "b", "f", "h", "v", "z")]
GOAL = 1.1  # grouped / base


def make_rows(adapters: int, per: int, seed: int = 11) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for a in range(adapters):
        for i in range(per):
            row: dict[str, Any] = {"id": f"a{a}-{i}", "max_tokens": rng.choice((64, 128, 192)),
                                   "prompt": " ".join(rng.choice(VOCAB) for _ in range(rng.randint(30, 80)))}
            if i % 2:
                row["model"] = f"{MODEL}:ad{a}"
            else:
                row["lora_path"] = f"ad{a}"
            rows.append(row)
    random.Random(seed + 1).shuffle(rows)
    return rows


def on_base(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("model", "lora_path")}


def make_adapters(tmp: Path, n: int) -> str:
    items = []
    for a in range(n):
        d = tmp / "adapters" / f"ad{a}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32,
                                                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
        items.append(f"ad{a}={d}")
    return ",".join(items)


def env_for(args: argparse.Namespace, lora: str | None) -> dict[str, str]:
    env = {"SGLANG_SIM_PROFILE": "llama-8b-a100", "BATCHFLEET_MODEL_PATH": MODEL,
           "SGLANG_SIM_TIME_SCALE": str(args.time_scale), "SGLANG_SIM_STARTUP_S": "1.0",
           "SGLANG_SIM_NUM_GPUS": str(args.gpus), "BATCHFLEET_SHUTDOWN_GRACE_S": "2",
           "BATCHFLEET_STATUS_INTERVAL_S": "0.5", "BATCHFLEET_HEALTH_INTERVAL_S": "5",
           "BATCHFLEET_STARTUP_TIMEOUT_S": "120"}
    if args.max_running:
        env["BATCHFLEET_MAX_RUNNING_REQUESTS"] = str(args.max_running)
    if lora is not None:
        env["BATCHFLEET_LORA_PATHS"] = lora
        env["BATCHFLEET_MAX_LORAS_PER_BATCH"] = str(args.slots)
    return env


def run_one(feed: str, rows: list[dict[str, Any]], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    ids = [r["id"] for r in rows]
    lora = make_adapters(tmp, args.adapters) if feed != "base" else None
    lines = [on_base(r) for r in rows] if feed == "base" else rows
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(PrivateRedis()).url
        fleet = Fleet(tmp, url, run=feed, gpus=args.gpus, env=env_for(args, lora))
        stack.callback(fleet.kill_all)
        (tmp / "in.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
        fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress",
                       *(["--no-plan"] if feed == "input" else []), timeout_s=900)
        try:
            t0 = time.monotonic()
            for g in range(args.gpus):
                fleet.start_worker(g)
            fleet.start_head()
            fleet.wait_for(lambda: fleet.finished() >= len(ids), args.timeout, f"all {len(ids)} prompts")
            makespan = time.monotonic() - t0
        finally:
            fleet.stop_all()
        lost, duplicated = exactly_once(fleet, ids)
        loads = evictions = peak = 0
        admits, finishes = [], []
        for g in range(args.gpus):
            whole = fleet.sim_record(g)
            if whole.get("first_admit_wall") and whole.get("last_finish_wall"):
                admits.append(whole["first_admit_wall"])
                finishes.append(whole["last_finish_wall"])
            rec = whole.get("lora")
            if rec:
                loads += rec["loads_total"]
                evictions += sum(1 for s in rec["switches"] if s[3] is not None)
                peak = max(peak, rec["peak_adapters_in_batch"])
        span = max(finishes) - min(admits) if admits else makespan
        return {"makespan_s": makespan, "span_s": span, "lost": lost, "duplicated": duplicated, "loads": loads,
                "evictions": evictions, "peak_adapters": peak}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} s ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--feeds", default="grouped,input,base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4, help="--max-loras-per-batch")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--per-adapter", type=int, default=500)
    ap.add_argument("--max-running", type=int, default=128, help="BATCHFLEET_MAX_RUNNING_REQUESTS (0: the server's)")
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    args = ap.parse_args()
    feeds = args.feeds.split(",")
    rows = make_rows(args.adapters, args.per_adapter)
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in feeds}
    for r in range(args.rounds):
        for feed in feeds:  # interleaved, so a drift of the machine falls on every feed alike
            with tempfile.TemporaryDirectory(prefix=f"bench-lora-{feed}-") as tmp:
                res = run_one(feed, rows, Path(tmp), args)
            results[feed].append(res)
            print(f"round {r + 1} {feed}: {res['makespan_s']:.1f} s (serving {res['span_s']:.1f} s), adapter loads "
                  f"{res['loads']} "
                  f"(evictions {res['evictions']}), peak adapters in a forward {res['peak_adapters']}, "
                  f"lost {res['lost']}, duplicated {res['duplicated']}", flush=True)
    print(f"\nLoRA, {args.adapters} adapters x {args.per_adapter} prompts (shuffled), {args.gpus} simulated GPUs "
          f"(llama-8b-a100), --max-loras-per-batch {args.slots}, time scale {args.time_scale:g}, "
          f"{args.rounds} round(s) (median, range):")
    med = {f: statistics.median(x["makespan_s"] for x in results[f]) for f in feeds if results[f]}
    serving = {f: statistics.median(x["span_s"] for x in results[f]) for f in feeds if results[f]}
    for f in feeds:
        runs = results[f]
        print(f"  {f:<8} {spread([x['makespan_s'] for x in runs])}, serving {spread([x['span_s'] for x in runs])}"
              f"  adapter loads "
              f"{statistics.median(x['loads'] for x in runs):g}, evictions (switches) "
              f"{statistics.median(x['evictions'] for x in runs):g}, peak adapters in a forward "
              f"{max(x['peak_adapters'] for x in runs)}")
    parts = []
    if "grouped" in med and "base" in med:
        parts.append(f"grouped / base {med['grouped'] / med['base']:.3f}x (goal <= {GOAL})")
    if "input" in med and "base" in med:
        parts.append(f"input / base {med['input'] / med['base']:.3f}x")
    if "input" in med and "grouped" in med:
        parts.append(f"input / grouped {med['input'] / med['grouped']:.2f}x")
    print("  makespan: " + "; ".join(parts))
    if "grouped" in serving and "base" in serving:
        print(f"  serving (first admission to last result, servers' start aside): grouped / base "
              f"{serving['grouped'] / serving['base']:.3f}x"
              + (f"; input / base {serving['input'] / serving['base']:.3f}x" if "input" in serving else ""))
    lost = sum(x["lost"] for f in feeds for x in results[f])
    dup = sum(x["duplicated"] for f in feeds for x in results[f])
    print(f"  {lost} lost, {dup} duplicated over all runs")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

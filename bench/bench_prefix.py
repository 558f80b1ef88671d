"""The prefix plan (producer/plan.py): time to finish the whole job, planned against input order and an
oracle, on simulated GPUs whose radix cache is SGLang 0.5.23's (docs/simulator.md).

For each profile (the hybrid 27B `seed-27b-96gb`, and the dense `llama-8b-a100`) and workload, three
feeds of the same prompts, each from a fresh private Redis, workers started together, `producer head`
feeding and `supervisor watch` deciding as in a real run:

    planned   producer enqueue (the plan: groups by shared prefix, whole units to servers)
    input     producer enqueue --no-plan (longest first, then input order: the shuffled file's order)
    sorted    (with --feeds ...,sorted) planned from the same prompts sorted by group in the file: input
              order must not matter (goal: shuffled within 1.05x of sorted)
    oracle    each group sent whole to one server, the groups dealt evenly (by tokens, largest first):
              one run per GPU in one Redis, each holding only its groups (a static partition: nothing is
              stolen at the end), on the spec the planned run ended on

Workloads (tokens are the simulator's words):

    docqa     500 documents of 2-4K tokens, 8 questions each, 64-token answers, shuffled
    fewshot   20 templates of about 1.5K tokens, 10,000 prompts (completions), 64-token answers, shuffled
    diverse   4,000 prompts sharing nothing (30-80 tokens, 64-256-token answers), like the demo's sample

Makespan is from the workers' start (servers' start included) to the last result, in wall seconds at
`--time-scale` simulated seconds per wall second; every run is checked exactly once (each custom_id
once in the export, succeeded). Printed: median and range over `--rounds`, the ratios input/planned and
planned/oracle (goals: docqa >= 1.8x and <= 1.05x; fewshot >= 1.5x; diverse >= 0.98x), the fleet's
measured hit rate (cached / prompt tokens, the servers' counters) beside the plan's prediction, and what
the supervisor decided.

    python bench/bench_prefix.py [--profiles hybrid,dense] [--workloads docqa,fewshot,diverse]
                                 [--feeds planned,input,oracle] [--rounds 3] [--gpus 8] [--time-scale 4]
                                 [--scale-workload 1.0]
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
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchfleet.records import Event, WorkerStatus  # noqa: E402
from bench.bench_seed import SupervisorProc  # noqa: E402
from fleetrun.redisproc import PrivateRedis  # noqa: E402
from tests.fleet import Fleet  # noqa: E402

PROFILES = {
    "hybrid": {"SGLANG_SIM_PROFILE": "seed-27b-96gb", "BATCHFLEET_MODEL_PATH": "Qwen/Qwen3.6-27B"},
    "dense": {"SGLANG_SIM_PROFILE": "llama-8b-a100", "BATCHFLEET_MODEL_PATH": "meta-llama/Llama-3.1-8B-Instruct"},
}
GOALS = {"docqa": (1.8, 1.05), "fewshot": (1.5, None), "diverse": (0.98, None)}
SUPERVISOR_ARGS = ("--windows", "3", "--sample", "0.5", "--window", "4", "--verify-windows", "2",
                   "--rollout-batch", "4")
VOCAB = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "po", "ru", "sa", "ti", "vu", "we", "xo", "ya", "zu")
         for b in ("n", "r", "s", "t", "l", "m", "k", "p", "d", "g", "b", "f", "h", "v", "z")]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def make_docqa(rng: random.Random, scale: float) -> list[tuple[dict[str, Any], str]]:
    """(line, group): 500 documents x 8 questions."""
    out = []
    for d in range(max(1, round(500 * scale))):
        doc = words(rng, rng.randint(2000, 4000))
        for q in range(8):
            body = {"model": "default", "max_tokens": 64, "messages": [
                {"role": "system", "content": "Answer the question from the document, briefly."},
                {"role": "user", "content": f"Document:\n{doc}\n\nQuestion {q}: what does it say of "
                                            f"{words(rng, 6)}?"}]}
            out.append(({"custom_id": f"d{d}q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body},
                        f"doc{d}"))
    return out


def make_fewshot(rng: random.Random, scale: float) -> list[tuple[dict[str, Any], str]]:
    """(line, group): 20 templates of ~1.5K tokens, 10,000 prompts."""
    templates = [f"Task {t}: follow the examples.\n" + "\n".join(
        f"Input: {words(rng, 40)}\nOutput: {words(rng, 33)}" for _ in range(20)) for t in range(20)]
    out = []
    for i in range(max(1, round(10_000 * scale))):
        t = rng.randrange(20)
        line = {"custom_id": f"f{i}", "method": "POST", "url": "/v1/completions",
                "body": {"model": "default", "max_tokens": 64, "prompt": f"{templates[t]}\nInput: {words(rng, 20)}\n"
                                                                        "Output:"}}
        out.append((line, f"template{t}"))
    return out


def make_diverse(rng: random.Random, scale: float) -> list[tuple[dict[str, Any], str]]:
    """(line, group): 4,000 prompts that share nothing, chat and completions as the demo's sample."""
    out = []
    for i in range(max(1, round(4000 * scale))):
        text, max_tokens = words(rng, rng.randint(30, 80)), rng.choice((64, 128, 192, 256))
        if i % 2:
            line = {"custom_id": f"v{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "default", "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": text}]}}
        else:
            line = {"custom_id": f"v{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "default", "max_tokens": max_tokens, "prompt": text}}
        out.append((line, f"v{i}"))
    return out


WORKLOADS = {"docqa": make_docqa, "fewshot": make_fewshot, "diverse": make_diverse}


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    with path.open("wb") as f:
        for line in lines:
            f.write(orjson.dumps(line) + b"\n")
    return path


def tokens_of(line: dict[str, Any]) -> int:
    body = line["body"]
    text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
    return len(text.split()) + body["max_tokens"]


def deal_groups(rows: list[tuple[dict[str, Any], str]], n: int) -> list[list[dict[str, Any]]]:
    """The oracle's partition: whole groups, largest first to the least loaded server."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for line, g in rows:
        groups.setdefault(g, []).append(line)
    load, out = [0] * n, [[] for _ in range(n)]
    for lines in sorted(groups.values(), key=lambda ls: -sum(map(tokens_of, ls))):
        i = load.index(min(load))
        out[i] += lines
        load[i] += sum(map(tokens_of, lines))
    return out


def exactly_once(fleet: Fleet, ids: list[str]) -> tuple[int, int]:
    """(lost, duplicated): custom_ids without exactly one succeeded line in the run's export."""
    out = fleet.tmp / "results.jsonl"
    fleet.producer("export", str(out), timeout_s=600)
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    seen = Counter(x["custom_id"] for x in lines)
    ok = {x["custom_id"] for x in lines if x["error"] is None and x["response"]["status_code"] == 200}
    return sum(1 for i in ids if i not in ok), sum(c - 1 for c in seen.values() if c > 1)


def env_for(profile: str, time_scale: float, spec: dict[str, Any] | None = None) -> dict[str, str]:
    env = {**PROFILES[profile], "SGLANG_SIM_TIME_SCALE": str(time_scale), "SGLANG_SIM_STARTUP_S": "1.0",
           "SGLANG_SIM_NUM_GPUS": "8", "BATCHFLEET_SHUTDOWN_GRACE_S": "2", "BATCHFLEET_STATUS_INTERVAL_S": "0.5",
           "BATCHFLEET_HEALTH_INTERVAL_S": "5", "BATCHFLEET_STARTUP_TIMEOUT_S": "120"}
    if spec:  # the oracle starts on the spec the planned run ended on
        env["BATCHFLEET_STRATEGY"] = str(spec["strategy"])
        if spec.get("mem_fraction_static"):
            env["BATCHFLEET_MEM_FRACTION_STATIC"] = str(spec["mem_fraction_static"])
        if spec.get("max_running_requests"):
            env["BATCHFLEET_MAX_RUNNING_REQUESTS"] = str(spec["max_running_requests"])
    return env


def figures(fleet: Fleet) -> dict[str, Any]:
    stats = fleet.stats()
    prompt, cached = stats.get("prompt_tokens", 0), stats.get("cached_tokens", 0)
    shared = sum(v for k, v in stats.items() if k.startswith("plan_shared:"))
    size = sum(v for k, v in stats.items() if k.startswith("plan_bytes:"))
    return {"hit": cached / prompt if prompt else None, "predicted": shared / size if size else None,
            "prompt_tokens": prompt, "cached_tokens": cached}


def spec_of(statuses: list[WorkerStatus]) -> dict[str, Any]:
    """The spec most servers ended on (strategy, memory fraction, ceiling), from their command lines."""
    from supervisor.ladder import current_spec

    spec = current_spec(None, statuses)
    return {"strategy": str(spec.strategy), "mem_fraction_static": spec.mem_fraction_static,
            "max_running_requests": spec.max_running_requests}


def decisions(sup: SupervisorProc) -> list[str]:
    events: list[Event] = sup.events()
    return [f"{e.kind}: {e.message[:240]}" for e in events
            if e.kind in ("decision", "canary", "rolled_out", "verified", "rollback", "advice")]


def run_one(profile: str, feed: str, rows: list[tuple[dict[str, Any], str]], tmp: Path, args: argparse.Namespace,
            spec: dict[str, Any] | None = None) -> dict[str, Any]:
    ids = [line["custom_id"] for line, _ in rows]
    gpus = args.gpus
    with contextlib.ExitStack() as stack:
        if feed == "oracle":
            parts = deal_groups(rows, gpus)
            fleets = []
            url = stack.enter_context(PrivateRedis()).url  # one Redis; a run (its own store, head, queue) per GPU
            for g, part in enumerate(parts):
                fleet = Fleet(tmp / f"o{g}", url, run=f"oracle{g}", gpus=gpus, env=env_for(profile, args.time_scale,
                                                                                            spec))
                fleet.tmp.mkdir(parents=True, exist_ok=True)
                write(fleet.tmp / "in.jsonl", part)
                fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queue(g), "--no-progress", "--no-plan",
                               timeout_s=900)
                fleets.append((fleet, g, [x["custom_id"] for x in part]))
            t0 = time.monotonic()
            for fleet, g, _ in fleets:
                fleet.start_worker(g)
                fleet.start_head()
            ends = {}
            while len(ends) < len(fleets):
                for fleet, g, part_ids in fleets:
                    if g not in ends and fleet.finished() >= len(part_ids):
                        ends[g] = time.monotonic() - t0
                time.sleep(0.2)
                if time.monotonic() - t0 > args.timeout:
                    raise AssertionError(f"oracle: not done after {args.timeout} s")
            makespan = max(ends.values())
            lost = duplicated = 0
            for fleet, _, part_ids in fleets:
                fleet.stop_all()
                a, b = exactly_once(fleet, part_ids)
                lost, duplicated = lost + a, duplicated + b
            stats = [figures(f) for f, _, _ in fleets]
            prompt = sum(s["prompt_tokens"] for s in stats)
            hit = sum(s["cached_tokens"] for s in stats) / prompt if prompt else None
            for fleet, _, _ in fleets:
                fleet.kill_all()
            return {"makespan_s": makespan, "lost": lost, "duplicated": duplicated, "hit": hit, "predicted": None,
                    "spec": spec, "decisions": []}
        url = stack.enter_context(PrivateRedis()).url
        fleet = Fleet(tmp, url, run=f"{feed}", gpus=gpus, env=env_for(profile, args.time_scale))
        write(tmp / "in.jsonl", [line for line, _ in rows])
        fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress",
                       *(["--no-plan"] if feed == "input" else []), timeout_s=900)
        sup = None
        try:
            t0 = time.monotonic()
            for g in range(gpus):
                fleet.start_worker(g)
            fleet.start_head()
            sup = SupervisorProc(fleet, *SUPERVISOR_ARGS)
            fleet.wait_for(lambda: fleet.finished() >= len(ids), args.timeout, f"all {len(ids)} prompts")
            makespan = time.monotonic() - t0
            end_spec = spec_of(fleet.statuses())
            said = decisions(sup)
        finally:
            if sup is not None:
                sup.stop()
            fleet.stop_all()
        lost, duplicated = exactly_once(fleet, ids)
        return {"makespan_s": makespan, "lost": lost, "duplicated": duplicated, **figures(fleet), "spec": end_spec,
                "decisions": said}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} s ({min(values):.1f}-{max(values):.1f})"


def pct(v: float | None) -> str:
    return "  n/a" if v is None else f"{v:5.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="hybrid,dense")
    ap.add_argument("--workloads", default="docqa,fewshot,diverse")
    ap.add_argument("--feeds", default="planned,input,oracle")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--scale-workload", type=float, default=1.0, help="fewer (or more) documents and prompts")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    args = ap.parse_args()
    feeds = args.feeds.split(",")
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for profile in args.profiles.split(","):
        for workload in args.workloads.split(","):
            rows = WORKLOADS[workload](random.Random(11), args.scale_workload)
            random.Random(12).shuffle(rows)
            for r in range(args.rounds):
                spec = None
                for feed in feeds:  # interleaved, so a drift of the machine falls on every feed alike
                    with tempfile.TemporaryDirectory(prefix=f"bench-prefix-{feed}-") as tmp:
                        if feed == "sorted":  # the same prompts, each group's together in the file
                            res = run_one(profile, "planned", sorted(rows, key=lambda x: x[1]), Path(tmp), args,
                                          spec)
                        else:
                            res = run_one(profile, feed, rows, Path(tmp), args, spec)
                    if feed == "planned":
                        spec = res["spec"]
                    results.setdefault((profile, workload, feed), []).append(res)
                    print(f"{profile} {workload} round {r + 1} {feed}: {res['makespan_s']:.1f} s, hit {pct(res['hit'])}"
                          f" (predicted {pct(res['predicted'])}), spec {res['spec']}, lost {res['lost']}, "
                          f"duplicated {res['duplicated']}", flush=True)
                    for line in res["decisions"][:6]:
                        print(f"    {line}", flush=True)
    print(f"\nprefix plan, {args.gpus} simulated GPUs, time scale {args.time_scale:g}, {args.rounds} rounds "
          "(median, range):")
    for profile in args.profiles.split(","):
        for workload in args.workloads.split(","):
            runs = {f: results.get((profile, workload, f), []) for f in feeds}
            line = [f"  {profile:<6} {workload:<8}"]
            for f in feeds:
                if runs[f]:
                    line.append(f"{f} {spread([x['makespan_s'] for x in runs[f]])}")
            print("  ".join(line))
            med = {f: statistics.median(x["makespan_s"] for x in runs[f]) for f in feeds if runs[f]}
            hits = {f: statistics.median(x["hit"] for x in runs[f] if x["hit"] is not None) for f in feeds
                    if runs[f] and any(x["hit"] is not None for x in runs[f])}
            predicted = [x["predicted"] for x in runs.get("planned", []) if x["predicted"] is not None]
            goal_in, goal_oracle = GOALS[workload]
            parts = []
            if "planned" in med and "input" in med:
                parts.append(f"input / planned {med['input'] / med['planned']:.2f}x (goal >= {goal_in})")
            if "planned" in med and "sorted" in med:
                parts.append(f"shuffled / sorted input, planned {med['planned'] / med['sorted']:.3f}x (goal <= 1.05)")
            if "planned" in med and "oracle" in med:
                parts.append(f"planned / oracle {med['planned'] / med['oracle']:.3f}x"
                             + (f" (goal <= {goal_oracle})" if goal_oracle else ""))
            parts.append("hit rate " + ", ".join(f"{f} {v:.0%}" for f, v in hits.items())
                         + (f"; predicted {statistics.median(predicted):.0%}" if predicted else ""))
            specs = Counter(json.dumps(x["spec"], sort_keys=True) for f in feeds for x in runs[f] if x["spec"])
            print("      " + "; ".join(parts))
            for f in ("planned", "input"):
                ends = Counter(x["spec"]["strategy"] for x in runs.get(f, []) if x["spec"])
                if ends:
                    print(f"      {f}: the supervisor ended on {dict(ends)}")
            lost = sum(x["lost"] for f in feeds for x in runs[f])
            dup = sum(x["duplicated"] for f in feeds for x in runs[f])
            print(f"      {lost} lost, {dup} duplicated over all runs; specs seen {len(specs)}")
    if args.json:
        args.json.write_text(json.dumps({"|".join(k): v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The tail of a run (issue 11 §3): makespan against its lower bound on mixed max_tokens 16/256/4000
(4000: tiny-hybrid's context is 4,096 tokens).

lower bound = max(total slot-time / fleet slots, the longest single generation), all in the
simulator's model time, from its own record (`slot_fill`: occupied slot-seconds and the longest
admission-to-finish per rank); makespan = from the first admission on any server to the last
finish on any server (wall clock x time scale, as the servers' model clocks start apart).

Real `rq worker` processes, simulated GPUs (tiny-hybrid: 12 slots each), prompts fed by the
producer (longest expected work first). Baseline and surplus (the default) runs interleaved.

    python bench/bench_tail.py [--gpus 2] [--rounds 2] [--time-scale 20] [--scale 1]

`--kills` (issue 21 §3): the same run of equal prompts with and without server kills, interleaved.
With kills, one server is killed with -9 at 30 % and another at 60 % of the prompts finished, and
every server once the queues are empty (all that is left is inside the servers: every prompt left is
struck, nothing innocent is left to hide behind). Tail = from that moment (the queues empty) to the
last result; the struck prompts' rate = prompts left once the servers are up again / the time they
took, against the fleet's normal rate (10 % to 90 % of the same round's run without kills). The
tail's ratio kills / no kills includes the servers' restart.

    python bench/bench_tail.py --kills --time-scale 4 [--gpus 2] [--rounds 2] [--prompts 600] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchfleet.keys import Keys  # noqa: E402
from fleetrun.redisproc import PrivateRedis  # noqa: E402
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


def _observed(fleet: Fleet, gpu: int) -> dict | None:
    try:
        return httpx.get(f"http://127.0.0.1:{fleet.port_base + gpu}/sim/observed", timeout=5).json()
    except httpx.HTTPError:
        return None


def _kill(fleet: Fleet, gpu: int) -> None:
    o = _observed(fleet, gpu)
    if o is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(o["pid"], signal.SIGKILL)


def _queues_empty(fleet: Fleet) -> bool:
    k = fleet.k
    return not any(fleet.r.llen(key) for key in [*(Keys.queue(fleet.queue(g)) for g in range(fleet.gpus)),
                                                  k.suspects, k.isolate])


def run_kills(tmp: Path, redis_url: str, *, gpus: int, n: int, max_tokens: int, time_scale: float, kills: bool,
              tag: str) -> dict:
    env = {"SGLANG_SIM_TIME_SCALE": str(time_scale), "BATCHFLEET_SHUTDOWN_GRACE_S": "5",
           "BATCHFLEET_WINDOW_DEFAULT": str(n)}
    work = tmp / tag
    work.mkdir()
    fleet = Fleet(work, redis_url, run=f"kills-{tag}", prefix=f"{tag}.", gpus=gpus, env=env)
    write(work / "prompts.jsonl", {max_tokens: n})
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    plan = [(0.3, [0]), (0.6, [1 % gpus])] if kills else []
    timeline: list[tuple[float, int]] = []
    t_empty = t_ready = None
    left_at_empty = 0
    killed: list[int] = []  # the pids of the servers killed at the tail
    try:
        for g in range(gpus):
            fleet.start_worker(g)
        deadline = time.monotonic() + 1800
        while (done := fleet.finished()) < n:
            now = time.monotonic()
            assert now < deadline, f"{tag}: {done} of {n} after 1800 s"
            if done and (not timeline or timeline[-1][1] != done):
                timeline.append((now, done))
            if plan and done >= plan[0][0] * n:
                for g in plan.pop(0)[1]:
                    _kill(fleet, g)
            if t_empty is None and done >= 0.5 * n and not plan and _queues_empty(fleet):
                t_empty, left_at_empty = now, n - done
                if kills:
                    killed = [o["pid"] for g in range(gpus) if (o := _observed(fleet, g))]
                    for g in range(gpus):
                        _kill(fleet, g)
                else:
                    t_ready = now
            if t_empty is not None and t_ready is None and all(
                    (o := _observed(fleet, g)) and o["ready"] and o["pid"] not in killed for g in range(gpus)):
                t_ready = time.monotonic()  # every server restarted
            time.sleep(0.01)
        t_end = time.monotonic()
        timeline.append((t_end, n))
        stats = fleet.stats()
        fleet.stop_all()
        solo = sum(fleet.worker_log(g).count("running it alone") for g in range(gpus))
    finally:
        fleet.kill_all()

    def at(frac: float) -> float:
        return next(t for t, d in timeline if d >= frac * n)

    assert t_empty is not None
    t_ready = t_empty if t_ready is None else t_ready
    left_at_ready = n - max((d for t, d in timeline if t <= t_ready), default=0)
    normal = 0.8 * n / (at(0.9) - at(0.1))
    return {"normal_rate": normal, "tail_s": t_end - t_empty, "left": left_at_empty, "restart_s": t_ready - t_empty,
            "tail_rate": left_at_ready / max(t_end - t_ready, 1e-3), "last2_s": max(t_end - at(0.98), 0.01),
            "deaths": stats.get("server_deaths", 0), "struck": stats.get("struck", 0), "solo": solo,
            "ok": stats.get("succeeded", 0) == n and not stats.get("failed", 0)}


def main_kills(args: argparse.Namespace) -> None:
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores); {args.gpus} simulated GPUs, time scale "
          f"{args.time_scale}, {args.prompts} prompts of {args.max_tokens} tokens")
    rows: dict[bool, list[dict]] = {False: [], True: []}
    t0 = time.monotonic()
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for kills in (False, True):
                rows[kills].append(run_kills(Path(tmp), redis_proc.url, gpus=args.gpus, n=args.prompts,
                                             max_tokens=args.max_tokens, time_scale=args.time_scale, kills=kills,
                                             tag=f"r{i}{'k' if kills else 'n'}"))
    for i in range(args.rounds):
        base, hit = rows[False][i], rows[True][i]
        for label, run in (("no kills (baseline)", base), ("kills", hit)):
            print(f"  round {i + 1} {label:<19}: normal {run['normal_rate']:6.1f} prompts/s; tail (queues empty "
                  f"-> last result) {run['tail_s']:5.2f} s for {run['left']} prompts (servers restarting "
                  f"{run['restart_s']:4.2f} s, then {run['tail_rate']:6.1f} prompts/s); last 2 % {run['last2_s']:5.2f} "
                  f"s; {run['deaths']} deaths, {run['struck']} struck, {run['solo']} run alone"
                  f"{'' if run['ok'] else '  NOT ALL SUCCEEDED'}")
        print(f"  round {i + 1} ratios: tail kills / no kills {hit['tail_s'] / base['tail_s']:.2f}; last 2 % kills "
              f"/ no kills {hit['last2_s'] / base['last2_s']:.2f}; struck prompts' rate / normal rate (same round, "
              f"no kills) {hit['tail_rate'] / base['normal_rate']:.2f}")
    print(f"({time.monotonic() - t0:.0f} s) load average at end: {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the prompt counts")
    ap.add_argument("--kills", action="store_true", help="the same run with and without server kills (issue 21 §3)")
    ap.add_argument("--prompts", type=int, default=600, help="--kills: how many prompts")
    ap.add_argument("--max-tokens", type=int, default=256, help="--kills: tokens each prompt generates")
    args = ap.parse_args()
    if args.kills:
        main_kills(args)
        return
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

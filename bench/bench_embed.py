"""An embedding run at scale (issue 30): N short documents through 8 simulated `--is-embedding` GPUs
(`embed-0.6b-96gb`), and in the same invocation the simulated servers' own ceiling.

1. ceiling: 8 bare simulators, one aiohttp client each sending its share of the same requests straight
   to its server with no batchfleet in between, at several in-flight counts per server (`--ceiling-
   concurrency`, far past what one prefill forward takes); the best inputs/s of them is the ceiling
   (over the first `--ceiling-n` documents: a rate, the same steady state). The servers' radix caches
   are flushed before each round: a round of documents cached by the previous one prefills one token
   each, and would measure a ceiling no fleet of new documents can reach.
2. fleet: the N documents as `--per-line` inputs per line, `producer enqueue` + 8 `rq worker`s + the
   head, inputs/s from the moment every worker serves to the last result, the CPU each part spent
   meanwhile (workers, their servers, the head, Redis) and Redis's peak memory; then `producer export`,
   its max RSS (`/usr/bin/time`), and the export checked: every line once (0 lost, 0 duplicated),
   every input in it, a sample of vectors exactly `sglang_sim.embedding.expected_embedding`.
3. small: the same with 10,000 documents on 2 GPUs: the export's max RSS beside the N-run's.

    .venv/bin/python bench/bench_embed.py [--n 1000000] [--per-line 16] [--words 8] [--time-scale 0.02]

The time scale must leave the simulated servers, not the 2 cores, the bound: at 0.02 the 8 servers' forwards
(1024 eight-token documents in 87 model ms each) allow ~1,885 inputs/s, and the whole fleet (servers, workers,
head, Redis) spends ~420 us of CPU an input, ~0.8 of a core. At 0.05 it would need ~2 cores.

Goals: fleet / ceiling >= 0.97; export RSS of N within 100 MiB of the 10,000 run's; 0 lost, 0 duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchfleet.records import WorkerState  # noqa: E402
from sglang_sim.embedding import expected_embedding  # noqa: E402
from tests.fleet import Fleet  # noqa: E402
from tests.simproc import SimProc  # noqa: E402

PROFILE, MODEL, HIDDEN = "embed-0.6b-96gb", "Qwen/Qwen3-Embedding-0.6B", 1024
VOCAB = [f"w{i}" for i in range(50000)]


def documents(n: int, words: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCAB, k=words)) for _ in range(n)]


def bodies(docs: list[str], per_line: int) -> list[dict[str, Any]]:
    return [{"input": docs[i : i + per_line] if per_line > 1 else docs[i]} for i in range(0, len(docs), per_line)]


def sim_env(time_scale: float) -> dict[str, str]:
    return {"SGLANG_SIM_PROFILE": PROFILE, "SGLANG_SIM_TIME_SCALE": str(time_scale), "SGLANG_SIM_STARTUP_S": "0.2"}


# --- 1. the ceiling -------------------------------------------------------------------------------
async def _drive(url: str, reqs: list[dict[str, Any]], concurrency: int) -> None:
    queue = list(reversed(reqs))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one() -> None:
            while queue:
                body = queue.pop()
                for _ in range(5):  # a kept-alive connection the server closed meanwhile: send again
                    try:
                        async with session.post(url + "/v1/embeddings", json=body) as res:
                            await res.read()
                            assert res.status == 200, await res.text()
                        break
                    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                        continue

        await asyncio.gather(*(one() for _ in range(concurrency)))


async def _all(sims: list[SimProc], shares: list[list[dict[str, Any]]], concurrency: int) -> float:
    t0 = time.monotonic()
    await asyncio.gather(*(_drive(s.url, share, concurrency) for s, share in zip(sims, shares, strict=True)))
    return time.monotonic() - t0


def ceiling(reqs: list[dict[str, Any]], inputs: int, *, gpus: int, time_scale: float,
            concurrencies: list[int]) -> dict[int, float]:
    """inputs/s of the bare servers at each in-flight count per server."""
    out: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(SimProc("--is-embedding", env=sim_env(time_scale), model_path=MODEL,
                                            record=False)) for _ in range(gpus)]
        for s in sims:
            s.start(timeout_s=60)
        shares = [reqs[g::gpus] for g in range(gpus)]
        for c in concurrencies:
            for s in sims:  # each round's documents are new to the servers, as the fleet's are to its own
                assert httpx.post(s.url + "/flush_cache", timeout=30).status_code == 200
            wall = asyncio.run(_all(sims, shares, c))
            out[c] = inputs / wall
            print(f"  ceiling, {c:5d} in flight per server: {out[c]:9,.0f} inputs/s ({wall:.1f} s)", flush=True)
    return out


# --- 2. the fleet -------------------------------------------------------------------------------------
def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each role's processes and all their live descendants."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parent[int(entry.name)] = int(st[1])
            ticks[int(entry.name)] = int(st[11]) + int(st[12])
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for role, roots in roles.items():
        tree, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid in tree:
                continue
            tree.add(pid)
            todo += [c for c, pp in parent.items() if pp == pid]
        out[role] = sum(ticks.get(pid, 0) for pid in tree) / hz
    return out


def export_rss_mib(fleet: Fleet, out: Path) -> float:
    """Run `producer export` under /usr/bin/time; its max RSS in MiB."""
    done = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb %M", str(ROOT / ".venv" / "bin" / "producer"),
                           "export", str(out)], env=fleet.env, cwd=fleet.tmp, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"export failed: {done.stdout}\n{done.stderr}")
    kb = next(int(ln.split()[1]) for ln in done.stderr.splitlines() if ln.startswith("maxrss_kb"))
    return kb / 1024


def check_export(out: Path, reqs: list[dict[str, Any]], *, sample: int = 200) -> tuple[int, int, int]:
    """(lost, duplicated, inputs) of the export, streamed line by line; a sample of vectors checked exactly."""
    seen: set[str] = set()
    duplicated = inputs = 0
    rng = random.Random(7)
    picks = set(rng.sample(range(len(reqs)), min(sample, len(reqs))))
    with out.open("rb") as fh:
        for raw in fh:
            line = orjson.loads(raw)
            cid = line["custom_id"]
            if cid in seen:
                duplicated += 1
                continue
            seen.add(cid)
            if line["error"] is not None or line["response"]["status_code"] != 200:
                continue
            data = line["response"]["body"]["data"]
            inputs += len(data)
            i = int(cid[1:])
            if i in picks:
                value = reqs[i]["input"]
                for item, one in zip(data, [value] if isinstance(value, str) else value, strict=True):
                    if item["embedding"] != expected_embedding(one, hidden_size=HIDDEN):
                        raise SystemExit(f"{cid}: a vector is not the simulator's")
    lost = len(reqs) - len(seen)
    return lost, duplicated, inputs


def fleet_run(tmp: Path, redis_url: str, reqs: list[dict[str, Any]], *, gpus: int, time_scale: float,
              run: str, redis_pid: int | None = None) -> dict[str, Any]:
    env = {**sim_env(time_scale), "BATCHFLEET_MODEL_PATH": MODEL, "BATCHFLEET_SERVER_ARGS": "--is-embedding",
           "BATCHFLEET_STATUS_INTERVAL_S": "1"}
    tmp.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(tmp, redis_url, run=run, gpus=gpus, env=env)
    path = tmp / "docs.jsonl"
    with path.open("wb") as fh:
        for i, body in enumerate(reqs):
            fh.write(orjson.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/embeddings", "body": body}))
            fh.write(b"\n")
    t = time.monotonic()
    fleet.producer("enqueue", str(path), "--queues", fleet.queues, "--no-progress", timeout_s=3600)
    enqueue_s = time.monotonic() - t
    try:
        for g in range(gpus):
            fleet.start_worker(g)
        fleet.start_head()
        fleet.wait_for(lambda: sum(s.state is WorkerState.SERVING for s in fleet.statuses()) == gpus, 300,
                       "every worker to serve")
        assert fleet.head is not None
        roles = {"workers": [p.pid for p in fleet.procs], "head": [fleet.head.pid],
                 **({"redis": [redis_pid]} if redis_pid else {})}  # a worker's role includes its server
        cpu0 = cpu_by_role(roles)
        t0 = time.monotonic()

        peak_stream = [0]

        def done() -> bool:
            try:
                peak_stream[0] = max(peak_stream[0], fleet.r.xlen(fleet.k.results))
                return fleet.finished() >= len(reqs)
            except redis.RedisError:  # Redis busy with a page of vectors for a moment: ask again
                return False

        fleet.wait_for(done, 36000, "every line")
        wall = time.monotonic() - t0
        cpu = {k: v - cpu0[k] for k, v in cpu_by_role(roles).items()}
        servers = cpu_by_role({"servers": [p for pid in roles["workers"] for p in _children(pid)]})["servers"]
        cpu = {"workers": cpu["workers"] - servers, "servers": servers, **{k: v for k, v in cpu.items()
                                                                          if k != "workers"}}
        redis_peak = fleet.r.info("memory").get("used_memory_peak", 0)
        slots = sorted({s.slots for s in fleet.statuses()})
    finally:
        fleet.stop_all()
    out = tmp / "out.jsonl"
    rss = export_rss_mib(fleet, out)
    lost, duplicated, inputs = check_export(out, reqs)
    return {"wall_s": wall, "enqueue_s": enqueue_s, "rss_mib": rss, "lost": lost, "duplicated": duplicated,
            "inputs": inputs, "slots": slots, "export_bytes": out.stat().st_size, "cpu": cpu,
            "redis_peak_mib": redis_peak / 2**20, "peak_stream": peak_stream[0]}


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (a worker's: its server)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and int(st[1]) == pid:
            out.append(int(entry.name))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="documents (inputs)")
    ap.add_argument("--per-line", type=int, default=16, help="documents per input line (one request)")
    ap.add_argument("--words", type=int, default=8, help="words (tokens) per document")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.02,
                    help="model seconds per wall second: low enough that the model, not 2 cores, binds")
    ap.add_argument("--ceiling-n", type=int, default=200_000, help="documents the ceiling is measured on")
    ap.add_argument("--ceiling-concurrency", default="64,256,1024", help="in flight per server, comma-separated")
    ap.add_argument("--small", type=int, default=10_000, help="documents of the run whose export RSS is compared")
    args = ap.parse_args()
    from fleetrun.redisproc import PrivateRedis

    docs = documents(args.n, args.words)
    reqs = bodies(docs, args.per_line)
    print(f"{args.n:,} documents of {args.words} words, {args.per_line} per line ({len(reqs):,} lines), "
          f"{args.gpus} simulated GPUs ({PROFILE}, --is-embedding), time scale {args.time_scale:g}", flush=True)
    cn = min(args.ceiling_n, args.n)
    creqs = bodies(docs[:cn], args.per_line)
    ceil = ceiling(creqs, cn, gpus=args.gpus, time_scale=args.time_scale,
                   concurrencies=[int(c) for c in args.ceiling_concurrency.split(",")])
    best = max(ceil.values())
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp, PrivateRedis() as redis_:
        big = fleet_run(Path(tmp) / "big", redis_.url, reqs, gpus=args.gpus, time_scale=args.time_scale,
                        run="embed-big", redis_pid=redis_.proc.pid if redis_.proc else None)
        rate = args.n / big["wall_s"]
        print(f"  fleet: {rate:9,.0f} inputs/s ({big['wall_s']:.1f} s from every worker serving; enqueue "
              f"{big['enqueue_s']:.1f} s; in-flight limits {big['slots']})", flush=True)
        print("  CPU while serving: " + ", ".join(f"{k} {v:.1f} s ({v / big['wall_s']:.2f} cores, "
                                                  f"{v / args.n * 1e6:.0f} us/input)" for k, v in big["cpu"].items())
              + f"; Redis peak memory {big['redis_peak_mib']:,.0f} MiB, results stream at most "
              f"{big['peak_stream']:,} entries (polled)", flush=True)
        small_docs = documents(args.small, args.words, seed=2)
        small = fleet_run(Path(tmp) / "small", redis_.url, bodies(small_docs, args.per_line), gpus=2,
                          time_scale=args.time_scale, run="embed-small")
    ratio = rate / best
    print(f"\nfleet / ceiling: {rate:,.0f} / {best:,.0f} inputs/s = {ratio:.3f}x (goal >= 0.97)")
    print(f"export max RSS: {big['rss_mib']:.1f} MiB for {args.n:,} inputs ({big['export_bytes'] / 2**20:,.0f} MiB "
          f"written) vs {small['rss_mib']:.1f} MiB for {args.small:,}: +{big['rss_mib'] - small['rss_mib']:.1f} MiB "
          f"(goal <= 100)")
    print(f"Redis peak memory (used_memory_peak): {big['redis_peak_mib']:,.0f} MiB")
    print(f"exactly once: {big['lost']} lost, {big['duplicated']} duplicated, {big['inputs']:,} of {args.n:,} inputs "
          f"embedded; small run {small['lost']} lost, {small['duplicated']} duplicated")
    ok = (ratio >= 0.97 and big["rss_mib"] - small["rss_mib"] <= 100 and big["lost"] == big["duplicated"] == 0
          and big["inputs"] == args.n)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

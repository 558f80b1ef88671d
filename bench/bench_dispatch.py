"""Worker dispatch ceiling and Redis memory, in one run on this machine.

1. jobs/s from queue to finished, against an instant backend (no server, no generation):
   RQ's own SimpleWorker (one job at a time, ~16 round trips each) vs batchfleet's dispatcher
   (one process, batched Lua bookkeeping). Reported side by side and as a ratio, because these
   machines are shared and noisy.
2. Redis memory (used_memory) at the start, with N prompts queued, after they all ran, and after
   they were collected and exported: results must not pile up in Redis.

    python bench/bench_dispatch.py [--baseline-jobs 3000] [--jobs 20000] [--memory-jobs 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis
import redis.asyncio as aioredis
from rq import Queue, SimpleWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchfleet.config import Config
from batchfleet.keys import Keys
from bench.instant import instant_backend
from bench.redisproc import PrivateRedis
from producer.api import enqueue
from producer.collect import collect_once
from producer.export import export
from producer.store import Store
from worker.dispatcher import Dispatcher
from worker.ledger import Ledger


def prompts_file(path: Path, n: int) -> Path:
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"p{i}", "prompt": f"Write a short note about item number {i}.",
                                  "max_tokens": 64}) + b"\n")
    return path


def baseline_simpleworker(url: str, n: int) -> float:
    r = redis.Redis.from_url(url)
    r.flushall()
    q = Queue("gpu0", connection=r)
    q.enqueue_many([Queue.prepare_data("bench.instant.instant", ({"cid": f"p{i}"},), result_ttl=0)
                    for i in range(n)])
    worker = SimpleWorker([q], connection=r)
    t0 = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    elapsed = time.perf_counter() - t0
    assert q.count == 0
    return n / elapsed


def enqueue_ours(url: str, n: int, workdir: Path, run: str) -> tuple[Config, Store]:
    # a window as large as the run: every prompt in Redis before the clock starts
    config = Config(run=run, redis_url=url, state_dir=workdir / run, queues=("gpu0",), window_default=n)
    done = enqueue(config, redis.Redis.from_url(url), prompts_file(workdir / f"{run}.jsonl", n), queues=("gpu0",))
    return config, done.store


async def run_dispatcher(url: str, config: Config, capacity: int) -> tuple[float, int]:
    client = aioredis.from_url(url)
    ledger = Ledger(client, Keys(config.run), worker="bench", lease_ttl_s=config.lease_ttl_s)
    d = Dispatcher(ledger, instant_backend, config=config, worker="bench", queues=lambda: ["gpu0"])
    await d.slots.resize(capacity)
    d.accepting.set()
    flusher = asyncio.create_task(ledger.run_flusher())
    t0 = time.perf_counter()
    await d.run(burst=True)
    await d.drain(10)
    elapsed = time.perf_counter() - t0
    ledger.close()
    await flusher
    await client.aclose()
    return elapsed, d.done


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-jobs", type=int, default=3000)
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--memory-jobs", type=int, default=100_000)
    ap.add_argument("--capacity", type=int, default=256)
    args = ap.parse_args()
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory() as tmp:
        url, workdir = redis_proc.url, Path(tmp)
        r = redis.Redis.from_url(url)
        base = baseline_simpleworker(url, args.baseline_jobs)
        r.flushall()
        config, _ = enqueue_ours(url, args.jobs, workdir, "dispatch")
        elapsed, done = asyncio.run(run_dispatcher(url, config, args.capacity))
        assert done == args.jobs, done
        ours = done / elapsed
        print("dispatch ceiling (instant backend, one process, local Redis)")
        print(f"  RQ SimpleWorker      : {base:9,.0f} jobs/s  ({args.baseline_jobs:,} jobs)")
        print(f"  batchfleet dispatcher: {ours:9,.0f} jobs/s  ({args.jobs:,} jobs, {args.capacity} slots)")
        print(f"  ratio                : {ours / base:9.1f}x")

        r.flushall()
        r.memory_purge() if hasattr(r, "memory_purge") else None
        start = used(r)
        config, store = enqueue_ours(url, args.memory_jobs, workdir, "memory")
        queued = used(r)
        elapsed, done = asyncio.run(run_dispatcher(url, config, args.capacity))
        ran = used(r)
        collect_once(r, store, Keys(config.run))
        summary = export(r, store, Keys(config.run), workdir / "out.jsonl")
        r.memory_purge() if hasattr(r, "memory_purge") else None
        end = used(r)
        lines = sum(1 for _ in (workdir / "out.jsonl").open("rb"))
        assert lines == args.memory_jobs, (lines, summary)
        mib = 1 / 2**20
        print(f"Redis used_memory over {args.memory_jobs:,} prompts ({done / elapsed:,.0f} jobs/s)")
        print(f"  at start                      : {start * mib:8.2f} MiB")
        print(f"  {args.memory_jobs:,} queued                : {queued * mib:8.2f} MiB")
        print(f"  all ran, results not collected: {ran * mib:8.2f} MiB")
        print(f"  collected and exported        : {end * mib:8.2f} MiB  ({(end - start) / 1024:+.1f} KiB vs start)")


if __name__ == "__main__":
    main()

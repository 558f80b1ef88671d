"""A run end to end with the head feeding a window: Redis memory stays flat however many prompts.

    .venv/bin/python bench/bench_window.py [--n 1000000] [--queues 4] [--capacity 256]

Starts a private redis-server; `producer enqueue` writes N short generated prompts into the store (and
feeds a first window); `producer head` runs as a subprocess (feeds each queue's window, collects
results into the store); batchfleet's dispatcher runs in this process against an instant backend (no
server: the cost of the plumbing alone) over all the queues. Redis `used_memory` is sampled every
0.5 s throughout. At the end `producer export` must hold exactly N lines.

Baseline, measured in the same run: RQ's `enqueue_many` puts every prompt of a run into Redis; its
bytes per prompt (measured on the first `baseline-n` prompts) times N is what Redis would hold at the
start of such a run, printed beside our peak.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchfleet.config import Config
from batchfleet.keys import Keys
from bench.bench_enqueue import MIB, PeakRss, rq_enqueue_many, short_prompts, used
from bench.instant import InstantAnswers
from fleetrun.redisproc import PrivateRedis
from producer.api import Store
from worker.dispatcher import Dispatcher
from worker.ledger import Ledger
from worker.steal import ClaimOrder

BIN = Path(sys.executable).parent


async def dispatch(url: str, config: Config, queues: list[str], capacity: int, store: Store) -> int:
    """Run the dispatcher until the store has a result for every prompt."""
    client = aioredis.from_url(url)
    ledger = Ledger(client, Keys(config.run), worker="bench", lease_ttl_s=config.lease_ttl_s)
    d = Dispatcher(ledger, InstantAnswers(), config=config, worker="bench", queues=lambda: ClaimOrder(list(queues)),
                   clock=time.time, on_completion=lambda tokens: None)
    d.limit.set_capacity(capacity)
    d.gate.resume()
    flusher = asyncio.create_task(ledger.run_flusher())
    runner = asyncio.create_task(d.run())
    while True:
        await asyncio.sleep(1.0)
        with store.read():
            if store.counts()["pending"] == 0:
                break
    runner.cancel()
    await d.takeback.drain(10)
    ledger.close()
    await flusher
    await client.aclose()
    return d.tally.done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=256, help="dispatcher slots")
    ap.add_argument("--baseline-n", type=int, default=100_000)
    a = ap.parse_args()
    queues = [f"gpu{i}" for i in range(a.queues)]
    with tempfile.TemporaryDirectory(prefix="bench-window-") as tmp, PrivateRedis() as redis_proc:
        work = Path(tmp)
        r = redis.Redis.from_url(redis_proc.url)
        path = work / "short.jsonl"
        short_prompts(path, a.n)
        start_mem = used(r)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
        env.update(REDIS_URL=redis_proc.url, BATCHFLEET_RUN="window", BATCHFLEET_STATE_DIR=str(work / "state"))
        config = Config.from_env(env)
        samples: list[tuple[float, int, int]] = []  # (s since start, used_memory, prompts finished)
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                stats = r.hmget(Keys("window").stats, "succeeded", "failed")
                samples.append((time.monotonic() - t0, used(r), sum(int(x or 0) for x in stats)))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        enq = subprocess.run([str(BIN / "producer"), "enqueue", str(path), "--queues", ",".join(queues),
                              "--no-progress"], env=env, capture_output=True, text=True, check=True)
        enqueued_s = time.monotonic() - t0
        head = subprocess.Popen([str(BIN / "producer"), "head", "--interval", "0.5"], env=env,
                                stdout=subprocess.DEVNULL, stderr=(work / "head.log").open("wb"))
        head_rss = PeakRss(head.pid)
        store = Store.open(config.results_db, run="window", readonly=True)
        t1 = time.monotonic()
        done = asyncio.run(dispatch(redis_proc.url, config, queues, a.capacity, store))
        ran_s = time.monotonic() - t1
        stop.set()
        sampler.join()
        head.terminate()
        head.wait(60)
        out = subprocess.run([str(BIN / "producer"), "export", str(work / "out.jsonl")], env=env,
                             capture_output=True, text=True)
        lines = sum(1 for _ in (work / "out.jsonl").open("rb"))
        assert out.returncode == 0 and lines == a.n, (out.stdout, out.stderr, lines)
        store_b = sum(f.stat().st_size for f in (work / "state").glob("window.sqlite*"))

        r.flushall()
        before = used(r)
        rq_enqueue_many(r, path, a.baseline_n, tuple(queues), "base")
        per = (used(r) - before) / a.baseline_n

    mems = [m for _, m, _ in samples]
    during = [m for _, m, f in samples if 0 < f < a.n]
    print(f"{a.n:,} short prompts end to end: enqueue, `producer head` feeding {a.queues} queues, one dispatcher "
          f"({a.capacity} slots, instant backend), export")
    print(f"  enqueue                   : {enqueued_s:6.1f} s ({enq.stdout.split('(')[1].split(')')[0]})")
    print(f"  run (dispatch + collect)  : {ran_s:6.1f} s, {done / ran_s:,.0f} prompts/s; export {lines:,} lines, "
          f"every prompt once")
    print(f"  Redis used_memory         : start {start_mem / MIB:.1f} MiB; while running median "
          f"{statistics.median(during) / MIB:.1f}, max {max(during) / MIB:.1f} MiB ({len(samples)} samples)")
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9):
        t, m, f = min(samples, key=lambda s: abs(s[2] - frac * a.n))
        print(f"    at {f / a.n:4.0%} done ({t:5.0f} s)  : {m / MIB:6.1f} MiB")
    print(f"  RQ enqueue_many, all in   : {per * a.n / MIB:6.0f} MiB ({per:,.0f} B a prompt x {a.n:,}, measured on "
          f"{a.baseline_n:,})")
    print(f"  ratio (our peak / RQ's)   : {max(mems) / (per * a.n):6.3f}")
    print(f"  head process peak RSS     : {head_rss.mib:6.0f} MiB; store on disk {store_b / MIB:,.0f} MiB")


if __name__ == "__main__":
    main()

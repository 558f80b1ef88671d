"""Enqueue throughput and Redis memory: `producer enqueue` vs RQ's `Queue.enqueue_many`.

    .venv/bin/python bench/bench_enqueue.py [--n 50000] [--words 60] [--queues 4]

Starts its own redis-server (free port, no persistence), writes N generated prompts to a JSONL file,
then, in this one process:
- ours: `producer.enqueue.enqueue_file` end to end (read + validate every line, SQLite store,
  one Lua call per 1,000 jobs);
- RQ: the same file read and decoded line by line, `Queue.prepare_data` + `Queue.enqueue_many`
  (one pipeline per 1,000 jobs), same job ids, same payload, same serializer (orjson);
and prints jobs/s for each (and for RQ's enqueue_many calls alone), the ratios, and Redis bytes
per queued prompt beyond its text (INFO used_memory delta / N - mean prompt-text bytes).
RQ zlib-compresses job data, so on compressible text its figure can come out smaller.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis
from rq import Queue

from batchfleet.config import Config
from batchfleet.jobs import GENERATE
from batchfleet.keys import FAILURE_TTL_S
from batchfleet.records import Prompt, job_id_for
from batchfleet.serializer import OrjsonSerializer
from producer.enqueue import enqueue_file
from producer.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def write_prompts(path: Path, n: int, words: int) -> float:
    """N simple-form prompts of `words` random pseudo-words; returns the mean text bytes."""
    rng = random.Random(7)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    total = 0
    with open(path, "wb") as fh:
        for i in range(n):
            text = " ".join(rng.choices(vocab, k=words))
            total += len(text.encode())
            fh.write(orjson.dumps({"id": f"p{i:07d}", "prompt": text, "max_tokens": 256}) + b"\n")
    return total / n


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def bench_ours(config: Config, r: redis.Redis, path: Path, queues: tuple[str, ...]) -> float:
    store = Store(config.results_db)
    t0 = time.perf_counter()
    s = enqueue_file(config, r, store, str(path), queues=queues, defaults={}, model="default", progress=False)
    dt = time.perf_counter() - t0
    store.close()
    assert s.new == s.lines and not s.rejected, s
    return dt


RQ_CALLS_S = [0.0]  # time inside enqueue_many alone, without reading the file or building job data


def _enqueue_many(q: Queue, batch: list) -> None:
    t = time.perf_counter()
    q.enqueue_many(batch)
    RQ_CALLS_S[0] += time.perf_counter() - t


def bench_rq(config: Config, r: redis.Redis, path: Path, queues: tuple[str, ...]) -> float:
    qs = [Queue(q, connection=r, serializer=OrjsonSerializer) for q in queues]
    t0 = time.perf_counter()
    batch, b = [], 0
    with open(path, "rb") as fh:
        for seq, raw in enumerate(fh):
            d = orjson.loads(raw)
            cid = d["id"]
            prompt = Prompt(cid, seq, "/v1/completions",
                            {"prompt": d["prompt"], "max_tokens": d["max_tokens"], "model": "default"},
                            f"{path.name}:{seq + 1}")
            batch.append(Queue.prepare_data(
                GENERATE, args=(prompt.to_dict(),), job_id=job_id_for(config.run, cid),
                description=f"generate({cid})", result_ttl=0, failure_ttl=FAILURE_TTL_S,
                timeout=int(config.request_timeout_s)))
            if len(batch) == 1000:
                _enqueue_many(qs[b % len(qs)], batch)
                batch, b = [], b + 1
    if batch:
        _enqueue_many(qs[b % len(qs)], batch)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=60, help="words per prompt")
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts (shared CPUs are noisy)")
    ap.add_argument("--listpack-value", type=int, default=0,
                    help="set Redis hash-max-listpack-value (bytes) first: job hashes stay compact listpacks")
    a = ap.parse_args()
    queues = tuple(f"gpu{i}" for i in range(a.queues))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc, url = start_redis(work)
        try:
            r = redis.Redis.from_url(url)
            path = work / "prompts.jsonl"
            text_b = write_prompts(path, a.n, a.words)
            config = Config.from_env({}, redis_url=url, run="bench", state_dir=work / "state", queues=queues)
            if a.listpack_value:
                r.config_set("hash-max-listpack-value", a.listpack_value)
            out: dict[str, tuple[float, float]] = {}
            rq_alone = 0.0
            for i in range(a.repeat):
                this: list[str] = []
                for name, fn in (("rq enqueue_many", bench_rq), ("producer enqueue", bench_ours)):
                    r.flushall()
                    shutil.rmtree(config.state_dir, ignore_errors=True)
                    RQ_CALLS_S[0] = 0.0
                    before = used(r)
                    dt = fn(config, r, path, queues)
                    per = (used(r) - before) / a.n
                    assert sum(r.llen(f"rq:queue:{q}") for q in queues) == a.n
                    this.append(f"{name} {a.n / dt:,.0f}/s")
                    if name not in out or a.n / dt > out[name][0]:
                        out[name] = (a.n / dt, per)
                    if RQ_CALLS_S[0]:
                        rq_alone = max(rq_alone, a.n / RQ_CALLS_S[0])
                print(f"run {i + 1}: " + ", ".join(this), file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(10)
    lp = f", hash-max-listpack-value {a.listpack_value}" if a.listpack_value else ""
    print(f"{a.n:,} prompts, mean prompt text {text_b:.0f} B, {len(queues)} queues, best of {a.repeat}{lp}")
    for name, (rate, per) in out.items():
        print(f"  {name:17s} {rate:>9,.0f} jobs/s   {per:7.0f} B/prompt in Redis, {per - text_b:+6.0f} B beyond text")
    ours, rq_only = out["producer enqueue"][0], rq_alone
    print(f"  (rq enqueue_many calls alone, job data prepared beforehand: {rq_only:,.0f} jobs/s)")
    print(f"  ratio ours / enqueue_many, same file to Redis: {ours / out['rq enqueue_many'][0]:.2f}x; "
          f"ours end to end / enqueue_many calls alone: {ours / rq_only:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

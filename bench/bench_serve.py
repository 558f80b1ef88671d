"""`batchfleet serve`: uploading and validating a batch beside `producer enqueue` of the same file, and
what answering polls costs the server — each beside its baseline in the same run.

    .venv/bin/python bench/bench_serve.py [--n 50000] [--repeat 3] [--polls-per-s 100] [--seconds 60]

1. upload + validate: N batch-form chat requests (~260 B a line). `producer enqueue FILE` as a
   subprocess (its own lines/s figure, as bench_enqueue reports it), then the same file through a
   running `batchfleet serve` with the `openai` client: `files.create`, `batches.create`, and
   `batches.retrieve` until the batch is `in_progress` (validated, every prompt in the store), timed
   from the client. `repeat` times each, interleaved: the median and range of each, the ratio of the
   medians and the ratio of each pair.
2. polls: a batch in progress whose request_counts change every second (a stand-in worker answers
   prompts with the worker's own Ledger, the head collects them), polled at `polls-per-s` with
   `batches.retrieve` for `seconds`; the serve process's CPU seconds (utime + stime of the process
   itself) over the window, beside the same serve's CPU over as long without polls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from fleetrun.redisproc import PrivateRedis
from worker.ledger import Ledger, parse_job_data

BIN = Path(sys.executable).parent
TICK = os.sysconf("SC_CLK_TCK")


def requests_file(path: Path, n: int) -> None:
    with path.open("wb", buffering=1 << 20) as fh:
        for i in range(n):
            fh.write(b'{"custom_id":"request-%d","method":"POST","url":"/v1/chat/completions","body":{"model":'
                     b'"qwen-hybrid-27b","messages":[{"role":"system","content":"You are a careful assistant."},'
                     b'{"role":"user","content":"Summarise item %d of the catalogue in two sentences."}],'
                     b'"max_tokens":%d,"temperature":0.7}}\n' % (i, i, 64 << (i % 3)))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: the process itself, not its children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def enqueue_rate(url: str, path: Path, state: Path, run: str) -> float:
    done = subprocess.run([str(BIN / "producer"), "--redis-url", url, "--run", run, "--state-dir", str(state),
                           "enqueue", str(path), "--queues", f"{run}.gpu0", "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    m = re.search(r"lines in \S+ s \(([\d,]+)/s\)", done.stdout + done.stderr)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"producer enqueue failed: {done.stdout}{done.stderr}")
    return float(m.group(1).replace(",", ""))


class Serve:
    def __init__(self, url: str, state: Path, run: str) -> None:
        self.run = run
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
        env.update({"REDIS_URL": url, "BATCHFLEET_QUEUES": f"{run}.gpu0"})
        self.log = (state.parent / f"{run}.log").open("wb")
        self.proc = subprocess.Popen([str(BIN / "batchfleet"), "serve", "--run", run, "--state-dir", str(state),
                                      "--port", str(self.port), "--max-requests", "1000000"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=600)

    def upload_and_validate(self, path: Path) -> tuple[float, float, str]:
        """(seconds in all, seconds of the upload, batch id)."""
        t0 = time.perf_counter()
        f = self.client.files.create(file=path.open("rb"), purpose="batch")
        t1 = time.perf_counter()
        b = self.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while (b := self.client.batches.retrieve(b.id)).status == "validating":
            time.sleep(0.01)
        took = time.perf_counter() - t0
        if b.status != "in_progress":
            raise SystemExit(f"the batch is {b.status}: {b.errors}")
        return took, t1 - t0, b.id

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)
        self.log.close()


def stand_in_worker(url: str, run: str, per_s: float, stop: threading.Event) -> None:
    """Answers `per_s` prompts a second from the run's queue with the worker's own Ledger."""

    async def go() -> None:
        client = aioredis.from_url(url)
        ledger = Ledger(client, Keys(run), worker="bench-w", lease_ttl_s=600)
        try:
            while not stop.is_set():
                for c in await ledger.claim(max(1, int(per_s / 10)), [f"{run}.gpu0"]):
                    p = Prompt.from_dict(parse_job_data(c.data)[1][0])
                    ledger.finish(c, Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=200, worker="bench-w",
                                            fp=p.fp, body={"choices": [{"message": {"content": "ok"}}],
                                                           "usage": {"prompt_tokens": 9, "completion_tokens": 2}}))
                await ledger.flush()
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    asyncio.run(go())


def polls(sv: Serve, batch_id: str, per_s: float, seconds: float) -> tuple[int, float]:
    """Poll at `per_s` for `seconds`; returns (polls, serve CPU seconds over the window)."""
    n, start_cpu = 0, cpu_s(sv.proc.pid)
    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < seconds:
        sv.client.batches.retrieve(batch_id)
        n += 1
        time.sleep(max(0.0, n / per_s - (time.perf_counter() - t0)))
    del now
    return n, cpu_s(sv.proc.pid) - start_cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--polls-per-s", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        path = work / "requests.jsonl"
        requests_file(path, args.n)
        size = path.stat().st_size
        with PrivateRedis() as rp:
            rates, took = [], []
            sv: Serve | None = None
            for i in range(args.repeat):  # interleaved, so the machine's load falls on both alike
                rates.append(enqueue_rate(rp.url, path, work / f"enq{i}", f"enq{i}"))
                if sv is not None:
                    sv.stop()
                sv = Serve(rp.url, work / f"serve{i}", f"bench{i}")  # a fresh store, as enqueue's
                time.sleep(2)  # its head has started (enqueue has no head starting beside it)
                t, up, bid = sv.upload_and_validate(path)
                took.append((t, up))
            assert sv is not None
            try:
                serves = [args.n / t for t, _ in took]
                enq, srv = statistics.median(rates), statistics.median(serves)
                mid, upload = statistics.median(t for t, _ in took), statistics.median(up for _, up in took)
                print(f"upload + validate, {args.n:,} lines ({size / 1e6:.1f} MB), {args.repeat} times each "
                      "interleaved: median (range)")
                print(f"  producer enqueue        {enq:>10,.0f} lines/s   ({min(rates):,.0f}-{max(rates):,.0f})")
                print(f"  serve (openai client)   {srv:>10,.0f} lines/s   ({min(serves):,.0f}-{max(serves):,.0f}; "
                      f"{mid:.2f} s: files.create {upload:.2f} s, then batches.create and retrieve until in_progress)")
                print(f"  ratio serve / enqueue   {srv / enq:>10.2f}   (per pair: "
                      f"{', '.join(f'{x / y:.2f}' for x, y in zip(serves, rates, strict=True))})")
                stop = threading.Event()
                worker = threading.Thread(target=stand_in_worker, args=(rp.url, sv.run, 50.0, stop), daemon=True)
                worker.start()
                time.sleep(3)  # the head feeds the queue and collects: request_counts move every second
                idle0 = cpu_s(sv.proc.pid)
                time.sleep(args.seconds)
                idle = cpu_s(sv.proc.pid) - idle0
                n, busy = polls(sv, bid, args.polls_per_s, args.seconds)
                counts = sv.client.batches.retrieve(bid).request_counts
                stop.set()
                worker.join(10)
                print(f"polls: {n:,} batches.retrieve in {args.seconds:g} s ({n / args.seconds:,.0f}/s) of a batch "
                      f"whose request_counts move ({counts.completed if counts else 0:,} completed so far):")
                print(f"  serve CPU polled        {busy:>8.2f} s = {100 * busy / args.seconds:5.1f}% of a core")
                print(f"  serve CPU not polled    {idle:>8.2f} s = {100 * idle / args.seconds:5.1f}% of a core")
                print(f"  per poll                {1e6 * (busy - idle) / max(1, n):>8.0f} us")
            finally:
                sv.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

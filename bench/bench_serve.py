"""`batchfleet serve`: uploading and validating a batch beside `producer enqueue` of the same file, what
answering polls costs the server, and how long a poll waits while a large file is uploaded — each
beside its baseline in the same run.

    .venv/bin/python bench/bench_serve.py [--n 50000] [--repeat 3] [--polls-per-s 100] [--seconds 60]
                                          [--only validate|upload] [--upload-mb 100]
                                          [--upload-repeat 3] [--baseline-checkout DIR]

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
3. polls during an upload (`--only upload`): a serve with one batch in progress; a file of
   `upload-mb` MB is uploaded (`POST /v1/files`, by a process of its own) while `GET /v1/batches/{id}` is sent
   every 10 ms on a schedule, each on its own connection if need be (a poll held up by the server does
   not hold up the next: open loop), from just before the upload starts until it is acknowledged.
   Latency: from a poll's scheduled time to its answer; p50, p99 and the worst of all polls of
   `upload-repeat` uploads. With `--baseline-checkout DIR` (a checkout of another commit, e.g. `git
   worktree add --detach /tmp/base91 91ea956`) the same with serve run from DIR's code, interleaved:
   both trees' figures and this tree's p99 over DIR's. Goal: p99 < 50 ms.
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

from batchfleet.jobs import parse_job_data
from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from fleetrun.redisproc import PrivateRedis
from worker.ledger import Ledger

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
    def __init__(self, url: str, state: Path, run: str, *, tree: Path | None = None) -> None:
        """`batchfleet serve` of run `run`; `tree`: with the code of that checkout (on PYTHONPATH)."""
        self.run = run
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
        env.update({"REDIS_URL": url, "BATCHFLEET_QUEUES": f"{run}.gpu0"})
        cmd = [str(BIN / "batchfleet")]
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
            cmd = [sys.executable, "-c", "import sys; from fleetrun.cli import main; sys.exit(main())"]
        self.log = (state.parent / f"{run}.log").open("wb")
        self.proc = subprocess.Popen([*cmd, "serve", "--run", run, "--state-dir", str(state), "--port", str(self.port),
                                      "--max-requests", "1000000"], env=env, cwd=tree,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.base = base = f"http://127.0.0.1:{self.port}"
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


async def polls_during(sv: Serve, batch_id: str, upload: threading.Thread, every_s: float = 0.01) -> list[float]:
    """GET /v1/batches/{id} every `every_s` on a schedule (open loop) from now until `upload` (under way)
    ends; each poll's seconds from its scheduled time to its answer."""
    out: list[float] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=sv.base, limits=limits, timeout=600) as client:

        async def poll(at: float) -> None:
            r = await client.get(f"/v1/batches/{batch_id}", headers={"Authorization": "Bearer bench"})
            r.raise_for_status()
            out.append(time.perf_counter() - at)

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        n = 0
        while upload.is_alive() or n == 0:
            at = start + n * every_s
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(poll(at)))
            n += 1
        await asyncio.gather(*tasks)
    return out


UPLOAD = """import sys, httpx
print("go", flush=True)
with open(sys.argv[2], "rb") as fh:
    r = httpx.post(sys.argv[1], files={"file": ("big.jsonl", fh)}, data={"purpose": "batch"},
                   headers={"Authorization": "Bearer bench"}, timeout=600)
sys.exit(0 if r.status_code == 200 else f"upload: HTTP {r.status_code}: {r.text[:200]}")
"""


def upload_once(sv: Serve, big: Path, batch_id: str) -> tuple[list[float], float]:
    """Upload `big` (from a process of its own: its client's work shares no GIL with the polls) while
    polling the batch (`polls_during`): (the polls' latencies, the upload's seconds)."""
    took: list[float] = []

    going = threading.Event()

    def send() -> None:
        proc = subprocess.Popen([sys.executable, "-c", UPLOAD, sv.base + "/v1/files", str(big)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # "go": its imports are done, it sends now
        t0 = time.perf_counter()
        going.set()
        _, err = proc.communicate(timeout=600)
        if proc.returncode == 0:
            took.append(time.perf_counter() - t0)
        else:
            print(err.strip(), file=sys.stderr)

    upload = threading.Thread(target=send)
    upload.start()
    going.wait(60)  # the polls' schedule starts as the upload does
    latencies = asyncio.run(polls_during(sv, batch_id, upload))
    upload.join()
    if not took:
        raise SystemExit("the upload failed")
    return latencies, took[0]


def bench_upload(args: argparse.Namespace, work: Path, url: str) -> None:
    trees: list[Path | None] = [None] + ([Path(args.baseline_checkout).resolve()] if args.baseline_checkout else [])
    big = work / "big.jsonl"
    requests_file(big, int(args.upload_mb * 1e6 / 297))  # ~297 B a line
    small = work / "small.jsonl"
    requests_file(small, 10)
    lat: dict[Path | None, list[float]] = {t: [] for t in trees}
    ups: dict[Path | None, list[float]] = {t: [] for t in trees}
    for i in range(args.upload_repeat):  # interleaved, so the machine's load falls on both alike
        for t, tree in enumerate(trees):
            sv = Serve(url, work / f"up{i}t{t}", f"up{i}t{t}", tree=tree)
            try:
                _, _, bid = sv.upload_and_validate(small)  # a batch in progress: the one polled
                latencies, took = upload_once(sv, big, bid)
                lat[tree] += latencies
                ups[tree].append(took)
            finally:
                sv.stop()
            shutil.rmtree(work / f"up{i}t{t}", ignore_errors=True)
    print(f"GET /v1/batches/{{id}} every 10 ms (open loop) during a {big.stat().st_size / 1e6:,.0f} MB upload, "
          f"{args.upload_repeat} uploads each{' interleaved' if len(trees) > 1 else ''}: latency from the poll's "
          "scheduled time")

    def p(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    for tree in trees:
        label = "this tree" if tree is None else tree.name
        xs = lat[tree]
        print(f"  {label:<12} p50 {1e3 * p(xs, 0.5):>8.1f} ms   p99 {1e3 * p(xs, 0.99):>8.1f} ms   worst "
              f"{1e3 * max(xs):>8.1f} ms   ({len(xs):,} polls; upload {statistics.median(ups[tree]):.2f} s median, "
              f"{min(ups[tree]):.2f}-{max(ups[tree]):.2f})")
    if len(trees) > 1:
        base = trees[1]
        print(f"  p99 this tree / {base.name if base else ''}: {p(lat[None], 0.99) / p(lat[base], 0.99):.3f}   "
              f"(goal: p99 < 50 ms; this tree's {1e3 * p(lat[None], 0.99):.1f} ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--polls-per-s", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--only", choices=("validate", "upload"),
                    help="validate: 1 and 2 (upload + validate, polls' CPU); upload: 3 (polls during an upload)")
    ap.add_argument("--upload-mb", type=float, default=100.0, help="the size of the file uploaded in 3")
    ap.add_argument("--upload-repeat", type=int, default=3, help="uploads of each tree in 3")
    ap.add_argument("--baseline-checkout", metavar="DIR", help="3 also with serve run from this checkout's code")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        with PrivateRedis() as rp:
            if args.only != "validate":
                bench_upload(args, work, rp.url)
            if args.only != "upload":
                bench_validate(args, work, rp.url)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def bench_validate(args: argparse.Namespace, work: Path, url: str) -> None:
    path = work / "requests.jsonl"
    requests_file(path, args.n)
    size = path.stat().st_size
    rates, took = [], []
    sv: Serve | None = None
    for i in range(args.repeat):  # interleaved, so the machine's load falls on both alike
        rates.append(enqueue_rate(url, path, work / f"enq{i}", f"enq{i}"))
        if sv is not None:
            sv.stop()
        sv = Serve(url, work / f"serve{i}", f"bench{i}")  # a fresh store, as enqueue's
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
        worker = threading.Thread(target=stand_in_worker, args=(url, sv.run, 50.0, stop), daemon=True)
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


if __name__ == "__main__":
    sys.exit(main())

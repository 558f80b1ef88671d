"""Worker dispatch over real HTTP (the ceiling, and paced at a GPU's rate): worker CPU per prompt, and Redis memory.

1. HTTP dispatch ceiling: one worker process against an instant HTTP server (`bench/instant.py`, its
   own process, real sockets on loopback), max_tokens 1, C prompts in flight. Each contender runs in
   a fresh child process whose own CPU time (getrusage: user + system) is measured from its first
   request to its last answer:
   - RQ's SimpleWorker: one job at a time, the job POSTs through a keep-alive httpx.Client;
   - a bare httpx loop: C coroutines POSTing through one httpx.AsyncClient, no Redis at all: the
     ceiling httpx allows with the same concurrency;
   - a bare aiohttp loop, the same through one aiohttp session with its defaults;
   - a bare tuned-aiohttp loop: the same session tuned for one server and JSON POSTs (no cookie jar,
     no auto headers or decompression, a prebuilt URL, keep-alive below the server's 5 s): the other
     road for the worker's client;
   - a bare http1 loop, the same through `batchfleet.http1.Http1Pool` (a keep-alive pool on a bare
     asyncio protocol, replies parsed by httptools): the worker's HTTP client;
   - batchfleet's dispatcher: Redis claim/finish (batched Lua) + the worker's SGLang client
     (`batchfleet.sglang.make_client` and its `complete`, as the worker's dispatcher calls them), and the same
     dispatcher with tuned aiohttp under `complete` instead (the other road, end to end).
   With --baseline-checkout DIR, also that checkout's own bare http1 loop and dispatcher (an older
   version, run with DIR's code in the same run).
   The contenders run interleaved, --rounds times each; the best and the median are printed (the
   machine is shared: the best is the least disturbed).
2. Paced: the instant server runs C requests at once for C / --paced-rate s each (a GPU that finishes
   that many prompts per second); CPU microseconds per prompt at that rate, bare loops vs dispatcher,
   sustained (after the first fifth of the prompts: connections open, the surplus grown) and over the
   whole run. Once per --paced-step-s: the server ends requests at the end of steps that long, several
   at once, as SGLang's scheduler does (a decode step, or a prefill batch, ends every request due in
   it, and their replies go out together), and with 0 each request ends alone at its own time (the
   worst case for the client: one wakeup per reply).
3. Redis memory (used_memory) at the start, with N prompts queued, after they all ran (in-process
   instant backend), and after they were collected and exported: results must not pile up.

    python bench/bench_dispatch.py [--jobs 20000] [--baseline-jobs 2000] [--concurrency 128] [--rounds 3]
                                   [--paced-rate 1000] [--paced-jobs 10000] [--paced-step-s 0.02,0]
                                   [--memory-jobs 100000] [--only ceiling,paced,memory] [--profile out.prof]
                                   [--loop auto|uvloop|asyncio] [--baseline-checkout DIR] [--no-httpx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchfleet import sglang  # noqa: E402
from batchfleet.config import EVENT_LOOPS, Config  # noqa: E402
from batchfleet.keys import Keys  # noqa: E402
from bench.instant import InstantAnswers  # noqa: E402
from fleetrun.redisproc import PrivateRedis  # noqa: E402
from producer.api import Store, collect_once, enqueue, export  # noqa: E402
from worker.dispatcher import Dispatcher  # noqa: E402
from worker.eventloop import loop_factory  # noqa: E402
from worker.ledger import Ledger  # noqa: E402
from worker.steal import ClaimOrder  # noqa: E402

URL_PATH = "/v1/completions"


def body_for(i: int) -> dict[str, Any]:
    return {"model": "default", "prompt": f"Write a short note about item number {i}.", "max_tokens": 1}


def prompts_file(path: Path, n: int, max_tokens: int = 64) -> Path:
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"p{i}", "prompt": f"Write a short note about item number {i}.",
                                  "max_tokens": max_tokens}) + b"\n")
    return path


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# --- children: each prints {"n", "wall_s", "cpu_s", ...} as its last line ---------------------------
class Steady:
    """CPU and wall time at the moment the first STEADY_FRACTION of the prompts are done: the figures
    after it are the sustained rate's, without the start (connections opening, the surplus growing
    from nothing: Turnover sizes it from finishes it has not yet seen)."""

    FRACTION = 0.2

    def __init__(self, n: int) -> None:
        self.mark = max(1, int(n * self.FRACTION))
        self.done = 0
        self.at: tuple[float, float] | None = None

    def tick(self, *_: object) -> None:
        self.done += 1
        if self.done == self.mark:
            self.at = (time.perf_counter(), cpu_s())

    def out(self, wall_end: float, cpu_end: float) -> dict[str, float]:
        if self.at is None:
            return {}
        return {"steady_n": self.done - self.mark, "steady_wall_s": wall_end - self.at[0],
                "steady_cpu_s": cpu_end - self.at[1]}


def child_simpleworker(redis_url: str, n: int) -> dict[str, float]:
    from rq import Queue, SimpleWorker

    r = redis.Redis.from_url(redis_url)
    q = Queue("gpu0", connection=r)
    worker = SimpleWorker([q], connection=r)
    t0, c0 = time.perf_counter(), cpu_s()
    worker.work(burst=True, logging_level="WARNING")
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    assert q.count == 0
    return {"n": n, "wall_s": wall, "cpu_s": cpu}


async def bare_loop(post: Callable[[bytes], Awaitable[tuple[int, bytes]]], n: int,
                    concurrency: int) -> dict[str, float]:
    """`concurrency` coroutines POSTing n one-token prompts through `post` (body -> status, reply),
    timed from the first request to the last answer: what every bare-client contender runs."""
    todo = iter(range(n))
    steady = Steady(n)

    async def loop() -> None:
        for i in todo:
            status, reply = await post(orjson.dumps(body_for(i)))
            assert status == 200
            orjson.loads(reply)
            steady.tick()

    await post(b"{}")  # the first connection before the clock starts, like the dispatcher's
    t0, c0 = time.perf_counter(), cpu_s()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    t1, c1 = time.perf_counter(), cpu_s()
    assert steady.done == n
    return {"n": n, "wall_s": t1 - t0, "cpu_s": c1 - c0, **steady.out(t1, c1)}


async def child_httpx(server_url: str, n: int, concurrency: int) -> dict[str, float]:
    import httpx

    client = httpx.AsyncClient(base_url=server_url, timeout=httpx.Timeout(60, connect=10.0),
                               limits=httpx.Limits(max_connections=concurrency + 4,
                                                   max_keepalive_connections=concurrency + 4))

    async def post(body: bytes) -> tuple[int, bytes]:
        resp = await client.post(URL_PATH, content=body, headers={"Content-Type": "application/json"})
        return resp.status_code, resp.content

    try:
        return await bare_loop(post, n, concurrency)
    finally:
        await client.aclose()


async def child_aiohttp(server_url: str, n: int, concurrency: int) -> dict[str, float]:
    """The same loop through one aiohttp session: the ceiling of the client the worker used for
    generations before `batchfleet.http1`."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=60))

    async def post(body: bytes) -> tuple[int, bytes]:
        async with session.post(server_url + URL_PATH, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.read()

    try:
        return await bare_loop(post, n, concurrency)
    finally:
        await session.close()


Post = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]


def tuned_aiohttp(server_url: str, connections: int) -> tuple[Any, Post]:
    """An aiohttp session tuned for the worker's traffic, and its post(path, body) -> (status, body): no
    cookie jar, no User-Agent/Accept-Encoding or decompression, URLs built once (no parsing per
    request), keep-alive given up at 4 s (the server's is 5 s), no total timeout (a read timeout)."""
    import aiohttp
    import yarl

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=4.0,
                                       ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=60.0),
        cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        headers={"Content-Type": "application/json", "Accept": "application/json"})
    urls: dict[str, Any] = {}

    async def post(path: str, body: bytes) -> tuple[int, bytes]:
        url = urls.get(path)
        if url is None:
            url = urls[path] = yarl.URL(server_url + path, encoded=True)
        async with session.post(url, data=body) as resp:
            return resp.status, await resp.read()

    return session, post


async def child_aiohttp_tuned(server_url: str, n: int, concurrency: int) -> dict[str, float]:
    """The same loop through tuned aiohttp (`tuned_aiohttp`)."""
    session, post = tuned_aiohttp(server_url, concurrency + 4)
    try:
        return await bare_loop(lambda body: post(URL_PATH, body), n, concurrency)
    finally:
        await session.close()


async def child_http1(server_url: str, n: int, concurrency: int) -> dict[str, float]:
    """The same loop through `batchfleet.http1.Http1Pool`, the transport under the worker's SGLang
    client: the ceiling the dispatcher can reach."""
    from batchfleet.http1 import Http1Pool

    client = Http1Pool(server_url, max_connections=concurrency + 4, timeout_s=60.0)
    try:
        return await bare_loop(lambda body: client.post(URL_PATH, body), n, concurrency)
    finally:
        await client.aclose()


class AiohttpPool:
    """The transport under the worker's SGLang client (`sglang.Transport`) on tuned aiohttp: what the
    worker would run on the other road."""

    def __init__(self, server_url: str, connections: int) -> None:
        self.session, self._post = tuned_aiohttp(server_url, connections)

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        import aiohttp

        try:
            return await self._post(path, payload)
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc

    async def get(self, path: str, *, timeout_s: float) -> tuple[int, bytes]:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.session.close()


async def child_ours(redis_url: str, server_url: str, run: str, n: int, concurrency: int,
                     transport: str = "http1") -> dict[str, float]:
    config = Config(run=run, redis_url=redis_url, queues=("gpu0",))
    client = aioredis.from_url(redis_url)
    ledger = Ledger(client, Keys(run), worker="bench", lease_ttl_s=config.lease_ttl_s)
    http = (sglang.make_client(server_url, timeout_s=60.0, max_connections=concurrency + 4)
            if transport == "http1" else sglang.SGLangClient(AiohttpPool(server_url, concurrency + 4)))
    steady = Steady(n)
    # the worker's dispatcher, its server's client as the keeper opens it
    d = Dispatcher(ledger, InstantAnswers(http), config=config, worker="bench", queues=lambda: ClaimOrder(["gpu0"]),
                   clock=time.time, on_completion=steady.tick)
    d.limit.set_capacity(concurrency)  # as the keeper does once its server is up (capacity + surplus)
    await client.ping()
    await http.pool.post(URL_PATH, b"{}")  # the first connection before the clock starts
    d.gate.resume()
    flusher = asyncio.create_task(ledger.run_flusher())
    t0, c0 = time.perf_counter(), cpu_s()
    await d.run(burst=True)
    await d.takeback.drain(10)
    ledger.close()
    await flusher
    t1, c1 = time.perf_counter(), cpu_s()
    await client.aclose()
    await http.aclose()
    assert d.tally.done == n, (d.tally.done, d.tally.failed, n)
    return {"n": n, "wall_s": t1 - t0, "cpu_s": c1 - c0, "surplus": d.limit.surplus, **steady.out(t1, c1)}


def child_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("simpleworker", "httpx", "aiohttp", "aiohttp-tuned", "http1", "ours",
                                     "ours-aiohttp"))
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--server-url", default="")
    ap.add_argument("--run", default="dispatch")
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("-c", "--concurrency", type=int, default=128)
    ap.add_argument("--profile", default="")
    ap.add_argument("--loop", default="auto", choices=EVENT_LOOPS)
    a = ap.parse_args(argv)
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    # Every asyncio contender runs on the event loop the worker runs on (worker.eventloop): the
    # figures compare clients and bookkeeping, not loops.
    with asyncio.Runner(loop_factory=loop_factory(a.loop)) as runner:
        if a.mode == "simpleworker":
            out = child_simpleworker(a.redis_url, a.n)
        elif a.mode == "httpx":
            out = runner.run(child_httpx(a.server_url, a.n, a.concurrency))
        elif a.mode == "aiohttp":
            out = runner.run(child_aiohttp(a.server_url, a.n, a.concurrency))
        elif a.mode == "aiohttp-tuned":
            out = runner.run(child_aiohttp_tuned(a.server_url, a.n, a.concurrency))
        elif a.mode == "http1":
            out = runner.run(child_http1(a.server_url, a.n, a.concurrency))
        else:
            out = runner.run(child_ours(a.redis_url, a.server_url, a.run, a.n, a.concurrency,
                                        "aiohttp" if a.mode == "ours-aiohttp" else "http1"))
        out["loop"] = type(runner.get_loop()).__module__.split(".")[0]
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
    print(json.dumps(out))


# --- parent ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InstantServer:
    def __init__(self, delay_s: float = 0.0, capacity: int = 0, step_s: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.instant", "--port", str(self.port),
                                      "--delay-s", str(delay_s), "--capacity", str(capacity), "--step-s",
                                      str(step_s)], cwd=ROOT)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("instant server did not start") from None
                time.sleep(0.05)

    def __enter__(self) -> InstantServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


LOOP = "auto"  # --loop: the event loop of every asyncio contender (the worker's: worker.eventloop)


def run_child(*args: str, env: dict[str, str] | None = None) -> dict[str, float]:
    if "--loop" not in args:
        args = (*args, "--loop", LOOP)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_checkout_child(checkout: Path, *args: str) -> dict[str, float]:
    """This benchmark's child, as another checkout has it (`git worktree add DIR <rev>`), run with that
    checkout's own venv when it has one: an older version's dispatcher, measured in the same run."""
    python = checkout / ".venv" / "bin" / "python"
    done = subprocess.run([str(python if python.exists() else sys.executable),
                           str(checkout / "bench" / "bench_dispatch.py"), "--child", *args], cwd=checkout,
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # nothing written into it
    if done.returncode != 0:
        raise RuntimeError(f"child of {checkout} failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def enqueue_ours(url: str, n: int, workdir: Path, run: str, max_tokens: int = 64) -> tuple[Config, Store]:
    # a window as large as the run: every prompt in Redis before the clock starts
    config = Config(run=run, redis_url=url, state_dir=workdir / run, queues=("gpu0",), window_default=n,
                    window_max=max(n, 20_000))
    done = enqueue(config, redis.Redis.from_url(url), prompts_file(workdir / f"{run}.jsonl", n, max_tokens),
                   queues=("gpu0",))
    return config, done.store


def enqueue_simpleworker(url: str, n: int) -> None:
    from rq import Queue

    q = Queue("gpu0", connection=redis.Redis.from_url(url))
    q.enqueue_many([Queue.prepare_data("bench.instant.post_instant", ({"url": URL_PATH, "body": body_for(i)},),
                                       result_ttl=0) for i in range(n)])


def measure_ours(url: str, server: InstantServer, n: int, concurrency: int, workdir: Path, run: str,
                 profile: str = "", loop: str = "", mode: str = "ours",
                 checkout: Path | None = None) -> dict[str, float]:
    """One dispatcher run (`mode` ours or ours-aiohttp; another checkout's with `checkout`) over n
    prompts enqueued afresh."""
    redis.Redis.from_url(url).flushall()
    enqueue_ours(url, n, workdir, run, max_tokens=1)
    extra = ["--profile", profile] if profile else []
    if loop:
        extra += ["--loop", loop]
    args = (mode, "--redis-url", url, "--server-url", server.url, "--run", run, "-n", str(n), "-c", str(concurrency))
    return run_checkout_child(checkout, *args, *extra) if checkout else run_child(*args, *extra)


def rate(m: dict[str, float]) -> float:
    return m["n"] / m["wall_s"]


def us(m: dict[str, float]) -> float:
    return m["cpu_s"] / m["n"] * 1e6


def line(name: str, ms: list[dict[str, float]]) -> str:
    rates, uss = [rate(m) for m in ms], [us(m) for m in ms]
    spread = (f"  (median {statistics.median(rates):,.0f}/s, {statistics.median(uss):.0f} µs; {len(ms)} runs of "
              f"{int(ms[0]['n']):,})")
    return f"  {name:<32}: {max(rates):9,.0f} prompts/s  {min(uss):6.0f} µs CPU/prompt" + spread


def bench_ceiling(url: str, workdir: Path, args: argparse.Namespace) -> None:
    c = args.concurrency
    keys = ("httpx", "aiohttp", "aiohttp-tuned", "http1", "old-http1", "ours", "ours-aiohttp", "older")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    old = args.baseline_checkout
    with InstantServer() as server:
        redis.Redis.from_url(url).flushall()
        enqueue_simpleworker(url, args.baseline_jobs)
        sw = run_child("simpleworker", "--redis-url", url, "-n", str(args.baseline_jobs),
                       env={"BENCH_INSTANT_URL": server.url})
        for i in range(args.rounds):
            bare = ("--server-url", server.url, "-n", str(args.jobs), "-c", str(c))
            for mode in ("httpx", "aiohttp", "aiohttp-tuned", "http1"):
                if mode != "httpx" or not args.no_httpx:
                    runs[mode].append(run_child(mode, *bare))
            runs["ours"].append(measure_ours(url, server, args.jobs, c, workdir, f"ceiling{i}",
                                             args.profile if i == args.rounds - 1 else ""))
            runs["ours-aiohttp"].append(measure_ours(url, server, args.jobs, c, workdir, f"ceilingaio{i}",
                                                     mode="ours-aiohttp"))
            if old:
                runs["old-http1"].append(run_checkout_child(old, "http1", *bare))
                runs["older"].append(measure_ours(url, server, args.jobs, c, workdir, f"ceilingold{i}", checkout=old))
    ours = runs["ours"]
    print(f"HTTP dispatch ceiling: one process, instant HTTP server (own process), max_tokens 1, {c} in flight; "
          f"event loop: {ours[-1]['loop']}")
    print(line("RQ SimpleWorker (httpx.Client)", [sw]))
    names = {"httpx": "bare httpx loop", "aiohttp": "bare aiohttp loop (defaults)",
             "aiohttp-tuned": "bare aiohttp loop (tuned)", "http1": "bare http1 loop (httptools)",
             "old-http1": f"bare http1 loop of {old.name if old else ''}", "ours": "batchfleet dispatcher",
             "ours-aiohttp": "dispatcher on tuned aiohttp", "older": f"dispatcher of {old.name if old else ''}"}
    for key, name in names.items():
        if runs[key]:
            print(line(name, runs[key]))
    r_ours, u_ours = max(map(rate, ours)), min(map(us, ours))
    print(f"  dispatcher / SimpleWorker        : {r_ours / rate(sw):9.1f}x prompts/s, "
          f"{us(sw) / u_ours:.1f}x less CPU per prompt")
    for key in ("httpx", "aiohttp-tuned", "http1", "ours-aiohttp", "older"):
        if runs[key]:
            print(f"  dispatcher / {names[key]:<30}: {r_ours / max(map(rate, runs[key])):6.2f}x prompts/s, "
                  f"{u_ours / min(map(us, runs[key])):.2f}x CPU per prompt (best)")
    u_h1, u_tuned = min(map(us, runs["http1"])), min(map(us, runs["aiohttp-tuned"]))
    print(f"  bare http1 / bare tuned aiohttp  : {u_h1 / u_tuned:.2f}x CPU per prompt (best)")


def us_steady(m: dict[str, float]) -> float:
    """CPU per prompt after the first fifth of the run (Steady); the whole run's for a child that
    does not say (another checkout's)."""
    if not m.get("steady_n"):
        return us(m)
    return m["steady_cpu_s"] / m["steady_n"] * 1e6


def paced_line(name: str, ms: list[dict[str, float]]) -> str:
    rates, steady, whole = [rate(m) for m in ms], [us_steady(m) for m in ms], [us(m) for m in ms]
    return (f"  {name:<34}: {max(rates):6,.0f} prompts/s  {min(steady):5.0f} µs CPU/prompt sustained (median "
            f"{statistics.median(steady):.0f}); whole run {min(whole):.0f} (median {statistics.median(whole):.0f}); "
            f"{len(ms)} runs of {int(ms[0]['n']):,}")


def ratio(a: list[dict[str, float]], b: list[dict[str, float]]) -> str:
    return (f"{min(map(us_steady, a)) / min(map(us_steady, b)):5.2f}x (best), "
            f"{statistics.median(map(us_steady, a)) / statistics.median(map(us_steady, b)):.2f}x (median)")


def bench_paced(url: str, workdir: Path, args: argparse.Namespace) -> None:
    for step_s in (float(x) for x in args.paced_step_s.split(",")):
        paced_once(url, workdir, args, step_s)


PACED_NAMES = {"httpx": "bare httpx loop", "aiohttp": "bare aiohttp loop (defaults)",
               "aiohttp-tuned": "bare aiohttp loop (tuned)", "http1": "bare http1 loop (httptools)",
               "old-http1": "bare http1 loop of {old}", "ours": "batchfleet dispatcher",
               "older": "dispatcher of {old}", "ours-aiohttp": "dispatcher on tuned aiohttp",
               "ours-std": "dispatcher, asyncio's own loop"}


def paced_once(url: str, workdir: Path, args: argparse.Namespace, step_s: float) -> None:
    c, target = args.concurrency, args.paced_rate
    old: Path | None = args.baseline_checkout  # another checkout's bare http1 loop and dispatcher
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in PACED_NAMES}
    # A request ends at the first step end after its time is up: half a step later on average.
    delay_s = c / target - step_s / 2
    tag = f"s{int(step_s * 1000)}"
    with InstantServer(delay_s=delay_s, capacity=c, step_s=step_s) as server:
        for i in range(args.rounds):
            bare = ("--server-url", server.url, "-n", str(args.paced_jobs), "-c", str(c))
            if not args.no_httpx:
                runs["httpx"].append(run_child("httpx", "--server-url", server.url, "-n", str(args.paced_httpx_jobs),
                                               "-c", str(c)))
            for mode in ("aiohttp", "aiohttp-tuned", "http1"):
                runs[mode].append(run_child(mode, *bare))
            if old:
                runs["old-http1"].append(run_checkout_child(old, "http1", *bare))
            runs["ours"].append(measure_ours(url, server, args.paced_jobs, c, workdir, f"paced{tag}{i}"))
            if old:  # right after ours: the two dispatchers see the machine alike
                runs["older"].append(measure_ours(url, server, args.paced_jobs, c, workdir, f"pacedold{tag}{i}",
                                                  checkout=old))
            runs["ours-aiohttp"].append(measure_ours(url, server, args.paced_jobs, c, workdir, f"pacedaio{tag}{i}",
                                                     mode="ours-aiohttp"))
            if runs["ours"][-1]["loop"] != "asyncio":
                runs["ours-std"].append(measure_ours(url, server, args.paced_jobs, c, workdir, f"pacedstd{tag}{i}",
                                                     loop="asyncio"))
    how = (f"replies at the end of {step_s * 1000:g}-ms steps, several at once, as SGLang's scheduler ends requests"
           if step_s else "each reply alone, at its own time (the worst case: a wakeup per reply)")
    ours = runs["ours"]
    print(f"paced: the server runs {c} at once, {c / target * 1000:.0f} ms each on average -> at most {target:,} "
          f"prompts/s; {how}; event loop: {ours[-1]['loop']}; sustained = after the first "
          f"{Steady.FRACTION:.0%} of the prompts")
    names = {k: v.format(old=old.name if old else "") for k, v in PACED_NAMES.items()}
    for key, name in names.items():
        if runs[key]:
            surplus = f"; surplus {ours[-1].get('surplus', 0):.0f}" if key == "ours" else ""
            print(paced_line(name, runs[key]) + surplus)
    if runs["older"]:
        print(f"  dispatcher / {names['older']:<34}: {ratio(ours, runs['older'])} sustained; "
              f"{min(map(us, ours)) / min(map(us, runs['older'])):.2f}x (best), "
              f"{statistics.median(map(us, ours)) / statistics.median(map(us, runs['older'])):.2f}x (median) "
              "whole runs (goal: <= 1.15x)")
    for a, b in (("ours", "ours-aiohttp"), ("ours", "ours-std"), ("ours", "http1"), ("http1", "aiohttp-tuned"),
                 ("http1", "aiohttp"), ("http1", "old-http1"), ("ours", "httpx")):
        if runs[a] and runs[b]:
            left = "dispatcher" if a == "ours" else "bare http1 loop"
            print(f"  {left} / {names[b]:<{47 - len(left)}}: {ratio(runs[a], runs[b])}")


async def run_dispatcher_inprocess(url: str, config: Config, capacity: int) -> tuple[float, int]:
    client = aioredis.from_url(url)
    ledger = Ledger(client, Keys(config.run), worker="bench", lease_ttl_s=config.lease_ttl_s)
    d = Dispatcher(ledger, InstantAnswers(), config=config, worker="bench", queues=lambda: ClaimOrder(["gpu0"]),
                   clock=time.time, on_completion=lambda tokens: None)
    d.limit.set_capacity(capacity)
    d.gate.resume()
    flusher = asyncio.create_task(ledger.run_flusher())
    t0 = time.perf_counter()
    await d.run(burst=True)
    await d.takeback.drain(10)
    elapsed = time.perf_counter() - t0
    ledger.close()
    await flusher
    await client.aclose()
    return elapsed, d.tally.done


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def bench_memory(url: str, workdir: Path, args: argparse.Namespace) -> None:
    r = redis.Redis.from_url(url)
    r.flushall()
    r.memory_purge()
    start = used(r)
    config, store = enqueue_ours(url, args.memory_jobs, workdir, "memory")
    queued = used(r)
    elapsed, done = asyncio.run(run_dispatcher_inprocess(url, config, 256))
    ran = used(r)
    collect_once(r, store, Keys(config.run))
    summary = export(r, store, Keys(config.run), workdir / "out.jsonl")
    r.memory_purge()
    end = used(r)
    lines = sum(1 for _ in (workdir / "out.jsonl").open("rb"))
    assert lines == args.memory_jobs, (lines, summary)
    mib = 1 / 2**20
    print(f"Redis used_memory over {args.memory_jobs:,} prompts (in-process instant backend, {done / elapsed:,.0f} "
          "jobs/s)")
    print(f"  at start                      : {start * mib:8.2f} MiB")
    print(f"  {args.memory_jobs:,} queued                : {queued * mib:8.2f} MiB")
    print(f"  all ran, results not collected: {ran * mib:8.2f} MiB")
    print(f"  collected and exported        : {end * mib:8.2f} MiB  ({(end - start) / 1024:+.1f} KiB vs start)")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-jobs", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paced-rate", type=int, default=1000)
    ap.add_argument("--paced-jobs", type=int, default=10000)
    ap.add_argument("--paced-httpx-jobs", type=int, default=3000, help="httpx cannot keep up: fewer")
    ap.add_argument("--no-httpx", action="store_true", help="leave the bare httpx loop out (slow: minutes)")
    ap.add_argument("--paced-step-s", default="0.02,0",
                    help="paced runs, one per value: the instant server ends requests at the end of steps this long "
                         "(0: each at its own time)")
    ap.add_argument("--memory-jobs", type=int, default=100_000)
    ap.add_argument("--only", default="ceiling,paced,memory")
    ap.add_argument("--profile", default="", help="cProfile the dispatcher's last ceiling run into this file")
    ap.add_argument("--baseline-checkout", type=Path, default=None,
                    help="also run this checkout's bare http1 loop and dispatcher (e.g. `git worktree add DIR REV`), "
                         "with its own .venv if it has one, interleaved; nothing is written into it")
    ap.add_argument("--loop", default="auto", choices=EVENT_LOOPS,
                    help="event loop of every asyncio contender (default: the worker's, uvloop when installed)")
    args = ap.parse_args()
    global LOOP
    LOOP = args.loop
    parts = set(args.only.split(","))
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores)")
    with PrivateRedis() as redis_proc, tempfile.TemporaryDirectory() as tmp:
        if "ceiling" in parts:
            bench_ceiling(redis_proc.url, Path(tmp), args)
        if "paced" in parts:
            bench_paced(redis_proc.url, Path(tmp), args)
        if "memory" in parts:
            bench_memory(redis_proc.url, Path(tmp), args)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

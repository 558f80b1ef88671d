"""`make demo`: the main job on simulated GPUs, start to finish.

Enqueues the bundled sample, starts one simulated SGLang server + batchfleet worker per GPU (the
same `rq worker gpuN` a real host runs), shows the supervisor's view while they work, then stops
everything, exports the results and prints a summary. Uses the Redis at REDIS_URL when it answers,
else starts a private redis-server for the duration. Everything it writes goes under var/demo/ (the
run's store, `<run>.sqlite`, too; `head.log` is the head process's output); in a shared Redis it
purges its run at the end (`producer purge`), so nothing of it stays there.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import redis
from rich.console import Console
from rich.live import Live

from batchfleet.keys import Keys
from producer.store import Store
from supervisor.fleet import read_fleet
from supervisor.view import render

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.redisproc import PrivateRedis  # noqa: E402  (a dev tool, not part of the installed package)

BIN = Path(sys.executable).parent
console = Console(width=None if sys.stdout.isatty() else 120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_or_private(url: str) -> tuple[str, PrivateRedis | None]:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        console.print(f"Redis: using {url}")
        return url, None
    except redis.RedisError:
        pass
    if shutil.which("redis-server") is None:
        sys.exit("demo: no Redis answers at REDIS_URL and redis-server is not installed (apt-get install redis-server)")
    private = PrivateRedis().__enter__()
    console.print(f"Redis: none at the configured URL; started a private redis-server at {private.url}")
    return private.url, private


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--prompts", type=Path, default=ROOT / "examples" / "prompts.jsonl")
    parser.add_argument("--profile", default="seed-27b-96gb", help="simulated model/GPU (SGLANG_SIM_PROFILE)")
    parser.add_argument("--time-scale", type=float, default=20.0, help="simulated seconds per wall second")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    run = time.strftime("demo-%Y%m%d-%H%M%S")
    workdir = ROOT / "var" / "demo" / run
    workdir.mkdir(parents=True, exist_ok=True)
    url, private_redis = redis_or_private(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    port_base = free_port_block(args.gpus)
    env = {
        **os.environ,
        "PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{os.environ.get('PATH', '')}",
        "REDIS_URL": url,
        "RQ_WORKER_CLASS": "worker.GPUWorker",
        "BATCHFLEET_RUN": run,
        # Queues of its own (demo-...gpuN): a Redis shared with other work keeps its queues to itself.
        "BATCHFLEET_QUEUE_PATTERN": re.escape(run) + r"\.gpu\d+",
        "BATCHFLEET_STATE_DIR": str(workdir),
        "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
        "BATCHFLEET_MODEL_PATH": f"sim/{args.profile}",
        "BATCHFLEET_SERVER_ARGS": "--context-length 4096",  # so the sample's two oversized prompts fail
        "BATCHFLEET_PORT_BASE": str(port_base),
        "BATCHFLEET_STARTUP_TIMEOUT_S": "120",
        "SGLANG_SIM_PROFILE": args.profile,
        "SGLANG_SIM_TIME_SCALE": str(args.time_scale),
        "SGLANG_SIM_GPU_DIR": str(workdir / "gpus"),
    }
    queues = ",".join(f"{run}.gpu{i}" for i in range(args.gpus))
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        console.rule(f"1. enqueue {args.prompts.name} onto {args.gpus} queues ({run}.gpu0 ...)")
        enq = subprocess.run([str(BIN / "producer"), "enqueue", str(args.prompts), "--queues", queues,
                              "--rejects", str(workdir / "rejects.jsonl")], env=env, check=False)
        if enq.returncode not in (0, 1):
            return enq.returncode
        console.rule(f"2. {args.gpus} simulated GPUs ({args.profile}, x{args.time_scale:g} time) + workers")
        for i in range(args.gpus):
            log = (workdir / f"worker-gpu{i}.log").open("wb")
            procs.append(subprocess.Popen([str(BIN / "rq"), "worker", f"{run}.gpu{i}"], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        # the head process: feeds each queue's window from the store, collects results into it
        head = subprocess.Popen([str(BIN / "producer"), "head"], env=env,
                                stdout=subprocess.DEVNULL, stderr=(workdir / "head.log").open("wb"))
        procs.append(head)
        store = Store.open(workdir / f"{run}.sqlite", run=run, readonly=True)
        watch(redis.Redis.from_url(url), Keys(run), store, env["BATCHFLEET_QUEUE_PATTERN"], args.timeout, procs)
        store.close()
        elapsed = time.monotonic() - t0
    finally:
        console.rule("3. stop workers (SIGTERM: finish or hand back in-flight, stop servers)")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
        console.print(f"exit codes: {codes}")
    console.rule("4. export")
    out = workdir / "results.jsonl"
    subprocess.run([str(BIN / "producer"), "export", str(out)], env=env, check=False)
    summary(out, workdir, elapsed, args.time_scale)
    if private_redis is not None:
        private_redis.__exit__(None, None, None)
    else:
        # A shared Redis keeps nothing of the demo: its processes are stopped, the store and the export
        # stay under var/demo/.
        console.rule("5. purge the demo's run from the shared Redis")
        subprocess.run([str(BIN / "producer"), "purge", run, "--yes", "--force"], env=env, check=False)
    return 0


def free_port_block(n: int) -> int:
    """A base port with n free ports after it (each GPU's server listens on base + index)."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def watch(r: redis.Redis, k: Keys, store: Store, pattern: str, timeout_s: float,
          procs: list[subprocess.Popen[bytes]]) -> None:
    """The supervisor's view until every prompt in the store has its result there."""
    deadline = time.monotonic() + timeout_s
    tty = console.is_terminal
    last_print = 0.0
    first = render(read_fleet(r, k, queue_pattern=pattern))
    with Live(first, console=console, refresh_per_second=2, transient=False) if tty else _NoLive() as live:
        while time.monotonic() < deadline:
            snap = read_fleet(r, k, queue_pattern=pattern)
            with store.read():
                pending = store.counts()["pending"]
            if tty:
                live.update(render(snap))
            elif time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                console.print(render(snap))
            if pending == 0:
                console.print(render(snap))
                return
            if all(p.poll() is not None for p in procs[:-1]):
                console.print("[red]all workers exited; see var/demo/<run>/worker-gpu*.log")
                return
            time.sleep(0.5)
    console.print("[red]demo timed out")


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, _: object) -> None:
        return None


def summary(out: Path, workdir: Path, elapsed: float, time_scale: float) -> None:
    ok = failed = tokens = 0
    reasons: list[str] = []
    with out.open("rb") as f:
        for line in f:
            rec = orjson.loads(line)
            if rec["error"] is None:
                ok += 1
                tokens += rec["response"]["body"]["usage"]["completion_tokens"]
            else:
                failed += 1
                reasons.append(f"{rec['custom_id']}: {rec['error']['message'][:100]}")
    rejects = sum(1 for _ in (workdir / "rejects.jsonl").open()) if (workdir / "rejects.jsonl").exists() else 0
    console.rule("summary")
    console.print(f"prompts exported : {ok + failed} ({ok} succeeded, {failed} failed), {rejects} input lines rejected")
    console.print(f"wall time        : {elapsed:.1f} s  ({tokens:,} completion tokens)")
    console.print(f"tokens/s         : {tokens / elapsed:,.0f} wall-clock, start-up included; "
                  f"{tokens / (elapsed * time_scale):,.0f} in simulated GPU time (x{time_scale:g})")
    for reason in reasons[:5]:
        console.print(f"failed           : {reason}")
    console.print(f"results          : {out}")
    console.print(f"rejects          : {workdir / 'rejects.jsonl'}")
    console.print(f"server/worker logs: {workdir}/logs/, {workdir}/worker-gpu*.log")


if __name__ == "__main__":
    sys.exit(main())

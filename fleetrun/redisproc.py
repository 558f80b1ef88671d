"""A private redis-server for one run on one box: the embedded default of `batchfleet run`.

It listens on 127.0.0.1 only, on a free port, and keeps an append-only file (AOF, fsync every
second) in its own directory inside the run's state dir, so stopping and starting it again — a
Ctrl-C and a re-run — finds the run's queues, leases and uncollected results where they were. A
pid file in that directory keeps a second redis-server off the same files.

Without a directory (the benchmarks'), it runs in a temporary one without persistence, removed when
it stops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from batchfleet.procs import pid_alive
from batchfleet.redact import private_dir

HOST = socket.gethostname()

__all__ = ["PrivateRedis", "PrivateRedisBusy", "PrivateRedisError", "answers"]


class PrivateRedisError(Exception):
    """The private redis-server could not start (a message a person can act on)."""


class PrivateRedisBusy(PrivateRedisError):
    """A live redis-server already uses the directory: another `batchfleet run` or `serve` of the run is
    active."""


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """Does a Redis answer PING at `url`?"""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """`start()` / `stop()` (SIGTERM: Redis flushes its AOF and exits), or use as a context manager.
    `directory` None: a temporary one, no persistence (see the module doc)."""

    def __init__(self, directory: Path | None = None, *, run: str = "") -> None:
        self.persist = directory is not None
        self.dir = directory or Path(tempfile.mkdtemp(prefix="batchfleet-redis-"))
        self.run = run or self.dir.name.removesuffix(".redis")
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pidfile(self) -> Path:
        return self.dir / "redis.pid"

    def start(self, timeout_s: float = 30.0) -> PrivateRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise PrivateRedisError("no Redis answers at REDIS_URL and redis-server is not installed: install it "
                                    "(apt-get install redis-server) or set REDIS_URL to a Redis that answers")
        private_dir(self.dir)
        os.chmod(self.dir, 0o700)  # the run's prompts are in the AOF
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = int(self.pidfile.read_text().strip())
            if pid_alive(pid):
                parent = _parent_of(pid)
                if parent is not None and parent > 1:
                    raise PrivateRedisBusy(f"another batchfleet run or serve of {self.run} is active ({HOST}, pid "
                                           f"{parent}): its private redis-server (pid {pid}) uses {self.dir}; "
                                           "nothing was started")
                raise PrivateRedisBusy(f"a redis-server (pid {pid}) already uses {self.dir}: the `batchfleet run` or "
                                       f"`serve` of {self.run} that started it is gone but its Redis outlived it: "
                                       "stop that pid")
        self.port = _free_port()
        log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes" if self.persist else "no", "--appendfsync", "everysec", "--save", "",
             "--pidfile", str(self.pidfile),
             "--logfile", "", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # Ctrl-C is ours to handle
        log.close()
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        while True:
            if self.proc.poll() is not None:
                lines = (self.dir / "redis.log").read_text(errors="replace").strip().splitlines()
                last = lines[-1].strip() if lines else "no output"
                raise PrivateRedisError(f"redis-server exited {self.proc.returncode} at start: {last} (its log: "
                                        f"{self.dir / 'redis.log'})")
            try:
                client.ping()  # also answers LOADING while it reads the AOF: wait for a real PONG
                break
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PrivateRedisError(f"redis-server did not answer within {timeout_s:.0f} s (see "
                                        f"{self.dir / 'redis.log'})")
            time.sleep(0.05)
        client.close()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if not self.persist:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

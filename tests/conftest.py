"""Shared fixtures: a private, real redis-server per test session (on a free port, so tests can stop
and restart it without touching the machine's own Redis), flushed before each test."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

if TYPE_CHECKING:
    from .fleet import Fleet


# Ports the tests listen on come from below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
# 32768-60999 by default), never from `bind(0)`: a port of that range can be taken as the local port of
# any outgoing connection on the machine while its server is down (a Redis a test restarts, an SGLang
# server its worker restarts on a new spec), and the restart then fails with "address already in use"
# for as long as that connection lives (seen: a minute, under a rollout). 30000-30099 is left to the
# product's default BATCHFLEET_PORT_BASE (a `make demo` on the same machine).
_handed_out: set[int] = set()
_rng = random.Random()  # seeded from os.urandom: two test sessions on one machine pick apart


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port still in TIME_WAIT counts as taken
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int = 1) -> int:
    """The first of `n` consecutive free ports below the ephemeral range, not handed out before in this
    session."""
    high = min(_ephemeral_low(), 60000)
    low = 10000 if high > 12000 else 1024
    # Under pytest-xdist each worker process draws from its own slice, so two of them never pick the
    # same free block between checking it and binding it.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    me = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0")[2:] or 0)
    if workers > 1:
        span = (high - low) // workers
        low, high = low + me * span, low + (me + 1) * span
    for _ in range(2000):
        base = _rng.randrange(low, high - n)
        block = range(base, base + n)
        if any(p in _handed_out or 30000 <= p < 30100 for p in block):
            continue
        if all(_bindable(p) for p in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no {n} free consecutive ports in {low}-{high}")


def free_port() -> int:
    return free_port_block(1)


class RedisServer:
    """A redis-server subprocess the tests own."""

    def __init__(self, workdir: Path, *extra_args: str, password: str = "", user: str = "",
                 bind: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.port = free_port()
        self.bind = bind  # the first address is the one `url` names (e.g. a test LAN's, tests/hosts.py)
        self.workdir = workdir
        # With `user` (an ACL user, e.g. from an --aclfile), `password` is that user's, not requirepass.
        self.extra_args = [*extra_args, *(["--requirepass", password] if password and not user else [])]
        self.password = password
        self.user = user
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.password else ""
        return f"redis://{auth}{self.bind[0]}:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", *self.bind, "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(autouse=True)
def _no_fleet_outlives_its_test() -> Iterator[None]:
    """Kill every process of every Fleet the test made, pass or fail, even one made without the
    `fleets` fixture: a worker left alive takes the next tests' jobs from the shared Redis, so one
    failure would fail the tests after it too."""
    yield
    from .fleet import Fleet  # tests/fleet.py imports this module

    while Fleet.made:
        Fleet.made.pop().kill_all()


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def fleets(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., Fleet]]:
    """Make fleets (tests/fleet.py) whose processes are all killed when the test ends, pass or fail."""
    from .fleet import Fleet  # tests/fleet.py imports this module

    made: list[Fleet] = []

    def make(**kw: object) -> Fleet:
        fleet = Fleet(tmp_path, redis_url, **kw)  # type: ignore[arg-type]
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.kill_all()


@pytest.fixture(autouse=True)
def _no_serve_outlives_its_test() -> Iterator[None]:
    """Every `batchfleet serve` a test started (tests/serveproc.py) is stopped when it ends."""
    yield
    from .serveproc import Serve

    while Serve.made:
        sv = Serve.made.pop()
        sv.stop(60)
        sv.kill()

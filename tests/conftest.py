"""Shared fixtures: a private, real redis-server per test session (on a free port, so tests can stop
and restart it without touching the machine's own Redis), flushed before each test."""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

"""Redis URLs: passwords and TLS are honoured by every process, and never printed."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.connection import async_client_like, connect, redacted

from .conftest import free_port


@pytest.fixture
def password_redis(tmp_path):
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--requirepass", "s3cret", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL)
    url = f"redis://:s3cret@127.0.0.1:{port}/2"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def test_password_is_used_by_sync_and_async_clients(password_redis):
    sync = connect(password_redis)
    sync.set("k", "v")
    assert sync.connection_pool.connection_kwargs["db"] == 2
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(password_redis.replace(":s3cret@", ":wrong@")).ping()

    async def go() -> bytes | None:
        client = async_client_like(sync)  # what the worker builds from RQ's connection
        try:
            return await client.get("k")
        finally:
            await client.aclose()

    assert asyncio.run(go()) == b"v"


def test_producer_works_through_a_password_and_redacts_it(password_redis, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    env = {"REDIS_URL": password_redis, "BATCHFLEET_STATE_DIR": str(tmp_path / "s"), "PATH": ""}
    bin_dir = sys.executable.rsplit("/", 1)[0]
    ok = subprocess.run([f"{bin_dir}/producer", "enqueue", str(tmp_path / "p.jsonl"), "--no-progress"], env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert connect(password_redis).llen("rq:queue:gpu0") == 1
    bad = subprocess.run([f"{bin_dir}/producer", "status"],
                         env={**env, "REDIS_URL": password_redis.replace(":s3cret@", ":nope@")},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "nope" not in bad.stderr + bad.stdout and "***" in bad.stderr


def test_tls_urls_give_tls_connections_everywhere():
    sync = connect("rediss://:pw@redis.example:6380/0")
    assert issubclass(sync.connection_pool.connection_class, redis.SSLConnection)
    client = async_client_like(sync)
    assert issubclass(client.connection_pool.connection_class, aioredis.SSLConnection)
    assert redacted("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"

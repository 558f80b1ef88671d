"""Redis URLs: passwords and TLS are honoured by every process, and never printed."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.connection import async_client_like, connect, redacted

from .conftest import RedisServer


@pytest.fixture
def password_redis(tmp_path):
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    yield server.url[: -len("/0")] + "/2"
    server.stop()


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

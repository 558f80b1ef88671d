"""`batchfleet serve`'s HTTP API in this process (its app, registry and a batch engine that is not started):
what waits on the disk (made slow here) stalls none of the API's other clients, and an upload it
refuses leaves no bytes behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
from aiohttp import web

from batchapi.app import make_app
from batchapi.engine import Engine, Limits
from batchapi.registry import Registry
from batchfleet.config import Config

from .conftest import free_port

STALL_S = 2.0  # each fsync of an upload takes this long


@contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """The app on a free port of 127.0.0.1, its event loop in a thread of its own; its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="api-loop", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def api(state: Path, redis_url: str, run: str, *, max_upload_bytes: int) -> tuple[Registry, web.Application]:
    """serve's registry and app for `run`, the batch engine made but not started (no batch is validated)."""
    config = Config(run=run, redis_url=redis_url, state_dir=state)
    registry = Registry(state, run)
    limits = Limits()
    engine = Engine(config, registry, state / f"{run}.sqlite", redis.Redis.from_url(redis_url), limits)
    return registry, make_app(registry, engine, limits, max_upload_bytes=max_upload_bytes)


def test_a_poll_is_answered_at_once_while_a_large_upload_is_being_synced_to_disk(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    registry, app = api(state, redis_url, "stall", max_upload_bytes=200_000_000)
    line = (b'{"custom_id":"r%d","method":"POST","url":"/v1/chat/completions","body":{"messages":'
            b'[{"role":"user","content":"hi"}]}}\n')
    big = b"".join(line % i for i in range(100_000))  # ~9 MB
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        f = client.post("/files", files={"file": ("small.jsonl", line % 0)}, data={"purpose": "batch"}).json()
        batch = client.post("/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}).json()
        syncing = threading.Event()
        real_fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            syncing.set()
            time.sleep(STALL_S)
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
        uploaded: list[httpx.Response] = []
        upload = threading.Thread(target=lambda: uploaded.append(client.post(
            "/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})))
        upload.start()
        try:
            assert syncing.wait(60), "the upload's bytes were never synced"
            t0 = time.monotonic()
            poll = client.get(f"/batches/{batch['id']}")
            took = time.monotonic() - t0
        finally:
            upload.join(60)
        assert poll.status_code == 200 and poll.json()["id"] == batch["id"]
        assert took < STALL_S / 4, f"a poll waited {took:.2f} s on another client's upload"
        # and the upload is what it was, once acknowledged: its bytes on disk, its record in the registry
        assert len(uploaded) == 1 and uploaded[0].status_code == 200, uploaded
        big_id = uploaded[0].json()["id"]
        assert uploaded[0].json()["bytes"] == len(big)
        assert registry.file_path(big_id).read_bytes() == big
        assert client.get(f"/files/{big_id}/content").content == big
    registry.close()
    again = Registry(state, "stall")  # as a serve started again finds it
    try:
        assert again.file(big_id, "") is not None
    finally:
        again.close()


def test_an_upload_that_grows_past_the_limit_midway_is_refused_and_leaves_no_bytes_behind(
        tmp_path: Path, redis_url: str) -> None:
    registry, app = api(tmp_path / "state", redis_url, "limit", max_upload_bytes=5_000_000)
    # under the limit by its Content-Length (which allows a multipart envelope), over it by its bytes:
    # refused while its first megabytes are being written
    over = b"x" * 5_500_000
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/files", files={"file": ("over.jsonl", over)}, data={"purpose": "batch"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
        ok = client.post("/files", files={"file": ("ok.jsonl", b"y" * 4_000_000)}, data={"purpose": "batch"})
        assert ok.status_code == 200
        assert client.get("/files").json()["data"] == [ok.json()]
    assert sorted(p.name for p in registry.dir.iterdir()) == [ok.json()["id"]]  # no temporary bytes left
    registry.close()

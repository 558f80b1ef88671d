"""The worker's HTTP client against the server SGLang really runs: uvicorn under FastAPI, started as
SGLang starts it (`timeout_keep_alive=5`, uvloop), with each of uvicorn's two HTTP implementations
(httptools, which SGLang gets when it is installed, and h11). Keep-alive closing at 5 s, `Connection:
close`, chunked replies, slow replies, resets, cancellation, and SGLang's reply shapes read through
the worker's own functions (`sglang.complete`, `get_server_info`, `status.scrape_metrics`,
`SGLangServer.check_health`). The app: tests/sglang_uvicorn.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest

from batchfleet import http1, sglang
from batchfleet.config import Config
from batchfleet.errors import PromptError, RetryableError, ServerDied
from worker.server import SGLangServer
from worker.status import scrape_metrics

from .conftest import free_port

REPO = Path(__file__).resolve().parents[1]


class Uvicorn:
    def __init__(self, http: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_uvicorn", "--port", str(self.port),
                                      "--http", http], cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"uvicorn did not start (exit {self.proc.returncode})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[Uvicorn]:
    srv = Uvicorn(request.param)
    request.addfinalizer(srv.stop)
    yield srv


def run(srv: Uvicorn, fn: Callable[[sglang.SGLangClient], Awaitable[None]], *, timeout_s: float = 30) -> None:
    async def go() -> None:
        async with sglang.make_client(srv.url, timeout_s=timeout_s, max_connections=8) as client:
            await client.pool.post("/_state", b'{"healthy": true, "queue_full": false, "started": 0, '
                                   b'"disconnects": 0}')
            await asyncio.wait_for(fn(client), 60)

    asyncio.run(go())


async def port_of(pool: http1.Http1Pool, path: str = "/_conn") -> int:
    status, body = await pool.post(path, b"{}")
    assert status == 200
    return orjson.loads(body)["port"]


def established(client_port: int) -> bool:
    """Is the connection from local port `client_port` still ESTABLISHED, as the kernel's socket table
    says (/proc/net/tcp, state 01)? Seen from outside the pool: after either side closes it, it is not."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if int(local.rsplit(":", 1)[1], 16) == client_port and state == "01":
                    return True
    return False


async def observed(client: sglang.SGLangClient, what: str, at_least: int) -> int:
    """A count the server keeps (`started` slow requests, `disconnects` of clients that left one),
    once it reaches `at_least` (or after 10 s)."""
    for _ in range(500):
        seen = orjson.loads((await client.get("/_observed", timeout_s=5))[1])[what]
        if seen >= at_least:
            return seen
        await asyncio.sleep(0.02)
    return seen


def test_uvicorn_closes_an_idle_connection_at_5_s_and_the_worker_gives_it_up_before(server: Uvicorn) -> None:
    """SGLang's uvicorn closes a connection idle for 5 s. A pool that keeps idle connections longer sees
    the server close it at 5 s; the worker's client (GENERATION_KEEPALIVE_S) closes it itself first,
    so it never sends a request on a connection the server is closing. Both go on with a new one."""

    async def go(client: sglang.SGLangClient) -> None:
        patient = http1.Http1Pool(server.url, max_connections=2, timeout_s=30, idle_s=60)
        try:
            theirs = await port_of(patient)
            since = {"patient": time.monotonic()}  # each connection idle from its reply on
            ours = await port_of(client.pool)
            since["worker"] = time.monotonic()
            closed: dict[str, float] = {}
            while len(closed) < 2 and time.monotonic() - since["patient"] < 20:
                for name, port in (("worker", ours), ("patient", theirs)):
                    if name not in closed and not established(port):
                        closed[name] = time.monotonic() - since[name]
                await asyncio.sleep(0.02)
            assert sglang.GENERATION_KEEPALIVE_S - 0.05 <= closed["worker"] < 4.9, closed
            assert 4.9 <= closed["patient"] < 15.0, closed  # uvicorn's keep-alive timer, not ours
            assert await port_of(client.pool) != ours
            assert await port_of(patient) != theirs
        finally:
            await patient.aclose()

    run(server, go)


def test_a_reply_with_connection_close_is_read_and_its_connection_not_reused(server: Uvicorn) -> None:
    async def go(client: sglang.SGLangClient) -> None:
        first = await port_of(client.pool, "/_close")
        second = await port_of(client.pool)
        assert first != second
        assert await port_of(client.pool) == second  # an ordinary reply keeps its connection

    run(server, go)


def test_chunked_replies_are_read_whole_slow_or_long(server: Uvicorn) -> None:
    """uvicorn sends a body without a length chunked; a chunk arriving within the timeout keeps the
    request alive however long the whole reply takes."""

    async def go(client: sglang.SGLangClient) -> None:
        conn = await port_of(client.pool)
        status, body = await client.pool.post("/_chunked?n=3000", b"{}")
        assert status == 200 and orjson.loads(body) == {"parts": list(range(3000))}
        slow = http1.Http1Pool(server.url, max_connections=2, timeout_s=1.0)
        try:
            status, body = await slow.post("/_chunked?n=4&delay=0.4", b"{}")  # 1.6 s in all
            assert status == 200 and orjson.loads(body) == {"parts": [0, 1, 2, 3]}
        finally:
            await slow.aclose()
        assert await port_of(client.pool) == conn  # chunked replies keep the connection alive

    run(server, go)


def test_a_slow_reply_within_the_timeout_arrives_and_one_past_it_times_out_and_the_server_sees_the_client_leave(
        server: Uvicorn) -> None:
    async def go(client: sglang.SGLangClient) -> None:
        short = sglang.make_client(server.url, timeout_s=1.0, max_connections=2)
        try:
            assert (await short.pool.post("/_slow?s=0.5", b"{}"))[0] == 200
            with pytest.raises(RetryableError) as late:
                await short.complete("/_slow?s=30", {})
        finally:
            await short.aclose()
        assert late.value.status_code is None and isinstance(late.value.__cause__, TimeoutError)
        assert await observed(client, "disconnects", 1) == 1

    run(server, go)


def test_a_cancelled_request_closes_its_connection_and_the_server_sees_the_client_leave(server: Uvicorn) -> None:
    """How the dispatcher hands a prompt back: SGLang aborts a request whose client disconnected."""

    async def go(client: sglang.SGLangClient) -> None:
        task = asyncio.create_task(client.complete("/_slow?s=30", {}))
        assert await observed(client, "started", 1) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await observed(client, "disconnects", 1) == 1

    run(server, go)


def test_a_reply_cut_by_a_reset_is_retryable_and_was_inside_the_server(server: Uvicorn) -> None:
    async def go(client: sglang.SGLangClient) -> None:
        with pytest.raises(RetryableError) as cut:
            await client.complete("/_reset", {})
        assert cut.value.status_code is None
        assert isinstance(cut.value.__cause__, http1.ServerClosed)  # not ConnectFailed: a death strikes it
        assert (await client.get("/health_generate", timeout_s=5)) == (200, b"")

    run(server, go)


def test_sglang_reply_shapes_read_by_complete(server: Uvicorn) -> None:
    async def go(client: sglang.SGLangClient) -> None:
        gen = await client.complete("/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 2}})
        assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert gen["meta_info"]["completion_tokens"] == 2 and gen["output_ids"] == [7, 7]
        batch = await client.complete("/generate", {"text": ["a", "b c"], "sampling_params": {}})
        assert [b["meta_info"]["prompt_tokens"] for b in batch] == [1, 2]
        chat = await client.complete("/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4})
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "ok"
        assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        text = await client.complete("/v1/completions", {"prompt": "one two three", "max_tokens": 3})
        assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 3

    run(server, go)


def test_sglang_error_shapes_become_prompt_errors_with_their_body_or_retryable_errors(server: Uvicorn) -> None:
    long = " ".join(["word"] * 100)

    async def go(client: sglang.SGLangClient) -> None:
        with pytest.raises(PromptError) as too_long:
            await client.complete("/v1/completions", {"prompt": long, "max_tokens": 3})
        message = "The input (100 tokens) is longer than the model's context length (64 tokens)."
        assert too_long.value.status_code == 400
        assert str(too_long.value) == f"HTTP 400: {message}"
        assert too_long.value.body == {"object": "error", "message": message, "type": "BadRequestError",
                                       "param": None, "code": 400}
        with pytest.raises(PromptError) as native:
            await client.complete("/generate", {"text": long})
        assert native.value.body == {"error": {"message": message}}
        with pytest.raises(PromptError) as invalid:  # FastAPI's 422, turned into 400 as SGLang does
            await client.complete("/v1/chat/completions", {"max_tokens": 3})
        assert invalid.value.status_code == 400
        assert invalid.value.body["object"] == "error" and invalid.value.body["code"] == 400
        assert "messages" in invalid.value.body["message"]
        await client.pool.post("/_state", b'{"queue_full": true}')
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/generate", {"text": "x"})):
            with pytest.raises(RetryableError) as full:
                await client.complete(path, body)
            assert full.value.status_code == 503
            assert str(full.value) == "HTTP 503: The request queue is full."
            assert full.value.body == {"object": "error", "message": "The request queue is full.", "type": "503",
                                       "param": None, "code": 503}

    run(server, go)


def test_health_server_info_and_metrics_through_the_workers_functions(server: Uvicorn) -> None:
    sglang_server = SGLangServer(Config(run="contract"), gpu=0, port=server.port)
    sglang_server.proc = server.proc  # the process check_health looks at first

    async def go(client: sglang.SGLangClient) -> None:
        await sglang_server.check_health(client, timeout_s=5)
        assert await client.get("/health_generate", timeout_s=5) == (200, b"")
        await client.pool.post("/_state", b'{"healthy": false}')
        assert await client.get("/health_generate", timeout_s=5) == (503, b"")
        with pytest.raises(ServerDied, match="answered 503"):
            await sglang_server.check_health(client, timeout_s=5)
        info = await sglang.get_server_info(client)
        assert sglang.effective_capacity(info) == 72 and info["max_running_requests"] == 128
        metrics = await scrape_metrics(client)
        assert (metrics.running, metrics.queued, metrics.gen_throughput) == (3, 2, 1180.5)
        assert (metrics.token_usage, metrics.cache_hit_rate) == (0.61, 0.25)

    try:
        run(server, go)
    finally:
        sglang_server.proc = None

"""The worker's HTTP client (`batchfleet.sglang.make_client` + `complete` and `get`, over
`batchfleet.http1`) against a raw HTTP/1.1 server on a real socket: keep-alive, a connection the
server closed (after a reply, or as the next request arrived), idle connections given up, timeouts,
chunked, Content-Length, interim and read-until-close replies, replies that must be refused, the API
key, and how each outcome is classified (above all: was the request perhaps inside the server?).
The same client against a real uvicorn server: tests/test_http_contract.py."""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import pstats
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from batchfleet import http1, sglang
from batchfleet.errors import PromptError, RetryableError
from worker.eventloop import loop_factory

REPLY = b'{"choices":[{"text":"ok","finish_reason":"stop"}],"usage":{"completion_tokens":1}}'


def reset(w: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), as a crashing peer or a dropped route does, not a clean FIN."""
    w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


def reply(status: int, body: bytes, *, reason: str = "OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


class RawServer:
    """One behaviour per path. Records every request (head lines) and every connection."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []  # lower-cased headers + ":path" + ":conn"
        self.connections = 0
        self.served: dict[int, int] = {}  # connection -> requests answered on it
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client.set()
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append({**headers, ":path": path, ":conn": str(conn), ":method": method,
                                      ":body": body.decode()})
                if path.startswith("/drop-if-reused") and self.served.get(conn):
                    # the keep-alive race: the server closes a kept connection as a request arrives
                    if path == "/drop-if-reused-and-stop":
                        assert self.server is not None
                        self.server.close()  # and then it is gone: a new connection is refused
                    writer.close()
                    return
                self.served[conn] = self.served.get(conn, 0) + 1
                if not await self._answer(path, reader, writer):
                    writer.close()
                    return
        finally:
            writer.close()

    async def _answer(self, path: str, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Write the reply for `path`; False closes the connection."""
        if path == "/ok" or path.startswith("/drop-if-reused"):
            w.write(reply(200, REPLY))
        elif path == "/continue":  # an interim 100 head before the real one
            w.write(b"HTTP/1.1 100 Continue\r\n\r\n" + reply(200, REPLY))
        elif path == "/huge":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 100000)
        elif path == "/chunked":
            parts = [REPLY[:10], REPLY[10:40], REPLY[40:]]
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in parts:
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
                await asyncio.sleep(0.01)
            w.write(b"0\r\n\r\n")
        elif path == "/until-close":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + REPLY)
            await w.drain()
            return False
        elif path == "/ok-then-close":  # as a keep-alive timeout does, after the reply
            w.write(reply(200, REPLY))
            await w.drain()
            return False
        elif path == "/bad":
            w.write(reply(400, b'{"object":"error","message":"The input is longer than the context.","code":400}',
                          reason="Bad Request"))
        elif path == "/full":
            w.write(reply(503, b'{"error":{"message":"The request queue is full."}}', reason="Service Unavailable"))
        elif path == "/garbage":
            w.write(reply(200, b"<html>not json"))
        elif path == "/half":  # the head, then the connection drops mid-body
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"cho")
            await w.drain()
            return False
        elif path == "/hang":  # never answers; notices when the client leaves
            if await reader.read(1) == b"":
                self.closed_by_client.set()
            return False
        elif path in ("/no-content", "/not-modified"):  # a Content-Length, but these statuses have no body
            w.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n" if path == "/no-content"
                    else b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\n")
        elif path == "/until-reset":  # a body read until close, cut by a reset
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"choices\":[")
            await w.drain()
            await asyncio.sleep(0.2)  # the client reads the head and the first bytes before the reset
            reset(w)
            return False
        elif path in ("/content-lengths", "/content-lengths-same"):
            second = 7 if path == "/content-lengths" else 2
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: %d\r\n\r\n{}" % second)
            if second == 7:
                w.write(b'"a":1}')  # 7 bytes in all: what the last header says
        elif path == "/length-and-chunked":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
                    b'7\r\n{"a":1}\r\n0\r\n\r\n')
        elif path == "/chunk-without-crlf":
            w.write(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\n{"a":1}XX0\r\n\r\n')
        elif path.startswith("/chunks-"):  # that many one-byte chunks, each in its own packet
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(int(path.removeprefix("/chunks-"))):
                w.write(b"1\r\nx\r\n")
                await w.drain()
                await asyncio.sleep(0)
            w.write(b"0\r\n\r\n")
        elif path == "/metrics":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 28\r\n\r\n"
                    b"sglang:num_running_reqs 3.0\n")
        elif path == "/health_generate":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await w.drain()
        return True


_LOOP = {"kind": "asyncio"}


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> None:
    """Every test on the standard event loop and on uvloop (the worker's): their transports report a
    clean close, a reset and a refused connection each their own way."""
    _LOOP["kind"] = request.param


def arun(coro: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory(_LOOP["kind"])) as runner:
        runner.run(coro)  # type: ignore[arg-type]


def run(coro_fn: Callable[[RawServer], Awaitable[None]]) -> None:
    async def go() -> None:
        async with RawServer() as srv:
            await asyncio.wait_for(coro_fn(srv), 60)

    arun(go())


def test_keep_alive_one_connection_for_sequential_requests_with_the_api_key() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, api_key="sk-test", timeout_s=30, max_connections=8)
        try:
            for i in range(5):
                assert await client.complete("/ok", {"prompt": f"p{i}", "max_tokens": 1}) == \
                    {"choices": [{"text": "ok", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
        finally:
            await client.aclose()
        assert srv.connections == 1
        assert [r[":conn"] for r in srv.requests] == ["1"] * 5
        first = srv.requests[0]
        assert first[":method"] == "POST"
        assert first["authorization"] == "Bearer sk-test"
        assert first["content-type"] == "application/json"
        assert first[":body"] == '{"prompt":"p0","max_tokens":1}'

    run(go)


def test_concurrent_requests_open_at_most_max_connections() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=3)
        try:
            await asyncio.gather(*(client.complete("/chunked", {"i": i}) for i in range(12)))
        finally:
            await client.aclose()
        assert len(srv.requests) == 12
        assert srv.connections <= 3

    run(go)


def test_chunked_and_read_until_close_replies() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            assert (await client.complete("/chunked", {}))["usage"] == {"completion_tokens": 1}
            assert (await client.complete("/until-close", {}))["choices"][0]["text"] == "ok"
            assert (await client.complete("/ok", {}))["choices"][0]["text"] == "ok"
        finally:
            await client.aclose()

    run(go)


def test_a_connection_the_server_closed_is_not_reused() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            await client.complete("/ok-then-close", {})
            for _ in range(50):  # let the client's loop see the close (no timing: it is the same loop)
                await asyncio.sleep(0.01)
            await client.complete("/ok", {})
            await client.complete("/ok", {})
        finally:
            await client.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "2", "2"]

    run(go)


def test_statuses_are_classified() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            with pytest.raises(PromptError) as bad:
                await client.complete("/bad", {})
            assert bad.value.status_code == 400
            assert str(bad.value) == "HTTP 400: The input is longer than the context."
            with pytest.raises(RetryableError) as full:
                await client.complete("/full", {})
            assert full.value.status_code == 503
            assert str(full.value) == "HTTP 503: The request queue is full."
            with pytest.raises(RetryableError) as garbage:
                await client.complete("/garbage", {})
            assert garbage.value.status_code == 200
            # the connection survives every one of those answers
            await client.complete("/ok", {})
        finally:
            await client.aclose()
        assert srv.connections == 1

    run(go)


def test_a_reply_cut_short_is_retryable_with_no_status() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            with pytest.raises(RetryableError) as cut:
                await client.complete("/half", {})
            assert cut.value.status_code is None
            assert not isinstance(cut.value.__cause__, http1.ConnectFailed)  # it was sent: a death strikes it
            await client.complete("/ok", {})
        finally:
            await client.aclose()

    run(go)


def test_read_timeout_is_retryable_and_closes_the_connection() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=0.5, max_connections=4)
        try:
            with pytest.raises(RetryableError) as slow:
                await client.complete("/hang", {})
            assert slow.value.status_code is None
            assert not isinstance(slow.value.__cause__, http1.ConnectFailed)
            await asyncio.wait_for(srv.closed_by_client.wait(), 10)  # the server sees the client leave
        finally:
            await client.aclose()

    run(go)


def test_cancelling_a_request_closes_its_connection() -> None:
    """The dispatcher cancels a prompt's task to hand it back: the server must see the client leave
    (SGLang aborts a request whose client disconnected)."""

    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            task = asyncio.create_task(client.complete("/hang", {}))
            while not srv.requests:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(srv.closed_by_client.wait(), 10)
        finally:
            await client.aclose()

    run(go)


def test_connection_refused_is_retryable_and_known_as_never_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused

        async def go() -> None:
            client = sglang.make_client(f"http://127.0.0.1:{port}", timeout_s=5, max_connections=4)
            try:
                with pytest.raises(RetryableError) as refused:
                    await client.complete("/ok", {})
            finally:
                await client.aclose()
            assert refused.value.status_code is None
            assert isinstance(refused.value.__cause__, http1.ConnectFailed)

        arun(go())


def test_metrics_health_and_generations_go_through_one_client_on_one_connection() -> None:
    async def go(srv: RawServer) -> None:
        async with sglang.make_client(srv.url, api_key="k", timeout_s=30, max_connections=4) as client:
            assert await client.get("/metrics", timeout_s=5) == (200, b"sglang:num_running_reqs 3.0\n")
            await client.complete("/ok", {})
            assert await client.get("/health_generate", timeout_s=5) == (200, b"")
        assert [(r[":method"], r[":path"], r[":conn"]) for r in srv.requests] == [
            ("GET", "/metrics", "1"), ("POST", "/ok", "1"), ("GET", "/health_generate", "1")]
        assert all(r["authorization"] == "Bearer k" and r["user-agent"] == "batchfleet" for r in srv.requests)
        assert "content-type" not in srv.requests[0] and "content-length" not in srv.requests[0]

    run(go)


def test_a_control_request_times_out_on_its_own_timeout_and_closes_its_connection() -> None:
    async def go(srv: RawServer) -> None:
        async with sglang.make_client(srv.url, timeout_s=3600, max_connections=4) as client:
            with pytest.raises(TimeoutError):
                await client.get("/hang", timeout_s=0.3)
            await asyncio.wait_for(srv.closed_by_client.wait(), 10)

    run(go)


def test_a_health_check_does_not_wait_for_ever_behind_generations_that_hold_every_connection() -> None:
    async def go(srv: RawServer) -> None:
        async with sglang.make_client(srv.url, timeout_s=3600, max_connections=1) as client:
            generation = asyncio.create_task(client.complete("/hang", {}))
            while not srv.requests:
                await asyncio.sleep(0.01)
            with pytest.raises(http1.ConnectFailed, match=r"no connection free within 0\.3 s"):
                await client.get("/health_generate", timeout_s=0.3)
            generation.cancel()
            with pytest.raises(asyncio.CancelledError):
                await generation
            assert await client.get("/health_generate", timeout_s=5) == (200, b"")

    run(go)


def test_a_204_or_304_reply_with_a_content_length_ends_at_its_head() -> None:
    """These statuses have no body whatever they declare: the reply must not wait for 7 bytes that
    never come (until the request timeout, an hour by default)."""

    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=5)
        try:
            assert await asyncio.wait_for(pool.post("/no-content", b"{}"), 3) == (204, b"")
            assert await asyncio.wait_for(pool.post("/not-modified", b"{}"), 3) == (304, b"")
            assert await pool.post("/ok", b"{}") == (200, REPLY)
        finally:
            await pool.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "1", "1"]  # kept alive throughout

    run(go)


def test_a_body_read_until_close_is_cut_short_by_a_reset() -> None:
    """Only a clean close (FIN) ends a body that has no length; a reset means the reply is incomplete."""

    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=30)
        try:
            with pytest.raises(http1.ServerClosed):
                await pool.post("/until-reset", b"{}")
            assert await pool.post("/until-close", b"{}") == (200, REPLY)  # a clean close still ends one
        finally:
            await pool.aclose()

    run(go)


def test_duplicate_content_lengths_are_refused_and_close_the_connection() -> None:
    """Two Content-Length headers: a parser that lets the last one win can be smuggled a reply. llhttp
    refuses them even when they agree, which RFC 9110 §8.6 allows (a recipient MAY reject them); uvicorn
    never sends two."""

    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=5)
        try:
            with pytest.raises(http1.ReplyError, match="Duplicate Content-Length"):
                await pool.post("/content-lengths", b"{}")
            with pytest.raises(http1.ReplyError, match="Duplicate Content-Length"):
                await pool.post("/content-lengths-same", b"{}")
            assert await pool.post("/ok", b"{}") == (200, REPLY)
        finally:
            await pool.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "2", "3"]

    run(go)


def test_a_reply_with_both_content_length_and_transfer_encoding_is_refused_and_its_connection_closed() -> None:
    """The framing is ambiguous (response splitting): the connection must not be used again."""

    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=5)
        try:
            with pytest.raises(http1.ReplyError, match="Content-Length"):
                await pool.post("/length-and-chunked", b"{}")
            assert await pool.post("/ok", b"{}") == (200, REPLY)
        finally:
            await pool.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "2"]

    run(go)


def test_a_chunk_not_followed_by_crlf_is_refused() -> None:
    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=5)
        try:
            with pytest.raises(http1.ReplyError, match="LF after chunk"):
                await pool.post("/chunk-without-crlf", b"{}")
        finally:
            await pool.aclose()

    run(go)


def test_a_chunked_reply_costs_work_in_proportion_to_its_chunks() -> None:
    """Each packet of a chunked reply is parsed once: 4x the chunks, about 4x the function calls (a
    parser that re-read every chunk from the head on each packet made 4x the chunks cost ~16x)."""

    def calls(n: int) -> int:
        prof = cProfile.Profile()

        async def go(srv: RawServer) -> None:
            pool = http1.Http1Pool(srv.url, max_connections=1, timeout_s=30)
            try:
                await pool.post("/ok", b"{}")  # the connection open before counting
                prof.enable()
                reply = await pool.post(f"/chunks-{n}", b"{}")
                prof.disable()
                assert reply == (200, b"x" * n)
            finally:
                await pool.aclose()

        run(go)
        return pstats.Stats(prof).total_calls  # type: ignore[attr-defined]

    few, many = calls(300), calls(1200)
    assert many < 6 * few, (few, many)


def test_a_kept_connection_the_server_closes_as_the_request_arrives_is_retried_once_on_a_new_one() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            await client.complete("/ok", {})
            assert (await client.complete("/drop-if-reused", {}))["choices"][0]["text"] == "ok"
        finally:
            await client.aclose()
        # connection 1 served /ok, then took the next request and closed; it went again on connection 2
        assert [(r[":path"], r[":conn"]) for r in srv.requests] == [
            ("/ok", "1"), ("/drop-if-reused", "1"), ("/drop-if-reused", "2")]

    run(go)


def test_a_kept_connection_closed_by_a_server_that_is_then_gone_may_have_held_the_request() -> None:
    """Written once on a kept connection, the request may have been inside a server that died: it is
    not 'never sent' (a poison prompt that kills its server must get its strike)."""

    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            await client.complete("/ok", {})
            with pytest.raises(RetryableError) as gone:
                await client.complete("/drop-if-reused-and-stop", {})
        finally:
            await client.aclose()
        assert gone.value.status_code is None
        assert isinstance(gone.value.__cause__, http1.ServerClosed)
        assert not isinstance(gone.value.__cause__, http1.ConnectFailed)
        assert [r[":path"] for r in srv.requests] == ["/ok", "/drop-if-reused-and-stop"]

    run(go)


def test_an_idle_connection_is_given_up_before_the_servers_keep_alive_timeout() -> None:
    """SGLang's server closes a connection idle for 5 s (SGLANG_TIMEOUT_KEEP_ALIVE); the client gives
    it up first (GENERATION_KEEPALIVE_S), closing it itself, and opens a new one for the next request."""
    assert sglang.GENERATION_KEEPALIVE_S < 5

    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=30, idle_s=0.3)
        try:
            assert (await pool.post("/ok", b"{}"))[0] == 200
            await asyncio.wait_for(srv.closed_by_client.wait(), 10)  # the sweep closed it, unasked
            assert (await pool.post("/ok", b"{}"))[0] == 200
        finally:
            await pool.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "2"]

    run(go)


def test_interim_heads_are_skipped_and_a_reply_over_the_limit_is_refused() -> None:
    async def go(srv: RawServer) -> None:
        pool = http1.Http1Pool(srv.url, max_connections=4, timeout_s=30, max_reply_bytes=50_000)
        try:
            assert await pool.post("/continue", b"{}") == (200, REPLY)
            with pytest.raises(http1.ReplyError, match="larger than 50,000 bytes"):
                await pool.post("/huge", b"{}")
            assert await pool.post("/ok", b"{}") == (200, REPLY)
        finally:
            await pool.aclose()
        assert [r[":conn"] for r in srv.requests] == ["1", "1", "2"]  # the refused reply's connection closed

    run(go)


def test_only_plain_http_urls_and_single_line_headers_are_accepted() -> None:
    with pytest.raises(ValueError, match="plain http"):
        http1.Http1Pool("https://127.0.0.1:1", max_connections=1, timeout_s=1)
    with pytest.raises(ValueError, match="no line breaks"):  # an API key cannot smuggle in a header
        http1.Http1Pool("http://127.0.0.1:1", max_connections=1, timeout_s=1,
                        headers={"Authorization": "Bearer k\r\nX-Evil: 1"})


def test_a_cancellation_that_arrives_as_a_connect_fails_is_not_swallowed() -> None:
    """A server death cancels every request just as their reconnects are refused. On Python 3.11,
    `asyncio.wait_for` turned such a cancellation into the connect's error: the request went on, and
    the worker waited for it forever (a hung server was never restarted)."""

    async def go() -> None:
        pool = http1.Http1Pool("http://127.0.0.1:9", max_connections=2, timeout_s=5)
        loop = asyncio.get_running_loop()
        caller: asyncio.Task[object] | None = None

        async def refused(*args: object, **kwargs: object) -> object:
            connecting: asyncio.Future[object] = loop.create_future()

            def refuse_and_cancel() -> None:  # the refusal and the cancel, in one step of the loop
                assert caller is not None
                connecting.set_exception(ConnectionRefusedError(111, "Connection refused"))
                caller.cancel()

            loop.call_soon(refuse_and_cancel)
            return await connecting

        loop.create_connection = refused  # type: ignore[method-assign]
        try:
            caller = asyncio.create_task(pool.post("/ok", b"{}"))
            with pytest.raises(asyncio.CancelledError):
                await caller
        finally:
            del loop.create_connection
            await pool.aclose()

    arun(go())


def test_an_error_answer_keeps_the_servers_json_body() -> None:
    async def go(srv: RawServer) -> None:
        client = sglang.make_client(srv.url, timeout_s=30, max_connections=4)
        try:
            with pytest.raises(PromptError) as bad:
                await client.complete("/bad", {})
            assert bad.value.body == {"object": "error", "message": "The input is longer than the context.",
                                      "code": 400}
            with pytest.raises(RetryableError) as full:
                await client.complete("/full", {})
            assert full.value.body == {"error": {"message": "The request queue is full."}}
            with pytest.raises(RetryableError) as garbage:
                await client.complete("/garbage", {})
            assert garbage.value.body is None  # not JSON: the message holds its text
        finally:
            await client.aclose()

    run(go)

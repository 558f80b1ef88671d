"""The worker's one HTTP client: a keep-alive HTTP/1.1 pool on a bare asyncio protocol, its replies
parsed by `httptools` (llhttp, the parser uvicorn itself serves SGLang with). Generations (one POST
per prompt, thousands a second) and the control plane (health, metrics, server info) go through it.

What it does, and what it refuses loudly:
- keep-alive connections in a LIFO stack (the most recently used first, so few stay warm), at most
  `max_connections` open; an idle connection is given up after `idle_s`, below the server's own
  keep-alive timeout (SGLang runs uvicorn with `timeout_keep_alive=5`), so the client never sends on
  a connection the server is closing;
- a reply body by Content-Length, chunked, or read until the server closes (complete only on a
  clean close: a reset cuts it short); 1xx heads skipped; 204 and 304 have no body whatever they
  declare; a connection the server closed or asked to close (`Connection: close`, HTTP/1.0) is not
  reused;
- llhttp refuses what a reply must not be: duplicate Content-Length headers (identical or not),
  Content-Length beside Transfer-Encoding, a chunk not followed by CRLF, a Transfer-Encoding other
  than chunked, a status line that is not HTTP/1.x. Each is a `ReplyError`, and its connection closes;
  so is a reply larger than `max_reply_bytes`;
- `timeout_s` without a byte from the server fails the request with `TimeoutError` and closes its
  connection (one sweep per pool, at least once a second, not a timer per request); a cancelled
  request closes its connection too, and SGLang aborts a request whose client left;
- a reused connection that the server closed before a byte of the reply came back is retried once on
  a new connection (the keep-alive race every client has); nothing else is retried here;
- `ConnectFailed` means the request was never written anywhere: the server cannot hold it. Every
  other error means it may have been inside the server;
- no header it sends can hold CR, LF or NUL (an API key cannot smuggle in a header).

Exceptions (all are OSErrors):

    ConnectionError
      ├── ConnectFailed   no connection could be opened: the request was never sent
      ├── ServerClosed    the connection closed before the reply was complete
      └── ReplyError      the reply is not one this client reads (or is too large)
    TimeoutError          no byte from the server for timeout_s
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

import httptools

__all__ = ["ConnectFailed", "Http1Pool", "ReplyError", "ServerClosed"]

MAX_HEAD_BYTES = 64 * 1024


class ConnectFailed(ConnectionError):
    """No connection to the server could be opened: the request was never sent."""


class ServerClosed(ConnectionError):
    """The server closed the connection before the reply was complete."""


class ReplyError(ConnectionError):
    """A reply that is not HTTP/1.x as this client reads it, or larger than allowed."""


_PARSE_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)


class _Conn(asyncio.Protocol):
    """One connection; at most one request on it at a time. The parser calls the `on_*` methods."""

    __slots__ = ("_body", "_framed", "_headed", "_status", "closed", "deadline", "got_bytes", "idle_since", "limit",
                 "parser", "received", "timeout_s", "transport", "waiter")

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.deadline = 0.0  # time.monotonic() by which the server must send something
        self.idle_since = 0.0
        self.closed = False
        self.got_bytes = False  # some of the current reply has arrived
        self.received = 0  # bytes of the current reply so far
        self.limit = limit
        self.timeout_s = timeout_s
        self._body: list[bytes] = []
        self._status = 0
        self._framed = False  # Content-Length or chunked: the body does not end with the connection
        self._headed = False  # the final (not 1xx) head is complete

    # --- asyncio ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        w = self.waiter
        if w is None or w.done():  # nothing was asked: a server talking out of turn is not reused
            self.close()
            return
        self.got_bytes = True
        self.received += len(data)
        try:
            if self.received > self.limit:
                raise ReplyError(f"reply larger than {self.limit:,} bytes")
            self.parser.feed_data(data)
            if not self._headed and self.received > MAX_HEAD_BYTES and not w.done():
                raise ReplyError(f"reply head over {MAX_HEAD_BYTES // 1024} KiB")
        except (ReplyError, *_PARSE_ERRORS) as exc:
            if not w.done():
                w.set_exception(_reply_error(exc))
            self.close()
            return
        if not w.done():
            self.deadline = time.monotonic() + self.timeout_s

    def eof_received(self) -> bool:
        """The server closed its side cleanly: that ends a body read until close (and nothing else)."""
        w = self.waiter
        if w is not None and not w.done() and self._headed and not self._framed:
            w.set_result((self._status, b"".join(self._body), False))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(ServerClosed("the server closed the connection before its reply was complete"
                                         + (f" ({exc})" if exc else "")))

    # --- the parser's callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        w = self.waiter
        if w is None or w.done():
            raise ReplyError("the server sent more than the reply asked for")
        self._body = []
        self._framed = self._headed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length":
            self._framed = True
        elif n == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                raise ReplyError(f"transfer-encoding {value[:40]!r}: this client reads chunked only")
            self._framed = True

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        self._headed = self._status >= 200

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if not self._headed:  # an interim head (100 Continue): the real one follows
            return
        w = self.waiter
        if w is not None and not w.done():
            w.set_result((self._status, b"".join(self._body), self.parser.should_keep_alive()))
        self._body = []
        self._headed = False  # until the next reply's head

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Requests to one server (`http://host:port`) over keep-alive HTTP/1.1 connections."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, connect_timeout_s: float = 10.0,
                 idle_s: float = 4.0, headers: dict[str, str] | None = None,
                 max_reply_bytes: int = 256 * 2**20) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the worker's HTTP client speaks plain http://host:port only, not {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.max_reply_bytes = max_reply_bytes
        netloc = u.netloc.rpartition("@")[2]
        for k, v in (headers or {}).items():
            if any(c in f"{k}{v}" for c in "\r\n\0") or ":" in k:
                raise ValueError(f"header {k[:40]!r}: no line breaks or NULs in a header, no ':' in its name")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        common = f"Host: {netloc}\r\nUser-Agent: batchfleet\r\n{extra}"
        self._post_prefix = f"{common}Accept: application/json\r\nContent-Type: application/json\r\n".encode("latin-1")
        self._get_prefix = f"{common}Accept: */*\r\n\r\n".encode("latin-1")
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._slot = asyncio.Semaphore(max_connections)
        self._sweeper: asyncio.Task[None] | None = None
        self._sweep_s = max(0.05, min(1.0, idle_s / 8, timeout_s / 4))
        self._closed = False

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path` -> (status, reply body). Raises the errors drawn above."""
        return await self._request(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            _path(path), self._post_prefix, len(body), body), self.timeout_s, bound_wait=False)

    async def get(self, path: str, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        """GET `path` -> (status, reply body); `timeout_s` (default: the pool's) without a byte from the
        server is a TimeoutError, and so long without a free connection a ConnectFailed (a health check
        must not wait behind generations for ever). Raises the errors drawn above."""
        return await self._request(b"GET %s HTTP/1.1\r\n%s" % (_path(path), self._get_prefix),
                                   self.timeout_s if timeout_s is None else timeout_s, bound_wait=True)

    async def _request(self, request: bytes, timeout_s: float, *, bound_wait: bool) -> tuple[int, bytes]:
        if self._closed:
            raise ConnectFailed("the client is closed")
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        if bound_wait and self._slot.locked():
            try:
                async with asyncio.timeout(timeout_s):
                    await self._slot.acquire()
            except TimeoutError:
                raise ConnectFailed(f"no connection free within {timeout_s:g} s "
                                    f"(all {self.max_connections} busy)") from None
        else:
            await self._slot.acquire()
        try:
            conn, reused = self._take_idle(), True
            if conn is None:
                conn, reused = await self._connect(), False
            try:
                return await self._exchange(conn, request, timeout_s)
            except ServerClosed:
                if not reused or conn.got_bytes:
                    raise
            # The server closed a kept-alive connection just as this request went out on it; it read
            # none of it (nothing came back): once more, on a new connection.
            try:
                conn = await self._connect()
            except ConnectFailed as exc:  # it was written once: it may have been inside a dying server
                raise ServerClosed(f"the server closed a kept-alive connection, then refused a new one ({exc})") \
                    from exc
            return await self._exchange(conn, request, timeout_s)
        finally:
            self._slot.release()

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if not c.closed and now - c.idle_since < self.idle_s:
                return c
            c.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as the
            # connect fails (a server death cancels every request just as their reconnects are
            # refused), and the cancelled request would go on.
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(self.max_reply_bytes, self.timeout_s),
                                                       self.host, self.port)
        except (TimeoutError, OSError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from exc
        return conn

    async def _exchange(self, conn: _Conn, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        conn.waiter = waiter = asyncio.get_running_loop().create_future()
        conn.got_bytes = False
        conn.received = 0
        conn.timeout_s = timeout_s
        conn.deadline = time.monotonic() + timeout_s
        self._busy.add(conn)
        keep = False
        try:
            if conn.closed or conn.transport is None:
                raise ServerClosed("the connection closed before the request was sent")
            conn.transport.write(request)
            status, reply, keep = await waiter
            return status, reply
        finally:
            self._busy.discard(conn)
            conn.waiter = None
            if keep and not conn.closed and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            now = time.monotonic()
            for conn in [c for c in self._busy if c.deadline < now]:
                w = conn.waiter
                if w is not None and not w.done():
                    w.set_exception(TimeoutError(f"no reply from the server within {conn.timeout_s:g} s"))
                conn.close()
            if self._idle and now - self._idle[0].idle_since >= self.idle_s:
                keep = []
                for c in self._idle:
                    if c.closed or now - c.idle_since >= self.idle_s:
                        c.close()
                    else:
                        keep.append(c)
                self._idle[:] = keep

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for c in [*self._idle, *self._busy]:
            c.close()
        self._idle.clear()


def _reply_error(exc: Exception) -> ReplyError:
    """The parser's refusal as a ReplyError (a callback's own ReplyError is the parser error's context)."""
    for e in (exc, exc.__context__):
        if isinstance(e, ReplyError):
            return e
    return ReplyError(f"not a reply this client reads: {exc or type(exc).__name__}")


_PATHS: dict[str, bytes] = {}


def _path(path: str) -> bytes:
    """`path` as the request line's target, checked once: absolute, no space, CR, LF or NUL."""
    target = _PATHS.get(path)
    if target is None:
        if not path.startswith("/") or any(c in path for c in " \r\n\0"):
            raise ValueError(f"not a request path: {path[:80]!r}")
        target = path.encode("latin-1")
        if len(_PATHS) < 256:
            _PATHS[path] = target
    return target

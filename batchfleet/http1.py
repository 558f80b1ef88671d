"""The generation transport: a small HTTP/1.1 client on a bare asyncio protocol, for one POST per
prompt to one SGLang server at thousands a second (`docs/benchmarks.md`, "Worker dispatch ceiling":
a fifth of aiohttp's CPU per request, a twentieth of httpx's).

It speaks the part of HTTP/1.1 that SGLang's server (uvicorn, or granian) answers a JSON POST with,
and refuses the rest loudly:
- keep-alive connections in a LIFO stack (the most recently used first, so few stay warm), at most
  `max_connections` open; an idle connection is given up after `idle_s`, below the server's own
  keep-alive timeout (SGLang's `SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s), so the client never sends on a
  connection the server is closing;
- a reply body by Content-Length, chunked, or read until the server closes; 1xx heads skipped;
  a connection the server closed or asked to close (`Connection: close`, HTTP/1.0) is not reused;
- a reply larger than `max_reply_bytes`, or not HTTP/1.x, is a `ReplyError` (the connection closes);
- `timeout_s` without a byte from the server fails the request with `TimeoutError` and closes its
  connection (one sweep per pool, not a timer per request); a cancelled request closes its connection
  too, and SGLang aborts a request whose client left;
- a reused connection that the server closed before a byte of the reply came back is retried once on
  a new connection (the keep-alive race every client has); nothing else is retried here;
- `ConnectFailed` means the request was never written anywhere: the server cannot hold it. Every
  other error means it may have been inside the server.

Exceptions:

    ConnectionError
      ├── ConnectFailed   no connection could be opened: the request was never sent
      ├── ServerClosed    the connection closed before the reply was complete
      └── ReplyError      the reply is not one this client reads (or is too large)
    TimeoutError          no byte from the server for timeout_s
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from urllib.parse import urlsplit

__all__ = ["ConnectFailed", "Http1Pool", "ReplyError", "ServerClosed"]

MAX_HEAD_BYTES = 64 * 1024
# The headers that say where a reply's body ends; each on its own line of the head.
_FRAMING = re.compile(rb"\r\n(content-length|transfer-encoding|connection)[ \t]*:([^\r\n]*)", re.IGNORECASE)
_UNTIL_CLOSE = -3
_CHUNKED = -2
_NO_HEAD = -1


class ConnectFailed(ConnectionError):
    """No connection to the server could be opened: the request was never sent."""


class ServerClosed(ConnectionError):
    """The server closed the connection before the reply was complete."""


class ReplyError(ConnectionError):
    """A reply that is not HTTP/1.x as this client reads it, or larger than allowed."""


class _Conn(asyncio.Protocol):
    """One connection; at most one request on it at a time."""

    __slots__ = ("_head", "_need", "buf", "closed", "deadline", "got_bytes", "idle_since", "limit", "timeout_s",
                 "transport", "waiter")

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.deadline = 0.0  # time.monotonic() by which the server must send something
        self.idle_since = 0.0
        self.closed = False
        self.got_bytes = False  # some of the current reply has arrived
        self.limit = limit
        self.timeout_s = timeout_s
        self._need = _NO_HEAD  # body bytes still expected, or one of the markers above
        self._head: tuple[int, int, bool] | None = None  # (status, head length, keep-alive)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        if self._need == _UNTIL_CLOSE and self._head is not None:  # a body read until close is complete now
            status, hlen, _ = self._head
            w.set_result((status, bytes(self.buf[hlen:]), False))
        else:
            w.set_exception(ServerClosed("the server closed the connection before its reply was complete"
                                         + (f" ({exc})" if exc else "")))

    def data_received(self, data: bytes) -> None:
        w = self.waiter
        if w is None or w.done():  # nothing was asked: a server talking out of turn is not reused
            self.close()
            return
        self.buf += data
        self.got_bytes = True
        try:
            if len(self.buf) > self.limit:
                raise ReplyError(f"reply larger than {self.limit:,} bytes")
            done = self._parse()
        except (ReplyError, ValueError) as exc:
            w.set_exception(exc if isinstance(exc, ReplyError) else ReplyError(str(exc)))
            self.close()
            return
        if done is not None:
            w.set_result(done)
        else:
            self.deadline = time.monotonic() + self.timeout_s

    def _parse(self) -> tuple[int, bytes, bool] | None:
        buf = self.buf
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ReplyError(f"reply head over {MAX_HEAD_BYTES // 1024} KiB")
                return None
            eol = buf.find(b"\r\n")
            status_line = bytes(buf[:eol])
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                raise ReplyError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:  # an interim head (100 Continue): the real one follows
                del buf[:end + 4]
                continue
            keep = parts[0] == b"HTTP/1.1"
            need = 0 if status in (204, 304) else _UNTIL_CLOSE
            for m in _FRAMING.finditer(buf, 0, end + 2):  # only the headers that frame the body
                name, value = m.group(1).lower(), m.group(2).strip().lower()
                if name == b"content-length" and need != _CHUNKED:
                    if not value.isdigit():
                        raise ReplyError(f"bad content-length: {value[:40]!r}")
                    need = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value:
                    need = _CHUNKED
                elif name == b"connection":
                    keep = value != b"close" and (keep or value == b"keep-alive")
            if need == _UNTIL_CLOSE:
                keep = False
            self._head = (status, end + 4, keep)
            self._need = need
        status, hlen, keep = self._head
        if self._need >= 0:
            if len(buf) - hlen < self._need:
                return None
            body = bytes(buf[hlen:hlen + self._need])
            del buf[:hlen + self._need]
        elif self._need == _CHUNKED:
            parts: list[bytes] = []
            pos = hlen
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                if size == 0:
                    end = buf.find(b"\r\n\r\n", eol)  # the trailers end with an empty line
                    if end < 0:
                        return None
                    del buf[:end + 4]
                    break
                if len(buf) < eol + 2 + size + 2:
                    return None
                parts.append(bytes(buf[eol + 2:eol + 2 + size]))
                pos = eol + 2 + size + 2
            body = b"".join(parts)
        else:
            return None  # until close: connection_lost completes it
        self._head, self._need = None, _NO_HEAD
        return status, body, keep

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """POST bodies to one server (`http://host:port`) over keep-alive HTTP/1.1 connections."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, connect_timeout_s: float = 10.0,
                 idle_s: float = 4.0, headers: dict[str, str] | None = None,
                 max_reply_bytes: int = 256 * 2**20) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the generation transport speaks plain http://host:port only, not {base_url!r}")
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
        self._prefix = (f"Host: {netloc}\r\nUser-Agent: batchfleet\r\nAccept: application/json\r\n"
                        f"Content-Type: application/json\r\n{extra}").encode("latin-1")
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._slot = asyncio.Semaphore(max_connections)
        self._sweeper: asyncio.Task[None] | None = None
        self._sweep_s = min(1.0, max(0.05, timeout_s / 4))
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._busy) + sum(1 for c in self._idle if not c.closed)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path` -> (status, reply body). Raises the errors drawn above."""
        if self._closed:
            raise ConnectFailed("the client is closed")
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        request = b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            path.encode("latin-1"), self._prefix, len(body), body)
        async with self._slot:
            conn, reused = self._take_idle(), True
            if conn is None:
                conn, reused = await self._connect(), False
            try:
                return await self._exchange(conn, request)
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
            return await self._exchange(conn, request)

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

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[int, bytes]:
        conn.waiter = waiter = asyncio.get_running_loop().create_future()
        conn.got_bytes = False
        conn.deadline = time.monotonic() + self.timeout_s
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
            if keep and not conn.closed and not conn.buf and not self._closed:
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
                    w.set_exception(TimeoutError(f"no reply from the server within {self.timeout_s:g} s"))
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

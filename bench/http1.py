"""A minimal HTTP/1.1 client on a bare asyncio protocol: the transport proposed for the worker's one
generation request (`docs/benchmarks.md`, worker dispatch ceiling). A benchmark contender only; the
worker does not use it.

What it does, and what the proposal needs it to do:
- one asyncio protocol per keep-alive connection, a LIFO stack of idle connections (the most
  recently used first, so few connections stay warm), at most `max_connections` open;
- a reply body by Content-Length, chunked, or read until the server closes (no Content-Length);
- a connection the server closed, or asked to close (`Connection: close`), never goes back to the
  stack; a request cancelled mid-flight closes its connection (SGLang aborts a request whose
  connection closes);
- one timeout sweep per client (every `sweep_s`) instead of a timer per request: a request older
  than `timeout_s` fails with `TimeoutError` and its connection closes;
- a connection that cannot be opened raises `ConnectionError` before anything was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A reply that is not HTTP/1.1 as this client reads it."""


class _Conn(asyncio.Protocol):
    __slots__ = ("_head", "_need", "buf", "closed", "deadline", "transport", "waiter")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.deadline = 0.0
        self.closed = False
        self._need = -1  # body bytes still expected (-1: head not parsed; -2: chunked; -3: until close)
        self._head: tuple[int, int, bool] | None = None  # (status, head length, keep-alive)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        if self._need == -3 and self._head is not None:  # body read until close: complete now
            status, hlen, _ = self._head
            w.set_result((status, bytes(self.buf[hlen:]), False))
        else:
            w.set_exception(ConnectionError("server closed the connection mid-reply"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        w = self.waiter
        if w is None or w.done():
            return
        try:
            done = self._parse()
        except HTTPError as e:
            w.set_exception(e)
            self.close()
            return
        if done is not None:
            w.set_result(done)

    def _parse(self) -> tuple[int, bytes, bool] | None:
        buf = self.buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise HTTPError("reply head over 64 KiB")
                return None
            head = bytes(buf[:end]).split(b"\r\n")
            parts = head[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise HTTPError(f"not an HTTP/1.x status line: {head[0][:80]!r}")
            try:
                status = int(parts[1])
            except ValueError:
                raise HTTPError(f"bad status: {head[0][:80]!r}") from None
            keep = parts[0] == b"HTTP/1.1"
            need = -3
            for h in head[1:]:
                name, _, value = h.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    need = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    need = -2
                elif name == b"connection":
                    v = value.strip().lower()
                    keep = v != b"close" and (keep or v == b"keep-alive")
            if need == -3:
                keep = False
            self._head = (status, end + 4, keep)
            self._need = need
        status, hlen, keep = self._head
        if self._need >= 0:
            if len(buf) - hlen < self._need:
                return None
            body = bytes(buf[hlen:hlen + self._need])
            del buf[:hlen + self._need]
        elif self._need == -2:
            body_parts: list[bytes] = []
            pos = hlen
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                if size == 0:
                    end = buf.find(b"\r\n\r\n", eol)  # trailers end with an empty line
                    if end < 0:
                        return None
                    del buf[:end + 4]
                    break
                if len(buf) < eol + 2 + size + 2:
                    return None
                body_parts.append(bytes(buf[eol + 2:eol + 2 + size]))
                pos = eol + 2 + size + 2
            body = b"".join(body_parts)
        else:
            return None  # until close: connection_lost completes it
        self._head, self._need = None, -1
        return status, body, keep

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Client:
    """POST bodies to one server over keep-alive HTTP/1.1 connections."""

    def __init__(self, base_url: str, *, max_connections: int = 256, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, headers: dict[str, str] | None = None,
                 sweep_s: float = 1.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"only http://host:port is supported, not {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._prefix = f"Host: {u.netloc}\r\nContent-Type: application/json\r\n{extra}".encode("latin-1")
        self._idle: list[_Conn] = []
        self._open = 0
        self._slot = asyncio.Semaphore(max_connections)
        self._busy: set[_Conn] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._sweep_s = sweep_s

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port),
                                             self.connect_timeout_s)
        except (TimeoutError, OSError) as e:
            raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return conn

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        async with self._slot:
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    conn = c
                    break
            if conn is None:
                conn = await self._connect()
            loop = asyncio.get_running_loop()
            conn.waiter = waiter = loop.create_future()
            conn.deadline = time.monotonic() + self.timeout_s
            self._busy.add(conn)
            ok = False
            try:
                assert conn.transport is not None
                conn.transport.write(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                                     % (path.encode("latin-1"), self._prefix, len(body), body))
                status, reply, keep = await waiter
                ok = keep
                return status, reply
            finally:
                self._busy.discard(conn)
                conn.waiter = None
                if ok and not conn.closed and not conn.buf:
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
                    w.set_exception(TimeoutError(f"no reply within {self.timeout_s:g} s"))
                conn.close()

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for c in self._idle + list(self._busy):
            c.close()
        self._idle.clear()

"""Job functions, backends and an HTTP server that take no time: for measuring dispatch overhead alone.

- `instant` / `InstantAnswers`: no HTTP at all (RQ's SimpleWorker job; the dispatcher's server).
- `post_instant`: an RQ job that POSTs its prompt to the instant server (`BENCH_INSTANT_URL`), over
  one keep-alive connection per process: the SimpleWorker baseline of the HTTP dispatch ceiling.
- `python -m bench.instant --port P [--delay-s D --capacity C]`: an HTTP/1.1 keep-alive server that
  answers every POST with a one-token OpenAI completion, after D seconds on average (0.5-1.5 x D,
  seeded) when D > 0, running at most C requests at once while the rest wait in its queue, like a
  GPU server: it finishes at most C / D prompts/s however many a client keeps in flight. With
  `--step-s S` a request ends only at the end of a step of S seconds, with every other request due
  in that step, as SGLang's scheduler ends requests (a decode step, or a prefill batch, ends several
  at once; the replies go out together). Without it each request ends alone, at its own random
  time: the worst case for a client, one wakeup per reply. A bare asyncio protocol, so that the
  server costs as little CPU as it can on the shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
from collections import deque
from typing import Any

import orjson

REPLY = {"choices": [{"text": "ok", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
_BODY = orjson.dumps({"id": "cmpl-instant", "object": "text_completion", "model": "instant", **REPLY})
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
             % len(_BODY)) + _BODY


def instant(prompt: dict[str, Any]) -> dict[str, Any]:
    """What RQ's SimpleWorker runs in the baseline: returns at once."""
    return REPLY


class InstantAnswers:
    """The dispatcher's server (`worker.server_side.Server`) with no server behind it: every request is
    answered at once, in process. `client`: what the dispatcher sends requests through (itself, or a
    real `batchfleet.sglang.SGLangClient` to an HTTP server)."""

    def __init__(self, client: Any = None) -> None:
        self.client = client if client is not None else self

    def serving(self) -> bool:
        return True

    async def probe(self) -> bool:
        return True

    @property
    def is_generation(self) -> bool:
        return True  # a chat server: the dispatcher sends it chat and completion lines

    async def complete(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return REPLY

    async def abort(self, rids: list[str]) -> int:
        return 0


_sync_client: Any = None


def post_instant(prompt: dict[str, Any]) -> dict[str, Any]:
    """The SimpleWorker baseline's job: one blocking POST to the instant server."""
    global _sync_client
    import httpx

    if _sync_client is None:
        _sync_client = httpx.Client(base_url=os.environ["BENCH_INSTANT_URL"], timeout=30.0)
    resp = _sync_client.post(prompt["url"], content=orjson.dumps(prompt["body"]),
                             headers={"Content-Type": "application/json"})
    resp.raise_for_status()
    return orjson.loads(resp.content)


class _Engine:
    """Runs at most `capacity` requests at once (0: no limit), each for `delay_s` on average; the rest
    wait in its queue, first come first served."""

    def __init__(self, delay_s: float, capacity: int, step_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.capacity = capacity
        self.step_s = step_s
        self.running = 0
        self.waiting: deque[_InstantProtocol] = deque()
        self.rng = random.Random(7)
        self.steps: dict[int, list[_InstantProtocol]] = {}  # step number -> requests that end with it

    def submit(self, conn: _InstantProtocol) -> None:
        if self.delay_s <= 0:
            conn.answer()
        elif self.capacity and self.running >= self.capacity:
            self.waiting.append(conn)
        else:
            self._start(conn)

    def _start(self, conn: _InstantProtocol) -> None:
        self.running += 1
        loop = asyncio.get_running_loop()
        delay = self.delay_s * (0.5 + self.rng.random())
        if not self.step_s:
            loop.call_later(delay, self._finish, conn)
            return
        step = math.ceil((loop.time() + delay) / self.step_s)
        due = self.steps.get(step)
        if due is None:
            due = self.steps[step] = []
            loop.call_at(step * self.step_s, self._end_step, step)
        due.append(conn)

    def _end_step(self, step: int) -> None:
        due = self.steps.pop(step)
        self.running -= len(due)
        for conn in due:
            conn.answer()
        self._admit()

    def _finish(self, conn: _InstantProtocol) -> None:
        self.running -= 1
        conn.answer()
        self._admit()

    def _admit(self) -> None:
        while self.waiting and (not self.capacity or self.running < self.capacity):
            nxt = self.waiting.popleft()
            if nxt.transport is not None:  # a client that left is not run
                self._start(nxt)


class _InstantProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            m = _CONTENT_LENGTH.search(self.buf, 0, end + 2)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.engine.submit(self)

    def answer(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_RESPONSE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(port: int, delay_s: float = 0.0, capacity: int = 0, step_s: float = 0.0) -> None:
    engine = _Engine(delay_s, capacity, step_s)
    server = await asyncio.get_running_loop().create_server(lambda: _InstantProtocol(engine), "127.0.0.1", port,
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--capacity", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=0.0, help="requests end only at the end of a step this long")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.delay_s, args.capacity, args.step_s))


if __name__ == "__main__":
    main()

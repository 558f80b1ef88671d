"""The dispatcher's server (`worker.server_side.Server`) for tests that need no HTTP: each request's
answer is the test's `answer(body)` (a reply, or PromptError / RetryableError as a server's answer
would raise them), and the dispatcher is built as the worker builds it."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from batchfleet.config import Config
from worker.dispatcher import Dispatcher
from worker.ledger import Ledger
from worker.steal import ClaimOrder

Answer = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class FakeServer:
    def __init__(self, answer: Answer, *, serving: bool = True, generates: bool = True) -> None:
        self.answer = answer
        self.up = serving
        self.generates = generates
        self.aborted: list[str] = []

    @property
    def client(self) -> FakeServer:
        return self

    def serving(self) -> bool:
        return self.up

    async def probe(self) -> bool:
        return self.generates

    @property
    def is_generation(self) -> bool | None:
        return None

    async def complete(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.answer(body)

    async def complete_raw(self, url: str, body: dict[str, Any]) -> tuple[Any, bytes]:
        reply = await self.answer(body)
        return reply, orjson.dumps(reply)

    async def abort(self, rids: list[str]) -> int:
        self.aborted += rids
        return len(rids)


def dispatcher(ledger: Ledger, server: Any, config: Config, *, queues: tuple[str, ...] = ("gpu0",),
               capacity: int | None = None, on_completion: Callable[[int], None] = lambda tokens: None) -> Dispatcher:
    """A dispatcher as the worker's service builds it; with `capacity`, sized as the keeper sizes it once
    its server serves (capacity + the configured surplus), and resumed."""
    d = Dispatcher(ledger, server, config=config, worker="w", queues=lambda: ClaimOrder(list(queues)), clock=time.time,
                   on_completion=on_completion)
    if capacity is not None:
        d.limit.set_capacity(capacity, max_in_flight=config.max_in_flight)
        d.gate.resume()
    return d

"""Work stealing order: the worker's own queue first, then the other GPUs' queues that match
`BATCHFLEET_QUEUE_PATTERN`, longest backlog first, refreshed every few seconds."""

from __future__ import annotations

import re
from typing import NoReturn

import redis.asyncio as aioredis

from batchfleet.keys import RQ_QUEUES, Keys

from .redislink import every

__all__ = ["StealOrder"]


class StealOrder:
    def __init__(self, client: aioredis.Redis, *, queue: str, pattern: str, period_s: float) -> None:
        self.r = client
        self.queue = queue
        self.pattern = re.compile(pattern)
        self.period_s = period_s
        self.order: list[str] = [queue]

    def __call__(self) -> list[str]:
        return self.order

    async def refresh(self) -> list[str]:
        names = [Keys.queue_name(m) for m in await self.r.smembers(RQ_QUEUES)]
        others = [q for q in names if q != self.queue and self.pattern.fullmatch(q)]
        if not others:
            self.order = [self.queue]
            return self.order
        async with self.r.pipeline(transaction=False) as pipe:
            for q in others:
                pipe.llen(Keys.queue(q))
            lengths = await pipe.execute()
        ranked = [q for n, q in sorted(zip(lengths, others, strict=True), reverse=True) if n > 0]
        self.order = [self.queue, *ranked]
        return self.order

    async def run(self) -> NoReturn:
        await every(self.period_s, "reading the queues' lengths", self.refresh)

"""Work stealing order: the worker's own queue first, then the other GPUs' queues that match
`BATCHFLEET_QUEUE_PATTERN`, longest backlog first, refreshed every few seconds; and how much of each a
thief may take, from what the queue's own worker says in its status record (`batchfleet.fleetview`):

- **its worker is gone** (silent, DOWN, FAILED or DRAINING): all it needs (as whole plan units from
  the tail): nobody else will serve that queue;
- **its worker is starting**: nothing. Its server takes that queue as soon as it is up, and a thief
  would run those prompts beside its own, in a fuller batch (slower a request), or leave them waiting
  inside its server while the other server idles: the first worker up took every queue of a short
  job (8 servers of 2,048 slots, 4,000 prompts: one server ran them all, the others nothing). A server
  that cannot start is marked FAILED, and its queue is stolen then;
- **its worker serves** (or restarts), **or no worker of it has said anything yet**: at most half a
  claim of what the queue holds beyond one load of its worker (the in-flight limit its record gives;
  0 without a record), as whole units: a tail is shared out, but a worker that is working through its
  queue keeps what it will start at once, and a queue nobody serves is still drained, by halves.

The order is refreshed every status interval: the first worker whose server is up reads its peers'
states from at most that long ago."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, NoReturn

import redis.asyncio as aioredis

from batchfleet.fleetview import LEAVE_ALL, aread_fleet_view
from batchfleet.keys import RQ_QUEUES, Keys

from .redislink import every

__all__ = ["ClaimOrder", "StealOrder"]


class ClaimOrder(NamedTuple):
    """The queues a claim takes from, in order (own queue first), and of those another worker serves,
    how many prompts to leave it (`keep`): a claim takes at most half of what the queue holds beyond
    them. A queue not in `keep`: all it needs."""

    queues: list[str]
    keep: Mapping[str, int] = MappingProxyType({})


class StealOrder:
    def __init__(self, client: aioredis.Redis, keys: Keys, *, queue: str, pattern: str, period_s: float) -> None:
        self.r = client
        self.keys = keys
        self.queue = queue
        self.pattern = re.compile(pattern)
        self.period_s = period_s
        self.order = ClaimOrder([queue])

    def __call__(self) -> ClaimOrder:
        return self.order

    async def refresh(self) -> ClaimOrder:
        names = [Keys.queue_name(m) for m in await self.r.smembers(RQ_QUEUES)]
        others = [q for q in names if q != self.queue and self.pattern.fullmatch(q)]
        if not others:
            self.order = ClaimOrder([self.queue])
            return self.order
        async with self.r.pipeline(transaction=False) as pipe:
            for q in others:
                pipe.llen(Keys.queue(q))
            lengths = await pipe.execute()
        view = await aread_fleet_view(self.r, self.keys)
        ranked, keep = [], {}
        for n, q in sorted(zip(lengths, others, strict=True), reverse=True):
            left = view.left_to_owner(q)
            if n == 0 or left == LEAVE_ALL:
                continue
            ranked.append(q)
            if left is not None:
                keep[q] = left
        self.order = ClaimOrder([self.queue, *ranked], keep)
        return self.order

    async def run(self) -> NoReturn:
        await every(self.period_s, "reading the queues' lengths", self.refresh)

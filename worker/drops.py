"""Cancelled prompts stop at once: the worker's side of `Keys.drop` and `Keys.signals`.

The producer (`producer.ends`: `producer cancel`, a `batchfleet serve` batch cancelled or expired)
adds the job ids of cancelled prompts that were in flight to `Keys.drop`, then PUBLISHes `{"drop": n}`
on `Keys.signals`. This watch is subscribed to the channel: on each message it asks Redis which of
the jobs this worker holds are in `drop` (one SMISMEMBER), and the dispatcher drops them (their tasks
cancelled, the server told to abort their requests, their leases released, nothing published); then
it looks at the run's cancel flag (`on_check`: the whole run, acknowledged to `producer cancel`).

A message can be missed (the subscription's connection broke, Redis restarted): the lease beat runs
the same check before it renews (`LeaseKeeper(check_drops=...)`), and the watch checks once each time it
has (re)subscribed. So a dropped prompt never reaches the lease renewal, where its lease (removed by
the producer) would read as lost to another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection

import redis
import redis.asyncio as aioredis

from batchfleet.backoff import backoff_s
from batchfleet.keys import Keys

__all__ = ["DropWatch"]

log = logging.getLogger("batchfleet.worker")

WAIT_S = 1.0  # each read of the subscription waits at most this long for a message
QUICK_MAX = 5  # reads in a row that return nothing at once before the subscription is made anew


class DropWatch:
    def __init__(self, client: aioredis.Redis, keyspace: Keys, *, held: Callable[[], Collection[str]],
                 drop: Callable[[set[str]], Awaitable[int]],
                 on_check: Callable[[int], Awaitable[None]]) -> None:
        self.r = client
        self.k = keyspace
        self.held = held  # job ids this worker holds now
        self.drop = drop  # drops those of them in flight -> how many
        self.on_check = on_check  # after each check, with how many it dropped: the run's cancel flag
        self.subscribed = asyncio.Event()  # set while subscribed (tests wait for it)
        self._lock = asyncio.Lock()

    async def check(self) -> int:
        """Drop the held prompts whose job ids are in `Keys.drop`, then `on_check`. Returns how many
        were dropped. Serialised: a message and a lease beat never drop the same prompts twice."""
        async with self._lock:
            dropped = 0
            jids = list(self.held())
            if jids:
                flags = await self.r.smismember(self.k.drop, jids)
                cancelled = {j for j, f in zip(jids, flags, strict=True) if f}
                if cancelled:
                    dropped = await self.drop(cancelled)
            await self.on_check(dropped)
            return dropped

    async def run(self) -> None:
        """Subscribe to `Keys.signals` and check on each message; resubscribe after a lost connection
        (and check once: a message may have come meanwhile)."""
        failures = 0
        loop = asyncio.get_running_loop()
        while True:
            pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.k.signals)
                self.subscribed.set()
                if failures:
                    await self.check()
                failures = 0
                quick = 0  # reads in a row that came back at once with nothing
                while True:
                    # a bounded wait (None when nothing came): a blocking read would hit the client's
                    # socket timeout, an error that costs a resubscription
                    started = loop.time()
                    message = await pubsub.get_message(timeout=WAIT_S)
                    if message is not None and message.get("type") == "message":
                        quick = 0
                        await self.check()
                    elif loop.time() - started < WAIT_S / 2:
                        # Nothing, at once: a subscribe confirmation (ignored), or a connection redis-py no
                        # longer reads: after a partition outlived TCP's retransmissions its reader held
                        # TimeoutError(110), which a read with a timeout takes for "no message", at once,
                        # for ever, and a loop that never yielded starved the worker. Never spin: again at
                        # once, then paced, then a new subscription.
                        quick += 1
                        if quick >= QUICK_MAX:
                            raise redis.ConnectionError("the subscription answers nothing at once, again and again")
                        if quick > 1:
                            await asyncio.sleep(0.1)
                    else:
                        quick = 0
            except (redis.RedisError, OSError) as exc:
                self.subscribed.clear()
                failures += 1
                log.debug("the drop signal's subscription broke (%s); subscribing again", exc)
                await asyncio.sleep(backoff_s(failures, base_s=0.5, max_s=5.0))
            finally:
                self.subscribed.clear()
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()

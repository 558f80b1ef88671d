"""One line when this worker loses Redis, one when Redis is back, whatever loop noticed.

Every loop that talks to Redis (leases, claims, outcomes, status, the stealing order, the desired
spec) retries on its own schedule through an outage; without this each would print a warning per
retry. They report here instead: the first failure says "lost Redis" once, the retries are debug
lines, and the first success afterwards says how long it lasted. One process serves one GPU, so one
link per process (`LINK`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import redis

__all__ = ["LINK", "RedisLink", "every", "guarded"]

log = logging.getLogger("batchfleet.worker")

STALE_S = 10.0  # how long after an outage a stale pooled connection may still fail once


class RedisLink:
    def __init__(self) -> None:
        self.where = "Redis"
        self.since: float | None = None  # monotonic time of the first failure of this outage
        self.said = False  # the "lost" line of this outage was printed
        self.back_at = -1e9  # when the last outage ended
        self.outages = 0

    def configure(self, where: str) -> None:
        """`where`: the (redacted) Redis URL, for the two lines."""
        self.where = where

    def lost(self, doing: str, exc: BaseException) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.outages += 1
        # Right after Redis came back, each pooled connection opened before the outage fails once when
        # next used (redis-py then reconnects): a blip of a few seconds is not a new outage to announce.
        blip = self.since - self.back_at < STALE_S and now - self.since < STALE_S / 2
        if not self.said and not blip:
            self.said = True
            log.warning("lost Redis at %s while %s (%s: %s); in-flight prompts keep running, retrying",
                        self.where, doing, type(exc).__name__, str(exc)[:160])
        else:
            log.debug("Redis away (%s: %s)", doing, exc)

    def ok(self) -> None:
        if self.since is not None:
            if self.said:
                log.warning("Redis at %s is back after %.0f s; carrying on", self.where, time.monotonic() - self.since)
            self.since, self.said, self.back_at = None, False, time.monotonic()

    @property
    def down(self) -> bool:
        return self.since is not None


LINK = RedisLink()


async def guarded(doing: str, step: Callable[[], Awaitable[object]]) -> bool:
    """One step of a loop that talks to Redis: True when it went through. A Redis failure is the link's
    to report (once per outage), anything else is logged with its traceback; either way the loop goes
    on (a worker never stops serving over its bookkeeping)."""
    try:
        await step()
    except (redis.RedisError, OSError) as exc:
        LINK.lost(doing, exc)
    except Exception:
        log.exception("%s failed", doing)
    else:
        LINK.ok()
        return True
    return False


async def every(period_s: float, doing: str, step: Callable[[], Awaitable[object]]) -> NoReturn:
    """`step`, `guarded`, every `period_s`, for ever."""
    while True:
        await guarded(doing, step)
        await asyncio.sleep(period_s)

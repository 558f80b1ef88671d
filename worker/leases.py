"""Lease upkeep: renew this worker's leases and requeue the jobs of workers that stopped renewing.

Both happen on Redis's clock inside the ledger's scripts; this loop only paces them (a third of the
lease time, so one missed beat is survived). A lease found lost (it lapsed, e.g. while this host was
cut off, and another worker requeued the job) is dropped here: the prompt runs elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis

from .ledger import Ledger
from .redislink import LINK

__all__ = ["LeaseKeeper"]

log = logging.getLogger("batchfleet.worker")


class LeaseKeeper:
    def __init__(self, ledger: Ledger, *, on_lost: Callable[[list[str]], None],
                 before: Callable[[], Awaitable[object]] | None = None,
                 also: Callable[[], Awaitable[object]] | None = None) -> None:
        self.ledger = ledger
        self.on_lost = on_lost
        self.before = before  # before renewing: drop cancelled prompts (their leases were removed, not lost)
        self.also = also  # paced with the leases: the run-marker check (Redis lost the run's data?)
        self.period_s = max(0.5, ledger.lease_ttl_s / 3)

    async def beat(self) -> None:
        if self.before is not None:
            await self.before()
        lost = await self.ledger.renew()
        if lost:
            log.warning("lost the lease of %d prompt(s) (requeued by another worker while this one was silent); "
                        "dropping them here", len(lost))
            self.on_lost(lost)
        recovered = await self.ledger.recover_lapsed()
        if recovered:
            log.warning("recovered %d prompt(s) from a worker that stopped renewing its leases", len(recovered))
        if self.also is not None:
            await self.also()

    async def run(self) -> None:
        while True:
            try:
                await self.beat()
                LINK.ok()
            except (redis.RedisError, OSError) as exc:  # Redis hiccup: leases have slack for a missed beat
                LINK.lost("renewing leases", exc)
            except Exception:
                log.exception("lease upkeep failed")
            await asyncio.sleep(self.period_s)

"""Lease upkeep: renew this worker's leases and requeue the jobs of workers that stopped renewing.

Both happen on Redis's clock inside the ledger's scripts; this loop only paces them (a third of the
lease time, so one missed beat is survived). A lease found lost (it lapsed, e.g. while this host was
cut off, and another worker requeued the job) is dropped here: the prompt runs elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from .ledger import Ledger
from .redislink import every

__all__ = ["LeaseKeeper"]

log = logging.getLogger("batchfleet.worker")


class LeaseKeeper:
    def __init__(self, ledger: Ledger, *, on_lost: Callable[[list[str]], None],
                 check_drops: Callable[[], Awaitable[object]] | None = None,
                 check_marker: Callable[[], Awaitable[object]] | None = None) -> None:
        self.ledger = ledger
        self.on_lost = on_lost
        # before renewing: drop cancelled prompts (their leases were removed, not lost)
        self.check_drops = check_drops
        # paced with the leases: the run-marker check (did Redis lose the run's data?)
        self.check_marker = check_marker
        self.period_s = max(0.5, ledger.lease_ttl_s / 3)

    async def beat(self) -> None:
        if self.check_drops is not None:
            await self.check_drops()
        lost = await self.ledger.renew()
        if lost:
            log.warning("lost the lease of %d prompt(s) (requeued by another worker while this one was silent); "
                        "dropping them here", len(lost))
            self.on_lost(lost)
        recovered = await self.ledger.recover_lapsed()
        if recovered:
            log.warning("recovered %d prompt(s) from a worker that stopped renewing its leases", len(recovered))
        if self.check_marker is not None:
            await self.check_marker()

    async def run(self) -> NoReturn:
        await every(self.period_s, "renewing leases", self.beat)  # a missed beat: leases have slack for it

"""The worker's wall clock: `time.time()` plus the test-only `BATCHFLEET_TEST_CLOCK_OFFSET_S`.

It stamps what a person reads (a result's `finished_at`, status records, events). No lease, lapse
or timeout decision uses it: those are made inside Redis on Redis's `TIME` (see `ledger`), so hosts
whose clocks disagree by minutes still agree on when a lease lapsed. Durations inside one process
use `time.monotonic()`.
"""

from __future__ import annotations

import time

__all__ = ["Clock"]


class Clock:
    def __init__(self, offset_s: float = 0.0) -> None:
        self.offset_s = offset_s

    def __call__(self) -> float:
        return time.time() + self.offset_s

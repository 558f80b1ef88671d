"""Back-off, once: how long to wait after failures in a row, for every loop that retries or polls (a
prompt's retries, a server that cannot start, a claim while Redis is away, a dry queue, a rolled-back
rung of the supervisor's ladder)."""

from __future__ import annotations

import math
import random

__all__ = ["backoff_s"]


def backoff_s(failures: int, *, base_s: float, max_s: float = math.inf, jitter: bool = False) -> float:
    """The wait after `failures` failures in a row (1 for the first): `base_s`, doubled for each failure
    after the first, at most `max_s`. With `jitter`, a random part of that from half to all of it, so a
    fleet that failed together does not retry in lockstep. 0 before any failure."""
    if failures < 1:
        return 0.0
    wait_s = min(max_s, base_s * 2.0 ** min(failures - 1, 60))
    return wait_s * random.uniform(0.5, 1.0) if jitter else wait_s

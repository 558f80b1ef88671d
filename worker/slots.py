"""A resizable asyncio semaphore: the worker's in-flight limit, sized to the server's effective
capacity and resized when a restart changes it.

Waiters are futures woken straight from `release()` (no lock, no task per release: it runs for
every finished prompt, thousands of times a second)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

__all__ = ["Slots"]


class Slots:
    def __init__(self, capacity: int = 0) -> None:
        self._capacity = capacity
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free(self) -> int:
        return max(0, self._capacity - self.in_use)

    async def resize(self, capacity: int) -> None:
        self.set_limit(capacity)

    def set_limit(self, capacity: int) -> None:
        self._capacity = capacity
        self._wake()

    async def acquire_up_to(self, n: int) -> int:
        """Wait until at least one slot is free, then take up to `n`; return how many were taken."""
        while self.free <= 0:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
                raise
        took = min(n, self.free)
        self.in_use += took
        return took

    async def acquire(self) -> None:
        await self.acquire_up_to(1)

    def release(self, n: int = 1) -> None:
        self.in_use -= n
        self._wake()

    def _wake(self) -> None:
        """Wake every waiter while slots are free (each re-checks; those that find none wait again)."""
        if self.free <= 0:
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)


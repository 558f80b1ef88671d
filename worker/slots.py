"""A resizable asyncio semaphore: the worker's in-flight limit, sized to the server's effective
capacity and resized when a restart changes it."""

from __future__ import annotations

import asyncio

__all__ = ["Slots"]


class Slots:
    def __init__(self, capacity: int = 0) -> None:
        self._capacity = capacity
        self.in_use = 0
        self._changed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free(self) -> int:
        return max(0, self._capacity - self.in_use)

    async def resize(self, capacity: int) -> None:
        async with self._changed:
            self._capacity = capacity
            self._changed.notify_all()

    async def acquire_up_to(self, n: int) -> int:
        """Wait until at least one slot is free, then take up to `n`; return how many were taken."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.free > 0)
            took = min(n, self.free)
            self.in_use += took
            return took

    async def acquire(self) -> None:
        await self.acquire_up_to(1)

    def release(self, n: int = 1) -> None:
        self.in_use -= n
        # notify needs the lock; schedule it rather than block the caller (called from `finally`).
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

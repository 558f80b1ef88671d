"""The worker's in-flight limit (`InFlightLimit`): the server's effective capacity plus a small
surplus that waits in the server's own queue, so a finished request's slot is refilled at the
server's next step instead of after a round trip to the worker and Redis. The surplus is sized from
the measured turnover (`Turnover`); the limit is a resizable semaphore (`Slots`), resized when a
restart changes the capacity.

Waiters are futures woken straight from `release()` (no lock, no task per release: it runs for
every finished prompt, thousands of times a second)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

__all__ = ["InFlightLimit", "KvBound", "Slots", "Turnover", "surplus_cap"]

log = logging.getLogger("batchfleet.worker.dispatcher")


class Slots:
    def __init__(self, capacity: int = 0) -> None:
        self._capacity = capacity
        self.in_use = 0
        self._waiters: list[tuple[asyncio.Future[None], int]] = []  # (woken when free >= n, n)
        self.freed_at: float | None = None  # monotonic time of the first release since `take_freed_at`

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def waiting(self) -> int:
        """Callers waiting for free slots."""
        return len(self._waiters)

    @property
    def free(self) -> int:
        return max(0, self._capacity - self.in_use)

    def set_limit(self, capacity: int) -> None:
        self._capacity = capacity
        self._wake()

    def take_freed_at(self) -> float | None:
        """When the first slot was released since the last call (the claim loop times its refills)."""
        freed_at, self.freed_at = self.freed_at, None
        return freed_at

    async def acquire_up_to(self, n: int) -> int:
        """Wait until at least one slot is free, then take up to `n`; return how many were taken."""
        await self.wait_one_free()
        took = min(n, self.free)
        self.in_use += took
        return took

    async def wait_one_free(self) -> None:
        """Wait until at least one slot is free. Takes nothing."""
        while self.free <= 0:
            await self._until_free(1)

    async def wait_free(self, n: int, timeout_s: float) -> None:
        """Wait until at least `n` slots are free, or for `timeout_s`, whichever comes first (the
        claim loop gathers free slots into one claim). Takes nothing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.free < n:
            left = deadline - loop.time()
            if left <= 0:
                return
            await self._until_free(n, left)

    async def _until_free(self, n: int, timeout_s: float | None = None) -> None:
        """Until a release finds `n` slots free (the caller checks again), or `timeout_s` is up."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, n)
        self._waiters.append(entry)
        timer = None if timeout_s is None else loop.call_later(timeout_s, _resolve, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):  # a release that woke it has taken it out already
                self._waiters.remove(entry)

    async def acquire(self) -> None:
        await self.acquire_up_to(1)

    def release(self, n: int = 1) -> None:
        self.in_use -= n
        if self.freed_at is None:
            self.freed_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        """Wake the waiters that enough slots are free for (each re-checks; one that finds too few
        waits again). Waiters are few: the claim loop and prompts waiting to retry."""
        waiters = self._waiters
        if not waiters:
            return
        free = self.free
        if free <= 0:
            return
        if len(waiters) == 1:  # the usual case (the claim loop alone): nothing to allocate per release
            fut, n = waiters[0]
            if fut.done() or n <= free:
                waiters.clear()
                if not fut.done():
                    fut.set_result(None)
            return
        still = []
        for fut, n in self._waiters:
            if fut.done():
                continue
            if n <= free:
                fut.set_result(None)
            else:
                still.append((fut, n))
        self._waiters = still


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def surplus_cap(base: int, configured: int | None) -> int:
    """The most prompts a worker keeps queued in a server that runs `base` at once: what was
    configured, else `base` itself; never more than `base`. Turnover decides how many of those it
    keeps (the most finishes within one round trip, + 1), so the bound binds only when a whole batch
    finishes in one decode step (fixed max_tokens, admitted together): then anything less leaves
    slots empty for a round trip (half the capacity: fill 0.9948 on 16-token generations, the whole
    capacity: 0.997). What it costs: a drain hands back at most `base`, a server death strikes at most
    2 x `base` prompts (suspects run one per worker at a time; a strike never fails a bystander)."""
    if base <= 0:
        return 0
    if configured is not None:
        return min(configured, base)
    return base


class Turnover:
    """How many prompts to keep waiting in the server so that no slot idles between a finish and
    its replacement's arrival.

    A finished request's slot stays empty until the worker has heard of the finish, claimed the next
    prompt from Redis and sent it: the refill delay, measured by the claim loop (`refilled`), doubled
    for the legs it cannot see (the reply on its way to the worker, the request on its way to the
    server). Requests already waiting inside the server fill those slots at its next step instead, as
    long as no more of them finish within one such round trip than are waiting. Finishes come in
    bursts (one decode step ends several requests), so the surplus is the most finishes seen within
    one round trip over the last `horizon_s`, plus one. O(1) per finish.

    Until it has measured for a whole horizon (from its first finish), it knows nothing, and the
    first batch of a run tends to finish together (prompts admitted together, alike): the surplus is
    then its bound, so the first claim fills the capacity plus that surplus at once (instead of some
    hundred claims of 1-3 prompts while a measured surplus grows from nothing, with slots left empty
    by each burst of finishes it had not yet seen)."""

    BUCKET_S = 0.5

    def __init__(self, *, horizon_s: float = 10.0, min_window_s: float = 0.002) -> None:
        self.horizon_s = horizon_s
        self.min_window_s = min_window_s
        self.refill_s = 0.0  # EWMA of the claim loop's refill delay
        self._window: deque[float] = deque()  # finishes within one round trip of the latest
        self._buckets: deque[list[float]] = deque()  # [bucket start, most finishes within one round trip]
        self._first: float | None = None  # the first finish seen: it measures from then on

    @property
    def window_s(self) -> float:
        return max(self.min_window_s, 2.0 * self.refill_s)

    def refilled(self, seconds: float) -> None:
        seconds = min(seconds, 1.0)
        self.refill_s = seconds if self.refill_s == 0.0 else 0.8 * self.refill_s + 0.2 * seconds

    def finished(self, now: float) -> None:
        if self._first is None:
            self._first = now
        win = self._window
        win.append(now)
        edge = now - self.window_s
        while win[0] < edge:
            win.popleft()
        buckets = self._buckets
        if not buckets or now - buckets[-1][0] >= self.BUCKET_S:
            buckets.append([now, 0])
            while now - buckets[0][0] > self.horizon_s:
                buckets.popleft()
        if len(win) > buckets[-1][1]:
            buckets[-1][1] = len(win)

    def surplus(self, now: float, cap: int) -> int:
        """The most finishes within one round trip over the horizon, + 1; within [min(1, cap), cap].
        `cap` itself until a whole horizon has been measured (the initial surplus)."""
        if cap <= 0:
            return 0
        if self._first is None or now - self._first < self.horizon_s:
            return cap
        buckets = self._buckets
        while buckets and now - buckets[0][0] > self.horizon_s:
            buckets.popleft()
        most = max((int(b[1]) for b in buckets), default=0)
        return max(1, min(cap, most + 1))


class KvBound:
    """What the server's KV pool holds, in prompts of the size this worker claims: a server runs as many
    requests at once as its `--max-running-requests` AND its KV pool allow, and its reported capacity
    is only the first (a token estimate for short requests). Long prompts fill the pool long before:
    2048 slots of a dense 8B server on an 80 GB card, 413,712 tokens of KV, run ~118 prompts of 3.5K
    tokens at once. Past that the rest waits in the server's queue, taken from the queues of servers
    that would have run them (a worker whose own queue is dry steals). For an embedding server the
    keeper gives its prefill forwards' token budget instead of the pool (`keeper.bounding_tokens`).

    `prompts()`: KV_OVERCOMMIT x the pool over the mean prompt claimed (bytes / bytes per token, an
    estimate: a shared prefix is counted whole, decode is left to the overcommit); None while the pool
    or the prompts' size is unknown. Before the first claim the worker claims at most PROBE prompts.
    Bytes per token is BYTES_PER_TOKEN until answers say how many tokens their requests were
    (`measured`: embeddings, whose usage counts every token of the request; a short document's job is
    mostly its JSON envelope, 5-10x its tokens at 4 bytes each)."""

    KV_OVERCOMMIT = 2.0  # what runs (1x) and as much waiting in the server's queue
    BYTES_PER_TOKEN = 4
    PROBE = 64

    def __init__(self) -> None:
        self.kv_tokens: int | None = None
        self.mean_bytes: float | None = None
        self.bytes_per_token: float = self.BYTES_PER_TOKEN

    @property
    def mean_tokens(self) -> float | None:
        return None if self.mean_bytes is None else self.mean_bytes / self.bytes_per_token

    def claimed(self, sizes: list[int]) -> None:
        """Claimed prompts of these sizes (bytes of their job data)."""
        if not sizes:
            return
        mean = sum(sizes) / len(sizes)
        self.mean_bytes = mean if self.mean_bytes is None else 0.8 * self.mean_bytes + 0.2 * mean

    def measured(self, nbytes: int, tokens: int) -> None:
        """An answer says its request of `nbytes` (job data) was `tokens` prompt tokens."""
        if nbytes > 0 and tokens > 0:
            self.bytes_per_token = 0.99 * self.bytes_per_token + 0.01 * (nbytes / tokens)

    def prompts(self) -> int | None:
        if not self.kv_tokens:
            return None
        mean = self.mean_tokens
        if mean is None:
            return self.PROBE
        return max(1, int(self.KV_OVERCOMMIT * self.kv_tokens / max(mean, 1.0)))


class InFlightLimit:
    """How many prompts the worker keeps in its server: `capacity` (what the server runs at once) +
    `surplus` (kept waiting in its queue on purpose), as a semaphore (`slots`); never more than its
    KV pool holds (`KvBound`)."""

    RESIZE_EVERY_S = 0.5

    def __init__(self, configured_surplus: int | None) -> None:
        self.configured_surplus = configured_surplus  # None: sized from the turnover; 0: none
        self.slots = Slots(0)
        self.turnover = Turnover()
        self.kv = KvBound()
        self.capacity = 0
        self.surplus = 0
        self.surplus_max = 0
        self.auto = False  # the surplus follows the turnover
        self._checked = 0.0

    def set_capacity(self, capacity: int, *, max_in_flight: int | None = None, kv_tokens: int | None = None) -> None:
        """For a server that runs `capacity` requests at once: capacity + surplus; or `max_in_flight`
        alone when the configuration caps below the server (its slots are not all used anyway, so a
        surplus would only raise the cap). `kv_tokens`: its KV pool (None: unknown)."""
        base = min(capacity, max_in_flight or capacity)
        self.capacity = base
        self.kv.kv_tokens = kv_tokens
        if base < capacity or self.configured_surplus == 0:
            self.auto, self.surplus_max = False, 0
        else:
            self.auto = self.configured_surplus is None
            self.surplus_max = surplus_cap(base, self.configured_surplus)
        self.surplus = self.turnover.surplus(time.monotonic(), self.surplus_max) if self.auto else self.surplus_max
        self._apply()

    def claimed(self, sizes: list[int]) -> None:
        """A claim brought prompts of these sizes (bytes): the KV bound follows their mean."""
        before = self.kv.mean_tokens
        self.kv.claimed(sizes)
        if before is None and self.kv.mean_tokens is not None:
            self._apply()  # the probe is over: the bound of the prompts' real size, at once

    def _apply(self) -> None:
        limit = self.capacity + self.surplus
        bound = self.kv.prompts()
        self.slots.set_limit(limit if bound is None else max(1, min(limit, bound)))

    def follow_turnover(self, now: float) -> None:
        """Resize the surplus to the turnover measured lately, and the KV bound to the prompts claimed
        lately (at most every RESIZE_EVERY_S)."""
        if now - self._checked <= self.RESIZE_EVERY_S:
            return
        self._checked = now
        if self.auto:
            surplus = self.turnover.surplus(now, self.surplus_max)
            if surplus != self.surplus:
                log.debug("surplus %d -> %d (refill %.1f ms)", self.surplus, surplus, self.turnover.refill_s * 1e3)
                self.surplus = surplus
        self._apply()

    @property
    def beyond_capacity(self) -> int:
        """Prompts in flight past what the server runs at once (most likely in its queue)."""
        return self.slots.in_use - self.capacity

"""The window Redis holds, and the feed pass that tops it up from the store.

Per queue the head keeps `window_target` prompts waiting in Redis:

    max(2 x effective capacity of the live workers serving it, window_s x its measured drain rate)

capped at `window_max`; `window_default` while nothing is known (no live worker on it, nothing drained
yet). The capacity is `batchfleet.fleetview`'s: the live worker of each queue (newest record per queue,
not silent). The drain rate is measured from the run's counters (`succeeded:<q>` + `failed:<q>`: a
prompt stolen by another GPU's worker still counts for the queue it came from), so it is the rate that
empties that queue. The queues fed are those live workers serve plus those given for the run (the
marker's `queues`).

A feed pass takes the WAITING prompts with the longest expected work first (max_tokens desc, then
input order: the long generations start early and do not straggle at the end of the run), deals them
over the queues that are short, and in one store transaction per batch writes their RQ jobs
(`scripts.FEED`) and marks them FED. A crash between the two leaves jobs in Redis whose prompts are
still WAITING: the next pass finds the jobs present and only marks them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import orjson
import redis

from batchfleet.config import Config
from batchfleet.fleetview import read_fleet_view
from batchfleet.jobs import job_data, job_id_for, prompt_wire
from batchfleet.keys import RQ_QUEUES, Keys

from .plan import Dealer, PlanRow, Unit
from .scripts import FEED
from .share import FairShare
from .store import FEED_ORDER, Store

__all__ = ["DrainMeter", "FeedSummary", "Feeder", "feed_pass", "window_target"]

FEED_BATCH = 2000  # prompts per store transaction and Lua call
SHARE_CHUNK = 128  # ... while several tenants of one priority have work: the share's grain
SHARE_BLIND = 16  # a shared queue before anything is known of it (no live worker, nothing drained yet)
HIGH_ROOM = 64  # high work a pass may push to the front of each shared queue beyond its window


class DrainMeter:
    """Prompts finished per second per queue over the last `span_s`, from the run's counters."""

    def __init__(self, span_s: float = 30.0) -> None:
        self.span_s = span_s
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def update(self, stats: dict[str, int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        finished: dict[str, int] = {}
        for name, value in stats.items():
            kind, _, q = name.partition(":")
            if kind in ("succeeded", "failed") and q:
                finished[q] = finished.get(q, 0) + value
        for q, n in finished.items():
            dq = self.samples.setdefault(q, deque())
            if dq and n < dq[-1][1]:
                dq.clear()  # the counter went back: Redis lost its data; measure afresh
            dq.append((now, n))
            while len(dq) > 2 and dq[0][0] < now - self.span_s:
                dq.popleft()

    def rate(self, queue: str) -> float:
        dq = self.samples.get(queue)
        if not dq or len(dq) < 2 or dq[-1][0] <= dq[0][0]:
            return 0.0
        return (dq[-1][1] - dq[0][1]) / (dq[-1][0] - dq[0][0])


def window_target(config: Config, capacity: int, rate: float, *, shared: bool = False) -> int:
    """How many prompts one queue should hold in Redis. In a shared fleet (`shared`: tenants' shares,
    `producer.share`) `share_window_s` of its drain rate once that is known: what the servers run
    follows the feed's choices within seconds (a batch of a tenant who was idle does not wait behind
    a minute of another's work), at the price of a window that lasts seconds, not a minute, when the
    head stops. Before anything is known of a shared queue, SHARE_BLIND: what is fed is out of the
    share's hands, and nothing runs before a worker reports anyway."""
    if capacity <= 0 and rate <= 0:
        return min(config.window_default, SHARE_BLIND) if shared else config.window_default
    if shared and rate > 0:
        return max(1, min(config.window_max, max(capacity // 4, math.ceil(config.share_window_s * rate))))
    return max(1, min(config.window_max, max(2 * capacity, math.ceil(config.window_s * rate))))


@dataclass
class FeedSummary:
    fed: dict[str, int] = field(default_factory=dict)  # new jobs per queue
    present: int = 0  # already in Redis (marked FED without a new job)

    @property
    def total(self) -> int:
        return sum(self.fed.values())


class Feeder:
    """Moves WAITING prompts from the store into RQ jobs."""

    def __init__(self, config: Config, r: redis.Redis, store: Store) -> None:
        self.config = config
        self.r = r
        self.store = store
        self.keys = Keys(config.run)
        self.dealer = Dealer()  # the plan's units and which queue each goes to (affinity while it lives)
        self.share = FairShare(half_life_s=config.share_half_life_s)
        self._shared = False

    def targets(self, queues: list[str], capacity: dict[str, int], meter: DrainMeter | None) -> dict[str, int]:
        shared = self.shared()
        return {q: window_target(self.config, capacity.get(q, 0), meter.rate(q) if meter else 0.0, shared=shared)
                for q in queues}

    def top_up(self, targets: dict[str, int]) -> FeedSummary:
        """Feed each queue up to its target (what it holds now counts)."""
        if not targets:
            return FeedSummary()
        queues = list(targets)
        pipe = self.r.pipeline(transaction=False)
        for q in queues:
            pipe.llen(Keys.queue(q))
        lengths = pipe.execute()
        return self.feed({q: max(0, targets[q] - n) for q, n in zip(queues, lengths, strict=True)},
                         high={q: max(0, targets[q] + HIGH_ROOM - n) for q, n in zip(queues, lengths, strict=True)})

    def shared(self) -> bool:
        """Is this a shared fleet's store (`batchfleet serve`'s: its inputs have owners, fed by input)?
        Then the feed shares the fleet between them (`producer.share`) and keeps a short window."""
        if not self._shared:  # once shared, always: owners are never removed
            with self.store.read():
                self._shared = self.store.get_meta(FEED_ORDER) == "input" and self.store.shares.any()
                if self._shared:  # what was fed before this head started is in Redis still
                    for tenant, n in self.store.shares.in_redis().items():
                        self.share.in_redis(tenant, n)
        return self._shared

    def feed(self, deficits: dict[str, int], *, high: dict[str, int] | None = None) -> FeedSummary:
        """Feed up to `deficits[q]` prompts to each queue q, in the store's order: the plan's, as units
        (a unit may take a queue past its deficit), else longest expected work first, dealt in turn; in
        a shared fleet's store, input by input as `producer.share` picks them, high work first up to
        `high[q]` (default `deficits[q]`)."""
        out = FeedSummary(fed={q: 0 for q in deficits})
        left = {q: n for q, n in deficits.items() if n > 0}
        if deficits and self.shared():
            return self._feed_shared(left, {q: n for q, n in (high or deficits).items() if n > 0}, out)
        while left:
            if not self._feed_chunk(min(FEED_BATCH, sum(left.values())), left, out):
                break
        return out

    def _feed_shared(self, left: dict[str, int], high: dict[str, int], out: FeedSummary) -> FeedSummary:
        """High work first, to the front of the queues, up to `high[q]` (top_up: HIGH_ROOM beyond the
        window): it waits for no window to drain, as it is claimed at a queue's next free slot before
        what the queue holds; then `left`, input by input as the share picks them."""
        with self.store.read():
            waiting = self.store.shares.waiting()
            weights = self.store.shares.weights()
        while high and waiting and (pick := self.share.pick(waiting, weights)) is not None and pick.front:
            before = dict(high)
            rows = self._feed_chunk(min(FEED_BATCH, sum(high.values())), high, out, file=pick.input.file, front=True)
            self.share.charge(pick.input.tenant, (row.cost for row in rows))
            for q, n in before.items():  # what high work took of the window's room
                if q in left:
                    left[q] -= n - high.get(q, 0)
                    if left[q] <= 0:
                        del left[q]
            if not rows:
                waiting.remove(pick.input)
        while left and waiting:
            pick = self.share.pick(waiting, weights)
            assert pick is not None
            rivals = {w.tenant for w in waiting if w.priority == pick.input.priority}
            room = sum(left.values())
            limit = min(max(16, room // 4), SHARE_CHUNK, room) if len(rivals) > 1 else min(FEED_BATCH, room)
            rows = self._feed_chunk(limit, left, out, file=pick.input.file, front=pick.front)
            self.share.charge(pick.input.tenant, (row.cost for row in rows))
            if len(rows) < limit:  # the input has nothing more waiting
                waiting.remove(pick.input)
        return out

    def _feed_chunk(self, limit: int, left: dict[str, int], out: FeedSummary, *, file: int | None = None,
                    front: bool = False) -> list[PlanRow]:
        """One store transaction: up to `limit` rows (of input `file`) dealt over `left` (updated, as
        `out`). Returns the rows fed."""
        with self.store.write():
            rows = self.store.next_to_feed(limit, file=file)
            if not rows:
                return rows
            dealt = self.dealer.deal_rows(rows, left)
            taken = {q: sum(len(u.rows) for u in units) for q, units in dealt.items()}
            rows = rows[:sum(taken.values())]
            _, present, per_queue = self._write_jobs(dealt, front=front)
            self.store.fed_rows(rows, file=file)
        out.present += present
        for q, n in zip(dealt, per_queue, strict=True):
            out.fed[q] += n
            left[q] -= taken[q]
            if left[q] <= 0:
                del left[q]
        return rows

    def _write_jobs(self, dealt: dict[str, list[Unit]], *, front: bool = False) -> tuple[int, int, list[int]]:
        """The jobs of the units dealt, in one script call. With them, per queue, the plan's prediction:
        the bytes its new prompts share with the one before them there, of their bytes."""
        k, run = self.keys, self.config.run
        jobs: list[str] = []
        argv: list[bytes | str] = []
        counts: list[int] = []
        predicted: list[tuple[int, int]] = []
        for units in dealt.values():
            counts.append(sum(len(u.rows) for u in units))
            predicted.append((sum(sum(u.shared) for u in units), sum(u.size for u in units)))
            for unit in units:
                grp = unit.grp
                for row in unit.rows:
                    argv += (job_data(prompt_wire(row.cid, row.seq, row.url, orjson.Fragment(row.body), fp=row.fp,
                                                  pri=1 if front else 0, run=run)), grp)
                    jobs.append(Keys.job(job_id_for(run, row.cid)))
        added, present, *per_queue = FEED.call(
            self.r, keys={"done": k.done, "stats": k.stats, "queue_index": RQ_QUEUES,
                          "queues": [Keys.queue(q) for q in dealt], "jobs": jobs},
            args={"front": "1" if front else "0", "names": list(dealt), "counts": counts,
                  "shared": [p[0] for p in predicted], "sizes": [p[1] for p in predicted], "jobs_argv": argv})
        return int(added), int(present), [int(n) for n in per_queue]


def feed_pass(config: Config, r: redis.Redis, store: Store, queues: tuple[str, ...]) -> FeedSummary:
    """One top-up of the given queues and those live workers serve (no drain rate known yet: the window
    is 2 x capacity, or window_default) — what `enqueue` and `recover` do before the head takes over."""
    view = read_fleet_view(r, Keys(config.run))
    feeder = Feeder(config, r, store)
    return feeder.top_up(feeder.targets(list(dict.fromkeys((*queues, *view.capacity))), view.capacity, None))

"""What `GET /v1/fleet`, serve's screen and its metrics show of the tenants and their batches, and the
deadline estimate of every running batch: `FleetBook.update`, called by the engine's thread (never by
the event loop: it reads Redis).

    a tenant    its weight (the tenants file), its share of the fleet's output tokens over the last
                minute and its tokens/s (what the head publishes, `Keys.tenants`), its queued requests
                (`quota.queued_of`) and its done ones (completed + failed, over its batches)
    a batch     its priority, its queue_position (0: its tenant's oldest unfinished batch of its
                priority, the one being fed; else how many of those are ahead of it), its eta and
                whether that is past its expires_at (`late`)

The ETA of a batch: the requests without a result of its tenant's batches created before it at the same
or a higher priority, and its own, over the tenant's rate (requests finished per second over the last
minute while it had work; `RATE_SPAN_S`, known once measured over MIN_SPAN_S). None while unknown. When
a batch's ETA passes its deadline, one warning line says so, and again only after it recovered.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

from batchfleet.keys import Keys
from producer.api import priority_level, read_tenants

from .auth import ApiKeys
from .objects import BatchRecord, BatchStatus
from .quota import left_of, queued_of, tenant_name
from .registry import Registry
from .tenants import priority_of

__all__ = ["BatchRow", "FleetBook", "TenantRow"]

log = logging.getLogger("batchfleet.serve")

UPDATE_EVERY_S = 1.0
RATE_SPAN_S = 60.0
MIN_SPAN_S = 5.0
SCREEN_EVERY_S = 10.0  # the screen's tenant rows, at most this often (and only when they changed)
QUEUED = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


@dataclass(frozen=True, slots=True)
class TenantRow:
    name: str
    weight: float
    share: float
    tokens_per_s: float
    queued: int
    done: int

    def to_api(self) -> dict[str, object]:
        return {"name": self.name, "weight": self.weight, "share": self.share, "tokens_per_s": self.tokens_per_s,
                "queued": self.queued, "done": self.done}


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    owner: str
    tenant: str
    priority: str
    queue_position: int
    eta: int | None
    expires_at: int
    late: bool

    def to_api(self) -> dict[str, object]:
        return {"id": self.id, "tenant": self.tenant, "priority": self.priority,
                "queue_position": self.queue_position, "eta": self.eta, "expires_at": self.expires_at,
                "late": self.late}


class RateMeter:
    """A tenant's requests finished per second, measured only while it has requests queued."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, done: int, queued: int) -> None:
        if queued == 0:
            self.samples.clear()  # idle: its next work is measured afresh
            return
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()
        self.samples.append((now, done))
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_SPAN_S:
            self.samples.popleft()

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        if t1 - t0 < MIN_SPAN_S or d1 <= d0:
            return None
        return (d1 - d0) / (t1 - t0)


class FleetBook:
    def __init__(self, r: redis.Redis, keys: Keys, registry: Registry, *,
                 on_rows: Callable[[list[TenantRow]], None] | None = None) -> None:
        self.r = r
        self.keys = keys
        self.registry = registry
        self.on_rows = on_rows
        self.tenants: list[TenantRow] = []  # replaced whole: the event loop reads it as it is
        self.batches: dict[str, BatchRow] = {}
        self.meters: dict[str, RateMeter] = {}
        self.late: set[str] = set()  # batches whose warning was given (and that did not recover since)
        self._made = 0  # batches of the registry looked at (its creation order)
        self._open: set[str] = set()  # the unfinished ones at the last pass
        self._counted: set[str] = set()  # ended batches whose counts are in _done
        self._done: dict[str, int] = {}  # tenant -> requests done of its batches that ended
        self._next = 0.0
        self._screen_at = 0.0
        self._shown: object = None

    def update(self, api_keys: ApiKeys, *, force: bool = False) -> bool:
        """Recompute (at most every UPDATE_EVERY_S). True when it did."""
        mono = time.monotonic()
        if not force and mono < self._next:
            return False
        self._next = mono + UPDATE_EVERY_S
        figures = read_tenants(self.r, self.keys)
        live, done = self._tally()
        unfinished = [b for b in live if b.status in QUEUED]
        files = self.registry.files
        names = set(api_keys.by_name) | set(done)
        for name in names:
            done.setdefault(name, 0)
        rows = []
        for name in sorted(names):
            fig = figures.get(name)
            spec = api_keys.by_name.get(name)
            queued = queued_of(unfinished, files, name).requests
            self.meters.setdefault(name, RateMeter()).update(mono, done[name], queued)
            rows.append(TenantRow(name=name, weight=spec.weight if spec else 1.0, share=fig.share if fig else 0.0,
                                  tokens_per_s=fig.tokens_per_s if fig else 0.0, queued=queued, done=done[name]))
        self.tenants = rows
        self.batches = self._batch_rows(unfinished, files, time.time())
        self._screen(mono)
        return True

    def _tally(self) -> tuple[list[BatchRecord], dict[str, int]]:
        """The unfinished batches, and per tenant the requests done (completed + failed) of all its
        batches. An ended batch's counts never change: each is added once, when it is seen ended, so a
        pass reads only the new and the unfinished batches, not every batch there ever was."""
        new = self.registry.all_batches(self._made)
        self._made += len(new)
        watch = self._open | {b.id for b in new}
        open_now = self.registry.unfinished()
        for bid in watch:
            b = self.registry.batches[bid]
            if b.final and bid not in self._counted:
                self._counted.add(bid)
                self._done[tenant_name(b)] = self._done.get(tenant_name(b), 0) + b.completed + b.failed
        live = [b for b in open_now if b.id not in self._counted]
        self._open = (watch - self._counted) | {b.id for b in live}
        done = dict(self._done)
        for b in live:
            done[tenant_name(b)] = done.get(tenant_name(b), 0) + b.completed + b.failed
        return live, done

    def _batch_rows(self, unfinished: list[BatchRecord], files: dict, now: float) -> dict[str, BatchRow]:
        out = {}
        older: dict[str, list[int]] = {}  # tenant -> per priority: its unfinished batches so far (oldest first)
        older_left: dict[str, list[int]] = {}  # ... and their requests without a result
        for b in unfinished:
            tenant, name = tenant_name(b), priority_of(b.metadata)
            prio = _level(name)
            counts, lefts = older.setdefault(tenant, [0, 0, 0]), older_left.setdefault(tenant, [0, 0, 0])
            left = left_of(b, files.get(b.input_file_id)).requests
            eta = None
            if b.status is BatchStatus.IN_PROGRESS:
                ahead = left + sum(lefts[:prio + 1])
                meter = self.meters.get(tenant)
                rate = meter.rate() if meter else None
                if rate:
                    eta = int(now + ahead / rate)
                    self._judge(b, eta, ahead, tenant, rate)
            out[b.id] = BatchRow(id=b.id, owner=b.owner, tenant=tenant, priority=name, queue_position=counts[prio],
                                 eta=eta, expires_at=b.expires_at, late=eta is not None and eta > b.expires_at)
            counts[prio] += 1
            lefts[prio] += left
        self.late &= set(out)
        return out

    def _judge(self, b: BatchRecord, eta: int, left: int, tenant: str, rate: float) -> None:
        """One warning when the batch's ETA passes its deadline; again only after it recovered."""
        if eta > b.expires_at and b.id not in self.late:
            self.late.add(b.id)
            log.warning("batch %s: estimated to finish at %s, after its deadline %s (%s requests left, tenant %s "
                        "at %.2f req/s)", b.id, _when(eta), _when(b.expires_at), f"{left:,}", tenant, rate)
        elif eta <= b.expires_at and b.id in self.late:
            self.late.discard(b.id)
            log.info("batch %s: estimated to finish at %s, before its deadline %s again", b.id, _when(eta),
                     _when(b.expires_at))

    def _screen(self, mono: float) -> None:
        if self.on_rows is None or mono < self._screen_at:
            return
        shown = [(t.name, round(t.share, 2), t.weight, t.queued, t.done) for t in self.tenants]
        if shown != self._shown and any(t.queued or t.done for t in self.tenants):
            self._shown = shown
            self._screen_at = mono + SCREEN_EVERY_S
            self.on_rows(list(self.tenants))


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _level(priority: str) -> int:
    level = priority_level(priority)
    return 1 if level is None else level

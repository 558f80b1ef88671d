"""The head process (`producer head`, alias `producer collect --follow`): one per run, on the host of
the run's store. Every `interval_s` it

  1. checks the run marker: gone while the store has fed prompts = Redis lost the run's data; it
     requeues the lost prompts from the store (`recover`), restores the marker, and says so in one line;
  2. collects finished results into the store;
  3. every `audit_s`, audits the fed prompts: ones that are nowhere in Redis are requeued; ones failed by
     a foreign (stock RQ) worker are reported with the repair command, not requeued (that worker would
     eat them again);
  4. tops each queue up to its window from the store (`feed`), longest expected work first, sized on
     the fleet as `batchfleet.fleetview` reads it, and publishes how many prompts still wait in the
     store and how many have no result (`stats` fields `store_waiting`, `store_pending`: what the
     supervisor's ETA counts);
  5. once the run has ended (nothing pending: every prompt has its result, or `producer cancel`), it
     only collects: no marker check, audit or feed, and it gives the run's keys their TTL
     (`ends.expire_finished`, config `finished_ttl_s`) without writing a key again. Prompts enqueued
     later make the run live again: its keys lose the TTL.

It rides out Redis outages: one warning line when Redis is lost, one when it is back, and it keeps
looping (never exits non-zero on a blip: under honcho an exit stops the whole host). If the head
dies, workers finish the window and idle; a restart resumes where the store says.
"""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
import time
import traceback
from typing import TextIO

import redis

from batchfleet.config import Config
from batchfleet.connection import connect, redacted
from batchfleet.errors import ErrorCode, RecordError
from batchfleet.fleetview import FleetView, read_fleet_view
from batchfleet.keys import STORE_PENDING, STORE_WAITING, Keys
from batchfleet.marker import RunMarker, read_marker, repair_command
from batchfleet.prompts import EMBEDDINGS, kind_mismatch
from batchfleet.records import ENDPOINTS
from batchfleet.redact import Scrubber

from .collect import CollectSummary, collect_once
from .ends import cancel_prompts, cancelled_line, expire_finished, mark_ended, refeed
from .feed import DrainMeter, Feeder
from .locate import Access, NoStore, ensure_marker, locate
from .recover import audit, recover
from .store import Store, StoreError
from .tenants import TenantBook

__all__ = ["Head"]


class Head:
    def __init__(self, config: Config, *, explicit: bool, interval_s: float = 2.0, audit_s: float = 30.0,
                 log: TextIO | None = None, r: redis.Redis | None = None) -> None:
        self.config = config
        self.explicit = explicit
        self.interval_s = interval_s
        self.audit_s = audit_s
        self.log = log or sys.stderr
        self.r = r or connect(config.redis_url)
        self.keys = Keys(config.run)
        self.store: Store | None = None
        self.marker: RunMarker | None = None
        self.feeder: Feeder | None = None
        self.meter = DrainMeter()
        self.total = CollectSummary()
        self.fed_total = 0
        self.redis_down_since: float | None = None
        self.waiting_said = False
        self.next_audit = 0.0
        self.said_foreign = 0
        self.said_errors: set[str] = set()
        self.stop = threading.Event()
        self._scrub = Scrubber.for_config(config)  # an error text never prints a secret
        self.ended = False  # the run's keys were given their end-of-run TTL
        self.gauges: dict[str, int] = {}  # what was last published to the run's stats
        self.tenants: TenantBook | None = None

    def say(self, text: str) -> None:
        print(f"head: {self._scrub(text)}", file=self.log, flush=True)

    # --- the loop -----------------------------------------------------------------------------------
    def run(self, *, until: float | None = None) -> int:
        """Loop until SIGINT/SIGTERM (or `until`, a monotonic deadline, for tests). Exit code: 0, or 2
        when the store is refused (another host's, another id)."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, lambda *_: self.stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not self.stop.is_set() and (until is None or time.monotonic() < until):
                try:
                    if self.redis_down_since is not None:
                        self.r.ping()
                        self.say(f"Redis is back after {time.monotonic() - self.redis_down_since:.0f} s; carrying on")
                        self.redis_down_since = None
                    self.step()
                except (redis.RedisError, OSError) as exc:
                    if self.redis_down_since is None:
                        self.redis_down_since = time.monotonic()
                        self.say(f"lost Redis at {redacted(self.config.redis_url)} ({type(exc).__name__}: {exc}); "
                                 "retrying every few seconds, workers keep their prompts")
                except sqlite3.OperationalError as exc:  # e.g. the store locked by a long enqueue: next pass
                    self.say(f"store busy ({exc}); retrying")
                except StoreError as exc:
                    self.say(f"refusing to run: {exc}")
                    return 2
                except Exception as exc:  # a bug must not stop the host (under honcho an exit stops all)
                    key = f"{type(exc).__name__}: {exc}"
                    if key not in self.said_errors:
                        self.said_errors.add(key)
                        self.say(f"unexpected error, carrying on: {key}\n{traceback.format_exc()}")
                self._pause()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            if self.store is not None:
                self.store.close()
        self.say(f"stopped: collected {self.total.succeeded:,} succeeded, {self.total.failed:,} failed; "
                 f"fed {self.fed_total:,}")
        return 0

    def step(self) -> None:
        if self.store is None and not self._open():
            return
        assert self.store is not None and self.feeder is not None and self.tenants is not None
        with self.store.read():
            cancelled = self.store.cancelled_at() is not None
            live = self.store.counts()["pending"] > 0
        if live and not cancelled:
            self._check_marker()
        got = collect_once(self.r, self.store, self.keys, log=self.log)
        self.total.add(got)
        if self.feeder.shared():
            self.tenants.observe(got)
        if not cancelled:
            n = refeed(self.r, self.store, self.keys)
            if n:
                self.say(f"{n:,} failed prompt(s) brought back by `rq requeue` go to the queues again")
        with self.store.read():
            counts = self.store.counts()
        if cancelled or counts["pending"] == 0:  # ended (or being cancelled): collect only
            if self.gauges:  # this head published while the run was live: say it ended (and once only)
                self._publish(counts, changed_only=True)
            if got.stored:
                self.say(f"+{got.succeeded:,} ok, +{got.failed:,} failed (total {self.total.succeeded:,} ok, "
                         f"{self.total.failed:,} failed); {counts['pending']:,} pending")
            if counts["pending"] == 0:
                self._end(counts, cancelled)
            return
        if self.ended:
            self.ended = False
            pipe = self.r.pipeline(transaction=False)
            for key in self.keys.run_keys():
                pipe.persist(key)
            pipe.execute()
            self.say(f"run {self.config.run} has prompts to run again: its keys no longer expire")
        view = read_fleet_view(self.r, self.keys)
        if self._fail_other_kind(view):
            return
        self.meter.update({name: int(v) for name, v in view.stats.items()})
        if time.monotonic() >= self.next_audit:
            self.next_audit = time.monotonic() + self.audit_s
            self._audit()
        queues = list(dict.fromkeys((*(self.marker.queues if self.marker else ()), *view.capacity)))
        fed = self.feeder.top_up(self.feeder.targets(queues, view.capacity, self.meter))
        self.fed_total += fed.total
        with self.store.read():
            counts = self.store.counts()
        self._publish(counts)
        if self.feeder.shared():
            self.tenants.publish()
        if got.stored or fed.total:
            per_queue = ", ".join(f"{q} {n:,}" for q, n in fed.fed.items() if n)
            self.say(f"+{got.succeeded:,} ok, +{got.failed:,} failed (total {self.total.succeeded:,} ok, "
                     f"{self.total.failed:,} failed); fed {fed.total:,}{' (' + per_queue + ')' if per_queue else ''}; "
                     f"{counts['waiting']:,} waiting in the store, {counts['pending']:,} pending")

    def _fail_other_kind(self, view: FleetView) -> bool:
        """The fleet's servers are of one kind (`/model_info` is_generation, in their status records) and
        prompts of the run ask the other (an embedding on a generation fleet, a chat on an embedding
        one): they can never run here. Each such input's prompts without a result end at once, never
        sent, with error code `wrong_endpoint_kind` and the reason in the export; one line says so.
        True when it failed some."""
        generates = view.is_generation
        if generates is None:
            return False
        embed_ep = ENDPOINTS.index(EMBEDDINGS)
        wrong = [embed_ep] if generates else [i for i in range(len(ENDPOINTS)) if i != embed_ep]
        assert self.store is not None
        with self.store.read():
            spans = self.store.unfinished_of(wrong)
        if not spans:
            return False
        at, run, failed = time.time(), self.config.run, 0
        for ep, span in spans:
            reason = kind_mismatch(ENDPOINTS[ep], generates) or ""

            def line(cid: str, reason: str = reason) -> bytes:
                return cancelled_line(run, cid, at, code=ErrorCode.WRONG_KIND, message=f"not sent: {reason}")

            failed += cancel_prompts(self.r, self.store, self.keys, line, at, span=span).cancelled
        urls = sorted({ENDPOINTS[ep] for ep, _ in spans})
        self.say(f"{failed:,} prompt(s) of run {run} failed without being sent: "
                 f"{kind_mismatch(urls[0], generates)} (export error code {ErrorCode.WRONG_KIND})")
        return True

    def _pause(self) -> None:
        """Until the next pass: `interval_s`, or less when something is pushed to `Keys.wake` (serve stored
        a batch: a high-priority one is fed at once)."""
        if self.redis_down_since is None and not self.stop.is_set():
            try:
                if self.r.blpop([self.keys.wake], timeout=self.interval_s) is not None:
                    self.r.delete(self.keys.wake)
                return
            except (redis.RedisError, OSError):
                pass  # the next pass says it
        self.stop.wait(self.interval_s)

    def _publish(self, counts: dict[str, int], *, changed_only: bool = False) -> None:
        """The store's figures for those without it (the supervisor's ETA counts `store_pending`)."""
        gauges = {STORE_WAITING: counts["waiting"], STORE_PENDING: counts["pending"]}
        if not (changed_only and gauges == self.gauges):
            self.r.hset(self.keys.stats, mapping=gauges)
            self.gauges = gauges

    def _end(self, counts: dict[str, int], cancelled: bool) -> None:
        """The run has ended: its keys expire after `finished_ttl_s` (once; nothing is written again)."""
        if self.ended or counts["prompts"] == 0:
            return
        assert self.store is not None
        mark_ended(self.r, self.keys)
        n = expire_finished(self.r, self.store, self.keys, self.config.finished_ttl_s)
        self.ended = True
        how = f"was cancelled ({counts['cancelled']:,} prompt(s) cancelled)" if cancelled else "has finished"
        self.say(f"run {self.config.run} {how}: {counts['succeeded']:,} succeeded, {counts['failed']:,} failed; its "
                 f"{n:,} key(s) in Redis expire in {self.config.finished_ttl_s:,} s (BATCHFLEET_FINISHED_TTL_S); the "
                 f"store {self.store.path} keeps everything")

    def _open(self) -> bool:
        try:
            loc = locate(self.config, self.r, explicit=self.explicit, access=Access.WRITE)
        except NoStore as exc:
            if not self.waiting_said:
                self.waiting_said = True
                self.say(f"waiting for `producer enqueue`: {exc}")
            return False
        if loc.redis_error is not None:
            loc.store.close()
            raise redis.ConnectionError(loc.redis_error)
        self.store, self.marker = loc.store, loc.marker
        self.feeder = Feeder(self.config, self.r, loc.store)
        self.tenants = TenantBook(self.r, self.keys, loc.store, self.feeder.share)
        self.say(f"run {self.config.run}: store {loc.store.path} ({loc.store.id}); "
                 f"Redis {redacted(self.config.redis_url)}")
        return True

    def _check_marker(self) -> None:
        assert self.store is not None
        try:
            marker = read_marker(self.r, self.keys)
        except RecordError as exc:  # data from Redis: rewrite it from the store, never exit on it
            self.say(f"WARNING: {exc}; rewriting the run marker from the store")
            self.r.delete(self.keys.meta)
            self.marker = ensure_marker(self.r, self.config, self.store)
            return
        if marker is not None and marker.store_id != self.store.id:
            raise StoreError(f"the run marker in Redis now names store {marker.store_id} at {marker.where}, "
                             f"not this head's {self.store.path} ({self.store.id})")
        if marker is None:
            if self.store.in_redis():
                s = recover(self.r, self.store, self.keys)
                self.meter = DrainMeter()
                self.say(f"WARNING: Redis lost the data of run {self.config.run} (its marker {self.keys.meta} was "
                         f"gone: restarted without persistence, or a failover): requeued {s.requeued:,} prompt(s) "
                         f"from the store ({s.lost:,} lost, {s.foreign:,} failed by a foreign worker; "
                         f"{s.in_redis:,} were still in Redis) — what "
                         f"`{repair_command(self.config.run, str(self.store.path.parent))}` does; marker restored")
            marker = ensure_marker(self.r, self.config, self.store)
        self.marker = marker

    def _audit(self) -> None:
        assert self.store is not None
        a = audit(self.r, self.store, self.keys)
        if a.lost:
            s = recover(self.r, self.store, self.keys, foreign=False, found=a)
            if s.lost:
                self.say(f"WARNING: {s.lost:,} fed prompt(s) were nowhere in Redis (deleted, or Redis lost "
                         "writes); requeued them from the store")
        n = a.counts["failed_foreign"]
        if n and n != self.said_foreign:
            where = "; ".join(f"{f['count']} on {f['queue']} by {f['worker']}" for f in a.foreign_by_worker(self.r))
            self.say(f"WARNING: {n:,} prompt(s) were failed by a worker that is not batchfleet's ({where}): start "
                     "workers with RQ_WORKER_CLASS=worker.GPUWorker, stop that one, then requeue them: "
                     f"{repair_command(self.config.run, str(self.store.path.parent))}")
        self.said_foreign = n


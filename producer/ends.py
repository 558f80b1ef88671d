"""How a run ends: cancelled, purged, or finished (its keys expire); and failed jobs kept lean.

**Cancel** (`producer cancel`: the whole run; `cancel_prompts` with a `Span`: a part of it, e.g. one
`batchfleet serve` batch, while the rest runs on). In this order, each step safe to repeat (run it
again after a crash):

  1. the store marks every WAITING prompt (of the span) CANCELLED (the head never feeds it); a
     whole run is marked cancelled (`cancelled_at`: the head feeds nothing more);
  2. a whole run's cancel flag `Keys.cancel` is set: each worker of the run, when it next checks (the
     announcement of step 4, else its lease beat), stops claiming, cancels its in-flight requests
     (aborted in the server by their rids; their HTTP connections close), releases their leases
     without putting them back, publishes nothing for them, and acknowledges (`ack:<worker>` =
     prompts it dropped);
  3. `scripts.CANCEL` removes each fed prompt's job atomically: queued (its queue, `suspects`, `isolate`),
     started (its leases and started-registry entries: a late finish of it is refused as stale) or
     failed without a result; a job whose result is in the stream is left to be collected;
  4. the job ids of those that were in flight go into `Keys.drop` and `{"drop": n}` is published on
     `Keys.signals` (`announce_drop`): the workers running them drop them at once (see keys.py);
  5. results already in the stream are collected (they stay, and export as they are);
  6. the store marks the FED prompts (of the span) still without a result CANCELLED, and their jobs
     are removed once more (a head in the middle of a feed pass when the flag went up);
  7. a whole run: it waits (bounded) for the acknowledgements of the run's live workers, and the run
     has ended: its keys get their end-of-run TTL (below), head or no head.

A cancelled prompt's export line is `error.code == "cancelled"` (a serve batch's: OpenAI's
`batch_cancelled` or `batch_expired`): results == prompts still holds. A result that arrives anyway
(a worker that finished before it saw the flag) replaces that line in the store; a serve batch's
output files were written when its cancel ended and do not change.

**Purge** (`producer purge RUN --yes`): every key of the run, found with SCAN (never KEYS): the
run's RQ jobs (their `data` ends with the run's name, see `feed`), their entries in queues and RQ's
started/failed registries, the queues left empty in `rq:queues`, and `bf:<run>:*`. Refused while
live workers of the run report (their status records), unless `--force`. RQ's records of the run's
dead workers (`rq:worker:<name>` of workers that served only the run's queues) go too.

**Finished**: once every prompt has its result in the store (nothing pending), the head sets a TTL
(config `finished_ttl_s`, BATCHFLEET_FINISHED_TTL_S, default 7 days) on every key of
`Keys.run_keys` and on the run's failed jobs (and their failed-registry scores), never lengthening a
shorter one. The marker expires too; the store knows the run has nothing in Redis to lose, so a
missing marker is then not taken for a Redis that lost data (see `locate`).

**Failed jobs**: once a failed prompt's result is collected, its job's `data` is trimmed to a stub
(custom_id, seq, run; `trimmed` = the original size): the store holds the prompt. `rq requeue` still
works: a worker that claims a trimmed job puts its custom_id on `Keys.refeed` and the head feeds the
prompt again from the store.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson
import redis

from batchfleet.config import Config
from batchfleet.connection import redacted
from batchfleet.errors import ErrorCode
from batchfleet.fleetview import read_fleet_view
from batchfleet.jobs import job_id_for, run_suffix
from batchfleet.keys import DROP_TTL_S, RQ_JOB_PREFIX, RQ_QUEUES, RQ_WORKER_PREFIX, RQ_WORKERS, Keys, valid_queue_name
from batchfleet.marker import FINISHED, read_marker
from batchfleet.records import RecordError
from batchfleet.rqlayout import execution_job

from .collect import collect_once
from .scripts import CANCEL, EXPIRE, EXPIRE_FAILED, RUN_JOBS
from .store import Span, State, Store

__all__ = ["CANCELLED", "CancelSummary", "PurgeRefused", "PurgeSummary", "announce_drop", "cancel", "cancel_prompts",
           "cancelled_line", "expire_finished", "live_workers", "mark_ended", "purge", "refeed", "run_cancel",
           "run_purge"]

CANCELLED = ErrorCode.CANCELLED  # the export's error code of a cancelled prompt
PAGE = 1000

def cancelled_line(run: str, cid: str, at: float, *, code: str = CANCELLED, message: str | None = None) -> bytes:
    """The export line of a prompt cancelled before it had a result (`code` and `message`: a serve
    batch's own, in OpenAI's words)."""
    jid = job_id_for(run, cid)
    if message is None:
        message = (f"run {run} was cancelled (producer cancel) at "
                   f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(at))} before this prompt had a result")
    return orjson.dumps({"id": f"batch_req_{jid}", "custom_id": cid, "response": None,
                         "error": {"code": code, "message": message}})


def live_workers(r: redis.Redis, keys: Keys) -> list[str]:
    """Names of the run's live workers (`batchfleet.fleetview`: the newest record of each queue)."""
    return [w.worker for w in read_fleet_view(r, keys).live]


# --- cancel -----------------------------------------------------------------------------------------
@dataclass
class CancelSummary:
    cancelled: int = 0  # prompts marked CANCELLED in the store
    removed: dict[str, int] = field(default_factory=dict)  # queued / started / failed jobs removed from Redis
    collected: int = 0  # results that were in Redis already: kept
    acked: list[str] = field(default_factory=list)  # live workers that confirmed they dropped the run's prompts
    silent: list[str] = field(default_factory=list)  # live workers that did not confirm in time
    dropped: int = 0  # in-flight prompts the workers said they dropped


def _remove_jobs(r: redis.Redis, keys: Keys, cids: Iterable[str], into: dict[str, int],
                 started: list[str] | None = None) -> None:
    """Remove these prompts' jobs (`scripts.CANCEL`), counting them by where they were into `into`; the
    job ids of those in flight (started) go to `started`."""
    names = {"q": "queued", "s": "in_flight", "f": "failed", "d": "done", "m": "missing"}
    batch: list[str] = []

    def go() -> None:
        codes = CANCEL.call(r, keys={"done": keys.done, "strikes": keys.strikes, "suspects": keys.suspects,
                                     "isolate": keys.isolate, "leases": keys.leases,
                                     "jobs": [k for j in batch for k in (Keys.job(j), Keys.rq_results(j))]})
        for jid, c in zip(batch, codes.decode(), strict=True):
            into[names[c]] = into.get(names[c], 0) + 1
            if c == "s" and started is not None:
                started.append(jid)
        batch.clear()

    for cid in cids:
        batch.append(job_id_for(keys.run, cid))
        if len(batch) >= PAGE:
            go()
    if batch:
        go()


def announce_drop(r: redis.Redis, keys: Keys, job_ids: list[str]) -> None:
    """Tell the run's workers to drop these prompts in flight: their job ids into `Keys.drop` (its TTL
    renewed), then `{"drop": n}` on `Keys.signals` (see keys.py)."""
    if not job_ids:
        return
    pipe = r.pipeline(transaction=False)
    for i in range(0, len(job_ids), PAGE):
        pipe.sadd(keys.drop, *job_ids[i : i + PAGE])
    pipe.expire(keys.drop, DROP_TTL_S)
    pipe.publish(keys.signals, orjson.dumps({"drop": len(job_ids)}))
    pipe.execute()


def cancel_prompts(r: redis.Redis, store: Store, keys: Keys, line_for: Callable[[str], bytes], at: float, *,
                   span: Span | None = None) -> CancelSummary:
    """Steps 1-6 of the module doc for the prompts of `span` (None: the whole run, flag included):
    every one without a result ends CANCELLED with `line_for(cid)` as its export line."""
    out = CancelSummary()
    with store.write():
        first = store.cancel([State.WAITING], line_for, at, span=span)
    if span is None:
        r.hset(keys.cancel, "at", repr(at))
    with store.read():
        fed = store.fed_cids(span)
    removed: dict[str, int] = {}
    in_flight: list[str] = []
    _remove_jobs(r, keys, [*(cid for _, cid in first), *fed], removed, in_flight)
    announce_drop(r, keys, in_flight)

    got = collect_once(r, store, keys)
    out.collected = got.stored
    with store.write():
        rest = store.cancel([State.FED, State.WAITING], line_for, at, span=span)
    in_flight = []
    _remove_jobs(r, keys, (cid for _, cid in rest), {}, in_flight)
    announce_drop(r, keys, in_flight)
    out.cancelled = len(first) + len(rest)
    out.removed = {k: removed[k] for k in ("queued", "in_flight", "failed") if removed.get(k)}
    return out


def cancel(r: redis.Redis, store: Store, keys: Keys, *, wait_s: float = 30.0, poll_s: float = 0.25,
           ttl_s: int | None = None) -> CancelSummary:
    """Cancel the run (see the module doc). `ttl_s`: then give the run's keys their end-of-run TTL (as
    the head does once it sees the run ended), so they expire even without a head."""
    at = time.time()
    run = keys.run

    def line(cid: str) -> bytes:
        return cancelled_line(run, cid, at)

    out = cancel_prompts(r, store, keys, line, at)
    deadline = time.monotonic() + wait_s
    while True:
        live = live_workers(r, keys)
        acks = {k.decode(errors="replace")[len(Keys.CANCEL_ACK_PREFIX):]: int(v)
                for k, v in r.hgetall(keys.cancel).items() if k.startswith(Keys.CANCEL_ACK_PREFIX.encode())}
        out.acked = [w for w in live if w in acks]
        out.silent = [w for w in live if w not in acks]
        out.dropped = sum(acks.values())
        if not out.silent or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if ttl_s is not None:
        mark_ended(r, keys)
        expire_finished(r, store, keys, ttl_s)
    return out


def mark_ended(r: redis.Redis, keys: Keys) -> None:
    """Say in the run marker that the run ended: its keys expire, and a missing marker is then no loss."""
    if r.exists(keys.meta):
        r.hset(keys.meta, FINISHED, repr(time.time()))


# --- purge ------------------------------------------------------------------------------------------
class PurgeRefused(Exception):
    """Live workers of the run report: purging under them would strand their prompts."""


@dataclass
class PurgeSummary:
    jobs: int = 0  # RQ job hashes of the run deleted
    keys: int = 0  # bf:<run>:* keys deleted
    queues: list[str] = field(default_factory=list)  # queues the run's jobs were on
    workers: int = 0  # RQ's records of the run's dead workers deleted


def run_jobs(r: redis.Redis, run: str) -> dict[str, str]:
    """job id -> origin queue, of every RQ job of the run in Redis (SCAN over rq:job:*)."""
    suffix = run_suffix(run)
    out: dict[str, str] = {}
    batch: list[bytes] = []
    for key in r.scan_iter(match=RQ_JOB_PREFIX + "*", count=PAGE):
        batch.append(key)
        if len(batch) >= PAGE:
            out.update(_match(r, batch, suffix))
            batch = []
    if batch:
        out.update(_match(r, batch, suffix))
    return out


def _match(r: redis.Redis, batch: list[bytes], suffix: bytes) -> dict[str, str]:
    raw = RUN_JOBS.call(r, keys={"jobs": batch}, args={"suffix": suffix})
    return {raw[i].decode()[len(RQ_JOB_PREFIX):]: raw[i + 1].decode(errors="replace") for i in range(0, len(raw), 2)}


def purge(r: redis.Redis, keys: Keys, *, force: bool = False, queues: Iterable[str] = ()) -> PurgeSummary:
    """Delete every key of the run (see the module doc). Raises PurgeRefused while its workers live."""
    live = live_workers(r, keys)
    if live and not force:
        raise PurgeRefused(f"{len(live)} live worker(s) of run {keys.run} report ({', '.join(live[:5])}): stop them "
                           "first, or --force")
    out = PurgeSummary()
    jobs = run_jobs(r, keys.run)
    qs = sorted({*(q for q in jobs.values() if valid_queue_name(q)), *(q for q in queues if valid_queue_name(q))})
    out.queues = qs
    ids = list(jobs)
    for i in range(0, len(ids), PAGE):
        part = ids[i : i + PAGE]
        pipe = r.pipeline(transaction=False)
        for jid in part:
            q = jobs[jid]
            if valid_queue_name(q):
                pipe.lrem(Keys.queue(q), 0, jid)
                pipe.zrem(Keys.failed(q), jid)
        pipe.delete(*(Keys.job(j) for j in part), *(Keys.rq_results(j) for j in part))
        pipe.execute()
    out.jobs = len(ids)
    mine = set(ids)
    for q in qs:  # started-registry members are "<job id>:<execution>"
        members = [m for m in r.zrange(Keys.started(q), 0, -1)
                   if execution_job(m) in mine]
        if members:
            r.zrem(Keys.started(q), *members)
        if not r.exists(Keys.queue(q), Keys.started(q), Keys.failed(q)):
            r.srem(RQ_QUEUES, Keys.queue(q))
    out.workers = _purge_dead_workers(r, set(qs), force=force)
    batch: list[bytes] = []
    for key in r.scan_iter(match=keys.pattern, count=PAGE):
        batch.append(key)
        if len(batch) >= PAGE:
            out.keys += r.unlink(*batch)
            batch = []
    if batch:
        out.keys += r.unlink(*batch)
    return out


def _purge_dead_workers(r: redis.Redis, queues: set[str], *, force: bool) -> int:
    """RQ's records (`rq:worker:<name>`, and its entries in `rq:workers`, `rq:workers:<queue>`) of workers
    that served only the run's queues and stopped (kept a minute by RQ) — with `force`, also of those that
    did not say so (killed: the caller says they are gone)."""
    if not queues:
        return 0
    n = 0
    for key in r.scan_iter(match=RQ_WORKER_PREFIX + "*", count=PAGE):
        served, death = r.hmget(key, "queues", "death")
        names = {q for q in (served or b"").decode(errors="replace").split(",") if q}
        if (death is not None or force) and names and names <= queues:
            pipe = r.pipeline(transaction=False)
            pipe.delete(key)
            pipe.srem(RQ_WORKERS, key)
            for q in names:
                pipe.srem(RQ_WORKERS + ":" + q, key)
            n += pipe.execute()[0]
    return n


# --- finished ---------------------------------------------------------------------------------------
def expire_finished(r: redis.Redis, store: Store, keys: Keys, ttl_s: int) -> int:
    """Give the finished run's keys and failed jobs `ttl_s` to live (never longer than they had).
    Returns how many keys got a TTL."""
    existing = [k for k, e in zip(keys.run_keys(), _exists(r, keys.run_keys()), strict=True) if e]
    n = int(EXPIRE.call(r, keys={"targets": existing}, args={"ttl": ttl_s})) if existing else 0
    after = 0
    while True:
        with store.read():
            rows = store.db.execute("SELECT p.seq, p.cid FROM prompts p JOIN results r ON r.seq = p.seq "
                                    "WHERE r.ok = 0 AND p.seq > ? ORDER BY p.seq LIMIT ?", (after, PAGE)).fetchall()
        if not rows:
            return n
        n += int(EXPIRE_FAILED.call(r, keys={"jobs": [Keys.job(job_id_for(keys.run, cid)) for _, cid in rows]},
                                    args={"ttl": ttl_s}))
        after = rows[-1][0]


def _exists(r: redis.Redis, names: list[str]) -> list[int]:
    pipe = r.pipeline(transaction=False)
    for k in names:
        pipe.exists(k)
    return pipe.execute()


# --- failed jobs ------------------------------------------------------------------------------------
def refeed(r: redis.Redis, store: Store, keys: Keys) -> int:
    """Trimmed failed jobs brought back by `rq requeue` (workers list their custom_ids in `refeed`):
    their prompts go back to WAITING, and the next feed pass writes their jobs in full. Returns how many."""
    n = 0
    while True:
        raw = r.lrange(keys.refeed, 0, PAGE - 1)
        if not raw:
            return n
        with store.write():
            n += store.refeed([c.decode(errors="replace") for c in raw])
        r.ltrim(keys.refeed, len(raw), -1)  # only once stored: a crash in between feeds them next time


# --- the commands -----------------------------------------------------------------------------------
def run_cancel(config: Config, r: redis.Redis, *, explicit: bool, wait_s: float) -> int:
    """`producer cancel`: exit 0 when cancelled and every live worker confirmed; 1 when some did not."""
    from .locate import Access, locate

    r.ping()
    loc = locate(config, r, explicit=explicit, access=Access.WRITE)
    keys = Keys(config.run)
    try:
        s = cancel(r, loc.store, keys, wait_s=wait_s, ttl_s=config.finished_ttl_s)
        with loc.store.read():
            counts = loc.store.counts()
    finally:
        loc.store.close()
    removed = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in s.removed.items()) or "none"
    print(f"cancelled run {config.run}: {s.cancelled:,} prompt(s) cancelled (jobs removed from Redis: {removed}); "
          f"{counts['succeeded']:,} succeeded and {counts['failed']:,} failed before that, kept "
          f"({s.collected:,} collected just now); export writes one line per prompt, the cancelled ones with "
          f"error code {CANCELLED!r}")
    if s.acked:
        print(f"{len(s.acked)} live worker(s) dropped {s.dropped:,} in-flight prompt(s) and take no more work of "
              "this run")
    if s.silent:
        print(f"{len(s.silent)} live worker(s) did not confirm within {wait_s:g} s ({', '.join(s.silent[:5])}): "
              "their leases are gone, they drop what they run at their next lease beat", file=sys.stderr)
        return 1
    return 0


def run_purge(config: Config, r: redis.Redis, target: str, *, yes: bool, force: bool) -> int:
    """`producer purge RUN`: exit 0 purged; 2 refused (no --yes, or live workers without --force)."""
    if not yes:
        keys = Keys(target)
        jobs = run_jobs(r, target)
        n = sum(1 for _ in r.scan_iter(match=keys.pattern, count=PAGE))
        print(f"producer: purge would delete every key of run {target} in Redis ({redacted(config.redis_url)}): "
              f"{len(jobs):,} RQ job(s) and {n:,} bf:{target}:* key(s); the store is not touched. Run again with "
              "--yes to do it", file=sys.stderr)
        return 2
    keys = Keys(target)
    try:
        marker = read_marker(r, keys)
    except RecordError:
        marker = None
    try:
        s = purge(r, keys, force=force, queues=marker.queues if marker else ())
    except PurgeRefused as exc:
        print(f"producer: refusing to purge: {exc}", file=sys.stderr)
        return 2
    print(f"purged run {target}: {s.jobs:,} RQ job(s), {s.keys:,} bf:{target}:* key(s)"
          + (f"; queues {', '.join(s.queues)}" if s.queues else "")
          + (f"; its store {marker.where} is kept" if marker else ""))
    return 0

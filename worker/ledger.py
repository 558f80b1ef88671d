"""The worker's Redis bookkeeping, batched: claim, finish, lease renewal, hand-back, recovery, and
the strikes a server death gives the prompts that were inside it.

A stock RQ worker spends ~16 round trips per job; here each operation is one Lua script call for a
whole batch of jobs, atomic in Redis (`worker/lua/*.lua`, declared below). Jobs stay in RQ's own
structures (queues, job hashes, started and failed registries) so `rq info` and `rq requeue` keep
working. What RQ lacks is a fast way to notice a dead worker (minutes), so every claimed job also
holds a short lease in `Keys.leases`: a worker renews its leases every few seconds; any worker puts a
lapsed lease's job back. A finish is accepted only while its lease is held, so a job recovered from a
stalled worker can never produce two results.

**Clocks.** Every lease expiry, lapse decision and registry score is computed INSIDE the scripts
from Redis's own `TIME`: workers on many hosts never compare their clocks with each other's. A
worker's clock only stamps informational fields (a result's `finished_at`, its status record).

**Poison prompts.** A prompt that kills its server would be handed back forever and carried to
every GPU. So when a server dies (or hangs and is killed), the prompts that were inside it get a
strike, counted in `Keys.strikes` (it outlives any worker), atomically with putting them back:

    strikes 0 -> its queue            (ordinary hand-back: shutdown, restart, worker death)
    strikes 1 -> Keys.suspects        a worker runs ONE GROUP of suspects at a time beside its normal
                                      work (see `dispatcher`): a struck set runs at the fleet's pace
    strikes 2 -> Keys.isolate         a worker reserves it, lets its other prompts finish, runs it
                                      alone, then resumes
    strike MAX_STRIKES, and it was alone in the server -> quarantined: failed with `server_crash`,
                                      the reason and the server log's tail; never run again

A death strikes the suspects of one group at most (a worker takes a new group only when its last one
has finished), so only those go on to run alone: a poison prompt costs three deaths (the one that
struck it, its group's, its own alone). A prompt that was not alone is never struck past
MAX_STRIKES - 1, so a bystander can never be failed for sharing a batch with a poison. A worker
killed with -9 is not a server death: its leases lapse and its prompts go back with the strikes they
had.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import redis
import redis.asyncio as aioredis

from batchfleet import keys
from batchfleet.backoff import backoff_s
from batchfleet.keys import Keys
from batchfleet.records import Result
from batchfleet.scripts import Each, Script

from .redislink import guarded

__all__ = ["MAX_STRIKES", "Claim", "ClaimKind", "DeathOutcome", "Ledger"]

log = logging.getLogger("batchfleet.worker.ledger")

MAX_STRIKES = 3  # server deaths (the last one alone) after which a prompt is quarantined
# A finish waits up to this long for others to share its script call (its slot is free already; only
# the results stream waits, and a lease covers 15 s). At 1,000 prompts/s: ~100 per call instead of 1.
# A worker killed with -9 loses at most this much finished work: those prompts' leases lapse and they
# run again (never twice in the export: their results were never written).
FLUSH_GATHER_S = 0.1
FLUSH_GATHER_MAX = 200

# The ledger's scripts (worker/lua/*.lua; see batchfleet.scripts). Every key arrives in KEYS but those
# of jobs a script finds inside: `claim` pops job ids from lists, `recover` reads them from lapsed leases.
CLAIM = Script("worker", "claim",
               keys=("leases", "suspects", "isolate", Each("queues")),
               argv=("n", "session", "lease_ttl", "started_ttl", "worker", "suspects_n", "suspects_dry", "take_solo",
                     Each("queue_names", "name", "keep")),  # parallel to queues
               derives=("job_key", "started_key"))
RENEW = Script("worker", "renew", keys=("leases",), argv=("lease_ttl", "session", Each("jids")))
FINISH = Script("worker", "finish",
                keys=("leases", "results", "done", "stats", "strikes", Each("jobs"),
                      Each("registries", "started", "failed")),  # once per origin, as in `origins`
                argv=("session", "failure_ttl", Each("origins"), Each("outcomes", "meta", "payload")))
RELEASE = Script("worker", "release",
                 keys=("leases", "stats", "strikes", "suspects", "isolate", Each("jobs", "job", "started", "queue")),
                 argv=("session", Each("jids")), include=("requeue",))
RECOVER = Script("worker", "recover", keys=("leases", "stats", "strikes", "suspects", "isolate"),
                 derives=("job_key", "started_key", "queue_key"), include=("requeue",))
DEATH = Script("worker", "death",
               keys=("leases", "stats", "strikes", "suspects", "isolate", "results", "done",
                     Each("jobs", "job", "started", "queue", "failed")),
               argv=("session", "failure_ttl", "strikes_ttl", "max_strikes",
                     Each("entries", "jid", "inside", "result", "exc_info")),
               include=("requeue",))
DROP = Script("worker", "drop", keys=("leases", Each("jobs", "job", "started")), argv=("session", Each("jids")))
REFEED = Script("worker", "refeed", keys=("leases", "refeed", "job", "started"), argv=("session", "jid", "cid"))


class ClaimKind(StrEnum):
    """Where a claimed job came from, which says how it may run."""

    NORMAL = "normal"  # a queue: runs beside anything
    SUSPECT = "suspect"  # one strike: runs in a group, one group per worker at a time
    SOLO = "solo"  # two strikes: runs alone in its server


_KINDS = {kind.value.encode(): kind for kind in ClaimKind}  # as `claim.lua` names them


@dataclass(slots=True)
class Claim:
    """A job this worker holds the lease of."""

    jid: str
    origin: str
    data: bytes
    kind: ClaimKind = ClaimKind.NORMAL
    claimed_at: float = 0.0  # time.monotonic()
    grp: bytes = b""  # its unit of the prefix plan (producer/plan.py), b"" for none


@dataclass(slots=True)
class _Finish:
    """One final outcome, as `finish.lua` takes it: its two arguments, packed when it finished."""

    claim: Claim
    meta: bytes  # b"<s|f|r> <completion tokens> <bytes of exc_info> <origin>"
    payload: bytes  # exc_info (utf-8) followed by the result JSON

    @classmethod
    def of(cls, claim: Claim, code: bytes, result_json: bytes, exc_string: str, tokens: int) -> _Finish:
        exc = exc_string.encode("utf-8", "replace")
        return cls(claim, b"%s %d %d %s" % (code, tokens, len(exc), claim.origin.encode()), exc + result_json)


@dataclass(frozen=True, slots=True)
class DeathOutcome:
    """What one server death did to the prompts that were in this worker's hands."""

    quarantined: list[str]
    struck: int
    handed_back: int
    stale: int


class Ledger:
    """Batched Redis bookkeeping for one worker process."""

    def __init__(self, client: aioredis.Redis, keyspace: Keys, *, worker: str, lease_ttl_s: float) -> None:
        self.r = client
        self.k = keyspace
        self.worker = worker
        self.lease_ttl_s = lease_ttl_s
        # One lease per (job, worker process): the session is the execution id of its member
        # (`batchfleet.rqlayout.execution_member`), made in the scripts.
        self.session = uuid.uuid4().hex[:12]
        self.held: dict[str, Claim] = {}
        self._pending: list[_Finish] = []
        # Jobs whose finish is on its way to Redis: `finish.lua` removes their leases, so a renewal
        # that reaches Redis after it finds them gone, and they are not lost.
        self._finishing: set[str] = set()
        self._wake = asyncio.Event()
        self._closing = False
        self.results_backlog = 0  # entries waiting in the results stream, as last seen
        # bytes and number of the results this worker queued for the stream: their mean sizes the backlog;
        # and how many of them are not in the stream yet (pending, or in a flush on its way)
        self.result_bytes = 0
        self.results_written = 0
        self._unwritten = 0
        self.stale = 0  # finishes refused because the lease had lapsed
        k = keyspace
        # the KEYS of every script that puts jobs back where their strikes say
        self._requeue_keys = {"leases": k.leases, "stats": k.stats, "strikes": k.strikes, "suspects": k.suspects,
                              "isolate": k.isolate}

    # --- claim -------------------------------------------------------------------------------------
    async def claim(self, n: int, queues: list[str], *, keep: Mapping[str, int] | None = None, suspects: int = 0,
                    suspects_dry: int | None = None, take_solo: bool = False) -> list[Claim]:
        """Up to `n` jobs: first (if asked) one prompt that must run alone, which then comes alone;
        else a group of up to `suspects` suspects (0: none), then the queues in order (of a queue in
        `keep`, at most half of what it holds beyond that many); slots the queues left empty go to more
        suspects, up to `suspects_dry` in the group (default `suspects`)."""
        if (n <= 0 or not queues) and not take_solo:
            return []
        group = max(suspects, 0)
        group_dry = max(group, suspects_dry or 0) if group else 0
        raw = await CLAIM.acall(
            self.r, keys={"leases": self.k.leases, "suspects": self.k.suspects, "isolate": self.k.isolate,
                          "queues": [Keys.queue(q) for q in queues]},
            args={"n": max(n, 0), "session": self.session, "lease_ttl": self.lease_ttl_s,
                  "started_ttl": keys.STARTED_REGISTRY_TTL_S, "worker": self.worker, "suspects_n": group,
                  "suspects_dry": group_dry, "take_solo": int(take_solo),
                  "queue_names": [x for q in queues for x in (q, (keep or {}).get(q, -1))]})
        now = time.monotonic()
        claims = []
        for i in range(0, len(raw), 5):
            c = Claim(jid=raw[i].decode(), origin=raw[i + 1].decode(), data=raw[i + 2],
                      kind=_KINDS[raw[i + 3]], claimed_at=now, grp=raw[i + 4])
            self.held[c.jid] = c
            claims.append(c)
        return claims

    # --- finish (batched) --------------------------------------------------------------------------
    def finish(self, claim: Claim, result: Result, exc_string: str = "") -> None:
        """Queue a final outcome; the flusher writes it with others in one script call."""
        payload = result.to_json()
        self.result_bytes += len(payload)
        self.results_written += 1
        self._unwritten += 1
        self._pending.append(_Finish.of(claim, b"s" if result.ok else b"f", payload, exc_string,
                                        result.completion_tokens))
        self._wake.set()

    @property
    def backlog_bytes(self) -> int:
        """About how many bytes of results the stream holds, with this worker's on their way to it: (its
        length as last seen + this worker's results not in it yet) x the mean size of this worker's results (a
        run's results are of one kind; no O(n) call to Redis). 0 before its first result."""
        if not self.results_written:
            return 0
        return (self.results_backlog + self._unwritten) * self.result_bytes // self.results_written

    def refuse(self, claim: Claim, reason: str) -> None:
        """Fail a job no worker of this run may run: RQ's failed registry (`rq requeue` brings it
        back), a `refused` count, and NO result: it never becomes a line of this run's export."""
        self._pending.append(_Finish.of(claim, b"r", b"", f"refused: {reason}", 0))
        self._wake.set()

    async def run_flusher(self) -> None:
        """Write queued outcomes as they come: batches form naturally while a call is in flight.
        Ends after `close()` once nothing is pending. (Stopped by a flag, not by cancellation:
        redis-py can swallow a CancelledError that lands inside a command, and the task would
        never end.)"""
        while not (self._closing and not self._pending):
            await self._wake.wait()
            if not self._closing and len(self._pending) < FLUSH_GATHER_MAX:
                await asyncio.sleep(FLUSH_GATHER_S)  # let a few more finish: one script call for all
            self._wake.clear()
            if not await guarded(f"writing {len(self._pending)} outcome(s)", self.flush):
                await asyncio.sleep(1.0)  # Redis away: the outcomes are kept; retry
                self._wake.set()

    def close(self) -> None:
        """Let `run_flusher` end once it has written what is pending."""
        self._closing = True
        self._wake.set()

    async def write_out(self, *, within_s: float) -> int:
        """At exit, after `run_flusher`: write what is still pending, retrying while Redis is away for up
        to `within_s` (a finish is accepted only while its lease is held). What cannot be written is
        said in one line, with how many: those prompts' leases lapse and they run again elsewhere.
        Returns how many outcomes were not written."""
        deadline = time.monotonic() + within_s
        failures = 0
        while self._pending:
            try:
                await self.flush()
            except (redis.RedisError, OSError) as exc:
                failures += 1
                wait_s = backoff_s(failures, base_s=0.25, max_s=2.0)
                if time.monotonic() + wait_s > deadline:
                    log.error("could not write the outcome of %d finished prompt(s) to Redis before exiting "
                              "(%s: %s): their leases lapse and they run again on another worker",
                              len(self._pending), type(exc).__name__, str(exc)[:160])
                    return len(self._pending)
                await asyncio.sleep(wait_s)
        return 0

    async def flush(self) -> None:
        """Write the outcomes pending now (500 a call). Those that come while it writes wait for the
        next flush, so that they gather into one call instead of trickling out a few per call."""
        todo, self._pending = self._pending, []
        while todo:
            batch, todo = todo[:500], todo[500:]
            jobs: list[str] = []
            outcomes: list[bytes] = []
            origins: dict[str, None] = {}
            for f in batch:
                jobs.append(Keys.job(f.claim.jid))
                outcomes += (f.meta, f.payload)
                origins[f.claim.origin] = None
            finishing = [f.claim.jid for f in batch]
            self._finishing.update(finishing)
            try:
                stale, backlog = await FINISH.acall(
                    self.r, keys={"leases": self.k.leases, "results": self.k.results, "done": self.k.done,
                                  "stats": self.k.stats, "strikes": self.k.strikes, "jobs": jobs,
                                  "registries": [k for o in origins for k in (Keys.started(o), Keys.failed(o))]},
                    args={"session": self.session, "failure_ttl": keys.FAILURE_TTL_S, "origins": list(origins),
                          "outcomes": outcomes})
            except BaseException:
                # keep them, first; the next flush retries (leases keep the jobs safe)
                self._pending[:0] = batch + todo
                raise
            finally:
                self._finishing.difference_update(finishing)
            for f in batch:
                self.held.pop(f.claim.jid, None)
            self._unwritten -= sum(1 for f in batch if f.meta[:1] != b"r")
            self.results_backlog = int(backlog)
            if stale:
                self.stale += len(stale)
                cancelled = await self._cancelled([j.decode() for j in stale])
                if cancelled:
                    log.info("%d finished prompt(s) were cancelled meanwhile; dropped", cancelled)
                if len(stale) > cancelled:
                    log.warning("%d finished prompt(s) were already recovered by another worker; dropped",
                                len(stale) - cancelled)

    async def _cancelled(self, jids: list[str]) -> int:
        """How many of these jobs were cancelled (`Keys.drop`): a refused finish of theirs is no sign of
        another worker."""
        try:
            return sum(1 for f in await self.r.smismember(self.k.drop, jids) if f)
        except (redis.RedisError, OSError):
            return 0

    async def refresh_backlog(self) -> int:
        """How long the results stream is now (a paused worker asks while it waits for the collector)."""
        self.results_backlog = int(await self.r.xlen(self.k.results))
        return self.results_backlog

    # --- leases --------------------------------------------------------------------------------------
    async def renew(self) -> list[str]:
        """Extend every lease this worker holds, on Redis's clock. Returns the jids whose lease is no
        longer held (it lapsed and another worker requeued the job): they are forgotten here. A job
        whose finish was written meanwhile (its lease removed with it) is not among them."""
        if not self.held:
            return []
        gone = await RENEW.acall(self.r, keys={"leases": self.k.leases},
                                 args={"lease_ttl": self.lease_ttl_s, "session": self.session, "jids": list(self.held)})
        lost = [jid for jid in (j.decode() for j in gone) if jid in self.held and jid not in self._finishing]
        for jid in lost:
            del self.held[jid]
        return lost

    async def hand_back(self, claims: list[Claim]) -> int:
        """Put jobs this worker holds back where their strikes say (shutdown, restart). If Redis
        refuses, they are forgotten all the same: their leases lapse and any worker requeues them,
        rather than a lease renewed forever for a prompt nobody runs."""
        if not claims:
            return 0
        try:
            jobs = [k for c in claims for k in (Keys.job(c.jid), Keys.started(c.origin), Keys.queue(c.origin))]
            out = await RELEASE.acall(self.r, keys={**self._requeue_keys, "jobs": jobs},
                                      args={"session": self.session, "jids": [c.jid for c in claims]})
        finally:
            for c in claims:
                self.held.pop(c.jid, None)
        return len(out)

    async def drop(self, claims: list[Claim]) -> int:
        """The run was cancelled: release these jobs' leases and delete them, publishing nothing (the
        producer marks their prompts cancelled). Forgotten here whatever Redis says."""
        if not claims:
            return 0
        try:
            jobs = [k for c in claims for k in (Keys.job(c.jid), Keys.started(c.origin))]
            return int(await DROP.acall(self.r, keys={"leases": self.k.leases, "jobs": jobs},
                                        args={"session": self.session, "jids": [c.jid for c in claims]}))
        finally:
            for c in claims:
                self.held.pop(c.jid, None)

    async def refeed(self, claim: Claim, cid: str) -> bool:
        """A trimmed failed job (its prompt is only in the store) was requeued: hand its custom_id to
        the head, which feeds the prompt again; the job itself is deleted."""
        try:
            return bool(await REFEED.acall(
                self.r, keys={"leases": self.k.leases, "refeed": self.k.refeed, "job": Keys.job(claim.jid),
                              "started": Keys.started(claim.origin)},
                args={"session": self.session, "jid": claim.jid, "cid": cid}))
        finally:
            self.held.pop(claim.jid, None)

    async def recover_lapsed(self) -> list[str]:
        """Requeue the jobs of workers that stopped renewing (killed, frozen, network-split)."""
        out = await RECOVER.acall(self.r, keys=self._requeue_keys)
        return [j.decode() for j in out]

    # --- server death ----------------------------------------------------------------------------------
    async def after_server_death(self, inside: list[tuple[Claim, Result | None]], outside: list[Claim], *,
                                 exc_string: str, retry_for_s: float | None = None) -> DeathOutcome:
        """One atomic call: a strike for each job that was inside the dead server (quarantine for
        one alone at its MAX_STRIKES-th death, with its `Result`), the others back untouched.

        The strikes matter, so a Redis error is retried for up to `retry_for_s` (default: a lease)
        while the leases are still renewed; after that the jobs are forgotten and their leases lapse
        (they come back with the strikes they had)."""
        claims = [c for c, _ in inside] + outside
        if not claims:
            return DeathOutcome([], 0, 0, 0)
        entries: list[object] = []
        for claim, result in inside:
            entries += (claim.jid, "1", result.to_json() if result is not None else b"", exc_string)
        for claim in outside:
            entries += (claim.jid, "0", b"", "")
        jobs = [k for c in claims for k in (Keys.job(c.jid), Keys.started(c.origin), Keys.queue(c.origin),
                                            Keys.failed(c.origin))]
        script_keys = {**self._requeue_keys, "results": self.k.results, "done": self.k.done, "jobs": jobs}
        script_args = {"session": self.session, "failure_ttl": keys.FAILURE_TTL_S, "strikes_ttl": keys.STRIKES_TTL_S,
                       "max_strikes": MAX_STRIKES, "entries": entries}
        deadline = time.monotonic() + (self.lease_ttl_s if retry_for_s is None else retry_for_s)
        failures = 0
        try:
            while True:
                try:
                    quarantined, struck, handed, stale = await DEATH.acall(self.r, keys=script_keys, args=script_args)
                    break
                except (redis.RedisError, OSError) as exc:
                    failures += 1
                    wait_s = backoff_s(failures, base_s=0.25, max_s=2.0)
                    if time.monotonic() + wait_s > deadline:
                        log.error("could not record the server death in Redis (%s): %d prompt(s) forgotten; "
                                  "their leases lapse and they run again", exc, len(claims))
                        raise
                    log.warning("recording the server death in Redis failed (%s); retrying", exc)
                    await asyncio.sleep(wait_s)
        finally:
            for c in claims:
                self.held.pop(c.jid, None)
        return DeathOutcome([j.decode() for j in quarantined], int(struck), int(handed), int(stale))

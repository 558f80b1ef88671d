"""The worker's Redis bookkeeping, batched: claim, finish, lease renewal, hand-back, recovery, and
the strikes a server death gives the prompts that were inside it.

A stock RQ worker spends ~16 round trips per job; here each operation is one Lua script call for a
whole batch of jobs, atomic in Redis. Jobs stay in RQ's own structures (queues, job hashes, started
and failed registries) so `rq info` and `rq requeue` keep working. What RQ lacks is a fast way to
notice a dead worker (minutes), so every claimed job also holds a short lease in `Keys.leases`: a
worker renews its leases every few seconds; any worker puts a lapsed lease's job back. A finish is
accepted only while its lease is held, so a job recovered from a stalled worker can never produce
two results.

**Clocks.** Every lease expiry, lapse decision and registry score is computed INSIDE the scripts
from Redis's own `TIME`: workers on many hosts never compare their clocks with each other's. A
worker's clock only stamps informational fields (a result's `finished_at`, its status record).

**Poison prompts.** A prompt that kills its server would be handed back forever and carried to
every GPU. So when a server dies (or hangs and is killed), the prompts that were inside it get a
strike, counted in `Keys.strikes` (it outlives any worker), atomically with putting them back:

    strikes 0 -> its queue            (ordinary hand-back: shutdown, restart, worker death)
    strikes 1 -> Keys.suspects        a worker runs at most ONE suspect beside its normal work
    strikes 2 -> Keys.isolate         a worker reserves it, lets its other prompts finish, runs it
                                      alone, then resumes
    strike MAX_STRIKES, and it was alone in the server -> quarantined: failed with `server_crash`,
                                      the reason and the server log's tail; never run again

A prompt that was not alone is never struck past MAX_STRIKES - 1, so a bystander can never be
failed for sharing a batch with a poison. A worker killed with -9 is not a server death: its leases
lapse and its prompts go back with the strikes they had.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from enum import StrEnum

import orjson
import redis
import redis.asyncio as aioredis

from batchfleet import keys
from batchfleet.keys import Keys
from batchfleet.prompts import MAX_BODY_BYTES
from batchfleet.records import Result

from .redislink import LINK

__all__ = ["MAX_STRIKES", "Claim", "ClaimKind", "DeathOutcome", "Ledger", "parse_job_data"]

log = logging.getLogger("batchfleet.worker.ledger")

MAX_STRIKES = 3  # server deaths (the last one alone) after which a prompt is quarantined
MAX_JOB_BYTES = MAX_BODY_BYTES + 64 * 1024  # a job's data, decompressed: the prompt and its envelope
# A finish waits up to this long for others to share its script call (its slot is free already; only
# the results stream waits, and a lease covers 15 s). At 1,000 prompts/s: ~100 per call instead of 1.
# A worker killed with -9 loses at most this much finished work: those prompts' leases lapse and they
# run again (never twice in the export: their results were never written).
FLUSH_GATHER_S = 0.1
FLUSH_GATHER_MAX = 200

# Helpers every script starts with: Redis's clock, and RQ's timestamp format from it.
_PRELUDE = """
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]), tonumber(t[2])
end
local function iso(s, us)  -- seconds since the epoch -> 2026-01-02T03:04:05.000006Z (RQ's format)
  local days = math.floor(s / 86400)
  local rem = s - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', y, m, d, math.floor(rem / 3600),
                       math.floor(rem % 3600 / 60), rem % 60, us)
end
"""

# Put a job that is no longer running back where its strikes say (KEYS[3..5] = strikes, suspects,
# isolate in every script that uses it).
_REQUEUE = """
local function requeue(jid, jkey, queue_key)
  redis.call('HSET', jkey, 'status', 'queued')
  local n = tonumber(redis.call('HGET', KEYS[3], jid) or '0')
  if n >= 2 then
    redis.call('LPUSH', KEYS[5], jid)
  elseif n == 1 then
    redis.call('LPUSH', KEYS[4], jid)
  else
    redis.call('LPUSH', queue_key, jid)
  end
end
"""

# KEYS = leases, suspects, isolate, <queue key>...
# ARGV = n, member suffix, lease ttl, started-registry ttl, worker, job prefix, started prefix,
#        take a suspect (0/1), take a prompt to run alone (0/1), <queue name>... (parallel to KEYS[4..])
# -> flat (jid, origin, data, kind) per claimed job; a 'solo' claim comes alone.
_CLAIM = _PRELUDE + """
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local n, suffix, ttl, sttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local worker, jpre, wpre = ARGV[5], ARGV[6], ARGV[7]
local out, taken = {}, 0
local function take(jid, fallback, kind)
  local jkey = jpre .. jid
  local f = redis.call('HMGET', jkey, 'data', 'origin', 'status')
  -- deleted while queued (`rq empty`), or a stray copy of an id that runs or ran: skip it
  if not f[1] or f[3] ~= 'queued' then return false end
  local origin = f[2] or fallback
  local member = jid .. suffix
  redis.call('HSET', jkey, 'status', 'started', 'started_at', now_iso, 'last_heartbeat', now_iso,
             'worker_name', worker)
  redis.call('ZADD', wpre .. origin, now + sttl, member)
  redis.call('ZADD', KEYS[1], now + ttl, member)
  out[#out + 1] = jid; out[#out + 1] = origin; out[#out + 1] = f[1]; out[#out + 1] = kind
  return true
end
local function pop_one(list, kind)
  while true do
    local jid = redis.call('LPOP', list)
    if not jid then return false end
    if take(jid, 'unknown', kind) then return true end
  end
end
if ARGV[9] == '1' and pop_one(KEYS[3], 'solo') then return out end
if n <= 0 then return out end
if ARGV[8] == '1' and pop_one(KEYS[2], 'suspect') then taken = 1 end
for i = 4, #KEYS do
  if taken >= n then break end
  local ids = redis.call('LPOP', KEYS[i], n - taken)
  if ids then
    for _, jid in ipairs(ids) do
      if take(jid, ARGV[i + 6], 'normal') then taken = taken + 1 end
    end
  end
end
return out
"""

# KEYS = leases; ARGV = lease ttl, member... -> members whose lease is no longer held (recovered).
_RENEW = _PRELUDE + """
local s, us = clock()
local expiry = s + us / 1e6 + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# KEYS = leases, results, done, stats, strikes
# ARGV = member suffix, failed-registry ttl, job prefix, started prefix, failed prefix, then three per
#        job: jid, "<s|f|r> <completion tokens> <bytes of exc_info> <origin>", exc_info .. result JSON
#        (s: succeeded, no exc_info; f: failed; r: refused, no result). Three arguments, not six: a
#        flush of 100 finishes costs the worker a third of the packing.
# -> {stale jids, results stream length}
_FINISH = _PRELUDE + """
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local suffix, fttl, jpre, wpre, fpre = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local OUTCOME = {s = 'succeeded', f = 'failed', r = 'refused'}
local stale = {}
for i = 6, #ARGV, 3 do
  local jid = ARGV[i]
  local code, tokens, exclen, origin = string.match(ARGV[i + 1], '^(%a) (%d+) (%d+) (.*)$')
  local outcome = OUTCOME[code]
  exclen = tonumber(exclen)
  local member = jid .. suffix
  if redis.call('ZREM', KEYS[1], member) == 0 then
    stale[#stale + 1] = jid  -- the lease lapsed and the job was recovered: its other run reports
  else
    redis.call('ZREM', wpre .. origin, member)
    redis.call('HDEL', KEYS[5], jid)
    local jkey = jpre .. jid
    if outcome == 'succeeded' then
      redis.call('DEL', jkey)  -- result_ttl=0: the result leaves Redis through the stream below
    else
      redis.call('HSET', jkey, 'status', 'failed', 'ended_at', now_iso, 'exc_info', string.sub(ARGV[i + 2], 1, exclen))
      redis.call('EXPIRE', jkey, fttl)  -- as long as its failed-registry entry: no job hash outlives it
      redis.call('ZADD', fpre .. origin, now + fttl, jid)
    end
    if outcome == 'refused' then  -- not this run's prompt to answer: no result, RQ's failed registry only
      redis.call('HINCRBY', KEYS[4], 'refused', 1)
      redis.call('HINCRBY', KEYS[4], 'refused:' .. origin, 1)
    else
      redis.call('XADD', KEYS[2], '*', 'r', exclen > 0 and string.sub(ARGV[i + 2], exclen + 1) or ARGV[i + 2])
      redis.call('SADD', KEYS[3], jid)
      redis.call('HINCRBY', KEYS[4], outcome, 1)
      redis.call('HINCRBY', KEYS[4], outcome .. ':' .. origin, 1)
      redis.call('HINCRBY', KEYS[4], 'completion_tokens', tokens)
    end
  end
end
return {stale, redis.call('XLEN', KEYS[2])}
"""

# Put jobs back where their strikes say. KEYS = leases, stats, strikes, suspects, isolate
# ARGV = job prefix, started prefix, queue prefix, counter, mode ('lapsed': every lease that lapsed
# by Redis's clock; 'given': the members ARGV[6..]) -> jids put back
_RELEASE = _PRELUDE + _REQUEUE + """
local jpre, wpre, qpre, counter = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local members = {}
if ARGV[5] == 'lapsed' then
  local s, us = clock()
  members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', s + us / 1e6),
                       'LIMIT', 0, 1000)
else
  for i = 6, #ARGV do members[#members + 1] = ARGV[i] end
end
local out = {}
for _, member in ipairs(members) do
  if redis.call('ZREM', KEYS[1], member) == 1 then
    local jid = string.match(member, '^(.*):[^:]*$')
    local jkey = jpre .. jid
    local f = redis.call('HMGET', jkey, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', wpre .. f[1], member)
      if f[2] == 'started' then
        requeue(jid, jkey, qpre .. f[1])
        redis.call('HINCRBY', KEYS[2], counter, 1)
        out[#out + 1] = jid
      end
    end
  end
end
return out
"""

# A server died with these jobs in this worker's hands. KEYS = leases, stats, strikes, suspects,
# isolate, results, done. ARGV = member suffix, job prefix, started prefix, queue prefix, failed
# prefix, failed-registry ttl, strikes ttl, max strikes, then per job: jid, inside ('1': it was inside
# the server when it died; '0': it was not, e.g. waiting to retry), result JSON (used only if it is
# quarantined), exc_info. -> {quarantined jids, strikes given, handed back, stale}
_DEATH = _PRELUDE + _REQUEUE + """
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local suffix, jpre, wpre, qpre, fpre = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local fttl, kttl, max = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local inside = 0
for i = 9, #ARGV, 4 do
  if ARGV[i + 1] == '1' then inside = inside + 1 end
end
local alone = inside == 1  -- nothing else was in the server: it cannot be a bystander
local quarantined, struck, handed, stale = {}, 0, 0, 0
redis.call('HINCRBY', KEYS[2], 'server_deaths', 1)
for i = 9, #ARGV, 4 do
  local jid = ARGV[i]
  local member = jid .. suffix
  if redis.call('ZREM', KEYS[1], member) == 0 then
    stale = stale + 1
  else
    local jkey = jpre .. jid
    local f = redis.call('HMGET', jkey, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', wpre .. f[1], member)
      if f[2] == 'started' then
        if ARGV[i + 1] == '1' then
          local n = redis.call('HINCRBY', KEYS[3], jid, 1)
          redis.call('EXPIRE', KEYS[3], kttl)
          struck = struck + 1
          if n >= max and alone then
            redis.call('HSET', jkey, 'status', 'failed', 'ended_at', now_iso, 'exc_info', ARGV[i + 3])
            redis.call('EXPIRE', jkey, fttl)
            redis.call('ZADD', fpre .. f[1], now + fttl, jid)
            redis.call('XADD', KEYS[6], '*', 'r', ARGV[i + 2])
            redis.call('SADD', KEYS[7], jid)
            redis.call('HINCRBY', KEYS[2], 'failed', 1)
            redis.call('HINCRBY', KEYS[2], 'failed:' .. f[1], 1)
            redis.call('HINCRBY', KEYS[2], 'quarantined', 1)
            redis.call('HDEL', KEYS[3], jid)
            quarantined[#quarantined + 1] = jid
          else
            if n > max - 1 then  -- not alone: never past "must run alone"
              redis.call('HSET', KEYS[3], jid, max - 1)
            end
            requeue(jid, jkey, qpre .. f[1])
          end
        else
          requeue(jid, jkey, qpre .. f[1])
          redis.call('HINCRBY', KEYS[2], 'handed_back', 1)
          handed = handed + 1
        end
      end
    end
  end
end
if struck > 0 then redis.call('HINCRBY', KEYS[2], 'struck', struck) end
return {quarantined, struck, handed, stale}
"""


# The run was cancelled: forget jobs this worker holds, publishing nothing. KEYS = leases
# ARGV = job prefix, started prefix, member... -> how many were still held (and are deleted now)
_DROP = """
local jpre, wpre, n = ARGV[1], ARGV[2], 0
for i = 3, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    local jid = string.match(ARGV[i], '^(.*):[^:]*$')
    local jkey = jpre .. jid
    local f = redis.call('HMGET', jkey, 'origin', 'status')
    if f[1] then redis.call('ZREM', wpre .. f[1], ARGV[i]) end
    if f[2] == 'started' then redis.call('DEL', jkey) end
    n = n + 1
  end
end
return n
"""

# A trimmed failed job came back (`rq requeue`): the head feeds its prompt again from the store.
# KEYS = leases, refeed; ARGV = member, job prefix, started prefix, custom_id -> 1 if handed over
_REFEED = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local jid = string.match(ARGV[1], '^(.*):[^:]*$')
local jkey = ARGV[2] .. jid
local origin = redis.call('HGET', jkey, 'origin')
if origin then redis.call('ZREM', ARGV[3] .. origin, ARGV[1]) end
redis.call('DEL', jkey)
redis.call('RPUSH', KEYS[2], ARGV[4])
return 1
"""


class ClaimKind(StrEnum):
    """Where a claimed job came from, which says how it may run."""

    NORMAL = "normal"  # a queue: runs beside anything
    SUSPECT = "suspect"  # one strike: at most one per worker at a time
    SOLO = "solo"  # two strikes: runs alone in its server


_KINDS = {kind.value.encode(): kind for kind in ClaimKind}  # as `_CLAIM` names them


@dataclass(slots=True)
class Claim:
    """A job this worker holds the lease of."""

    jid: str
    origin: str
    data: bytes
    kind: ClaimKind = ClaimKind.NORMAL
    claimed_at: float = 0.0  # time.monotonic()


@dataclass(slots=True)
class _Finish:
    """One final outcome, as `_FINISH` takes it: the job's three arguments, packed when it finished."""

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
        # One lease member per (job, worker process): "<jid>:<session>", RQ's execution-key shape.
        self.session = uuid.uuid4().hex[:12]
        self.held: dict[str, Claim] = {}
        self._pending: list[_Finish] = []
        self._wake = asyncio.Event()
        self._closing = False
        self.results_backlog = 0  # entries waiting in the results stream, as last seen
        self.stale = 0  # finishes refused because the lease had lapsed
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)
        self._death = client.register_script(_DEATH)
        self._drop = client.register_script(_DROP)
        self._refeed = client.register_script(_REFEED)

    def _member(self, jid: str) -> str:
        return f"{jid}:{self.session}"

    @property
    def _requeue_keys(self) -> list[str]:
        return [self.k.leases, self.k.stats, self.k.strikes, self.k.suspects, self.k.isolate]

    # --- claim -------------------------------------------------------------------------------------
    async def claim(self, n: int, queues: list[str], *, take_suspect: bool = False,
                    take_solo: bool = False) -> list[Claim]:
        """Up to `n` jobs: first (if asked) one prompt that must run alone, which then comes alone;
        else (if asked) one suspect, then the queues in order."""
        if (n <= 0 or not queues) and not take_solo:
            return []
        raw = await self._claim(
            keys=[self.k.leases, self.k.suspects, self.k.isolate, *(Keys.queue(q) for q in queues)],
            args=[max(n, 0), ":" + self.session, self.lease_ttl_s, keys.STARTED_REGISTRY_TTL_S, self.worker,
                  keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX, int(take_suspect), int(take_solo), *queues])
        now = time.monotonic()
        claims = []
        for i in range(0, len(raw), 4):
            c = Claim(jid=raw[i].decode(), origin=raw[i + 1].decode(), data=raw[i + 2],
                      kind=_KINDS[raw[i + 3]], claimed_at=now)
            self.held[c.jid] = c
            claims.append(c)
        return claims

    # --- finish (batched) --------------------------------------------------------------------------
    def finish(self, claim: Claim, result: Result, exc_string: str = "") -> None:
        """Queue a final outcome; the flusher writes it with others in one script call."""
        self._pending.append(_Finish.of(claim, b"s" if result.ok else b"f", result.to_json(), exc_string,
                                        result.completion_tokens))
        self._wake.set()

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
            try:
                await self.flush()
                LINK.ok()
            except (redis.RedisError, OSError) as exc:  # Redis away: keep the outcomes and retry
                LINK.lost(f"writing {len(self._pending)} outcome(s)", exc)
                await asyncio.sleep(1.0)
                self._wake.set()
            except Exception:
                log.exception("writing %d outcome(s) to Redis failed; retrying", len(self._pending))
                await asyncio.sleep(1.0)
                self._wake.set()

    def close(self) -> None:
        """Let `run_flusher` end once it has written what is pending."""
        self._closing = True
        self._wake.set()

    async def flush(self) -> None:
        """Write the outcomes pending now (500 a call). Those that come while it writes wait for the
        next flush, so that they gather into one call instead of trickling out a few per call."""
        todo, self._pending = self._pending, []
        while todo:
            batch, todo = todo[:500], todo[500:]
            args: list[object] = [":" + self.session, keys.FAILURE_TTL_S, keys.RQ_JOB_PREFIX,
                                  keys.RQ_STARTED_PREFIX, keys.RQ_FAILED_PREFIX]
            for f in batch:
                args += [f.claim.jid, f.meta, f.payload]
            try:
                stale, backlog = await self._finish(
                    keys=[self.k.leases, self.k.results, self.k.done, self.k.stats, self.k.strikes], args=args)
            except BaseException:
                # keep them, first; the next flush retries (leases keep the jobs safe)
                self._pending[:0] = batch + todo
                raise
            for f in batch:
                self.held.pop(f.claim.jid, None)
            self.results_backlog = int(backlog)
            if stale:
                self.stale += len(stale)
                log.warning("%d finished prompt(s) were already recovered by another worker; dropped", len(stale))

    async def refresh_backlog(self) -> int:
        """How long the results stream is now (a paused worker asks while it waits for the collector)."""
        self.results_backlog = int(await self.r.xlen(self.k.results))
        return self.results_backlog

    # --- leases --------------------------------------------------------------------------------------
    async def renew(self) -> list[str]:
        """Extend every lease this worker holds, on Redis's clock. Returns the jids whose lease is no
        longer held (it lapsed and another worker requeued the job): they are forgotten here."""
        if not self.held:
            return []
        held = list(self.held)
        lost = await self._renew(keys=[self.k.leases], args=[self.lease_ttl_s, *(self._member(j) for j in held)])
        jids = [m.decode().rsplit(":", 1)[0] for m in lost]
        for jid in jids:
            self.held.pop(jid, None)
        return jids

    async def hand_back(self, claims: list[Claim]) -> int:
        """Put jobs this worker holds back where their strikes say (shutdown, restart). If Redis
        refuses, they are forgotten all the same: their leases lapse and any worker requeues them,
        rather than a lease renewed forever for a prompt nobody runs."""
        if not claims:
            return 0
        try:
            out = await self._release(keys=self._requeue_keys, args=[*self._release_args("handed_back"), "given",
                                                                     *(self._member(c.jid) for c in claims)])
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
            return int(await self._drop(keys=[self.k.leases], args=[keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX,
                                                                    *(self._member(c.jid) for c in claims)]))
        finally:
            for c in claims:
                self.held.pop(c.jid, None)

    async def refeed(self, claim: Claim, cid: str) -> bool:
        """A trimmed failed job (its prompt is only in the store) was requeued: hand its custom_id to
        the head, which feeds the prompt again; the job itself is deleted."""
        try:
            return bool(await self._refeed(keys=[self.k.leases, self.k.refeed],
                                           args=[self._member(claim.jid), keys.RQ_JOB_PREFIX,
                                                 keys.RQ_STARTED_PREFIX, cid]))
        finally:
            self.held.pop(claim.jid, None)

    async def recover_lapsed(self) -> list[str]:
        """Requeue the jobs of workers that stopped renewing (killed, frozen, network-split)."""
        out = await self._release(keys=self._requeue_keys, args=[*self._release_args("recovered"), "lapsed"])
        return [j.decode() for j in out]

    def _release_args(self, counter: str) -> list[str]:
        return [keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX, keys.RQ_QUEUE_PREFIX, counter]

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
        args: list[object] = [":" + self.session, keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX, keys.RQ_QUEUE_PREFIX,
                              keys.RQ_FAILED_PREFIX, keys.FAILURE_TTL_S, keys.STRIKES_TTL_S, MAX_STRIKES]
        for claim, result in inside:
            args += [claim.jid, "1", result.to_json() if result is not None else b"", exc_string]
        for claim in outside:
            args += [claim.jid, "0", b"", ""]
        script_keys = [*self._requeue_keys, self.k.results, self.k.done]
        deadline = time.monotonic() + (self.lease_ttl_s if retry_for_s is None else retry_for_s)
        wait_s = 0.25
        try:
            while True:
                try:
                    quarantined, struck, handed, stale = await self._death(keys=script_keys, args=args)
                    break
                except (redis.RedisError, OSError) as exc:
                    if time.monotonic() + wait_s > deadline:
                        log.error("could not record the server death in Redis (%s): %d prompt(s) forgotten; "
                                  "their leases lapse and they run again", exc, len(claims))
                        raise
                    log.warning("recording the server death in Redis failed (%s); retrying", exc)
                    await asyncio.sleep(wait_s)
                    wait_s = min(wait_s * 2, 2.0)
        finally:
            for c in claims:
                self.held.pop(c.jid, None)
        return DeathOutcome([j.decode() for j in quarantined], int(struck), int(handed), int(stale))


def parse_job_data(data: bytes) -> tuple[str, list, dict]:
    """(function name, args, kwargs) from a job's `data` field: JSON as batchfleet's producer writes
    it, or zlib-compressed JSON as RQ's own `enqueue` writes it. Never unpickled; never inflated past
    MAX_JOB_BYTES (a zip bomb is refused, not decompressed)."""
    if len(data) > MAX_JOB_BYTES:
        raise ValueError(f"job data of {len(data):,} bytes is larger than {MAX_JOB_BYTES:,}")
    if data[:1] == b"x":  # zlib header: written through RQ's API
        inflater = zlib.decompressobj()
        data = inflater.decompress(data, MAX_JOB_BYTES + 1)
        if len(data) > MAX_JOB_BYTES or inflater.unconsumed_tail:
            raise ValueError(f"job data inflates past {MAX_JOB_BYTES:,} bytes")
    func, _instance, args, kwargs = orjson.loads(data)
    if not isinstance(func, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("job data is not (function, instance, args, kwargs)")
    return func, args, kwargs

"""The worker's Redis bookkeeping, batched: claim, finish, lease renewal, hand-back, recovery.

A stock RQ worker spends ~16 round trips per job; here each operation is one Lua script call for a
whole batch of jobs, atomic in Redis. Jobs stay in RQ's own structures (queues, job hashes, started
and failed registries) so `rq info` and `rq requeue` keep working. What RQ lacks is a fast way to
notice a dead worker (minutes), so every claimed job also holds a short lease in `Keys.leases`: a
worker renews its leases every few seconds; any worker puts a lapsed lease's job back at the front
of its queue. A finish is accepted only while its lease is held, so a job recovered from a stalled
worker can never produce two results.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
import redis
import redis.asyncio as aioredis

from batchfleet import keys
from batchfleet.keys import Keys
from batchfleet.records import Result

__all__ = ["Claim", "Ledger"]

log = logging.getLogger("batchfleet.worker.ledger")

_CLAIM = """
local n = tonumber(ARGV[1])
local suffix, lease_exp, started_exp, now_iso, worker = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local leases, qpre, jpre, wpre = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local out, taken = {}, 0
for i = 11, #ARGV do
  if taken >= n then break end
  local ids = redis.call('LPOP', qpre .. ARGV[i], n - taken)
  if ids then
    for _, jid in ipairs(ids) do
      local jkey = jpre .. jid
      local f = redis.call('HMGET', jkey, 'data', 'origin')
      if f[1] then  -- a job deleted while queued (e.g. by `rq empty`) is skipped
        local origin = f[2] or ARGV[i]
        local member = jid .. suffix
        redis.call('HSET', jkey, 'status', 'started', 'started_at', now_iso, 'last_heartbeat', now_iso,
                   'worker_name', worker)
        redis.call('ZADD', wpre .. origin, started_exp, member)
        redis.call('ZADD', leases, lease_exp, member)
        out[#out + 1] = jid; out[#out + 1] = origin; out[#out + 1] = f[1]
        taken = taken + 1
      end
    end
  end
end
return out
"""

_FINISH = """
local suffix, now_iso, leases, results, done, stats = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local failed_exp, jpre, wpre, fpre = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local stale = {}
for i = 11, #ARGV, 6 do
  local jid, origin, ok = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local member = jid .. suffix
  if redis.call('ZREM', leases, member) == 0 then
    stale[#stale + 1] = jid  -- the lease lapsed and the job was recovered: its other run reports
  else
    redis.call('ZREM', wpre .. origin, member)
    local jkey = jpre .. jid
    local outcome = ok and 'succeeded' or 'failed'
    if ok then
      redis.call('DEL', jkey)  -- result_ttl=0: the result leaves Redis through the stream below
    else
      redis.call('HSET', jkey, 'status', 'failed', 'ended_at', now_iso, 'exc_info', ARGV[i + 4])
      redis.call('ZADD', fpre .. origin, failed_exp, jid)
    end
    redis.call('XADD', results, '*', 'r', ARGV[i + 3])
    redis.call('SADD', done, jid)
    redis.call('HINCRBY', stats, outcome, 1)
    redis.call('HINCRBY', stats, outcome .. ':' .. origin, 1)
    redis.call('HINCRBY', stats, 'completion_tokens', ARGV[i + 5])
  end
end
return {stale, redis.call('XLEN', results)}
"""

# Put jobs back at the front of their queue: ARGV[7] = 'lapsed' -> every lease that lapsed before
# ARGV[8]; 'given' -> the members ARGV[8..].
_RELEASE = """
local leases, jpre, wpre, qpre, stats, counter = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local members = {}
if ARGV[7] == 'lapsed' then
  members = redis.call('ZRANGEBYSCORE', leases, '-inf', ARGV[8], 'LIMIT', 0, 1000)
else
  for i = 8, #ARGV do members[#members + 1] = ARGV[i] end
end
local out = {}
for _, member in ipairs(members) do
  if redis.call('ZREM', leases, member) == 1 then
    local jid = string.match(member, '^(.*):[^:]*$')
    local jkey = jpre .. jid
    local f = redis.call('HMGET', jkey, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', wpre .. f[1], member)
      if f[2] == 'started' then
        redis.call('HSET', jkey, 'status', 'queued')
        redis.call('LPUSH', qpre .. f[1], jid)
        redis.call('HINCRBY', stats, counter, 1)
        out[#out + 1] = jid
      end
    end
  end
end
return out
"""


@dataclass(slots=True)
class Claim:
    """A job this worker holds the lease of."""

    jid: str
    origin: str
    data: bytes
    claimed_at: float


@dataclass(slots=True)
class _Finish:
    claim: Claim
    result: Result
    exc_string: str


def _utcnow_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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
        self.results_backlog = 0  # entries waiting in the results stream, as of the last flush
        self.stale = 0  # finishes refused because the lease had lapsed
        self._claim = client.register_script(_CLAIM)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)

    def _member(self, jid: str) -> str:
        return f"{jid}:{self.session}"

    # --- claim -------------------------------------------------------------------------------------
    async def claim(self, n: int, queues: list[str]) -> list[Claim]:
        if n <= 0 or not queues:
            return []
        now = time.time()
        raw = await self._claim(args=[
            n, ":" + self.session, now + self.lease_ttl_s, now + keys.STARTED_REGISTRY_TTL_S, _utcnow_iso(),
            self.worker, self.k.leases, keys.RQ_QUEUE_PREFIX, keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX, *queues,
        ])
        claims = []
        for i in range(0, len(raw), 3):
            c = Claim(jid=raw[i].decode(), origin=raw[i + 1].decode(), data=raw[i + 2], claimed_at=now)
            self.held[c.jid] = c
            claims.append(c)
        return claims

    # --- finish (batched) --------------------------------------------------------------------------
    def finish(self, claim: Claim, result: Result, exc_string: str = "") -> None:
        """Queue a final outcome; the flusher writes it with others in one script call."""
        self._pending.append(_Finish(claim, result, exc_string))
        self._wake.set()

    async def run_flusher(self) -> None:
        """Write queued outcomes as they come: batches form naturally while a call is in flight.
        Ends after `close()` once nothing is pending. (Stopped by a flag, not by cancellation:
        redis-py can swallow a CancelledError that lands inside a command, and the task would
        never end.)"""
        while not (self._closing and not self._pending):
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except (redis.RedisError, OSError) as exc:  # Redis away: keep the outcomes and retry
                log.warning("writing %d outcome(s) to Redis failed (%s); retrying", len(self._pending), exc)
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
        while self._pending:
            batch, self._pending = self._pending[:500], self._pending[500:]
            args: list[object] = [":" + self.session, _utcnow_iso(), self.k.leases, self.k.results, self.k.done,
                                  self.k.stats, time.time() + keys.FAILURE_TTL_S, keys.RQ_JOB_PREFIX,
                                  keys.RQ_STARTED_PREFIX, keys.RQ_FAILED_PREFIX]
            for f in batch:
                args += [f.claim.jid, f.claim.origin, "1" if f.result.ok else "0", f.result.to_json(),
                         f.exc_string, f.result.completion_tokens]
            try:
                stale, backlog = await self._finish(args=args)
            except Exception:
                self._pending[:0] = batch  # keep them; the next flush retries (leases keep the jobs safe)
                raise
            for f in batch:
                self.held.pop(f.claim.jid, None)
            self.results_backlog = int(backlog)
            if stale:
                self.stale += len(stale)
                log.warning("%d finished prompt(s) were already recovered by another worker; dropped", len(stale))

    # --- leases --------------------------------------------------------------------------------------
    async def renew(self) -> None:
        if not self.held:
            return
        expiry = time.time() + self.lease_ttl_s
        mapping = {self._member(jid): expiry for jid in self.held}
        await self.r.zadd(self.k.leases, mapping, xx=True)

    async def hand_back(self, claims: list[Claim]) -> int:
        """Put jobs this worker holds back at the front of their queues (shutdown, server loss)."""
        if not claims:
            return 0
        members = [self._member(c.jid) for c in claims]
        out = await self._release(args=[*self._release_args("handed_back"), "given", *members])
        for c in claims:
            self.held.pop(c.jid, None)
        return len(out)

    async def recover_lapsed(self) -> list[str]:
        """Requeue the jobs of workers that stopped renewing (killed, frozen, network-split)."""
        out = await self._release(args=[*self._release_args("recovered"), "lapsed", time.time()])
        return [j.decode() for j in out]

    def _release_args(self, counter: str) -> list[str]:
        return [self.k.leases, keys.RQ_JOB_PREFIX, keys.RQ_STARTED_PREFIX, keys.RQ_QUEUE_PREFIX, self.k.stats, counter]


def parse_job_data(data: bytes) -> tuple[str, list, dict]:
    """(function name, args, kwargs) from a job's `data` field: JSON as batchfleet's producer writes
    it, or zlib-compressed JSON as RQ's own `enqueue` writes it. Never unpickled."""
    if data[:1] == b"x":  # zlib header: written through RQ's API
        data = zlib.decompress(data)
    func, _instance, args, kwargs = orjson.loads(data)
    return func, args, kwargs

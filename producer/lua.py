"""The one Lua script enqueue runs per batch (EVALSHA; registered once per process).

Atomically, for each job of the batch: skip it when its hash already exists (queued, running, or
failed and kept for `rq requeue`) or its id is in the run's `done` set (finished, result not yet
collected); otherwise write the job hash in RQ 2.12's layout and queue its id. One round trip and
~3 Redis commands per job instead of RQ's pipeline of 3 commands plus client-side Job objects.

Every key arrives in KEYS (built by `batchfleet.keys`), so the script builds no key strings:

    KEYS  = done, stats, rq:queues, <queue key> * nq, <job key> * njobs
    ARGV  = nq, timestamp, timeout, result_ttl, failure_ttl, <queue name> * nq,
            then per job: job id, queue index (1-based), data, description
    returns {new jobs, jobs already present}
"""

from __future__ import annotations

__all__ = ["ENQUEUE_LUA"]

ENQUEUE_LUA = """
local nq = tonumber(ARGV[1])
local ts, timeout, rttl, fttl = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local ids, added, present = {}, 0, 0
for q = 1, nq do ids[q] = {} end
local a = 6 + nq
for k = 4 + nq, #KEYS do
  local jid, q = ARGV[a], tonumber(ARGV[a + 1])
  if redis.call('EXISTS', KEYS[k]) == 0 and redis.call('SISMEMBER', KEYS[1], jid) == 0 then
    redis.call('HSET', KEYS[k], 'created_at', ts, 'enqueued_at', ts, 'data', ARGV[a + 2],
      'origin', ARGV[5 + q], 'description', ARGV[a + 3], 'status', 'queued',
      'timeout', timeout, 'result_ttl', rttl, 'failure_ttl', fttl)
    local list = ids[q]
    list[#list + 1] = jid
    added = added + 1
  else
    present = present + 1
  end
  a = a + 4
end
for q = 1, nq do
  local list = ids[q]
  if #list > 0 then
    -- unpack in slices: Lua's C stack takes a few thousand values at most
    for i = 1, #list, 1000 do
      redis.call('RPUSH', KEYS[3 + q], unpack(list, i, math.min(i + 999, #list)))
    end
    redis.call('SADD', KEYS[3], KEYS[3 + q])
    redis.call('HINCRBY', KEYS[2], 'enqueued:' .. ARGV[5 + q], #list)
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'enqueued', added) end
return {added, present}
"""

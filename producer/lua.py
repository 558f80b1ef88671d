"""The one Lua script enqueue runs per batch (EVALSHA; registered once per process).

Atomically, for each job of the batch: skip it when its hash already exists (queued, running, or
failed and kept for `rq requeue`) or its id is in the run's `done` set (finished, result not yet
collected); otherwise write the job hash in RQ 2.12's layout and queue its id. One round trip and
~3 Redis commands per job instead of RQ's pipeline of 3 commands plus client-side Job objects.

Every key arrives in KEYS (built by `batchfleet.keys`), so the script builds no key strings. Jobs
come grouped by queue, and each job is ONE argument, `data .. "\0" .. description` (JSON never holds
a raw NUL byte, so the first NUL splits it): the client's per-argument packing, not Redis, is the
cost that matters, so a job costs two arguments instead of five.

    KEYS  = done, stats, rq:queues, <queue key> * nq, <job key> * njobs (grouped by queue)
    ARGV  = nq, len(job key prefix), timestamp, timeout, result_ttl, failure_ttl,
            <queue name> * nq, <number of jobs for that queue> * nq, <data NUL description> * njobs
    returns {new jobs, jobs already present, new jobs per queue...}
"""

from __future__ import annotations

__all__ = ["ENQUEUE_LUA"]

ENQUEUE_LUA = """
local nq, plen = tonumber(ARGV[1]), tonumber(ARGV[2])
local ts, timeout, rttl, fttl = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local added, present, k, per_queue = 0, 0, 4 + nq, {}
for q = 1, nq do
  local name, ids = ARGV[6 + q], {}
  per_queue[q] = 0
  for _ = 1, tonumber(ARGV[6 + nq + q]) do
    local jid = string.sub(KEYS[k], plen + 1)
    if redis.call('EXISTS', KEYS[k]) == 0 and redis.call('SISMEMBER', KEYS[1], jid) == 0 then
      local blob = ARGV[k + 3 + nq]
      local z = string.find(blob, '\\0', 1, true)
      redis.call('HSET', KEYS[k], 'created_at', ts, 'enqueued_at', ts, 'data', string.sub(blob, 1, z - 1),
        'origin', name, 'description', string.sub(blob, z + 1), 'status', 'queued',
        'timeout', timeout, 'result_ttl', rttl, 'failure_ttl', fttl)
      ids[#ids + 1] = jid
    else
      present = present + 1
    end
    k = k + 1
  end
  if #ids > 0 then
    -- unpack in slices: Lua's C stack takes a few thousand values at most
    for i = 1, #ids, 1000 do
      redis.call('RPUSH', KEYS[3 + q], unpack(ids, i, math.min(i + 999, #ids)))
    end
    redis.call('SADD', KEYS[3], KEYS[3 + q])
    redis.call('HINCRBY', KEYS[2], 'enqueued:' .. name, #ids)
    added = added + #ids
    per_queue[q] = #ids
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'enqueued', added) end
return {added, present, unpack(per_queue)}
"""

"""The Lua scripts the head runs against Redis (EVALSHA; registered once per process). Every key arrives
in KEYS (built by `batchfleet.keys`), so no script builds a key name.

FEED_LUA — put a batch of prompts from the store into RQ jobs, atomically per batch. Each job is
skipped when its hash already exists (queued, running, or failed and kept for `rq requeue`) or its id
is in the run's `done` set (finished, result not yet collected); otherwise its hash is written in RQ
2.12's layout, lean — `data`, `origin`, `status`, the fields RQ needs (`Job.restore` requires `data`,
`rq requeue` the `origin`, `Job.get_status` the `status`; the rest have defaults) — and its id is
queued. Jobs come grouped by queue.

    KEYS  = done, stats, rq:queues, <queue key> * nq, <job key> * njobs (grouped by queue)
    ARGV  = nq, len(job key prefix), <queue name> * nq, <number of jobs for that queue> * nq, <data> * njobs
    returns {new jobs, jobs already present, new jobs per queue...}

CHECK_LUA — where each of a batch of fed jobs is now, one letter each:
    q queued (or any RQ state but the ones below), s started (in flight), d done (its result is in the
    stream, not yet collected), f failed and not done (a worker that is not batchfleet's failed it:
    no result will come), m missing (nowhere: Redis lost it, or it was deleted behind our back)

    KEYS  = done, <job key> * n;   ARGV = len(job key prefix);   returns a string of n letters

TAKE_FAILED_LUA — take back jobs failed by a foreign worker so they can be fed again: for each job
still failed and not done, remove it from RQ's failed registry and delete its hash and RQ result.

    KEYS  = done, then per job: <job key>, <its failed registry>, <its RQ results key>
    ARGV  = len(job key prefix);   returns the job ids taken
"""

from __future__ import annotations

__all__ = ["CHECK_LUA", "FEED_LUA", "TAKE_FAILED_LUA"]

FEED_LUA = """
local nq, plen = tonumber(ARGV[1]), tonumber(ARGV[2])
local added, present, k, a, per_queue = 0, 0, 4 + nq, 3 + 2 * nq, {}
for q = 1, nq do
  local name, ids = ARGV[2 + q], {}
  per_queue[q] = 0
  for _ = 1, tonumber(ARGV[2 + nq + q]) do
    local jid = string.sub(KEYS[k], plen + 1)
    if redis.call('EXISTS', KEYS[k]) == 0 and redis.call('SISMEMBER', KEYS[1], jid) == 0 then
      redis.call('HSET', KEYS[k], 'data', ARGV[a], 'origin', name, 'status', 'queued')
      ids[#ids + 1] = jid
    else
      present = present + 1
    end
    k = k + 1
    a = a + 1
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

CHECK_LUA = """
local plen, out = tonumber(ARGV[1]), {}
for i = 2, #KEYS do
  local jid = string.sub(KEYS[i], plen + 1)
  local c
  if redis.call('SISMEMBER', KEYS[1], jid) == 1 then
    c = 'd'
  elseif redis.call('EXISTS', KEYS[i]) == 0 then
    c = 'm'
  else
    local st = redis.call('HGET', KEYS[i], 'status')
    if st == 'started' then c = 's' elseif st == 'failed' then c = 'f' else c = 'q' end
  end
  out[#out + 1] = c
end
return table.concat(out)
"""

TAKE_FAILED_LUA = """
local plen, out = tonumber(ARGV[1]), {}
for i = 2, #KEYS, 3 do
  local jid = string.sub(KEYS[i], plen + 1)
  if redis.call('SISMEMBER', KEYS[1], jid) == 0 and redis.call('HGET', KEYS[i], 'status') == 'failed' then
    redis.call('ZREM', KEYS[i + 1], jid)
    redis.call('DEL', KEYS[i], KEYS[i + 2])
    out[#out + 1] = jid
  end
end
return out
"""

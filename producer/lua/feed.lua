-- Put a batch of prompts from the store into RQ jobs, atomically per batch. A job is skipped when its
-- hash already exists (queued, running, or failed and kept for `rq requeue`) or its id is in the
-- run's `done` set (finished, result not yet collected); otherwise its hash is written in RQ 2.12's
-- layout, lean: `data`, `origin`, `status`, the fields RQ needs (`Job.restore` requires `data`,
-- `rq requeue` the `origin`, `Job.get_status` the `status`; the rest have defaults), and its id is
-- queued. Jobs come grouped by queue: `counts[q]` jobs (and data) for `queues[q]`, named `names[q]`. A job's
-- `grp` (its plan unit, producer/plan.py; '' without a plan) is kept in its hash: a worker stealing from
-- another GPU's queue takes whole units (worker/lua/claim.lua). Per queue, the plan's prediction of what
-- its new prompts share with the ones before them there (`shared` of `sizes` bytes) adds to the run's
-- stats, `plan_shared:<q>` and `plan_bytes:<q>`, with the jobs. `front` '1' puts the new jobs at the front
-- of their queues, in their order (a high-priority batch of a shared fleet: claimed at the next free slot).
-- -> {new jobs, jobs already present, new jobs per queue...}
local added, present, k, a, per_queue = 0, 0, jobs_first, jobs_argv_first, {}
for q = 0, queues_last - queues_first do
  local name, ids = ARGV[names_first + q], {}
  per_queue[q + 1] = 0
  for _ = 1, tonumber(ARGV[counts_first + q]) do
    local jid = job_id(KEYS[k])
    if redis.call('EXISTS', KEYS[k]) == 0 and redis.call('SISMEMBER', done, jid) == 0 then
      if ARGV[a + 1] == '' then
        redis.call('HSET', KEYS[k], 'data', ARGV[a], 'origin', name, 'status', 'queued')
      else
        redis.call('HSET', KEYS[k], 'data', ARGV[a], 'origin', name, 'status', 'queued', 'grp', ARGV[a + 1])
      end
      ids[#ids + 1] = jid
    else
      present = present + 1
    end
    k = k + 1
    a = a + 2
  end
  if #ids > 0 then
    -- unpack in slices: Lua's C stack takes a few thousand values at most
    if front == '1' then
      local rev = {}
      for i = #ids, 1, -1 do rev[#rev + 1] = ids[i] end
      for i = 1, #rev, 1000 do
        redis.call('LPUSH', KEYS[queues_first + q], unpack(rev, i, math.min(i + 999, #rev)))
      end
    else
      for i = 1, #ids, 1000 do
        redis.call('RPUSH', KEYS[queues_first + q], unpack(ids, i, math.min(i + 999, #ids)))
      end
    end
    redis.call('SADD', queue_index, KEYS[queues_first + q])
    redis.call('HINCRBY', stats, 'enqueued:' .. name, #ids)
    added = added + #ids
    per_queue[q + 1] = #ids
  end
  if tonumber(ARGV[sizes_first + q]) > 0 then
    redis.call('HINCRBY', stats, 'plan_shared:' .. name, ARGV[shared_first + q])
    redis.call('HINCRBY', stats, 'plan_bytes:' .. name, ARGV[sizes_first + q])
  end
end
if added > 0 then redis.call('HINCRBY', stats, 'enqueued', added) end
return {added, present, unpack(per_queue)}

-- Remove each job of cancelled prompts (a run's, or a `batchfleet serve` batch's): queued (from its
-- queue, suspects, isolate), started (its leases and started-registry entries: a late finish is
-- refused as stale) or failed without a result
-- (its failed-registry entry), with its RQ result; a job whose result is in the stream is left for
-- the collector. The origin is read from the job's hash: its queue and registries are derived.
-- -> one letter per job: q queued (removed), s started (removed), f failed (removed), d done (left),
--    m missing
local held = {}
for _, member in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
  local jid = execution_job(member)
  if jid then
    held[jid] = held[jid] or {}
    table.insert(held[jid], member)
  end
end
local out = {}
for i = jobs_first, jobs_last, 2 do
  local job, result = KEYS[i], KEYS[i + 1]
  local jid = job_id(job)
  local c
  if redis.call('SISMEMBER', done, jid) == 1 then
    c = 'd'
  else
    local f = redis.call('HMGET', job, 'origin', 'status')
    if not f[2] then
      c = 'm'
    else
      local origin = f[1] or ''
      if f[2] == 'started' then c = 's' elseif f[2] == 'failed' then c = 'f' else c = 'q' end
      redis.call('LREM', queue_key(origin), 0, jid)
      redis.call('LREM', suspects, 0, jid)
      redis.call('LREM', isolate, 0, jid)
      for _, member in ipairs(held[jid] or {}) do
        redis.call('ZREM', leases, member)
        redis.call('ZREM', started_key(origin), member)
      end
      redis.call('ZREM', failed_key(origin), jid)
      redis.call('DEL', job, result)
    end
  end
  redis.call('HDEL', strikes, jid)
  out[#out + 1] = c
end
return table.concat(out)

-- Take back jobs failed by a foreign worker so they can be fed again: for each job still failed and
-- not done, remove it from RQ's failed registry and delete its hash and RQ result.
-- -> the job ids taken
local out = {}
for i = jobs_first, jobs_last, 3 do
  local jid = job_id(KEYS[i])
  if redis.call('SISMEMBER', done, jid) == 0 and redis.call('HGET', KEYS[i], 'status') == 'failed' then
    redis.call('ZREM', KEYS[i + 1], jid)
    redis.call('DEL', KEYS[i], KEYS[i + 2])
    out[#out + 1] = jid
  end
end
return out

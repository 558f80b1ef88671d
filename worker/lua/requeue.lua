-- Put a job that is no longer running back where its strikes say: its queue, suspects (one strike)
-- or isolate (two). Uses the including script's KEYS strikes, suspects, isolate.
local function requeue(jid, job, queue)
  redis.call('HSET', job, 'status', 'queued')
  local n = tonumber(redis.call('HGET', strikes, jid) or '0')
  if n >= 2 then
    redis.call('LPUSH', isolate, jid)
  elseif n == 1 then
    redis.call('LPUSH', suspects, jid)
  else
    redis.call('LPUSH', queue, jid)
  end
end

-- A server died with these jobs in this worker's hands. Per entry: jid, inside ('1': it was inside the
-- server when it died; '0': it was not, e.g. waiting to retry), result JSON (used only if it is
-- quarantined), exc_info. A job inside gets a strike; alone at its max_strikes-th, it is quarantined.
-- -> {quarantined jids, strikes given, handed back, stale}
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local fttl, kttl, max = tonumber(failure_ttl), tonumber(strikes_ttl), tonumber(max_strikes)
local inside = 0
for i = entries_first, entries_last, 4 do
  if ARGV[i + 1] == '1' then inside = inside + 1 end
end
local alone = inside == 1  -- nothing else was in the server: it cannot be a bystander
local quarantined, struck, handed, stale = {}, 0, 0, 0
redis.call('HINCRBY', stats, 'server_deaths', 1)
local k = jobs_first
for i = entries_first, entries_last, 4 do
  local jid = ARGV[i]
  local job, started, queue, failed = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  k = k + 4
  local member = execution_member(jid, session)
  if redis.call('ZREM', leases, member) == 0 then
    stale = stale + 1
  else
    local f = redis.call('HMGET', job, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', started, member)
      if f[2] == 'started' then
        if ARGV[i + 1] == '1' then
          local n = redis.call('HINCRBY', strikes, jid, 1)
          redis.call('EXPIRE', strikes, kttl)
          struck = struck + 1
          if n >= max and alone then
            redis.call('HSET', job, 'status', 'failed', 'ended_at', now_iso, 'exc_info', ARGV[i + 3])
            redis.call('EXPIRE', job, fttl)
            redis.call('ZADD', failed, now + fttl, jid)
            redis.call('XADD', results, '*', 'r', ARGV[i + 2])
            redis.call('SADD', done, jid)
            redis.call('HINCRBY', stats, 'failed', 1)
            redis.call('HINCRBY', stats, 'failed:' .. f[1], 1)
            redis.call('HINCRBY', stats, 'quarantined', 1)
            redis.call('HDEL', strikes, jid)
            quarantined[#quarantined + 1] = jid
          else
            if n > max - 1 then  -- not alone: never past "must run alone"
              redis.call('HSET', strikes, jid, max - 1)
            end
            requeue(jid, job, queue)
          end
        else
          requeue(jid, job, queue)
          redis.call('HINCRBY', stats, 'handed_back', 1)
          handed = handed + 1
        end
      end
    end
  end
end
if struck > 0 then redis.call('HINCRBY', stats, 'struck', struck) end
return {quarantined, struck, handed, stale}

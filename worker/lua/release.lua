-- Hand back jobs this worker holds (shutdown, restart): each back where its strikes say, counted as
-- handed_back. -> the jids put back
local out = {}
local k = jobs_first
for i = jids_first, jids_last do
  local jid = ARGV[i]
  local job, started, queue = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  k = k + 3
  local member = execution_member(jid, session)
  if redis.call('ZREM', leases, member) == 1 then
    local f = redis.call('HMGET', job, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', started, member)
      if f[2] == 'started' then
        requeue(jid, job, queue)
        redis.call('HINCRBY', stats, 'handed_back', 1)
        out[#out + 1] = jid
      end
    end
  end
end
return out

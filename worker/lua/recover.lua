-- Requeue the jobs whose lease lapsed by Redis's clock (up to 1,000 a call), each back where its
-- strikes say, counted as recovered. The lease says only the job id: its hash, and from the hash its
-- origin's started registry and queue, are derived. -> the jids put back
local s, us = clock()
local members = redis.call('ZRANGEBYSCORE', leases, '-inf', '(' .. string.format('%.6f', s + us / 1e6),
                           'LIMIT', 0, 1000)
local out = {}
for _, member in ipairs(members) do
  if redis.call('ZREM', leases, member) == 1 then
    local jid = execution_job(member)
    local job = job_key(jid)
    local f = redis.call('HMGET', job, 'origin', 'status')
    if f[1] then
      redis.call('ZREM', started_key(f[1]), member)
      if f[2] == 'started' then
        requeue(jid, job, queue_key(f[1]))
        redis.call('HINCRBY', stats, 'recovered', 1)
        out[#out + 1] = jid
      end
    end
  end
end
return out

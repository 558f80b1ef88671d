-- Extend the leases of these jobs to Redis's clock + lease_ttl.
-- -> the jids whose lease is no longer held (it lapsed and the job was recovered).
local s, us = clock()
local expiry = s + us / 1e6 + tonumber(lease_ttl)
local lost = {}
for i = jids_first, jids_last do
  local member = execution_member(ARGV[i], session)
  if redis.call('ZSCORE', leases, member) then
    redis.call('ZADD', leases, expiry, member)
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost

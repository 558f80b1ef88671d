-- The run was cancelled: forget jobs this worker holds, publishing nothing.
-- -> how many were still held (and are deleted now)
local n, k = 0, jobs_first
for i = jids_first, jids_last do
  local member = execution_member(ARGV[i], session)
  local job, started = KEYS[k], KEYS[k + 1]
  k = k + 2
  if redis.call('ZREM', leases, member) == 1 then
    local f = redis.call('HMGET', job, 'origin', 'status')
    if f[1] then redis.call('ZREM', started, member) end
    if f[2] == 'started' then redis.call('DEL', job) end
    n = n + 1
  end
end
return n

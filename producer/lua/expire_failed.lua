-- Failed jobs of a finished run: the job hash and its failed-registry score expire with the run's
-- keys (never later than they would). The origin is read from the job's hash: its failed registry is
-- derived. -> how many jobs got a TTL
local t = tonumber(ttl)
local s = clock()
local until_ = s + t
local n = 0
for i = jobs_first, jobs_last do
  local origin = redis.call('HGET', KEYS[i], 'origin')
  if origin then
    local have = redis.call('TTL', KEYS[i])
    if have == -1 or have > t then redis.call('EXPIRE', KEYS[i], t) end
    redis.call('ZADD', failed_key(origin), 'LT', until_, job_id(KEYS[i]))
    n = n + 1
  end
end
return n

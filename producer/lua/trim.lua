-- Trim failed jobs whose result is collected: `data` becomes the stub given for it (parallel to the
-- job keys), `trimmed` its original size. Skipped: a job not failed, done again, or trimmed already.
-- -> bytes freed
local freed = 0
for i = jobs_first, jobs_last do
  local jid = job_id(KEYS[i])
  local stub = ARGV[stubs_first + i - jobs_first]
  if redis.call('SISMEMBER', done, jid) == 0 and redis.call('HGET', KEYS[i], 'status') == 'failed'
      and redis.call('HEXISTS', KEYS[i], 'trimmed') == 0 then
    local size = redis.call('HSTRLEN', KEYS[i], 'data')
    if size > string.len(stub) then
      redis.call('HSET', KEYS[i], 'data', stub, 'trimmed', size)
      freed = freed + size - string.len(stub)
    end
  end
end
return freed

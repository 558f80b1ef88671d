-- Where each of a batch of fed jobs is now, one letter each: q queued (or any RQ state but the ones
-- below), s started (in flight), d done (its result is in the stream, not yet collected), f failed
-- and not done (a worker that is not batchfleet's failed it: no result will come), m missing
-- (nowhere: Redis lost it, or it was deleted behind our back). -> a string of one letter per job
local out = {}
for i = jobs_first, jobs_last do
  local c
  if redis.call('SISMEMBER', done, job_id(KEYS[i])) == 1 then
    c = 'd'
  elseif redis.call('EXISTS', KEYS[i]) == 0 then
    c = 'm'
  else
    local st = redis.call('HGET', KEYS[i], 'status')
    if st == 'started' then c = 's' elseif st == 'failed' then c = 'f' else c = 'q' end
  end
  out[#out + 1] = c
end
return table.concat(out)

-- Final outcomes, accepted only while the job's lease is held. Per outcome: its job key (in `jobs`),
-- meta "<s|f|r> <completion tokens> <bytes of exc_info> <origin>" (s: succeeded, no exc_info;
-- f: failed; r: refused, no result) and payload = exc_info followed by the result JSON. Each origin's
-- started and failed registries come once (`registries`, in the order of `origins`).
-- -> {stale jids, results stream length}
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local fttl = tonumber(failure_ttl)
local started, failed = {}, {}
for i = origins_first, origins_last do
  local r = registries_first + 2 * (i - origins_first)
  started[ARGV[i]], failed[ARGV[i]] = KEYS[r], KEYS[r + 1]
end
local OUTCOME = {s = 'succeeded', f = 'failed', r = 'refused'}
local stale = {}
local k = jobs_first
for i = outcomes_first, outcomes_last, 2 do
  local job = KEYS[k]
  k = k + 1
  local jid = job_id(job)
  local code, tokens, exclen, origin = string.match(ARGV[i], '^(%a) (%d+) (%d+) (.*)$')
  local outcome = OUTCOME[code]
  local payload = ARGV[i + 1]
  exclen = tonumber(exclen)
  local member = execution_member(jid, session)
  if redis.call('ZREM', leases, member) == 0 then
    stale[#stale + 1] = jid  -- the lease lapsed and the job was recovered: its other run reports
  else
    redis.call('ZREM', started[origin], member)
    redis.call('HDEL', strikes, jid)
    if outcome == 'succeeded' then
      redis.call('DEL', job)  -- result_ttl=0: the result leaves Redis through the stream below
    else
      redis.call('HSET', job, 'status', 'failed', 'ended_at', now_iso, 'exc_info', string.sub(payload, 1, exclen))
      redis.call('EXPIRE', job, fttl)  -- as long as its failed-registry entry: no job hash outlives it
      redis.call('ZADD', failed[origin], now + fttl, jid)
    end
    if outcome == 'refused' then  -- not this run's prompt to answer: no result, RQ's failed registry only
      redis.call('HINCRBY', stats, 'refused', 1)
      redis.call('HINCRBY', stats, 'refused:' .. origin, 1)
    else
      redis.call('XADD', results, '*', 'r', exclen > 0 and string.sub(payload, exclen + 1) or payload)
      redis.call('SADD', done, jid)
      redis.call('HINCRBY', stats, outcome, 1)
      redis.call('HINCRBY', stats, outcome .. ':' .. origin, 1)
      redis.call('HINCRBY', stats, 'completion_tokens', tokens)
    end
  end
end
return {stale, redis.call('XLEN', results)}

-- Helpers batchfleet's scripts share (see batchfleet/scripts.py): each starts with a `--- name:` line;
-- a script gets the ones it uses. The key prefixes are filled in from batchfleet/rqlayout.py.
-- The key helpers (`*_key`) are the only place a script builds a key name: a script may call one
-- only if its declaration lists it in `derives`, for keys it learns inside (a job id popped from a
-- list, a job's origin read from its hash). Every other key arrives in KEYS.

--- clock: Redis's clock (TIME) as seconds and microseconds: every expiry and timestamp a script writes
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]), tonumber(t[2])
end

--- iso: seconds since the epoch and microseconds -> 2026-01-02T03:04:05.000006Z (RQ's timestamp format)
local function iso(s, us)
  local days = math.floor(s / 86400)
  local rem = s - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', y, m, d, math.floor(rem / 3600),
                       math.floor(rem % 3600 / 60), rem % 60, us)
end

--- execution_member: a job's lease and started-registry member for one execution (as in rqlayout.py)
local function execution_member(jid, execution)
  return jid .. ':' .. execution
end

--- execution_job: the job id of a lease or started-registry member (as in rqlayout.py); nil if none
local function execution_job(member)
  return string.match(member, '^(.*):[^:]*$')
end

--- job_id: the job id of a job key given in KEYS
local function job_id(key)
  return string.sub(key, {{job_prefix_len}} + 1)
end

--- job_key: the hash of a job the script learned the id of
local function job_key(jid)
  return {{job_prefix}} .. jid
end

--- queue_key: the queue a job read from Redis names as its origin
local function queue_key(queue)
  return {{queue_prefix}} .. queue
end

--- started_key: RQ's started registry of a queue a script learned the name of
local function started_key(queue)
  return {{started_prefix}} .. queue
end

--- failed_key: RQ's failed registry of a queue a script learned the name of
local function failed_key(queue)
  return {{failed_prefix}} .. queue
end

-- Claim up to `n` jobs: first (take_solo = '1') one prompt that must run alone, which then comes
-- alone; else a group of up to `suspects` suspects (0: none), then the queues in order (the first is
-- the worker's own; from the others, whole plan units from their tails, see steal_units; of a queue
-- whose `keep` is not -1 (another worker serves it), at most half what it holds beyond `keep`); if the queues
-- left slots empty, the group grows to up to `suspects_dry`. Each claimed job is marked started (RQ's
-- fields), entered in its origin's started registry and leased, on Redis's clock.
-- -> flat (jid, origin, data, kind, grp) per claimed job, kind 'normal', 'suspect' or 'solo', grp its plan unit
-- ('' for none).
local s, us = clock()
local now, now_iso = s + us / 1e6, iso(s, us)
local want, ttl, sttl = tonumber(n), tonumber(lease_ttl), tonumber(started_ttl)
local out, taken = {}, 0
local function take(jid, fallback, kind)
  local jkey = job_key(jid)
  local f = redis.call('HMGET', jkey, 'data', 'origin', 'status', 'grp')
  -- deleted while queued (`rq empty`), or a stray copy of an id that runs or ran: skip it
  if not f[1] or f[3] ~= 'queued' then return false end
  local origin = f[2] or fallback
  local member = execution_member(jid, session)
  redis.call('HSET', jkey, 'status', 'started', 'started_at', now_iso, 'last_heartbeat', now_iso,
             'worker_name', worker)
  redis.call('ZADD', started_key(origin), now + sttl, member)
  redis.call('ZADD', leases, now + ttl, member)
  out[#out + 1] = jid; out[#out + 1] = origin; out[#out + 1] = f[1]; out[#out + 1] = kind
  out[#out + 1] = f[4] or ''
  return true
end
local function pop_one(list, kind)
  while true do
    local jid = redis.call('LPOP', list)
    if not jid then return false end
    if take(jid, 'unknown', kind) then return true end
  end
end
if take_solo == '1' and pop_one(isolate, 'solo') then return out end
if want <= 0 then return out end
local group, group_dry = math.min(tonumber(suspects_n), want), math.min(tonumber(suspects_dry), want)
local grouped = 0
while grouped < group and pop_one(suspects, 'suspect') do grouped = grouped + 1 end
taken = grouped
-- Another GPU's queue whose tail holds a unit of the prefix plan (its jobs carry `grp`): whole units
-- from its tail, as many as `room` holds (the front is what its own worker takes next); a unit is split
-- only when it is all that queue has within reach. A tail of no unit: nil (taken from the front).
local function steal_units(list, room)
  local ids = redis.call('LRANGE', list, -room, -1)
  local n = #ids
  if n == 0 then return nil end
  local grps = {}
  for j = 1, n do grps[j] = redis.call('HGET', job_key(ids[j]), 'grp') or false end
  if not grps[n] then return nil end
  local cut = 1
  if grps[1] and redis.call('LLEN', list) > n then  -- the range may begin inside a unit: leave it whole
    local j = 1
    while j <= n and grps[j] == grps[1] do j = j + 1 end
    if j <= n then cut = j end
  end
  return redis.call('RPOP', list, n - cut + 1)
end
for i = queues_first, queues_last do
  if taken >= want then break end
  local at = queue_names_first + 2 * (i - queues_first)  -- its name, then how many to leave its worker
  local room, keep = want - taken, tonumber(ARGV[at + 1])
  if keep >= 0 then room = math.min(room, math.ceil((redis.call('LLEN', KEYS[i]) - keep) / 2)) end
  if room > 0 then
    local ids = i > queues_first and steal_units(KEYS[i], room) or nil
    if ids == nil then ids = redis.call('LPOP', KEYS[i], room) end
    if ids then
      for _, jid in ipairs(ids) do
        if take(jid, ARGV[at], 'normal') then taken = taken + 1 end
      end
    end
  end
end
if group > 0 then  -- the queues are dry: nothing waits for these slots but suspects
  while grouped < group_dry and taken < want and pop_one(suspects, 'suspect') do
    grouped, taken = grouped + 1, taken + 1
  end
end
return out

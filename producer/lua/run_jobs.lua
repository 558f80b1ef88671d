-- The jobs of a run among a SCAN batch of job keys: their `data` ends with `suffix`.
-- -> flat (job key, origin) of those that match
local out, n = {}, string.len(suffix)
for i = jobs_first, jobs_last do
  local f = redis.call('HMGET', KEYS[i], 'data', 'origin')
  if f[1] and string.sub(f[1], -n) == suffix then
    out[#out + 1] = KEYS[i]
    out[#out + 1] = f[2] or ''
  end
end
return out

-- Give keys a TTL of `ttl` seconds, never lengthening one they have. -> how many got it
local t, n = tonumber(ttl), 0
for i = targets_first, targets_last do
  local have = redis.call('TTL', KEYS[i])
  if have == -1 or have > t then
    redis.call('EXPIRE', KEYS[i], t)
    n = n + 1
  end
end
return n

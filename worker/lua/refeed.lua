-- A trimmed failed job came back (`rq requeue`): the head feeds its prompt again from the store.
-- -> 1 if handed over (its lease was held), else 0
local member = execution_member(jid, session)
if redis.call('ZREM', leases, member) == 0 then return 0 end
if redis.call('HGET', job, 'origin') then redis.call('ZREM', started, member) end
redis.call('DEL', job)
redis.call('RPUSH', refeed, cid)
return 1

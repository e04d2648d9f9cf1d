-- KEYS: ready, held.  ARGV: group, dead consumer, limit.  Moves up to ``limit``
-- of the consumer's pending entries to the end of the stream as new entries
-- (XACK + XDEL + XADD, the job's index entry following), where any live
-- consumer reads them; forgets the consumer once it has none left.
-- Returns {pending entries looked at, entries handed on}.
local limit = tonumber(ARGV[3])
local pend = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', limit, ARGV[2])
local n = 0
for _, p in ipairs(pend) do
  local eid = p[1]
  local found = redis.call('XRANGE', KEYS[1], eid, eid)
  redis.call('XACK', KEYS[1], ARGV[1], eid)
  if #found > 0 then
    local fields = found[1][2]
    redis.call('XDEL', KEYS[1], eid)
    local new = redis.call('XADD', KEYS[1], '*', unpack(fields))
    for i = 1, #fields, 2 do
      if fields[i] == 'id' then
        local cur = redis.call('HGET', KEYS[2], fields[i + 1])
        if cur and string.match(cur, '|(.*)$') == eid then
          redis.call('HSET', KEYS[2], fields[i + 1], string.match(cur, '^(%d+)|') .. '|' .. new)
        end
      end
    end
    n = n + 1
  end
end
if #pend < limit then redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) end
return {#pend, n}

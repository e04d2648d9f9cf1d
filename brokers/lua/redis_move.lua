-- KEYS: due, msg, ready, held.  ARGV: now_ms, limit.  Returns {moved, next score or nil}.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #ids > 0 then
  local bodies = redis.call('HMGET', KEYS[2], unpack(ids))
  local curs = redis.call('HMGET', KEYS[4], unpack(ids))
  redis.call('ZREM', KEYS[1], unpack(ids))
  redis.call('HDEL', KEYS[2], unpack(ids))
  local held = {}
  for n, id in ipairs(ids) do
    if bodies[n] then
      local ver = curs[n] and string.match(curs[n], '^(%d+)|') or '0'
      local eid = redis.call('XADD', KEYS[3], '*', 'id', id, 'v', ver, 'body', bodies[n])
      held[#held + 1] = id
      held[#held + 1] = ver .. '|' .. eid
    end
  end
  if #held > 0 then redis.call('HSET', KEYS[4], unpack(held)) end
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {#ids, head[2] or false}

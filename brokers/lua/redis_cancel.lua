-- KEYS: due, msg, ready, held.  ARGV: job ids.  Returns how many entries went.
local n = 0
for _, id in ipairs(ARGV) do
  local cur = redis.call('HGET', KEYS[4], id)
  n = n + redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  if cur then
    local loc = string.match(cur, '|(.*)$')
    if loc ~= 'z' then n = n + redis.call('XDEL', KEYS[3], loc) end
    redis.call('HDEL', KEYS[4], id)
  end
end
return n

-- KEYS: due, msg, ready, held.  ARGV: now_ms, wake channel, then (id, version,
-- score_ms, body) per message.  Returns per message the stream entry id, "z"
-- (parked) or "stale" (Redis holds a newer version of the job: skipped).
local now = tonumber(ARGV[1])
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local oldmin = head[2] and tonumber(head[2])
local ids = {}
for i = 3, #ARGV, 4 do ids[#ids + 1] = ARGV[i] end
local curs = redis.call('HMGET', KEYS[4], unpack(ids))
local newmin = nil
local zadd, msgs, held, out = {}, {}, {}, {}
for n, id in ipairs(ids) do
  local i = 3 + (n - 1) * 4
  local ver, score, body = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]
  local cur = curs[n]
  if cur and tonumber(string.match(cur, '^(%d+)|')) > ver then
    out[n] = 'stale'
  elseif score <= now then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    local eid = redis.call('XADD', KEYS[3], '*', 'id', id, 'v', ver, 'body', body)
    redis.call('HSET', KEYS[4], id, ver .. '|' .. eid)
    out[n] = eid
  else
    zadd[#zadd + 1] = score
    zadd[#zadd + 1] = id
    msgs[#msgs + 1] = id
    msgs[#msgs + 1] = body
    held[#held + 1] = id
    held[#held + 1] = ver .. '|z'
    if newmin == nil or score < newmin then newmin = score end
    out[n] = 'z'
  end
end
if #zadd > 0 then
  redis.call('ZADD', KEYS[1], unpack(zadd))
  redis.call('HSET', KEYS[2], unpack(msgs))
  redis.call('HSET', KEYS[4], unpack(held))
end
if newmin and (oldmin == nil or newmin < oldmin) then
  redis.call('PUBLISH', ARGV[2], tostring(newmin))
end
return out

-- KEYS: due, msg, ready, held.  ARGV: group, entry id, job id, version,
-- score_ms, body, wake channel.  Returns 1 if parked again, 0 if stale.
redis.pcall('XACK', KEYS[3], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])
local ver = tonumber(ARGV[4])
local cur = redis.call('HGET', KEYS[4], ARGV[3])
if cur and tonumber(string.match(cur, '^(%d+)|')) > ver then return 0 end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local score = tonumber(ARGV[5])
redis.call('ZADD', KEYS[1], score, ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[6])
redis.call('HSET', KEYS[4], ARGV[3], ver .. '|z')
if head[2] == nil or score < tonumber(head[2]) then redis.call('PUBLISH', ARGV[7], ARGV[5]) end
return 1

-- KEYS: ready, held.  ARGV: group, entry id, job id.
for i = 2, #ARGV, 2 do
  local entry, id = ARGV[i], ARGV[i + 1]
  redis.pcall('XACK', KEYS[1], ARGV[1], entry)
  redis.call('XDEL', KEYS[1], entry)
  local cur = redis.call('HGET', KEYS[2], id)
  if cur and string.match(cur, '|(.*)$') == entry then redis.call('HDEL', KEYS[2], id) end
end
return 1

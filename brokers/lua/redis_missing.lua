-- KEYS: due, ready, held.  ARGV: (job id, version) pairs.  Returns the ids
-- whose message at that version is neither parked nor on the stream.
local out = {}
for i = 1, #ARGV, 2 do
  local id, ver = ARGV[i], ARGV[i + 1]
  local cur = redis.call('HGET', KEYS[3], id)
  local ok = false
  if cur then
    local v, loc = string.match(cur, '^(%d+)|(.*)$')
    if v == ver then
      if loc == 'z' then
        ok = redis.call('ZSCORE', KEYS[1], id) ~= false
      else
        ok = #redis.call('XRANGE', KEYS[2], loc, loc) > 0
      end
    end
  end
  if not ok then out[#out + 1] = id end
end
return out

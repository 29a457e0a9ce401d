-- The design reference's sliding window counter, unchanged: the baseline ringlimit is
-- measured against (`ringlimit bench --compare-redis`).
-- KEYS[1] = current window counter, KEYS[2] = previous window counter.
-- ARGV = limit, window_ms, elapsed_ms in this window.
local limit   = tonumber(ARGV[1])
local window  = tonumber(ARGV[2])
local elapsed = tonumber(ARGV[3])
local f       = elapsed / window

local cur  = tonumber(redis.call('GET', KEYS[1]) or '0')
local prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local est  = prev * (1 - f) + cur

if est + 1 > limit then
  local rest = window - elapsed
  if prev > 0 then
    local head = limit - 1 - cur
    if head >= 0 then
      local need = (1 - head / prev) * window
      rest = math.min(rest, math.max(0, need - elapsed))
    end
  end
  return { 0, math.ceil(rest), limit, 0 }
end

redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], window * 2)
return { 1, 0, limit, limit - math.ceil(est) - 1 }

-- redis-cell's CL.THROTTLE as a Redis Lua script: the same GCRA and the same five
-- integers (limited, limit, remaining, retry_after s, reset_after s), so the two sides
-- of bench/resp-compare.sh do the same work per call.
-- KEYS[1]: the key. ARGV: max_burst, count, period (s), quantity.
local max_burst = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local quantity = tonumber(ARGV[4] or "1")
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) -- microseconds
local interval = period * 1000000 / count
local tolerance = interval * (max_burst + 1)
local increment = interval * quantity
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then
    tat = now
end
local new_tat = tat + increment
local diff = now - (new_tat - tolerance)
local limited, retry, ttl = 0, -1, 0
if diff < 0 then
    limited = 1
    if increment <= tolerance then
        retry = math.ceil(-diff / 1000000)
    end
    ttl = tat - now
else
    ttl = new_tat - now
    if increment > 0 then
        redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil(ttl / 1000))
    end
end
local remaining = 0
local next = tolerance - ttl
if next > -interval then
    remaining = math.floor(next / interval)
end
return { limited, max_burst + 1, remaining, retry, math.ceil(ttl / 1000000) }

-- Shared by every script that draws fencing tokens (the store puts this file in front of
-- each of them when it loads them). Before a draw, lifts the counter to the floor below
-- which no token may be drawn:
--   the newest token the caller drew before (an instance remembers its own), and
--   when the counter is missing, the server's clock in microseconds. A missing counter was
--   never there or was lost with Redis's data; either way no token was ever drawn above
--   the clock, since the counter starts from it and a draw adds 1 (or one block of 16)
--   far less often than once a microsecond. So the first token after a loss is above every
--   token drawn before it, by any instance, not only above the drawer's own.
-- Built as a string, not a Lua number: Redis turns a number past 14 digits into 1.7e+15.
local function fence_floor(fence, newest)
  local current = redis.call('GET', fence)
  if not current then
    local t = redis.call('TIME')
    local clock = t[1] .. string.format('%06d', tonumber(t[2]))
    if tonumber(clock) > tonumber(newest) then
      redis.call('SET', fence, clock)
      return
    end
  end
  if tonumber(current or '0') < tonumber(newest) then
    redis.call('SET', fence, newest)
  end
end

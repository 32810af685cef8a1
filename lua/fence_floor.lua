-- Shared by every script that draws fencing tokens (the store puts this file in front of
-- each of them when it loads them). Before a draw, lifts the counter to the floor below
-- which no token may be drawn:
--   the newest token the caller drew before (an instance remembers its own), and
--   the server's clock in microseconds, at every draw. Tokens are drawn far less often
--   than once a microsecond (one, or one block of 16, per holder), so the counter keeps
--   close to the clock and every token is above every token drawn a moment before, by any
--   instance. That is what makes a counter that went back safe: lost with Redis's data, or
--   rolled back (an append-only file whose last second was not on disk, a backup, a lagging
--   replica promoted), whose tokens, already given out, would otherwise be given out again.
--   It relies on Redis's clock not going back by more than the tokens' lead over it.
-- Built as a string, not a Lua number: Redis turns a number past 14 digits into 1.7e+15.
local function fence_floor(fence, newest)
  local current = tonumber(redis.call('GET', fence) or '0')
  local t = redis.call('TIME')
  local clock = t[1] .. string.format('%06d', tonumber(t[2]))
  if tonumber(clock) > current and tonumber(clock) >= tonumber(newest) then
    redis.call('SET', fence, clock)
  elseif current < tonumber(newest) then
    redis.call('SET', fence, newest)
  end
end

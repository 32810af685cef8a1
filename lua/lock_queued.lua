-- Take the lock, or join its FIFO queue of waiters, in one step (`LOCK_WAIT=notify`, the
-- strategies whose release hands the lock over: lua-release, reentrant, watchdog, fenced).
-- A release hands the lock to the first live waiter (see hand_off.lua):
-- it writes the lock for that waiter and pushes
-- '<behind>|<token>|<last>|<passes>|<next_waited>|<shape>|<owner>' onto the waiter's
-- instance's inbox list, so the woken waiter already holds the lock (<behind>: how many
-- other instances still have waiters queued; <token>..<last>: the fencing tokens drawn for
-- it, 0|0 unless fenced; <passes>: the mean of critical sections per tenure; <next_waited>:
-- how long the next in line has waited, in ms).
-- A waiter's entry carries a deadline that the waiter refreshes while it waits; a release
-- skips entries past their deadline, so a waiter that died stalls nobody.
-- KEYS[1]: the lock key (a string for shape 'string', a hash owner -> count otherwise)
-- KEYS[2]: the fencing counter
-- KEYS[3]: the queue (a sorted set: owner -> arrival time in microseconds)
-- KEYS[4]: the entries (a hash: owner ->
--          'deadline ms|inbox key|shape|newest token|lease ms|tokens to draw')
-- KEYS[5]: this waiter's inbox (a list its instance blocks on)
-- KEYS[6]: how many queued waiters each instance has (a hash: inbox key -> count)
-- ARGV[1]: owner id (instance:request)
-- ARGV[2]: shape: 'string' (lua-release), 'hash' (reentrant, watchdog), 'fenced'
-- ARGV[3]: lease in milliseconds
-- ARGV[4]: the newest token the caller has drawn before (0 if none)
-- ARGV[5]: phase: 'try' (not queued yet), 'wait' (queued: refresh the entry),
--          'leave' (giving up: leave the queue), 'forget' (leave the queue and nothing
--          else: the waiter got the lock from a sale of its own instance)
-- ARGV[6]: how long the entry stays valid without a refresh, in milliseconds
-- ARGV[7]: fenced only: how many tokens to draw when the lock is granted, here or by a
--          hand-off: the first is the holder's, the others are for the sales its instance
--          passes the lock to within its tenure (1 without tenures)
-- returns: {1, token, behind, last} when held (taken, re-entered, or handed over while
--          queued; token..last are the tokens drawn for it, 0 unless fenced, and
--          token = last when re-entered; behind is how many other instances have waiters
--          queued); {0, pttl} when another owner holds it (queued unless leaving);
--          {0, 0} for 'forget'
local owner, shape, phase = ARGV[1], ARGV[2], ARGV[5]
local block = math.max(1, tonumber(ARGV[7] or '1') or 1)
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
-- pcall: GET on a hash lock is an error (a table), and HEXISTS then asks the hash. One call
-- for a free or string lock instead of TYPE then GET: a waiter's attempt is often in line
-- in Redis just ahead of the new holder's first command.
local held = redis.pcall('GET', KEYS[1])
local free = held == false
local mine = held == owner
  or (type(held) == 'table' and redis.pcall('HEXISTS', KEYS[1], owner) == 1)
local queued = phase ~= 'try' and redis.call('HEXISTS', KEYS[4], owner) == 1

local function current_token()
  if shape ~= 'fenced' then
    return 0
  end
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end

local function leave_queue()
  if redis.call('ZREM', KEYS[3], owner) == 1
      and redis.call('HINCRBY', KEYS[6], KEYS[5], -1) <= 0 then
    redis.call('HDEL', KEYS[6], KEYS[5])
  end
  redis.call('HDEL', KEYS[4], owner)
end

-- Other instances with waiters queued: this one's are served within its tenure.
local function others_waiting()
  local n = redis.call('HLEN', KEYS[6])
  if redis.call('HEXISTS', KEYS[6], KEYS[5]) == 1 then
    n = n - 1
  end
  return n
end

if phase == 'forget' then
  leave_queue()
  return {0, 0}
end

-- Queued before, and the entry is gone while the lock is ours: a release handed it over,
-- with a short lease (hand_off.lua), which this holder now extends to its own.
-- The inbox message is then redundant: take it back so that nobody acts on it, and take
-- the tokens it carries. Without it (the instance has popped it already) the newest token
-- is this holder's: only a holder draws, and the lock is ours.
if phase ~= 'try' and mine and not queued then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  local tail = '|' .. shape .. '|' .. owner
  for _, message in ipairs(redis.call('LRANGE', KEYS[5], 0, -1)) do
    local head = #message > #tail and string.sub(message, -#tail) == tail
      and string.sub(message, 1, #message - #tail)
    -- 'behind|token|last|passes|next_waited' (hand_off.lua), or fewer numbers after `last`
    -- from an older release.
    local token, last = nil, nil
    if head then
      token, last = string.match(head, '^%d+|(%d+)|(%d+)[|%d]*$')
    end
    if token then
      redis.call('LREM', KEYS[5], 1, message)
      return {1, tonumber(token), others_waiting(), tonumber(last)}
    end
  end
  local token = current_token()
  return {1, token, others_waiting(), token}
end

if free or (mine and shape ~= 'string') then
  leave_queue()
  local token, last = 0, 0
  if shape == 'string' then
    redis.call('SET', KEYS[1], owner, 'PX', ARGV[3])
  else
    if shape == 'fenced' then
      last = mine and tonumber(redis.call('GET', KEYS[2]))
      if last then
        token = last
      else
        fence_floor(KEYS[2], ARGV[4])
        last = redis.call('INCRBY', KEYS[2], block)
        token = last - block + 1
      end
    end
    redis.call('HINCRBY', KEYS[1], owner, 1)
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
  end
  return {1, token, others_waiting(), last}
end

local pttl = redis.call('PTTL', KEYS[1])
if phase == 'leave' then
  leave_queue()
  return {0, pttl}
end
-- NX: a refresh keeps the waiter's place in line.
if redis.call('ZADD', KEYS[3], 'NX', now_us, owner) == 1 then
  redis.call('HINCRBY', KEYS[6], KEYS[5], 1)
end
redis.call('HSET', KEYS[4], owner, (now + tonumber(ARGV[6])) .. '|' .. KEYS[5] .. '|' .. shape
  .. '|' .. ARGV[4] .. '|' .. ARGV[3] .. '|' .. block)
-- Forgotten by themselves once nobody refreshes any entry.
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]) + 60000)
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[6]) + 60000)
redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[6]) + 60000)
return {0, pttl}

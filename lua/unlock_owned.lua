-- Compare-and-delete a plain string lock in one step (tutorial v6), and hand the lock to
-- the next queued waiter if there is one.
-- (A lock key of another type is a hash lock of another strategy: not ours.)
-- KEYS[1]: the lock key (a string holding the owner id)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- KEYS[3..5] (optional, together): the waiters' queue, their entries and the fencing
--          counter (see lock_queued.lua); without them nothing is handed over
-- ARGV[1]: owner id
-- ARGV[2]: release channel, told when the lock is free so waiters retry at once
-- returns: 1 when released (deleted, or handed to the next waiter); 0 when the lock is gone
--          or belongs to another owner
-- Hands the free lock to the first queued waiter whose entry is still valid (see
-- lock_queued.lua); false when there is none. Expired entries (a waiter that died or
-- stopped refreshing) are dropped on the way.
local function hand_off(lock, fence, queue, entries)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  while true do
    local first = redis.call('ZRANGE', queue, 0, 0)
    if #first == 0 then
      return false
    end
    local who = first[1]
    local entry = redis.call('HGET', entries, who)
    redis.call('ZREM', queue, who)
    redis.call('HDEL', entries, who)
    if entry then
      local deadline, inbox, shape, newest, lease = string.match(entry, '^(%d+)|(.+)|(%a+)|(%d+)|(%d+)$')
      if deadline and tonumber(deadline) > now then
        local token = 0
        if shape == 'string' then
          redis.call('SET', lock, who, 'PX', lease)
        else
          if shape == 'fenced' then
            if tonumber(redis.call('GET', fence) or '0') < tonumber(newest) then
              redis.call('SET', fence, newest)
            end
            token = redis.call('INCR', fence)
          end
          redis.call('HSET', lock, who, 1)
          redis.call('PEXPIRE', lock, lease)
        end
        redis.call('RPUSH', inbox, token .. '|' .. shape .. '|' .. who)
        redis.call('PEXPIRE', inbox, lease)
        return true
      end
    end
  end
end

if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if #KEYS >= 5 and hand_off(KEYS[1], KEYS[5], KEYS[3], KEYS[4]) then
    return 1
  end
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0

-- Leave one level of the reentrant lock; the last level deletes it, or hands it to the next
-- queued waiter if there is one, and otherwise announces the release.
-- (A lock key of another type belongs to another strategy's holder: not ours.)
-- KEYS[1]: the lock key (a hash, owner -> hold count)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- KEYS[3..5] (optional, together): the waiters' queue, their entries and the fencing
--          counter (see lock_queued.lua); without them nothing is handed over
-- ARGV[1]: owner id
-- ARGV[2]: lease in milliseconds, restored while outer levels are still held
-- ARGV[3]: release channel, told when the lock is free so waiters retry at once
-- returns: -1 when this owner does not hold the lock (nothing changed);
--          0 when outer levels remain (count - 1); 1 when the lock was released (deleted,
--          or handed to the next waiter)
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

if redis.call('TYPE', KEYS[1]).ok ~= 'hash' or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return -1
end
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('DEL', KEYS[1])
if #KEYS >= 5 and hand_off(KEYS[1], KEYS[5], KEYS[3], KEYS[4]) then
  return 1
end
redis.call('PUBLISH', ARGV[3], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1

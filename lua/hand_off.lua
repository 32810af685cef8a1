-- Shared by the release scripts (unlock_owned.lua, unlock_reentrant.lua): the store puts this
-- file in front of each of them when it loads them, so that the hand-off is written once and
-- still runs inside the release's own atomic step.
-- Hands the lock its caller has just let go of to the first queued waiter whose entry is
-- still valid (see lock_queued.lua); false when there is none, and then the caller deletes
-- the lock. The caller does not delete it first: a string lock is overwritten by SET, and
-- only a hash waiter needs the old value gone; every call a release makes is on the path
-- from one holder to the next (about 7 us each on a small VM, as measured by SLOWLOG).
-- Expired entries (a waiter that died or stopped refreshing) are dropped on the way. The lock is written with a lease of at most
-- HANDED_LEASE_MS: a waiter that died within its entry's validity then holds it up that
-- long, not a whole lease; the live one extends it to its lease as soon as it hears of it
-- (src/lock/handoff.rs, HANDED_LEASE).
local HANDED_LEASE_MS = 1000
-- `passes` is the releasing instance's number of critical sections per tenure (in 256ths,
-- 0 when it has none), passed on to the next holder in the message: one number travels with
-- the lock from instance to instance, so every instance in line uses the same
-- (src/lock/cohort.rs, next_mean).
local function hand_off(lock, fence, queue, entries, inboxes, passes)
  local t = redis.call('TIME')
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local now = math.floor(now_us / 1000)
  while true do
    local first = redis.call('ZPOPMIN', queue)
    if #first == 0 then
      return false
    end
    local who = first[1]
    local entry = redis.call('HGET', entries, who)
    redis.call('HDEL', entries, who)
    if entry then
      local deadline, inbox, shape, newest, lease, block =
        string.match(entry, '^(%d+)|(.+)|(%a+)|(%d+)|(%d+)|(%d+)$')
      -- Whether the waiter's instance still has others queued, known from the count
      -- itself rather than asked again below.
      local still_listed = false
      if inbox then
        if redis.call('HINCRBY', inboxes, inbox, -1) <= 0 then
          redis.call('HDEL', inboxes, inbox)
        else
          still_listed = true
        end
      end
      if deadline and tonumber(deadline) > now then
        local token, last = 0, 0
        local handed = math.min(tonumber(lease), HANDED_LEASE_MS)
        if shape == 'string' then
          redis.call('SET', lock, who, 'PX', handed)
        else
          if shape == 'fenced' then
            fence_floor(fence, newest)
            -- The waiter's whole block, as its own attempt would have drawn it.
            last = redis.call('INCRBY', fence, math.max(1, tonumber(block)))
            token = last - math.max(1, tonumber(block)) + 1
          end
          redis.call('DEL', lock)
          redis.call('HSET', lock, who, 1)
          redis.call('PEXPIRE', lock, handed)
        end
        -- How many other instances still wait: the new holder's tenure is shared with them
        -- (its own instance's waiters are served within the tenure).
        local behind = redis.call('HLEN', inboxes)
        if still_listed then
          behind = behind - 1
        end
        -- How long the next in line has waited already, in milliseconds: the new holder
        -- ends its tenure early rather than let that wait run past its bound
        -- (src/lock/cohort.rs, LONGEST_WAIT). The round the holders size their tenures by is
        -- measured a round late; this is measured now, so a turn that comes late is caught
        -- at the next one. 0 when nobody is next, when the next entry is past its deadline
        -- (the next release skips it), or is the new holder's own instance's (served
        -- within its tenure).
        local next_waited = 0
        local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
        if #head == 2 then
          local next_entry = redis.call('HGET', entries, head[1]) or ''
          local valid, next_inbox = string.match(next_entry, '^(%d+)|(.+)|%a+|%d+|%d+|%d+$')
          if valid and tonumber(valid) > now and next_inbox ~= inbox then
            next_waited = math.max(0, math.floor((now_us - tonumber(head[2])) / 1000))
          end
        end
        -- %d, not `..`: Lua writes a number past 14 digits as 1.7961764366741e+15, and
        -- tokens start from the clock in microseconds (fence_floor.lua).
        redis.call('RPUSH', inbox,
          string.format('%d|%d|%d|%d|%d|', behind, token, last, tonumber(passes) or 0,
            next_waited) .. shape .. '|' .. who)
        redis.call('PEXPIRE', inbox, lease)
        return true
      end
    end
  end
end

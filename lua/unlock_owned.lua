-- Compare-and-delete a plain string lock in one step (tutorial v6), and hand the lock to
-- the next queued waiter if there is one.
-- (A lock key of another type is a hash lock of another strategy: not ours.)
-- KEYS[1]: the lock key (a string holding the owner id)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- KEYS[3..6] (optional, together): the waiters' queue, their entries, the fencing counter
--          and the count of waiters per instance (see lock_queued.lua); without them
--          nothing is handed over
-- ARGV[1]: owner id
-- ARGV[2]: release channel, told when the lock is free so waiters retry at once
-- ARGV[3]: the command that tells it: PUBLISH, or SPUBLISH on a cluster (sharded pub/sub)
-- ARGV[4] (optional): critical sections per tenure, passed on with the lock (see hand_off.lua)
-- returns: 1 when released (deleted, or handed to the next waiter); 0 when the lock is gone
--          or belongs to another owner
-- hand_off(lock, fence, queue, entries, inboxes, passes): see hand_off.lua, loaded in front of this script.

-- pcall: GET on a hash lock is an error, returned as a table, which is no owner id. One call
-- instead of TYPE then GET, since this script is on the path from one holder to the next.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  if #KEYS >= 6 and hand_off(KEYS[1], KEYS[5], KEYS[3], KEYS[4], KEYS[6], ARGV[4]) then
    return 1
  end
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3], ARGV[2], ARGV[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0

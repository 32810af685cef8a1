-- Leave one level of the reentrant lock; the last level deletes it, or hands it to the next
-- queued waiter if there is one, and otherwise announces the release.
-- (A lock key of another type belongs to another strategy's holder: not ours.)
-- KEYS[1]: the lock key (a hash, owner -> hold count)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- KEYS[3..6] (optional, together): the waiters' queue, their entries, the fencing counter
--          and the count of waiters per instance (see lock_queued.lua); without them
--          nothing is handed over
-- ARGV[1]: owner id
-- ARGV[2]: lease in milliseconds, restored while outer levels are still held
-- ARGV[3]: release channel, told when the lock is free so waiters retry at once
-- ARGV[4]: the command that tells it: PUBLISH, or SPUBLISH on a cluster (sharded pub/sub)
-- ARGV[5] (optional): critical sections per tenure, passed on with the lock (see hand_off.lua)
-- returns: -1 when this owner does not hold the lock (nothing changed);
--          0 when outer levels remain (count - 1); 1 when the lock was released (deleted,
--          or handed to the next waiter)
-- hand_off(lock, fence, queue, entries, inboxes, passes): see hand_off.lua, loaded in front of this script.

-- pcall: HEXISTS on a string lock is an error, returned as a table, which is not 1. One call
-- instead of TYPE then HEXISTS, since this script is on the path from one holder to the next.
if redis.pcall('HEXISTS', KEYS[1], ARGV[1]) ~= 1 then
  return -1
end
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
if #KEYS >= 6 and hand_off(KEYS[1], KEYS[5], KEYS[3], KEYS[4], KEYS[6], ARGV[5]) then
  return 1
end
redis.call('DEL', KEYS[1])
redis.call(ARGV[4], ARGV[3], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1

-- Leave one level of the reentrant lock; the last level deletes it and announces the release.
-- (A lock key of another type belongs to another strategy's holder: not ours.)
-- KEYS[1]: the lock key (a hash, owner -> hold count)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- ARGV[1]: owner id
-- ARGV[2]: lease in milliseconds, restored while outer levels are still held
-- ARGV[3]: release channel, told when the lock is free so waiters retry at once
-- returns: -1 when this owner does not hold the lock (nothing changed);
--          0 when outer levels remain (count - 1); 1 when the lock was deleted
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return -1
end
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1

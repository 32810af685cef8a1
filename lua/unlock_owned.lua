-- Compare-and-delete a plain string lock in one step (tutorial v6).
-- (A lock key of another type is a hash lock of another strategy: not ours.)
-- KEYS[1]: the lock key (a string holding the owner id)
-- KEYS[2]: the release signal (a list of at most one element; one waiting instance pops it)
-- ARGV[1]: owner id
-- ARGV[2]: release channel, told when the lock is free so waiters retry at once
-- returns: 1 when deleted; 0 when the lock is gone or belongs to another owner
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0

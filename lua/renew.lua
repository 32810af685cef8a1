-- Extend the lease of the reentrant lock, but only while this owner still holds it.
-- (Two of the tutorials get this wrong: one inverts the check, one re-runs the lock script,
-- which would resurrect a lock that was already lost.)
-- (A lock key of another type belongs to another strategy's holder: not ours.)
-- KEYS[1]: the lock key (a hash, owner -> hold count)
-- ARGV[1]: owner id
-- ARGV[2]: lease in milliseconds
-- returns: 1 when renewed; 0 when the lock is gone or belongs to another owner
-- pcall: HEXISTS on a string lock is an error, returned as a table, which is not 1.
if redis.pcall('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0

-- Extend the lease of a plain string lock, but only while this owner still holds it: the
-- renewal of a lock kept on several nodes, sent to each of them.
-- (A lock key of another type belongs to another strategy's holder: not ours.)
-- KEYS[1]: the lock key (a string holding the owner id)
-- ARGV[1]: owner id
-- ARGV[2]: lease in milliseconds
-- returns: 1 when extended; 0 when the lock is gone or belongs to another owner
-- pcall: GET on a hash lock is an error, returned as a table, which is no owner id.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0

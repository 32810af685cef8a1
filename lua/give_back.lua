-- Give a quorum lock back on one lock node: compare-and-delete of the plain string lock.
-- Sent whole (EVAL), never by hash: a give-back by EVALSHA to a node that has not cached the
-- script (fresh, restarted) answers NOSCRIPT and must be sent again after loading it; when
-- the node is frozen, the call gives up before that answer, and the grant it was to undo,
-- sent just before on the same connection, lands when the node wakes and holds the lock,
-- for nobody, for a whole lease. One command runs right behind the grant it follows.
-- (Lock nodes keep no queue and wake no waiter: the quorum lock's waiters poll.)
-- KEYS[1]: the lock key (a string holding the owner id)
-- ARGV[1]: owner id
-- returns: 1 when deleted; 0 when the lock is gone or belongs to another owner
-- pcall: GET on a lock key of another type is an error, returned as a table: not ours.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

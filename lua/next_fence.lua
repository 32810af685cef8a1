-- Draw the next fencing token for a lock that lives elsewhere (on the nodes of a quorum
-- lock): the counter is kept next to the stock, whose read and write check the token.
-- KEYS[1]: the fencing counter (only ever incremented, never reset)
-- ARGV[1]: the newest token the caller has drawn before (0 if none): a counter lost with
--          Redis's data restarts above it, so that tokens never go backwards
-- returns: the token
fence_floor(KEYS[1], ARGV[1])
return redis.call('INCR', KEYS[1])

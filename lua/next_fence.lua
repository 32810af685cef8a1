-- Draw the next fencing token for a lock that lives elsewhere (on the nodes of a quorum
-- lock): the counter is kept next to the stock, whose read and write check the token.
-- KEYS[1]: the fencing counter (only ever incremented, never reset)
-- ARGV[1]: the newest token the caller has drawn before (0 if none): a counter lost with
--          Redis's data restarts above it, so that tokens never go backwards
-- returns: the token
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return redis.call('INCR', KEYS[1])

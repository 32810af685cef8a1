-- Draw a block of fencing tokens for the sales that a fenced lock passes through inside one
-- instance's tenure (see src/lock/cohort.rs), only while the tenure's owner still holds the
-- lock: tokens are drawn by holders only, so the next holder's are above the whole block.
-- KEYS[1]: the fenced lock (a hash owner -> count)
-- KEYS[2]: the fencing counter (only ever incremented, never reset)
-- ARGV[1]: the owner id the lock is held under
-- ARGV[2]: the newest token the caller has drawn before (0 if none): a counter lost with
--          Redis's data restarts above it
-- ARGV[3]: how many tokens to draw
-- returns: the last token of the block, or 0 when the lock is not the owner's any more
-- pcall: HEXISTS on a string lock is an error, returned as a table, which is not 1.
if redis.pcall('HEXISTS', KEYS[1], ARGV[1]) ~= 1 then
  return 0
end
fence_floor(KEYS[2], ARGV[2])
return redis.call('INCRBY', KEYS[2], ARGV[3])

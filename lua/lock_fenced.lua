-- Take or re-enter the reentrant lock and draw a fencing token in the same atomic step.
-- A lock key of another type is a string lock taken by another strategy: it is held.
-- KEYS[1]: the lock key (a hash, owner -> hold count)
-- KEYS[2]: the fencing counter (only ever incremented, never reset)
-- ARGV[1]: owner id (instance:request)
-- ARGV[2]: lease in milliseconds
-- ARGV[3]: the newest token the caller has drawn before (0 if none): a counter lost with
--          Redis's data restarts above it, so that tokens never go backwards
-- returns: {1, token} when taken (a new token) or re-entered (the token of this holding);
--          {0, pttl} when another owner holds it (its remaining lease in ms, -1 if it has none)
local kind = redis.call('TYPE', KEYS[1]).ok
local mine = kind == 'hash' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
if kind ~= 'none' and not mine then
  return {0, redis.call('PTTL', KEYS[1])}
end
-- While this owner's field exists nobody else can have taken the lock, so the newest token
-- issued is still the one drawn when this holding began.
local token = mine and tonumber(redis.call('GET', KEYS[2]))
if not token then
  fence_floor(KEYS[2], ARGV[3])
  token = redis.call('INCR', KEYS[2])
end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}

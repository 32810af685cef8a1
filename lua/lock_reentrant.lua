-- Take or re-enter the reentrant lock: a hash of owner -> hold count (tutorial v7, Redisson's layout).
-- A lock key of another type is a string lock taken by another strategy on the same item:
-- it is held, and this script waits for it like for any other holder.
-- KEYS[1]: the lock key (a hash)
-- ARGV[1]: owner id (instance:request)
-- ARGV[2]: lease in milliseconds
-- returns: {1, 0} when taken or re-entered (count + 1, lease reset);
--          {0, pttl} when another owner holds it (its remaining lease in ms, -1 if it has none)
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' or (kind == 'hash' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1) then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}

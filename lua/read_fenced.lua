-- Read the stock on behalf of a fencing token, and make the store remember the token.
-- Registering the token at the read (not only at the write) is what stops a paused holder
-- from writing after a newer holder has read: its write then carries an older token.
-- KEYS[1]: the stock key
-- KEYS[2]: the newest fencing token the store has seen
-- ARGV[1]: the reader's fencing token
-- returns: {1, stock} when the token is current (stock is -1 when the key is missing);
--          {0, newest} when a newer token has been seen: the reader no longer holds the lock
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = tonumber(ARGV[1])
if token < newest then
  return {0, newest}
end
if token > newest then
  redis.call('SET', KEYS[2], token)
end
return {1, tonumber(redis.call('GET', KEYS[1]) or '-1')}

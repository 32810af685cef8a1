-- Sell one item without any lock: decrement only if stock is left, and record the sale.
-- KEYS[1]: the stock key
-- KEYS[2]: the ledger (a list of JSON entries)
-- KEYS[3]: the count of sales per remaining-stock value (a hash)
-- ARGV[1]: order id
-- ARGV[2]: instance name
-- ARGV[3]: strategy name
-- returns: the stock left after the sale, or -1 when nothing was left to sell
local stock = tonumber(redis.call('GET', KEYS[1]) or '0')
if not stock or stock <= 0 then
  return -1
end
local remaining = redis.call('DECR', KEYS[1])
redis.call('RPUSH', KEYS[2], cjson.encode({order_id = ARGV[1], instance = ARGV[2], strategy = ARGV[3],
  remaining = remaining}))
redis.call('HINCRBY', KEYS[3], remaining, 1)
return remaining

-- Sell one item without any lock: decrement only if stock is left, and record the sale.
-- KEYS[1]: the stock key
-- KEYS[2]: the ledger (a list of JSON entries)
-- KEYS[3]: the count of sales per remaining-stock value (a hash)
-- KEYS[4]: the sale's idempotency key (untouched when ARGV[4] is '')
-- ARGV[1]: order id
-- ARGV[2]: instance name
-- ARGV[3]: strategy name
-- ARGV[4]: the idempotency claim this sale holds ('pending:<order id>'), or ''
-- ARGV[5]: how long the idempotency key keeps the result, in milliseconds
-- returns: the stock left after the sale; -1 when nothing was left to sell; -2 when the
--          idempotency claim expired or was taken (nothing sold)
if ARGV[4] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[4] then
  return -2
end
local stock = tonumber(redis.call('GET', KEYS[1]) or '0')
if not stock or stock <= 0 then
  return -1
end
local remaining = redis.call('DECR', KEYS[1])
local entry = cjson.encode({order_id = ARGV[1], instance = ARGV[2], strategy = ARGV[3],
  remaining = remaining})
redis.call('RPUSH', KEYS[2], entry)
redis.call('HINCRBY', KEYS[3], remaining, 1)
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[4], 'sold:' .. entry, 'PX', ARGV[5])
end
return remaining

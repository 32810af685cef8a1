-- Write the stock computed by the caller and record the sale in the ledger, in one step,
-- so no sale is recorded without its write and no write happens without its record.
-- The write is the tutorial's read-modify-write: a stale caller overwrites newer stock.
-- KEYS[1]: the stock key
-- KEYS[2]: the ledger (a list of JSON entries)
-- KEYS[3]: the count of sales per remaining-stock value (a hash)
-- KEYS[4]: the newest fencing token the store has seen
-- KEYS[5]: the sale's idempotency key (untouched when ARGV[6] is '')
-- ARGV[1]: the new stock value
-- ARGV[2]: order id
-- ARGV[3]: instance name
-- ARGV[4]: strategy name
-- ARGV[5]: fencing token, or '' when the strategy has none
-- ARGV[6]: the idempotency claim this sale holds ('pending:<order id>'), or ''
-- ARGV[7]: how long the idempotency key keeps the result, in milliseconds
-- returns: {1, stock} when written; {0, newest} when refused because a newer token was
--          seen; {2, 0} when refused because the idempotency claim expired or was taken
local fence = tonumber(ARGV[5])
if fence then
  local newest = tonumber(redis.call('GET', KEYS[4]) or '0')
  if fence < newest then
    return {0, newest}
  end
end
if ARGV[6] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[6] then
  return {2, 0}
end
if fence then
  redis.call('SET', KEYS[4], fence)
end
local entry = cjson.encode({order_id = ARGV[2], instance = ARGV[3], strategy = ARGV[4],
  remaining = tonumber(ARGV[1]), fence = fence})
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], entry)
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[5], 'sold:' .. entry, 'PX', ARGV[7])
end
return {1, tonumber(ARGV[1])}

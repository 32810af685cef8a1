-- Start the item afresh: new stock, empty ledger, no fencing history, no lock.
-- KEYS[1]: the stock key
-- KEYS[2]: the initial-stock key
-- KEYS[3]: the ledger
-- KEYS[4]: the count of sales per remaining-stock value
-- KEYS[5]: the fencing counter
-- KEYS[6]: the newest fencing token seen
-- KEYS[7]: the lock key
-- ARGV[1]: the new stock
-- ARGV[2]: release channel, told so that waiters on the deleted lock retry at once
-- returns: the new stock
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('PUBLISH', ARGV[2], 'reset')
return tonumber(ARGV[1])

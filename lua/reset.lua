-- Start the item afresh: new stock, empty ledger and audit counters, no lock.
-- The fencing counter and the newest token seen are kept: a token must never go backwards,
-- or a sale that drew one before the reset could pass the fence after it. A sale in flight
-- read the stock before the reset; bumping the lock-free write count refuses its write.
-- KEYS[1]: the stock key
-- KEYS[2]: the initial-stock key
-- KEYS[3]: the ledger
-- KEYS[4]: the number of sales
-- KEYS[5]: the bitmap of remaining values sold
-- KEYS[6]: the values sold more than once
-- KEYS[7]: the lock key
-- KEYS[8]: the count of lock-free writes
-- KEYS[9]: the release signal, so that one waiter on the deleted lock retries at once
-- ARGV[1]: the new stock
-- ARGV[2]: release channel, told so that waiters on the deleted lock retry at once
-- returns: the new stock
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('INCR', KEYS[8])
redis.call('PUBLISH', ARGV[2], 'reset')
redis.call('DEL', KEYS[9])
redis.call('RPUSH', KEYS[9], 'reset')
return tonumber(ARGV[1])

-- Start the item afresh: new stock, empty ledger and audit counters.
-- A lock with a lease stays with its holder: taking it away would let the next buyer in
-- beside a sale that has not read yet (it would read the new stock and write as if it held
-- the lock alone), and let a naive release delete the next holder's lock. The holder's sale
-- is refused if it read before the reset, and writes the new stock correctly if it reads
-- after. A lock without a lease (`setnx`'s, whose holder may have crashed: its flaw) gets a
-- lease longer than any live sale (the caller's wait budget, work and Redis timeouts),
-- rather than being deleted: a live holder keeps it for the rest of its sale (deleted, or
-- leased for only `LOCK_TTL_MS`, it let a second sale in beside its own, and the two sold
-- one unit twice), and a dead holder's frees itself when that lease runs out.
-- The fencing counter and the newest token seen are kept: a token must never go backwards,
-- or a sale that drew one before the reset could pass the fence after it. A sale in flight
-- read the stock before the reset; moving the lock-free write count refuses its write. It
-- is set to the server's clock in microseconds rather than incremented, so that it moves
-- past any value a sale may hold even after Redis lost its data and the count restarted.
-- KEYS[1]: the stock key
-- KEYS[2]: the initial-stock key
-- KEYS[3]: the ledger
-- KEYS[4]: the number of sales
-- KEYS[5]: the bitmap of remaining values sold
-- KEYS[6]: the values sold more than once
-- KEYS[7]: the lock key
-- KEYS[8]: the count of lock-free writes
-- ARGV[1]: the new stock
-- ARGV[2]: the lease a lock without one gets, in milliseconds (longer than any live sale)
-- returns: the new stock
-- Each write is checked against the user's ACL first: Redis does not undo the writes of a
-- script that fails half-way, and a reset that set the stock but kept the old audit would
-- report sales that never happened (see sell.lua).
for _, check in ipairs({
  {'SET', KEYS[1], '0'}, {'SET', KEYS[2], '0'},
  {'DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6]},
  {'PTTL', KEYS[7]}, {'PEXPIRE', KEYS[7], '1'}, {'TIME'},
  {'GET', KEYS[8]}, {'SET', KEYS[8], '0'}, {'INCR', KEYS[8]},
}) do
  if not redis.acl_check_cmd(unpack(check)) then
    return redis.error_reply('NOPERM the Redis user may not run ' .. check[1]
      .. (check[2] and (' on ' .. check[2]) or '') .. ': the reset wrote nothing')
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
if redis.call('PTTL', KEYS[7]) == -1 then
  redis.call('PEXPIRE', KEYS[7], ARGV[2])
end
local now = redis.call('TIME')
local count = tonumber(redis.call('GET', KEYS[8]) or '0')
local clock = now[1] .. string.format('%06d', tonumber(now[2]))
if tonumber(clock) > count then
  redis.call('SET', KEYS[8], clock)
else
  redis.call('INCR', KEYS[8])
end
return tonumber(ARGV[1])

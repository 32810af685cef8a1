-- Read the stock for a locked sale, with the count of lock-free writes that its write
-- will check, and (for a fenced sale) make the store remember the reader's token.
-- Registering the token at the read (not only at the write) is what stops a paused holder
-- from writing after a newer holder has read: its write then carries an older token.
-- KEYS[1]: the stock key
-- KEYS[2]: the newest fencing token the store has seen under this kind of lock (single-node
--          or quorum; the kinds do not exclude each other, so each keeps its own)
-- KEYS[3]: the count of lock-free writes (atomic sales and resets)
-- KEYS[4]: the count of writes made under the other kind of lock (a single-node lock for
--          a quorum-lock reader, and the reverse): those writers never waited for this
--          reader's lock, so its write must notice them
-- KEYS[5]: the count of writes made under this kind of lock. A fenced write checks it too:
--          a holder of the same kind of lock without a token (`watchdog` beside `fenced`)
--          moves no token when it takes the lock from a paused fenced holder, so only this
--          count tells the paused one that somebody wrote after its read
-- KEYS[6]: the newest fencing token seen under the other kind of lock. Both kinds draw from
--          one counter; a reader whose token is older than one the other kind already
--          registered would write after it, and the tokens in the ledger would go backwards
-- KEYS[7]: the count of reads made under this kind of lock without a token. A reader
--          without a token counts itself here: it moves no token either, and a fenced
--          holder whose lease ran out while its write was on its way would otherwise land
--          that write between this read and this reader's own write (which then writes
--          over it: one unit sold twice). A fenced reader reads the count, and its write
--          checks it
-- ARGV[1]: the reader's fencing token, or '' when the strategy has none
-- returns: {1, stock, lock-free writes, other-lock writes, this-lock writes, token-less
--          reads} when the token is current or absent (stock is -1 when the key is missing);
--          {0, newest, 0, 0, 0, 0} when a newer token has been seen: the reader no longer
--          holds the lock; {2, 0, 0, 0, 0, 0} when the other kind of lock has seen a newer
--          token (nothing is registered: the reader's lock is still its own, but it must
--          not write)
local token = tonumber(ARGV[1])
local unfenced_reads
if token then
  local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
  if token < newest then
    return {0, newest, 0, 0, 0, 0}
  end
  if token < tonumber(redis.call('GET', KEYS[6]) or '0') then
    return {2, 0, 0, 0, 0, 0}
  end
  if token > newest then
    redis.call('SET', KEYS[2], token)
  end
  unfenced_reads = tonumber(redis.call('GET', KEYS[7]) or '0')
else
  unfenced_reads = redis.call('INCR', KEYS[7])
end
return {1, tonumber(redis.call('GET', KEYS[1]) or '-1'), tonumber(redis.call('GET', KEYS[3]) or '0'),
  tonumber(redis.call('GET', KEYS[4]) or '0'), tonumber(redis.call('GET', KEYS[5]) or '0'),
  unfenced_reads}

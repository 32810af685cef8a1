-- Write one sale: the stock, its ledger entry, the audit counters and the idempotency
-- outcome, in one step, so no sale is recorded without its write and no write happens
-- without its record. Both kinds of sale go through here, so every writer passes the
-- same guards.
--   mode 'locked': the tutorial's read-modify-write. The caller read the stock under its
--     lock and sends the value to write; a stale caller overwrites newer stock (that is
--     what the unsafe locks show). Refused when the store saw a newer fencing token, or
--     when a writer that takes no lock (an `atomic` sale, a reset), or one that takes the
--     other kind of lock (single-node vs quorum), wrote since the read: a lock protects
--     only the writers that take it, so the others announce themselves.
--   mode 'atomic': no lock; decrement if anything is left, and announce the lock-free write.
--   mode 'optimistic': no lock; only ever run inside a MULTI whose WATCH covers the stock and
--     the write counters, so nothing has changed since the caller's read (else EXEC refused
--     the whole transaction and this never ran). Writes the caller's value, and announces
--     the lock-free write so that a locked sale that read before it is refused.
-- The keys and arguments a mode does not use come last and are left out by the caller: each
-- costs Redis a string to parse and one to build for Lua, on every sale.
-- KEYS[1]: the stock key
-- KEYS[2]: the ledger (a stream of about ARGV[3] entries)
-- KEYS[3]: the number of sales since the last reset
-- KEYS[4]: a bitmap of the remaining-stock values already sold, bit (initial - 1 - value),
--          so that it grows with the sales made, not with the size of the stock
-- KEYS[5]: remaining-stock value -> times sold, for values sold more than once
-- KEYS[6]: the count of lock-free writes (atomic sales and resets), never reset
-- KEYS[7]: the initial stock (the bitmap counts down from it)
-- KEYS[8]: with a claim only: the sale's idempotency key
-- KEYS[9]: 'locked' only: the newest fencing token the store has seen under this kind of
--          lock (single-node or quorum; the kinds do not exclude each other, so each keeps
--          its own)
-- KEYS[10]: 'locked' only: the count of writes under the other kind of lock (checked)
-- KEYS[11]: 'locked' only: the count of writes under this kind of lock (incremented)
-- KEYS[12]: 'locked' with a fencing token only: the count of reads under this kind of lock
--          made without a token (see read_stock.lua)
-- ARGV[1]: mode, 'locked', 'optimistic' or 'atomic'
-- ARGV[2]: the ledger entry's JSON without its closing brace and without the figures only
--          this script knows: '{"order_id":..,"instance":..,"strategy":..' (the caller
--          escapes the strings; here only numbers are appended, so no cjson per sale).
--          'atomic' without a claim: one such head per sale, a line each (JSON text holds
--          no raw newline), for sales sent together: sold in that order while stock lasts
-- ARGV[3]: the ledger's cap ('~': Redis trims whole nodes of the stream, so a little more
--          is kept; trimming one entry per sale cost more than the rest of the write)
-- ARGV[4]: the idempotency claim this sale holds ('pending:<order id>'), '' or absent
-- ARGV[5]: with a claim: how long the idempotency key keeps the result, in milliseconds
-- ARGV[6]: 'locked' and 'optimistic': the new stock value
-- ARGV[7]: 'locked' only: the fencing token, or '' when the strategy has none
-- ARGV[8]: 'locked' only: the lock-free write count the caller read with the stock
-- ARGV[9]: 'locked' only: the other-lock write count the caller read with the stock
-- ARGV[10]: 'locked' only, optional: the fencing token of the sale its lock tenure passes
--          the lock to next, registered as read once this write lands, as that sale's own
--          read would (its stock is this write's, and its counts the ones checked here)
-- ARGV[11]: 'locked' with a fencing token only: the count of writes under this kind of lock
--          the caller read with the stock. A token is drawn only by fenced holders, so a
--          holder of the same kind of lock without one (`watchdog`, `lua-release` ... beside
--          `fenced`) that took the lock while this caller was paused leaves the token
--          current; its write moved this count
-- ARGV[12]: 'locked' with a fencing token only: the count of reads without a token under
--          this kind of lock that the caller read with the stock. A holder without a token
--          that took the lock after this caller's lease ran out, and read, moved it; its
--          write, still to come, would go over this one
-- returns: {1, stock left} when sold (several atomic sales: the first one's; the i-th
--          sale, from 0, was sold with stock left - i if that is not negative, and found
--          nothing left otherwise); {0, newest token} for a stale fencing token;
--          {2, 0} when the idempotency claim expired or was taken; {3, 0} when a lock-free
--          writer, or one under the other kind of lock, wrote since the read; {4, 0} when
--          the stock key is missing (never stocked, or Redis lost its data); {5, 0} when
--          nothing is left (atomic only); {6, 0} when a fenced caller's lock was taken by a
--          holder without a token, who read or wrote since the read.
--          Nothing is written in any case but the first.
-- Numbers go to Redis and into the entry as text made with '%d': Lua's own conversion of a
-- number ('%.14g', and '%.17g' for a command's argument) is a floating-point print, which
-- cost more than some of the commands, and writes a number past 14 digits as 1.7e+15.
local locked = ARGV[1] == 'locked'
local fence = locked and tonumber(ARGV[7]) or nil
local claim = ARGV[4] or ''
if claim ~= '' and redis.call('GET', KEYS[8]) ~= claim then
  return {2, 0}
end
local current = redis.call('GET', KEYS[1])
if not current then
  return {4, 0}
end
-- Writers that do not take this lock first: a sale under the other kind of lock draws its
-- token from the same counter, so a newer token may be one of theirs, and this sale's lock
-- was then not lost (stock_changed, not stale_fence).
if locked and ((redis.call('GET', KEYS[6]) or '0') ~= ARGV[8]
    or (redis.call('GET', KEYS[10]) or '0') ~= ARGV[9]) then
  return {3, 0}
end
if fence then
  local newest = tonumber(redis.call('GET', KEYS[9]) or '0')
  if fence < newest then
    return {0, newest}
  end
  if (ARGV[11] or '') ~= '' and (redis.call('GET', KEYS[11]) or '0') ~= ARGV[11] then
    return {6, 0}
  end
  if (ARGV[12] or '') ~= '' and (redis.call('GET', KEYS[12]) or '0') ~= ARGV[12] then
    return {6, 0}
  end
end
-- Redis does not undo a script's writes when a later command of it fails, and an ACL user may
-- lack a command this script needs (from outside: a user without XADD had every sale answer
-- 500 after taking its unit, and one Idempotency-Key sold on every retry). So each write this
-- sale will make is checked against the user's ACL first, with its real key, and a refusal
-- writes nothing (NOPERM: 503 redis_auth_failed, nothing sold). About 0.2 us a check.
local function refused(command, key, ...)
  if redis.acl_check_cmd(command, key, ...) then
    return nil
  end
  return redis.error_reply('NOPERM the Redis user may not run ' .. command .. ' on ' .. key
    .. ': nothing was written')
end
local denied = refused('XADD', KEYS[2], 'MAXLEN', '~', '1', '*', 'sale', '')
  or refused('SETBIT', KEYS[4], '0', '1')
  or refused('HINCRBY', KEYS[5], '0', '1')
  or refused('HSET', KEYS[5], '0', '2')
  or refused('HEXISTS', KEYS[5], '0') or refused('GET', KEYS[7])
  or (claim ~= '' and refused('SET', KEYS[8], '', 'PX', '1'))
if ARGV[1] == 'atomic' then
  denied = denied or refused('DECRBY', KEYS[1], '1') or refused('INCRBY', KEYS[6], '1')
    or refused('INCRBY', KEYS[3], '1')
else
  denied = denied or refused('SET', KEYS[1], '0') or refused('INCR', KEYS[3])
    or (locked and refused('INCR', KEYS[11]))
    or (fence and refused('SET', KEYS[9], '0'))
    or (not locked and refused('INCR', KEYS[6]))
end
if denied then
  return denied
end
-- What every sale writes beside the stock: its ledger entry and the audit's bit for the
-- remaining value it sold. Returns the entry.
local initial
local function record(head, remaining, text)
  local entry
  if fence then
    entry = head .. ',"remaining":' .. text .. ',"fence":' .. ARGV[7] .. '}'
  else
    entry = head .. ',"remaining":' .. text .. '}'
  end
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'sale', entry)
  -- One bit per remaining value: a value sold twice is the tutorial's "76 sold twice".
  -- Only values sold more than once go into the hash, so the audit reads O(duplicates).
  initial = initial or tonumber(redis.call('GET', KEYS[7]) or '0')
  local bit = initial - 1 - remaining
  if bit < 0 or remaining < 0
      or redis.call('SETBIT', KEYS[4], string.format('%d', bit), '1') == 1 then
    if redis.call('HEXISTS', KEYS[5], text) == 1 then
      redis.call('HINCRBY', KEYS[5], text, '1')
    else
      redis.call('HSET', KEYS[5], text, '2')
    end
  end
  return entry
end

if ARGV[1] == 'atomic' then
  local stock = tonumber(current)
  if stock <= 0 then
    return {5, 0}
  end
  local heads = {}
  for head in string.gmatch(ARGV[2], '[^\n]+') do
    heads[#heads + 1] = head
  end
  local sold = math.min(#heads, stock)
  redis.call('DECRBY', KEYS[1], string.format('%d', sold))
  redis.call('INCRBY', KEYS[6], string.format('%d', sold))
  redis.call('INCRBY', KEYS[3], string.format('%d', sold))
  local entry
  for i = 1, sold do
    local remaining = stock - i
    entry = record(heads[i], remaining, string.format('%d', remaining))
  end
  if claim ~= '' then
    redis.call('SET', KEYS[8], 'sold:' .. entry, 'PX', ARGV[5])
  end
  return {1, stock - 1}
end

if locked then
  redis.call('INCR', KEYS[11])
  if fence then
    local next_fence = tonumber(ARGV[10] or '')
    redis.call('SET', KEYS[9], (next_fence and next_fence > fence) and ARGV[10] or ARGV[7])
  end
else
  -- optimistic
  redis.call('INCR', KEYS[6])
end
local remaining = tonumber(ARGV[6])
redis.call('SET', KEYS[1], ARGV[6])
redis.call('INCR', KEYS[3])
local entry = record(ARGV[2], remaining, ARGV[6])
if claim ~= '' then
  redis.call('SET', KEYS[8], 'sold:' .. entry, 'PX', ARGV[5])
end
return {1, remaining}

-- Settle an idempotency claim that did not end in a sale: keep an outcome worth replaying,
-- or free the key so that a retry tries again. Only the claim's own holder may do either.
-- KEYS[1]: the idempotency key
-- ARGV[1]: the claim ('pending:<order id>')
-- ARGV[2]: the outcome to keep, or '' to delete the key
-- ARGV[3]: how long to keep it, in milliseconds
-- returns: 1 when settled; 0 when the key no longer holds this claim (nothing changed)
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1

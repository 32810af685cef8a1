#!lua
-- Whether Redis takes a sale's commands now, without running any of them. With the shebang
-- and no `no-writes` flag, Redis treats the script as one that may write and refuses it up
-- front, for the reasons it would refuse a sale's write part way through: READONLY (a
-- replica), NOREPLICAS (`min-replicas-to-write` unmet), MISCONF (it cannot save), OOM (past
-- `maxmemory` under `noeviction`). Then each command a sale may send is checked against the
-- user's ACL with its real key (`redis.acl_check_cmd`): Redis checks a command's rights only
-- when it runs, so a user without XADD answered every PING while every sale failed.
-- `/ready` runs it: a Redis that answers PING but would refuse the sales is not ready
-- (src/http/meta.rs, src/lock/acl.rs).
-- KEYS: none
-- ARGV: the checks, each as its number of words, then the words: a command and its
--       arguments (key first)
-- returns: 0 when every check passed, else the number (from 1) of the first one refused
local i, check = 1, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local words = {}
  for j = 1, n do
    words[j] = ARGV[i + j]
  end
  if not redis.acl_check_cmd(unpack(words)) then
    return check
  end
  i, check = i + n + 1, check + 1
end
return 0

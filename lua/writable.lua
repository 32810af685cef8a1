#!lua
-- Whether Redis takes a write now, without writing anything. With the shebang and no
-- `no-writes` flag, Redis treats the script as one that may write and refuses it up front,
-- for the reasons it would refuse a sale's write part way through: READONLY (a replica),
-- NOREPLICAS (`min-replicas-to-write` unmet), MISCONF (it cannot save), OOM (past
-- `maxmemory` under `noeviction`). `/ready` runs it: a Redis that answers PING but refuses
-- every write is not ready (src/http/meta.rs).
-- KEYS: none
-- ARGV: none
-- returns: 1
return 1

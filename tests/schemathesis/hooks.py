"""Schemathesis hooks for the inventory service.

`work_ms` may legally be up to 60000: a sale that sleeps a minute inside the lock. The
fuzzer would find that boundary at once and then wait on it for every example, so valid
values are capped at 20 ms here; invalid ones (negative, too large, not a number) still go
through unchanged, and must still be refused with 400.
"""

import schemathesis

WORK_MS_CAP = 20


@schemathesis.hook
def map_query(ctx, query):
    if query and isinstance(query.get("work_ms"), int) and 0 <= query["work_ms"] <= 60000:
        query["work_ms"] = min(query["work_ms"], WORK_MS_CAP)
    return query


# A 5xx is a failure unless it is one the API documents: the lock stayed held for the whole
# wait budget, every optimistic attempt was refused, no pooled connection was free, or Redis
# did not answer.
DOCUMENTED_5XX = {
    (503, "lock_timeout"),
    (503, "too_much_contention"),
    (503, "pool_exhausted"),
    (503, "redis_unavailable"),
}


@schemathesis.check
def only_documented_server_errors(ctx, response, case):
    if response.status_code < 500:
        return None
    try:
        code = response.json().get("error")
    except Exception:
        code = None
    if (response.status_code, code) not in DOCUMENTED_5XX:
        raise AssertionError(f"undocumented server error {response.status_code} {code!r}")
    return None

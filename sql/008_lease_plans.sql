-- 008_lease_plans.sql: the lease and the other batch functions are planned
-- on every call, not once per session.
--
-- PL/pgSQL caches a generic plan of each statement after five calls.  A
-- worker that starts while effect_outbox is small (a fresh install, a
-- drained queue after TRUNCATE, the first minute of a busy day before
-- autoanalyze has run) caches a lease plan that reads the whole table
-- (Seq Scan + Hash Join), and keeps it until the next ANALYZE of the
-- table invalidates it.  Measured at 1,000 effects/s from an empty table:
-- each lease read 1,400 pages at 18,000 rows and took 26-160 ms, the
-- insert-to-send p99 went past a second and the queue ran away until
-- autoanalyze came, 60-70 s later.  A custom plan per call costs a fraction
-- of a millisecond and is made with the table's real size (the planner
-- reads the current number of pages), so the due index is used from the
-- first row on.  003 did this for mark, complete and fail_invalid; these
-- are the rest of the PL/pgSQL functions the workers call in a loop
-- (outbox_renew is LANGUAGE sql: planned anew for every calling query).

ALTER FUNCTION outbox_lease(uuid, text, integer, integer, text[], boolean, timestamptz, uuid)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION outbox_release(uuid, uuid[], bigint)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION outbox_reap(text, integer)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION outbox_reconcile_lease(uuid, text, text[], integer, integer)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION outbox_reconcile_record(uuid, text, jsonb)
    SET plan_cache_mode = force_custom_plan;

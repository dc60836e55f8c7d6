-- 009_hot_lease.sql: leasing a row writes no index entry.
--
-- A lease sets lease_owner, lease_worker, leased_at and lease_expires_at
-- on a pending row.  Because lease_expires_at was a key of the reaper's
-- index (rows in `sending` by lease expiry), every lease was a non-HOT
-- update: a new entry in each of the table's indexes (primary key, the
-- run/type/target key, the due index, and the run index), and a second dead
-- entry per effect at the head of the due index that every lease from the
-- head walks until vacuum.  Now:
--
-- 1. The reaper's index is on send_deadline, a stored generated column
--    that equals lease_expires_at while the row is `sending` and is NULL
--    otherwise.  A lease (or renewal) of a pending row leaves it NULL, so
--    no indexed value changes and the update can be HOT: a new version on
--    the same page, no index entries.  Derived, so it cannot disagree with
--    lease_expires_at (an operator or a test that expires a lease by hand
--    still gets the row reaped).
-- 2. fillfactor 80 keeps room on each new page for those versions (pages
--    written before this migration keep theirs full; they are old rows).
-- 3. effect_outbox_run_idx (idempotency_key) goes: the UNIQUE
--    (idempotency_key, effect_type, target) index answers the same lookups
--    by its leading column, and every insert and non-HOT update paid for
--    both.
--
-- Measured (bench, 20,000 effects, 1 worker and the pgbench ceiling):
-- see docs/performance.md "Changes, measured".
--
-- Adding a stored generated column rewrites the table under an ACCESS
-- EXCLUSIVE lock: on a large outbox, stop producers and workers for it
-- (README, "Upgrading"), or prune completed rows first.

DROP INDEX effect_outbox_run_idx;
DROP INDEX effect_outbox_sending_idx;
ALTER TABLE effect_outbox
    ADD COLUMN send_deadline timestamptz
        GENERATED ALWAYS AS (CASE WHEN state = 'sending' THEN lease_expires_at END) STORED;
-- The reaper's and the kill switch's index: rows in flight, by deadline.
CREATE INDEX effect_outbox_sending_idx ON effect_outbox (send_deadline)
    WHERE state = 'sending';
ALTER TABLE effect_outbox SET (fillfactor = 80);

-- The reaper, reading its index by send_deadline (otherwise as in 007,
-- with 008's plan per call).
CREATE OR REPLACE FUNCTION outbox_reap(p_worker text, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, state text, lost_worker text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH expired AS (
        SELECT o.effect_id, o.lease_worker, o.lease_owner, o.attempts, o.sending_since
          FROM effect_outbox o
         WHERE o.state = 'sending' AND o.send_deadline < now()
         ORDER BY o.send_deadline
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED),
    moved AS (
        UPDATE effect_outbox o
           SET state = CASE WHEN o.sending_idempotent THEN 'pending' ELSE 'unknown' END,
               available_at = now(),
               last_error_class = 'ambiguous',
               last_error = 'lease expired while sending (worker '
                            || coalesce(e.lease_worker, '?') || ' lost)',
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL, updated_at = now()
          FROM expired e
         WHERE o.effect_id = e.effect_id
        RETURNING o.effect_id, o.state, e.lease_worker, e.lease_owner, e.attempts,
                  e.sending_since, o.metadata),
    logged AS (
        INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                     outcome_class, error_text, cas_applied, metadata)
        SELECT m.effect_id, m.attempts, m.lease_owner, 'reaper:' || p_worker,
               coalesce(m.sending_since, now()), 'ambiguous',
               'lease expired while sending; worker ' || coalesce(m.lease_worker, '?')
               || ' lost; state ' || m.state, true, m.metadata
          FROM moved m)
    SELECT m.effect_id, m.state, m.lease_worker FROM moved m;
END $$;

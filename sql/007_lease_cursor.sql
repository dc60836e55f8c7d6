-- 007_lease_cursor.sql: leasing that stays fast when vacuum is held back,
-- and fleet-wide (not per-worker) sweeps of the pending backlog.
--
-- 1. The due index becomes (available_at, effect_id).  outbox_lease takes
--    the position of the last row a worker leased and starts its index scan
--    there.  Every row a worker has leased leaves dead entries at the head
--    of the due index; while some transaction holds an old snapshot they
--    cannot be removed or even marked dead, and a scan from the head walks
--    all of them (measured: 614 ms per lease after 100,000 effects under a
--    snapshot held for a minute).  The worker still scans from the head
--    now and then, for rows that became due behind its position (a
--    producer's transaction that committed late, an expired lease, rows
--    given back while the kill switch was off); see lease_batch().
-- 2. The reaper keeps only its `sending` half, which has its own small
--    index.  Clearing expired leases of `pending` rows (cosmetic: the lease
--    query already treats an expired lease as none) and failing rows of
--    types no worker serves walk the whole pending backlog: they move to
--    outbox_sweep(), which one worker of the fleet runs at most every
--    p_every_seconds (measured: 90-110 ms per pass at 200,000 pending, run
--    every 2 s by every worker before).
--
-- A migration runs in one transaction, so the index is built without
-- CONCURRENTLY: on a large live outbox, stop the workers for it (README,
-- "Upgrading").

DROP INDEX effect_outbox_due_idx;
CREATE INDEX effect_outbox_due_idx ON effect_outbox (available_at, effect_id)
    WHERE state = 'pending';

DROP FUNCTION outbox_lease(uuid, text, integer, integer, text[], boolean);

-- Lease up to p_limit due pending rows, in (available_at, effect_id) order,
-- starting after (p_after_at, p_after_id) when given (at most 50 ms ago).  Rows come back in
-- that order, with available_at, so the caller's next position is the last
-- row.  Returns nothing while the kill switch is off (env flag or control
-- row): leasing then would only cost a release.  The authoritative check is
-- in outbox_mark_sending.
CREATE FUNCTION outbox_lease(p_owner uuid, p_worker text, p_limit integer,
                             p_lease_seconds integer, p_types text[],
                             p_env_enabled boolean,
                             p_after_at timestamptz DEFAULT NULL,
                             p_after_id uuid DEFAULT NULL)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               metadata text, approved_by text, retry_base integer,
               available_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    after_at timestamptz := p_after_at;
    after_id uuid := p_after_id;
BEGIN
    IF NOT p_env_enabled OR NOT (SELECT c.enabled FROM outbox_control c WHERE c.id = 1) THEN
        RETURN;
    END IF;
    -- A position less than 50 ms old moves back to 50 ms ago: producers'
    -- transactions that commit a little out of order put rows just behind
    -- the last one leased.  (Not a look-back from the last row: one bulk
    -- insert gives all its rows the same available_at.)
    IF after_at > now() - interval '50 milliseconds' THEN
        after_at := now() - interval '50 milliseconds';
        after_id := NULL;
    END IF;
    -- One statement shape whether or not a position is given, so that its
    -- cached plan is always the index range scan.
    after_at := coalesce(after_at, '-infinity');
    after_id := coalesce(after_id, '00000000-0000-0000-0000-000000000000');
    RETURN QUERY
    WITH due AS (
        SELECT o.effect_id FROM effect_outbox o
         WHERE o.state = 'pending'
           AND (o.available_at, o.effect_id) > (after_at, after_id)
           AND o.available_at <= now()
           AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
           AND o.effect_type = ANY (p_types)
         ORDER BY o.available_at, o.effect_id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    leased AS (
        UPDATE effect_outbox o
           SET lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
          FROM due
         WHERE o.effect_id = due.effect_id
        RETURNING o.effect_id, o.idempotency_key, o.effect_type, o.target, o.payload::text,
                  o.payload_hash, o.effect_key, o.attempts, o.metadata::text, o.approved_by,
                  o.retry_base, o.available_at)
    SELECT * FROM leased l ORDER BY l.available_at, l.effect_id;
END $$;

-- The reaper: a `sending` row whose lease expired belonged to a worker
-- that died, stopped or lost its database.  It goes to `unknown`, or back
-- to `pending` with the same key when the provider honours keys; an
-- ambiguous attempt row records why.  Safe with every worker running it
-- (SKIP LOCKED); reads only the small index of rows in flight.
CREATE OR REPLACE FUNCTION outbox_reap(p_worker text, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, state text, lost_worker text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH expired AS (
        SELECT o.effect_id, o.lease_worker, o.lease_owner, o.attempts, o.sending_since
          FROM effect_outbox o
         WHERE o.state = 'sending' AND o.lease_expires_at < now()
         ORDER BY o.lease_expires_at
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

-- When the fleet last swept, and which worker did.
CREATE TABLE outbox_sweeps (
    id          integer PRIMARY KEY CHECK (id = 1),
    last_run    timestamptz NOT NULL,
    last_worker text
);
INSERT INTO outbox_sweeps (id, last_run) VALUES (1, '-infinity');

-- The sweep of the pending backlog, by one worker of the fleet at most
-- every p_every_seconds (the others return at once, without waiting):
-- frees expired leases of pending rows, and fails rows of a type no worker
-- has served for p_grace_seconds.  Returns the rows failed.
CREATE FUNCTION outbox_sweep(p_worker text, p_grace_seconds integer, p_every_seconds integer,
                             p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, effect_type text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF NOT pg_try_advisory_xact_lock(7262935012345678902) THEN
        RETURN;
    END IF;
    UPDATE outbox_sweeps s SET last_run = now(), last_worker = p_worker
     WHERE s.id = 1 AND s.last_run <= now() - make_interval(secs => greatest(p_every_seconds, 0));
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE effect_outbox o
       SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL
     WHERE o.effect_id IN (SELECT p.effect_id FROM effect_outbox p
                            WHERE p.state = 'pending' AND p.lease_expires_at < now()
                            LIMIT p_limit FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT * FROM outbox_fail_unknown_types(p_grace_seconds, p_limit);
END $$;

REVOKE EXECUTE ON FUNCTION outbox_lease(uuid, text, integer, integer, text[], boolean, timestamptz, uuid),
                       outbox_sweep(text, integer, integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_lease(uuid, text, integer, integer, text[], boolean, timestamptz, uuid),
    outbox_sweep(text, integer, integer, integer)
    TO outbox_dispatcher;
GRANT SELECT ON outbox_sweeps TO outbox_dispatcher, outbox_operator;

-- The current week's figures for the workers' metrics, computed by one
-- worker of the fleet at most every p_every_seconds and kept here: the
-- view aggregates every row of the last 26 weeks (measured 1.9 s at
-- 200,000 rows, run every 30 s by every worker before).
CREATE TABLE outbox_weekly_cache (
    id                        integer PRIMARY KEY CHECK (id = 1),
    refreshed_at              timestamptz NOT NULL,
    refreshed_by              text,
    duplicate_share           numeric,
    approval_wait_p50_seconds numeric,
    approval_wait_p95_seconds numeric,
    validation_failure_share  numeric,
    automatic_share           numeric,
    retries_exhausted         bigint
);
INSERT INTO outbox_weekly_cache (id, refreshed_at) VALUES (1, '-infinity');

CREATE FUNCTION outbox_weekly_figures(p_worker text, p_every_seconds integer)
RETURNS TABLE (duplicate_share numeric, approval_wait_p50_seconds numeric,
               approval_wait_p95_seconds numeric, validation_failure_share numeric,
               automatic_share numeric, retries_exhausted bigint, refreshed_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF pg_try_advisory_xact_lock(7262935012345678903)
       AND (SELECT c.refreshed_at FROM outbox_weekly_cache c WHERE c.id = 1)
           <= now() - make_interval(secs => greatest(p_every_seconds, 0)) THEN
        UPDATE outbox_weekly_cache c
           SET (refreshed_at, refreshed_by, duplicate_share, approval_wait_p50_seconds,
                approval_wait_p95_seconds, validation_failure_share, automatic_share,
                retries_exhausted) =
               (SELECT now(), p_worker, s.duplicate_share, s.approval_wait_p50_seconds,
                       s.approval_wait_p95_seconds, s.validation_failure_share,
                       s.automatic_share, s.retries_exhausted
                  FROM outbox_weekly_stats s ORDER BY s.week_start DESC LIMIT 1)
         WHERE c.id = 1;
    END IF;
    RETURN QUERY
    SELECT c.duplicate_share, c.approval_wait_p50_seconds, c.approval_wait_p95_seconds,
           c.validation_failure_share, c.automatic_share, c.retries_exhausted, c.refreshed_at
      FROM outbox_weekly_cache c WHERE c.id = 1;
END $$;

REVOKE EXECUTE ON FUNCTION outbox_weekly_figures(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_weekly_figures(text, integer) TO outbox_dispatcher;
GRANT SELECT ON outbox_weekly_cache TO outbox_operator;

-- outbox_mark_sending as in 003, except that the second half (rows this
-- same call already moved, when it is repeated after a lost connection) is
-- read only when some id did not move: a probe per id on every call
-- otherwise.
CREATE OR REPLACE FUNCTION outbox_mark_sending(p_owner uuid, p_ids uuid[], p_env_enabled boolean,
                                               p_idempotent_types text[], p_lease_seconds integer,
                                               p_call uuid DEFAULT NULL)
RETURNS TABLE (effect_id uuid, attempts integer, blocked boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    allowed boolean;
    ids uuid[];
    atts integer[];
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key());
    -- A fresh snapshot for this statement: taken after the lock, so an "off"
    -- that committed while we waited is seen.
    SELECT c.enabled INTO allowed FROM outbox_control c WHERE c.id = 1;
    IF NOT (coalesce(allowed, false) AND p_env_enabled) THEN
        RETURN QUERY
        UPDATE effect_outbox o
           SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL
         WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner AND o.state = 'pending'
        RETURNING o.effect_id, o.attempts, true;
        RETURN;
    END IF;
    WITH u AS (
        UPDATE effect_outbox o
           SET state = 'sending', attempts = o.attempts + 1,
               sending_since = now(), mark_token = p_call,
               sending_idempotent = o.effect_type = ANY (p_idempotent_types),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds),
               updated_at = now()
         WHERE o.effect_id = ANY (p_ids)
           AND o.lease_owner = p_owner
           AND o.state = 'pending'
           AND o.lease_expires_at > now()
        RETURNING o.effect_id, o.attempts)
    SELECT coalesce(array_agg(u.effect_id), '{}'), coalesce(array_agg(u.attempts), '{}')
      INTO ids, atts FROM u;
    RETURN QUERY SELECT x.id, x.att, false FROM unnest(ids, atts) AS x(id, att);
    -- Rows this very call already moved to `sending` come back too: the
    -- call is repeated (same p_call) after a lost connection, when the first
    -- one may have committed, and its answer was never seen, so nothing was
    -- sent.  Another call never gets them.
    IF p_call IS NOT NULL AND cardinality(ids) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT o.effect_id, o.attempts, false FROM effect_outbox o
         WHERE o.effect_id = ANY (p_ids) AND NOT o.effect_id = ANY (ids)
           AND o.lease_owner = p_owner AND o.state = 'sending'
           AND o.mark_token = p_call;
    END IF;
END $$;

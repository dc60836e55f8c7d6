-- SPDX-License-Identifier: ISC
-- functions/45_reads.sql: what outboxctl and the web console read, as
-- functions, so that only sql/ knows the tables (outboxctl/outboxctl_sql.c
-- names each call and its columns).
--
-- Each is a STABLE SECURITY DEFINER function: outbox_operator and
-- outbox_viewer (sql/111_console_viewer.sql) may call it without reading a
-- table.  Every read is bounded: an index probe, the live queue's due index
-- at its `unknown` end, or a window of the history's end times (its BRIN
-- index), never a count of the whole history.

-- The kill switch as it is now.
CREATE OR REPLACE FUNCTION outbox_read_switch()
RETURNS TABLE (enabled boolean, changed_by text, reason text, changed_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT c.enabled, c.changed_by, c.reason, c.changed_at FROM outbox_control c WHERE c.id = 1;
$$;

-- Open effects from the live queue (one pass over it: the open effects are
-- the queue), finished ones from the history's finishing rows of the last
-- 24 hours (window_hours), each counted while it is still
-- the effect's last word (an operator's requeue puts a failed effect back
-- in the live queue, and it may fail again; a completed effect is never
-- reopened).  The rule is outbox_effects' (sql/105_live_queue.sql).  The
-- window is read through the history's BRIN index on end times, so the
-- read is the same at ten million finished effects as at ten thousand:
-- it grows with the last day's traffic, not with the history.
CREATE OR REPLACE FUNCTION outbox_read_status()
RETURNS TABLE (pending bigint, sending bigint, completed bigint, unknown bigint, failed bigint,
               oldest_pending_age_seconds numeric, failed_last_hour bigint,
               window_hours integer, enabled boolean, changed_by text, reason text,
               changed_at timestamptz, held bigint, oldest_held_age_seconds numeric)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp SET jit = off AS $$
    WITH live AS (
        SELECT count(*) FILTER (WHERE l.state = 'pending') AS pending,
               count(*) FILTER (WHERE l.state = 'sending') AS sending,
               count(*) FILTER (WHERE l.state = 'unknown') AS unknown,
               min(l.available_at) FILTER (WHERE l.state = 'pending' AND l.available_at <= now())
                   AS oldest_due,
               -- held by a paused or limited scope: not due, so not in the
               -- pending age above; their own age, since creation
               count(*) FILTER (WHERE l.state = 'pending' AND l.held_by IS NOT NULL) AS held,
               min(l.created_at) FILTER (WHERE l.state = 'pending' AND l.held_by IS NOT NULL)
                   AS oldest_held
          FROM effect_live l),
    finished AS (
        SELECT h.state, h.ended_at FROM effect_history h
         WHERE h.ended_at > now() - interval '24 hours'
           AND h.state IS NOT NULL
           AND (h.state = 'completed'
                OR (NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = h.effect_id)
                    AND NOT EXISTS (SELECT 1 FROM effect_history n
                                     WHERE n.created_at = h.created_at AND n.effect_id = h.effect_id
                                       AND n.state IS NOT NULL AND n.history_id > h.history_id))))
    SELECT l.pending, l.sending,
           (SELECT count(*) FROM finished WHERE state = 'completed'),
           l.unknown,
           (SELECT count(*) FROM finished WHERE state = 'failed'),
           coalesce(extract(epoch FROM now() - l.oldest_due)::numeric(12,3), 0),
           (SELECT count(*) FROM finished
             WHERE state = 'failed' AND ended_at > now() - interval '1 hour'),
           24,
           c.enabled, c.changed_by, c.reason, c.changed_at,
           l.held, coalesce(extract(epoch FROM now() - l.oldest_held)::numeric(12,3), 0)
      FROM live l, outbox_control c WHERE c.id = 1;
$$;

-- The unknown effects, oldest first, each with its last provider call:
-- `unknown` rows sit at available_at = 'infinity' in the live queue's due
-- index; the call is found by the effect's creation time and id.
CREATE OR REPLACE FUNCTION outbox_read_unknown()
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_key text, effect_type text,
               target text, attempts integer, unknown_since timestamptz, created_at timestamptz,
               last_error_class text, last_error text, last_attempt_worker text,
               last_attempt_outcome text, last_attempt_status integer, run_state text,
               last_attempt_started timestamptz, last_attempt_ended timestamptz,
               last_attempt_error text, last_reconciled_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT l.effect_id, b.idempotency_key, b.effect_key, b.effect_type, b.target, l.attempts,
           l.updated_at, l.created_at, l.last_error_class, l.last_error,
           a.worker, a.outcome_class, a.provider_status, w.state,
           a.started_at, a.ended_at, a.error_text, l.last_reconciled_at
      FROM effect_live l
      JOIN effect_outbox b ON b.effect_id = l.effect_id
      JOIN workflow_runs w ON w.idempotency_key = b.idempotency_key
      LEFT JOIN LATERAL (SELECT x.worker, x.outcome_class, x.provider_status, x.started_at,
                                x.ended_at, x.error_text
                           FROM effect_history x
                          WHERE x.created_at = l.created_at AND x.effect_id = l.effect_id
                            AND x.outcome_class IS NOT NULL
                          ORDER BY x.history_id DESC LIMIT 1) a ON true
     WHERE l.available_at = 'infinity' AND l.state = 'unknown'
     ORDER BY l.updated_at, l.effect_id;
$$;

-- The runs of the unknown effects settled as their effects make them
-- (outbox_settle_runs), before a list reads their states: outboxctl's
-- `unknown list` as an operator (the viewer reads without settling).
CREATE OR REPLACE FUNCTION outbox_settle_unknown_runs()
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT outbox_settle_runs(ARRAY(SELECT DISTINCT b.idempotency_key
                                      FROM effect_live l JOIN effect_outbox b USING (effect_id)
                                     WHERE l.available_at = 'infinity' AND l.state = 'unknown'));
$$;

-- One effect as outbox_effects shows it (three index probes), or no row.
CREATE OR REPLACE FUNCTION outbox_read_effect(p_effect_id uuid)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               state text, attempts integer, created_at timestamptz, available_at timestamptz,
               updated_at timestamptz, completed_at timestamptz, provider_id text,
               last_error_class text, last_error text, last_status integer, effect_key text,
               lease_worker text, sending_since timestamptz, approved_by text,
               replaces_effect uuid, last_reconciled_at timestamptz, run_state text,
               payload jsonb)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT o.effect_id, o.idempotency_key, o.effect_type, o.target, o.state, o.attempts,
           o.created_at, o.available_at, o.updated_at, o.completed_at, o.provider_id,
           o.last_error_class, o.last_error, o.last_status, o.effect_key, o.lease_worker,
           o.sending_since, o.approved_by, o.replaces_effect, o.last_reconciled_at,
           (SELECT w.state FROM workflow_runs w WHERE w.idempotency_key = o.idempotency_key),
           o.payload
      FROM outbox_effects o WHERE o.effect_id = p_effect_id;
$$;

-- An effect's history, in order: every provider call, reaper's and
-- reconciliation's verdict and state change (the partition by the
-- effect's creation time, then its rows).
CREATE OR REPLACE FUNCTION outbox_read_effect_history(p_effect_id uuid)
RETURNS TABLE (history_id bigint, attempt integer, worker text, started_at timestamptz,
               ended_at timestamptz, outcome_class text, provider_status integer,
               provider_id text, error_text text, cas_applied boolean, resolution text,
               state text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT h.history_id, h.attempt, h.worker, h.started_at, h.ended_at, h.outcome_class,
           h.provider_status, h.provider_id, h.error_text, h.cas_applied, h.resolution, h.state
      FROM effect_outbox b
      JOIN effect_history h ON h.created_at = b.created_at AND h.effect_id = b.effect_id
     WHERE b.effect_id = p_effect_id
     ORDER BY h.history_id;
$$;

-- Every scope (outbox_scope_status), or those with a rate limit only.
CREATE OR REPLACE FUNCTION outbox_read_scopes(p_limited_only boolean)
RETURNS TABLE (kind text, value text, paused boolean, paused_by text, paused_at timestamptz,
               paused_reason text, rate_per_second double precision, burst integer,
               limit_by text, limit_at timestamptz, limit_reason text, waiting bigint,
               held_total bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT s.kind, s.value, s.paused, s.paused_by, s.paused_at, s.paused_reason,
           s.rate_per_second, s.burst, s.limit_by, s.limit_at, s.limit_reason, s.waiting,
           s.held_total
      FROM outbox_scope_status s
     WHERE NOT p_limited_only OR s.rate_per_second IS NOT NULL
     ORDER BY s.kind, s.value;
$$;

-- Reconciliation, as outboxctl reconcile follows it: the database's clock
-- and the unknown effects of types some worker can reconcile, and of the
-- others (which need an operator).
CREATE OR REPLACE FUNCTION outbox_read_reconcile_start()
RETURNS TABLE (clock text, reconcilable bigint, others bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT clock_timestamp()::text,
           count(*) FILTER (WHERE p.name IS NOT NULL),
           count(*) FILTER (WHERE p.name IS NULL)
      FROM effect_live o
      LEFT JOIN outbox_providers p ON p.name = o.effect_type AND p.can_reconcile
     WHERE o.available_at = 'infinity' AND o.state = 'unknown';
$$;

-- The effects unknown at p_start, of a reconcilable type, not asked since.
CREATE OR REPLACE FUNCTION outbox_read_reconcile_remaining(p_start timestamptz)
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT count(*) FROM effect_live o
      JOIN outbox_providers p ON p.name = o.effect_type AND p.can_reconcile
     WHERE o.available_at = 'infinity' AND o.state = 'unknown'
       AND o.created_at <= p_start
       AND (o.last_reconciled_at IS NULL OR o.last_reconciled_at < p_start);
$$;

-- The reconciliation verdicts written since p_since, after history row
-- p_after (the history's end-time index bounds the read to the run).
CREATE OR REPLACE FUNCTION outbox_read_reconcile_verdicts(p_since timestamptz, p_after bigint)
RETURNS TABLE (history_id bigint, effect_id uuid, effect_type text, outcome_class text,
               provider_status integer, provider_id text, error_text text, worker text,
               cas_applied boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT a.history_id, a.effect_id, b.effect_type, a.outcome_class, a.provider_status,
           a.provider_id, a.error_text, a.worker, a.cas_applied
      FROM effect_history a LEFT JOIN effect_outbox b ON b.effect_id = a.effect_id
     WHERE a.outcome_class IN ('reconciled_sent', 'reconciled_not_sent', 'reconcile_unknown')
       AND a.ended_at >= p_since AND a.history_id > p_after
     ORDER BY a.history_id;
$$;

-- How many months the history has partitions for (prune's report).
CREATE OR REPLACE FUNCTION outbox_read_history_months()
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT count(*) FROM pg_inherits WHERE inhparent = 'effect_history'::regclass;
$$;

REVOKE EXECUTE ON FUNCTION
    outbox_read_switch(),
    outbox_read_status(),
    outbox_read_unknown(),
    outbox_settle_unknown_runs(),
    outbox_read_effect(uuid),
    outbox_read_effect_history(uuid),
    outbox_read_scopes(boolean),
    outbox_read_reconcile_start(),
    outbox_read_reconcile_remaining(timestamptz),
    outbox_read_reconcile_verdicts(timestamptz, bigint),
    outbox_read_history_months()
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_read_switch(),
    outbox_read_status(),
    outbox_read_unknown(),
    outbox_read_effect(uuid),
    outbox_read_effect_history(uuid),
    outbox_read_scopes(boolean),
    outbox_read_reconcile_start(),
    outbox_read_reconcile_remaining(timestamptz),
    outbox_read_reconcile_verdicts(timestamptz, bigint),
    outbox_read_history_months()
    TO outbox_operator, outbox_viewer;
GRANT EXECUTE ON FUNCTION outbox_settle_unknown_runs() TO outbox_operator;

-- SPDX-License-Identifier: ISC
-- functions/60_housekeeping.sql: what one worker of the fleet runs for all
-- of it, at most every few seconds or minutes (an advisory lock and a
-- timestamp row decide who): failing rows of effect types nobody serves,
-- the history's months ahead, and this week's figures; and the operators'
-- view of the weekly figures.

-- Fail pending rows of types no worker has registered for p_grace_seconds.
-- Expired leases of pending rows are left alone: every reader treats an
-- expired lease as none and the next lease overwrites the columns, while
-- clearing them would read the whole outbox.
-- The first pass of each hour also makes the history's partitions for
-- this month and the next three (outbox_history_partitions), so that no
-- completion ever lands in the default partition.  Making one takes the
-- history's exclusive lock: when it is not granted within a second (a
-- long reader), the months are made by a later hour's pass instead of
-- holding up every worker's completion behind it.
CREATE OR REPLACE FUNCTION outbox_sweep(p_worker text, p_grace_seconds integer,
                                        p_every_seconds integer, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, effect_type text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    prev timestamptz;
    old_timeout text;
BEGIN
    IF NOT pg_try_advisory_xact_lock(7262935012345678902) THEN
        RETURN;
    END IF;
    SELECT s.last_run INTO prev FROM outbox_sweeps s WHERE s.id = 1;
    UPDATE outbox_sweeps s SET last_run = now(), last_worker = p_worker
     WHERE s.id = 1 AND s.last_run <= now() - make_interval(secs => greatest(p_every_seconds, 0));
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF prev < date_trunc('hour', now()) THEN
        old_timeout := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            PERFORM outbox_history_partitions(now(), now() + interval '3 months');
            PERFORM set_config('lock_timeout', old_timeout, true);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;                           -- a later hour's pass makes them
        END;
    END IF;
    PERFORM outbox_scope_held_fold();
    RETURN QUERY SELECT * FROM outbox_fail_unknown_types(p_grace_seconds, p_limit);
END $$;

-- The history's monthly partitions from p_from to p_to, made where
-- missing, for the workers and operators (outbox_history_partitions, which
-- makes any range, is the owner's): at most 24 months in one call, none
-- more than a year ahead and none more than ten years back.  Refused with
-- 22023 otherwise; returns how many it made.
CREATE OR REPLACE FUNCTION outbox_history_months(p_from timestamptz, p_to timestamptz)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF p_from IS NULL OR p_to IS NULL OR NOT isfinite(p_from) OR NOT isfinite(p_to)
       OR p_to > p_from + interval '24 months'
       OR p_to > now() + interval '12 months'
       OR p_from < now() - interval '120 months' THEN
        RAISE EXCEPTION 'outbox_history_months: a range of at most 24 months, from at most 10 years back to at most 12 months ahead (got % to %)',
                        p_from, p_to
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN outbox_history_partitions(p_from, p_to);
END $$;

-- The workers' figures: this week only.
CREATE OR REPLACE FUNCTION outbox_weekly_figures(p_worker text, p_every_seconds integer)
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
                  FROM outbox_weekly_stats_since(date_trunc('week', now() AT TIME ZONE 'UTC')) s
                 ORDER BY s.week_start DESC LIMIT 1)
         WHERE c.id = 1;
    END IF;
    RETURN QUERY
    SELECT c.duplicate_share, c.approval_wait_p50_seconds, c.approval_wait_p95_seconds,
           c.validation_failure_share, c.automatic_share, c.retries_exhausted, c.refreshed_at
      FROM outbox_weekly_cache c WHERE c.id = 1;
END $$;

-- The view's figures for the weeks from p_since (UTC wall time; its week)
-- to the current one, newest first, at most two years back (the workers
-- and operators may call it: a far-off p_since must not become a scan of
-- thousands of empty weeks).
CREATE OR REPLACE FUNCTION outbox_weekly_stats_since(p_since timestamp)
RETURNS TABLE (week_start timestamptz, claims bigint, duplicate_claims bigint,
               duplicate_share numeric, approvals_consumed bigint,
               approval_wait_p50_seconds numeric, approval_wait_p95_seconds numeric,
               effects_created bigint, validation_failures bigint,
               validation_failure_share numeric, automatic bigint, human_approved bigint,
               automatic_share numeric, retries_exhausted bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = public, pg_temp
-- planned with p_since at hand, so that a week's scan uses the indexes
SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    this_week timestamp := date_trunc('week', now() AT TIME ZONE 'UTC');
    first_week timestamp := greatest(date_trunc('week', p_since), this_week - interval '104 weeks');
    since timestamptz := first_week AT TIME ZONE 'UTC';
BEGIN
    RETURN QUERY
    WITH weeks AS (
        SELECT generate_series(first_week, this_week, interval '1 week') AS week),
    claims AS (
        SELECT date_trunc('week', c.claimed_at AT TIME ZONE 'UTC') AS week, count(*) AS claims,
               count(*) FILTER (WHERE c.outcome <> 'claimed') AS duplicates
          FROM run_claims c WHERE c.claimed_at >= since GROUP BY 1),
    waits AS (
        SELECT date_trunc('week', a.consumed_at AT TIME ZONE 'UTC') AS week, count(*) AS approvals,
               percentile_cont(0.5) WITHIN GROUP (
                   ORDER BY extract(epoch FROM a.consumed_at - a.created_at)) AS p50,
               percentile_cont(0.95) WITHIN GROUP (
                   ORDER BY extract(epoch FROM a.consumed_at - a.created_at)) AS p95
          FROM approvals a WHERE a.consumed_at >= since GROUP BY 1),
    -- Effects by the week they were created in: what the producers wrote
    -- (effect_outbox, its BRIN index on created_at).
    created AS (
        SELECT date_trunc('week', b.created_at AT TIME ZONE 'UTC') AS week, count(*) AS effects,
               count(*) FILTER (WHERE b.approved_by IS NULL) AS automatic,
               count(*) FILTER (WHERE b.approved_by IS NOT NULL) AS human
          FROM effect_outbox b WHERE b.created_at >= since GROUP BY 1),
    -- The finishing rows that are still an effect's last word (no live
    -- row, no later finishing row: an operator may have requeued it), of
    -- the failures counted here only.  A finishing row ends after the
    -- effect was created, so ended_at >= since holds for every one of them
    -- and lets the BRIN index on ended_at skip the older blocks of each
    -- partition.
    failed AS (
        SELECT h.created_at, h.ended_at, h.last_error_class
          FROM effect_history h
         WHERE h.state = 'failed' AND h.ended_at >= since
           AND h.last_error_class IN ('invalid', 'retry', 'not_sent', 'ambiguous')
           AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = h.effect_id)
           AND NOT EXISTS (SELECT 1 FROM effect_history later
                            WHERE later.effect_id = h.effect_id
                              AND later.created_at = h.created_at
                              AND later.state IS NOT NULL
                              AND later.history_id > h.history_id)),
    invalid AS (
        SELECT date_trunc('week', f.created_at AT TIME ZONE 'UTC') AS week, count(*) AS n
          FROM failed f WHERE f.last_error_class = 'invalid' AND f.created_at >= since
         GROUP BY 1),
    exhausted AS (
        SELECT date_trunc('week', f.ended_at AT TIME ZONE 'UTC') AS week, count(*) AS n
          FROM failed f WHERE f.last_error_class IN ('retry', 'not_sent', 'ambiguous')
         GROUP BY 1)
    SELECT w.week AT TIME ZONE 'UTC',
           coalesce(c.claims, 0),
           coalesce(c.duplicates, 0),
           round(c.duplicates::numeric / nullif(c.claims, 0), 4),
           coalesce(a.approvals, 0),
           round(a.p50::numeric, 3),
           round(a.p95::numeric, 3),
           coalesce(e.effects, 0),
           coalesce(i.n, 0),
           round(coalesce(i.n, 0)::numeric / nullif(e.effects, 0), 4),
           coalesce(e.automatic, 0),
           coalesce(e.human, 0),
           round(e.automatic::numeric / nullif(e.effects, 0), 4),
           coalesce(x.n, 0)
      FROM weeks w
      LEFT JOIN claims c ON c.week = w.week
      LEFT JOIN waits a ON a.week = w.week
      LEFT JOIN created e ON e.week = w.week
      LEFT JOIN invalid i ON i.week = w.week
      LEFT JOIN exhausted x ON x.week = w.week
     ORDER BY w.week DESC;
END $$;

-- The weekly figures, one row per week (Monday 00:00 UTC) for the last 26
-- weeks, newest first.  Effect figures only reach back as far as retention
-- keeps effects.
--   duplicate_share      claims that found the key already taken / claims
--   approval_wait_*      consumed_at - created_at of approvals consumed
--                        that week, in seconds
--   validation_failure_share  effects failed as 'invalid' / effects created
--   automatic / human_approved  effects created without / with an approver
--   retries_exhausted    effects that failed that week after retryable or
--                        ambiguous outcomes used up their attempts
CREATE OR REPLACE VIEW outbox_weekly_stats AS
SELECT * FROM outbox_weekly_stats_since(date_trunc('week', now() AT TIME ZONE 'UTC')
                                        - interval '25 weeks')
 ORDER BY week_start DESC;

GRANT SELECT ON outbox_weekly_stats TO outbox_operator;

-- Workers export the current week's figures as metrics.  The view runs with
-- its owner's rights, so this exposes aggregates, not approvals.
GRANT SELECT ON outbox_weekly_stats TO outbox_dispatcher;

-- The backfill of effect_history.source that 112_history_source.sql left
-- for after its commit: up to p_pages pages of one partition, by TID range
-- (a scan of those pages only), each row set to what its other columns say
-- (outbox_history_source_of: the one update the append-only trigger
-- allows).  Returns how many pages are left (0: done); the call that finds
-- none left validates the CHECK, which 112 added NOT VALID (a read of the
-- history under a lock that blocks no insert).  Run by `outboxctl
-- migrate` as the owner after every migration, one transaction per call.
-- A partition dropped meanwhile (prune) is skipped.
CREATE OR REPLACE FUNCTION outbox_history_source_backfill(p_pages integer DEFAULT 4096)
RETURNS bigint
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    b outbox_history_backfill%ROWTYPE;
    upto bigint;
BEGIN
    SELECT * INTO b FROM outbox_history_backfill x
     WHERE x.next_page < x.end_page ORDER BY x.part LIMIT 1 FOR UPDATE;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM pg_constraint c
                    WHERE c.conrelid = 'effect_history'::regclass
                      AND c.conname = 'effect_history_source_check' AND NOT c.convalidated) THEN
            ALTER TABLE effect_history VALIDATE CONSTRAINT effect_history_source_check;
        END IF;
        RETURN 0;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = b.part) THEN
        DELETE FROM outbox_history_backfill x WHERE x.part = b.part;
        RETURN 1;
    END IF;
    upto := least(b.next_page + greatest(p_pages, 1), b.end_page);
    EXECUTE format('UPDATE %s h SET source = outbox_history_source_of(h.worker, h.lease_owner, '
                   'h.outcome_class, h.resolution, h.state) '
                   'WHERE h.ctid >= %L::tid AND h.ctid < %L::tid AND h.source = ''worker'' '
                   'AND outbox_history_source_of(h.worker, h.lease_owner, h.outcome_class, '
                   'h.resolution, h.state) <> ''worker''',
                   b.part, format('(%s,0)', b.next_page), format('(%s,0)', upto));
    UPDATE outbox_history_backfill x SET next_page = upto WHERE x.part = b.part;
    -- At least 1: the call that finds nothing left validates.
    RETURN greatest((SELECT sum(x.end_page - x.next_page) FROM outbox_history_backfill x), 1);
END $$;

-- The partitions of the history whose part of effect_history_failed_idx
-- is not attached yet (114_history_failed_index.sql made the index ON ONLY
-- the parent): the partition, the name its part gets, an index there that
-- is such a part but not
-- attached (a build or an attach cut short: found by what it indexes, not
-- by its name), with whether it is valid, and whether a session is
-- building an index on it now.  `outboxctl migrate` builds each part
-- CONCURRENTLY after its commit and attaches it (lib/migrate.c); nothing
-- is returned once the parent is whole, or on a schema without the index.
DROP FUNCTION IF EXISTS outbox_history_index_pending();
CREATE OR REPLACE FUNCTION outbox_history_index_pending()
RETURNS TABLE (part text, index_name text, leftover text, leftover_valid boolean,
               busy boolean)
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    SELECT p.inhrelid::regclass::text,
           -- The name PostgreSQL gives the part of a month made later, so
           -- that two builds at once meet on it.
           quote_ident(left(c.relname, 63 - length('_effect_id_idx')) || '_effect_id_idx'),
           l.indexrelid::regclass::text, l.indisvalid,
           EXISTS (SELECT 1 FROM pg_stat_progress_create_index b WHERE b.relid = p.inhrelid)
      FROM pg_inherits p
      JOIN pg_class c ON c.oid = p.inhrelid
      LEFT JOIN LATERAL (
           SELECT i.indexrelid, i.indisvalid FROM pg_index i
            WHERE i.indrelid = p.inhrelid AND i.indnatts = 1 AND NOT i.indisunique
              AND i.indkey[0] = (SELECT a.attnum FROM pg_attribute a
                                  WHERE a.attrelid = p.inhrelid AND a.attname = 'effect_id')
              AND pg_get_expr(i.indpred, i.indrelid) = '(state = ''failed''::text)'
              AND NOT EXISTS (SELECT 1 FROM pg_inherits x WHERE x.inhrelid = i.indexrelid)
            ORDER BY i.indisvalid DESC, i.indexrelid LIMIT 1) l ON true
     WHERE p.inhparent = 'effect_history'::regclass
       AND to_regclass('effect_history_failed_idx') IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_inherits x JOIN pg_index i ON i.indexrelid = x.inhrelid
                        WHERE x.inhparent = to_regclass('effect_history_failed_idx')
                          AND i.indrelid = p.inhrelid)
     ORDER BY c.relname;
$$;

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_history_source_backfill(integer),
    outbox_history_index_pending(),
    outbox_sweep(text, integer, integer, integer),
    outbox_weekly_figures(text, integer),
    outbox_weekly_stats_since(timestamp without time zone),
    outbox_history_months(timestamp with time zone, timestamp with time zone)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_history_months(timestamp with time zone, timestamp with time zone)
    TO outbox_dispatcher, outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox_sweep(text, integer, integer, integer),
    outbox_weekly_figures(text, integer),
    outbox_weekly_stats_since(timestamp without time zone)
    TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION
    outbox_weekly_stats_since(timestamp without time zone)
    TO outbox_operator;

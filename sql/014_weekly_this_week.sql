-- 014_weekly_this_week.sql: the workers' weekly figures read this week's
-- rows, not the 26 weeks the operator's view covers.
--
-- outbox_weekly_figures() (007), run by one worker of the fleet every five
-- minutes, took the newest row of outbox_weekly_stats, which aggregates
-- 26 weeks; effect_outbox has no index on created_at, so every refresh
-- read the whole table: 1.9 s at 200,000 rows, and it grows with the
-- retention (two million rows kept: some twenty seconds of one core every
-- five minutes, and as long a snapshot holding vacuum back on the hot path).
--
-- Now the view's body is a function of the first week it covers; the view
-- asks for 26 weeks as before, the workers for the current one.  Block
-- range (BRIN) indexes on effect_outbox.created_at and
-- approvals.consumed_at let that read only recent pages: rows are written
-- in time order and a lease is a HOT update (it stays on its page), so a
-- range of pages covers a narrow span of time.  A BRIN index costs next to
-- nothing per insert (its summaries are made by autovacuum:
-- autosummarize), unlike a btree, which every non-HOT update would add to.
-- run_claims (claimed_at) and finished effects (completed_at) had btrees.
--
-- Building the two indexes reads each table once (no rewrite), and every
-- write to the table waits for it (producers' inserts, the workers'
-- leases and outcomes): on a large outbox, run it with the fleet and the
-- producers paused (docs/running-a-fleet.md).  The ranges stay narrow while
-- rows are written in time order; once `outboxctl prune` has freed pages
-- that new rows reuse, the ranges that hold them widen and a refresh
-- reads more of the table (at worst all of it, as before).

CREATE INDEX effect_outbox_created_brin ON effect_outbox USING brin (created_at)
    WITH (pages_per_range = 32, autosummarize = on);
CREATE INDEX approvals_consumed_brin ON approvals USING brin (consumed_at)
    WITH (pages_per_range = 32, autosummarize = on);

-- The view's figures for the weeks from p_since (UTC wall time; its week)
-- to the current one, newest first, at most two years back (the workers
-- and operators may call it: a far-off p_since must not become a scan of
-- thousands of empty weeks).  What each column means: 005's comment on
-- outbox_weekly_stats.
CREATE FUNCTION outbox_weekly_stats_since(p_since timestamp)
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
    created AS (
        SELECT date_trunc('week', o.created_at AT TIME ZONE 'UTC') AS week, count(*) AS effects,
               count(*) FILTER (WHERE o.state = 'failed' AND o.last_error_class = 'invalid') AS invalid,
               count(*) FILTER (WHERE o.approved_by IS NULL) AS automatic,
               count(*) FILTER (WHERE o.approved_by IS NOT NULL) AS human
          FROM effect_outbox o WHERE o.created_at >= since GROUP BY 1),
    exhausted AS (
        SELECT date_trunc('week', o.completed_at AT TIME ZONE 'UTC') AS week, count(*) AS n
          FROM effect_outbox o
         WHERE o.state = 'failed' AND o.last_error_class IN ('retry', 'not_sent', 'ambiguous')
           AND o.completed_at >= since
         GROUP BY 1)
    SELECT w.week AT TIME ZONE 'UTC',
           coalesce(c.claims, 0),
           coalesce(c.duplicates, 0),
           round(c.duplicates::numeric / nullif(c.claims, 0), 4),
           coalesce(a.approvals, 0),
           round(a.p50::numeric, 3),
           round(a.p95::numeric, 3),
           coalesce(e.effects, 0),
           coalesce(e.invalid, 0),
           round(e.invalid::numeric / nullif(e.effects, 0), 4),
           coalesce(e.automatic, 0),
           coalesce(e.human, 0),
           round(e.automatic::numeric / nullif(e.effects, 0), 4),
           coalesce(x.n, 0)
      FROM weeks w
      LEFT JOIN claims c ON c.week = w.week
      LEFT JOIN waits a ON a.week = w.week
      LEFT JOIN created e ON e.week = w.week
      LEFT JOIN exhausted x ON x.week = w.week
     ORDER BY w.week DESC;
END $$;

REVOKE EXECUTE ON FUNCTION outbox_weekly_stats_since(timestamp) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_weekly_stats_since(timestamp)
    TO outbox_operator, outbox_dispatcher;

-- The operator's view: 26 weeks, as before (same columns).
CREATE OR REPLACE VIEW outbox_weekly_stats AS
SELECT * FROM outbox_weekly_stats_since(date_trunc('week', now() AT TIME ZONE 'UTC')
                                        - interval '25 weeks')
 ORDER BY week_start DESC;

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

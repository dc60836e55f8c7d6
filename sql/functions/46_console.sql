-- SPDX-License-Identifier: ISC
-- functions/46_console.sql: the pages of the web console (console/,
-- docs/console.md), read by outbox_viewer.  Like 45_reads.sql, each is a
-- STABLE SECURITY DEFINER function, and each is bounded: a window of the
-- history's end times (its BRIN index), a walk of a primary key from a
-- keyset position with a LIMIT, or the live queue's due index.

-- The lowest effect id of a moment: effect ids begin with the Unix
-- milliseconds of their creation (outbox_new_effect_id), so a time window
-- of effects is a range of effect_outbox's primary key.
CREATE OR REPLACE FUNCTION outbox_effect_id_floor(p_at timestamptz)
RETURNS uuid LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM p_at) * 1000)::bigint), 12, '0')
            || '00000000000000000000')::uuid;
$$;
-- Only the console's functions (their owner) call it.
REVOKE EXECUTE ON FUNCTION outbox_effect_id_floor(timestamptz) FROM PUBLIC;

-- Effects by state, type and destination host (a URL target's host as
-- the scopes read it, outbox_target_host; NULL for other targets): the
-- open ones now and those finished in the last 24 hours by their final
-- state.  held: pending effects a scope holds back, counted apart.
-- Bounded at any size: each of three walks counts at most p_cap rows (1,000
-- to 200,000) and says when it stopped there (capped: the counts of that
-- walk are lower bounds): the due index's head (pending and sending, the
-- oldest first), its 'infinity' end (unknown, and pending a scope holds),
-- and the history's end-time index over the last day (its BRIN, the day's
-- oldest rows first).  Each counted row costs one probe of effect_outbox's
-- primary key for its type and target; the host of each target is read
-- as written and put in its one spelling once per host written
-- (outbox_target_host_written), not once per row.  The planner settings keep those
-- walks and probes whatever the statistics say (a table analyzed while
-- empty would otherwise make a hash join over effect_outbox look cheap).
DROP FUNCTION IF EXISTS outbox_console_counts();
CREATE OR REPLACE FUNCTION outbox_console_counts(p_cap integer DEFAULT 20000)
RETURNS TABLE (state text, effect_type text, host text, n bigint, held bigint, capped boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp SET jit = off
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
    WITH cap AS (SELECT least(greatest(p_cap, 1000), 200000) AS n),
    walked AS (
        SELECT 'due' AS walk, d.effect_id, d.state, d.held_by
          FROM (SELECT l.effect_id, l.state, l.held_by FROM effect_live l
                 WHERE l.available_at < 'infinity'
                 ORDER BY l.available_at, l.effect_id
                 LIMIT (SELECT n + 1 FROM cap)) d
        UNION ALL
        SELECT 'parked', p.effect_id, p.state, p.held_by
          FROM (SELECT l.effect_id, l.state, l.held_by FROM effect_live l
                 WHERE l.available_at = 'infinity'
                 ORDER BY l.available_at, l.effect_id
                 LIMIT (SELECT n + 1 FROM cap)) p
        UNION ALL
        SELECT 'finished', f.effect_id, f.state, NULL
          FROM (SELECT h.effect_id, h.state FROM effect_history h
                 WHERE h.ended_at > now() - interval '24 hours' AND h.state IS NOT NULL
                 LIMIT (SELECT n + 1 FROM cap)) f),
    walks AS (SELECT w.walk, count(*) > (SELECT n FROM cap) AS capped FROM walked w GROUP BY 1)
    SELECT c.state, c.effect_type, coalesce(outbox_host_canon(c.written), nullif(c.written, '')),
           sum(c.n)::bigint, sum(c.held)::bigint, bool_or(c.capped)
      FROM (SELECT w.state, b.effect_type, outbox_target_host_written(b.target) AS written,
                   count(*) AS n, count(*) FILTER (WHERE w.held_by IS NOT NULL) AS held,
                   bool_or(k.capped) AS capped
              FROM walked w
              JOIN effect_outbox b ON b.effect_id = w.effect_id
              JOIN walks k ON k.walk = w.walk
             GROUP BY 1, 2, 3) c
     GROUP BY 1, 2, 3
     ORDER BY 1, 2, 3;
$$;

-- The age of the oldest due pending effect no scope holds (the due
-- index's head), and of the oldest one a scope holds, since its creation,
-- as outbox_read_status counts it: a held effect is not due (a pause
-- parks it at 'infinity', a limit defers it), so its due time says
-- nothing of its age.  Both bounded, from the due index: the parked ones
-- at its 'infinity' end are in effect id order, which is creation order
-- (the first pending one there is the oldest); the deferred ones are due
-- soon, among the next 20,000 rows due after now.
CREATE OR REPLACE FUNCTION outbox_console_ages()
RETURNS TABLE (oldest_pending_seconds numeric, oldest_held_seconds numeric)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp
SET enable_seqscan = off SET enable_bitmapscan = off AS $$
    SELECT (SELECT extract(epoch FROM now() - min(available_at))::numeric(12,1) FROM effect_live
             WHERE state = 'pending' AND available_at <= now() AND held_by IS NULL),
           extract(epoch FROM now() - least(
               (SELECT l.created_at FROM effect_live l
                 WHERE l.available_at = 'infinity' AND l.state = 'pending'
                   AND l.held_by IS NOT NULL
                 ORDER BY l.available_at, l.effect_id LIMIT 1),
               (SELECT min(d.created_at)
                  FROM (SELECT l.created_at, l.held_by FROM effect_live l
                         WHERE l.available_at > now() AND l.available_at < 'infinity'
                         ORDER BY l.available_at, l.effect_id LIMIT 20000) d
                 WHERE d.held_by IS NOT NULL)))::numeric(12,1);
$$;

-- Per minute over the last p_hours (1 to 24): completions, retries,
-- failures and unknowns, from the history's end-time window: its BRIN
-- index in every month's partition, whatever the statistics say (with
-- none, the planner read a month's partition whole).
CREATE OR REPLACE FUNCTION outbox_console_minutes(p_hours integer)
RETURNS TABLE (minute timestamptz, completed bigint, retried bigint, failed bigint,
               unknown bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp SET jit = off
SET enable_seqscan = off AS $$
    SELECT date_trunc('minute', h.ended_at),
           count(*) FILTER (WHERE h.state = 'completed'),
           count(*) FILTER (WHERE h.outcome_class = 'retry'),
           count(*) FILTER (WHERE h.state = 'failed'),
           count(*) FILTER (WHERE h.outcome_class IN ('ambiguous', 'lease_lost'))
      FROM effect_history h
     WHERE h.ended_at > now() - make_interval(hours => least(greatest(p_hours, 1), 24))
     GROUP BY 1 ORDER BY 1;
$$;

-- Where a walk of at most p_walk effects (1,000 or more) of the window
-- [p_from, p_to) ends, going back from p_before (NULL: the newest): the
-- last effect id the walk reads, or NULL when the window holds no more
-- than p_walk effects from there (or p_walk is NULL).  An index-only walk
-- of the primary key.
CREATE OR REPLACE FUNCTION outbox_console_walk_floor(p_from timestamptz, p_to timestamptz,
    p_before uuid, p_walk integer)
RETURNS uuid
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT b.effect_id FROM effect_outbox b
     WHERE p_walk IS NOT NULL
       AND b.effect_id >= outbox_effect_id_floor(p_from)
       AND b.effect_id < coalesce(p_before, outbox_effect_id_floor(p_to))
       AND b.effect_id < outbox_effect_id_floor(p_to)
     ORDER BY b.effect_id DESC OFFSET greatest(p_walk, 1000) - 1 LIMIT 1;
$$;

-- Effects created in [p_from, p_to), newest first, from the keyset position
-- p_before (an effect id; NULL: the newest), at most p_limit (1 to 200),
-- with the filters given (NULL: any): state, type, host, run key, the
-- provider key, error text (a substring).  The walk is the primary key's
-- range of the window, backwards; a run key is its unique index.  Failed
-- effects, few among many, are found from the other side: the history's
-- failing rows of the window's effects, newest first (the partial index
-- effect_history_failed_idx, each partition's walked backwards and merged),
-- so that a page of them walks its own rows and stops, not every effect of
-- the window.  The planner settings keep those walks whatever the
-- statistics say (a sort of the window's failing rows looks cheap to a
-- planner that thinks the history small).
-- p_walk (the console's pages: 20,000; NULL: the whole window, as the acts
-- on a filter take it) bounds the walk without a run key to that many
-- effects: a filter that matches few of them (a host, an error text) ends
-- a page early at outbox_console_walk_floor, and the next page goes on
-- from there.
DROP FUNCTION IF EXISTS outbox_console_effects(timestamptz, timestamptz, text, text, text, text,
                                               text, text, uuid, integer);
CREATE OR REPLACE FUNCTION outbox_console_effects(p_from timestamptz, p_to timestamptz,
    p_state text, p_type text, p_host text, p_run_key text, p_effect_key text, p_error text,
    p_before uuid, p_limit integer, p_walk integer DEFAULT NULL)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               state text, attempts integer, created_at timestamptz, updated_at timestamptz,
               last_error_class text, last_error text, provider_id text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp SET jit = off
SET enable_sort = off SET enable_hashjoin = off SET enable_hashagg = off
SET enable_seqscan = off AS $$
    (SELECT o.effect_id, o.idempotency_key, o.effect_type, o.target, o.state, o.attempts,
            o.created_at, o.updated_at, o.last_error_class, o.last_error, o.provider_id
       FROM outbox_effects o
      WHERE p_state IS DISTINCT FROM 'failed'
        AND o.effect_id >= outbox_effect_id_floor(p_from)
        AND o.effect_id >= coalesce((SELECT outbox_console_walk_floor(p_from, p_to, p_before,
                                                                      p_walk)
                                      WHERE p_run_key IS NULL), outbox_effect_id_floor(p_from))
        AND o.effect_id < coalesce(p_before, outbox_effect_id_floor(p_to))
        AND o.effect_id < outbox_effect_id_floor(p_to)
        AND (p_run_key IS NULL OR o.idempotency_key = p_run_key)
        AND (p_type IS NULL OR o.effect_type = p_type)
        AND (p_effect_key IS NULL OR o.effect_key = p_effect_key)
        AND (p_host IS NULL OR outbox_target_host(o.target) = lower(p_host))
        AND (p_state IS NULL OR o.state = p_state)
        AND (p_error IS NULL OR strpos(lower(o.last_error), lower(p_error)) > 0)
      ORDER BY o.effect_id DESC
      LIMIT least(greatest(p_limit, 1), 200))
    UNION ALL
    (SELECT o.effect_id, o.idempotency_key, o.effect_type, o.target, o.state, o.attempts,
            o.created_at, o.updated_at, o.last_error_class, o.last_error, o.provider_id
       FROM (SELECT DISTINCT h.effect_id FROM effect_history h
              WHERE p_state = 'failed' AND h.state = 'failed'
                -- The partitions of the window (by the effects' creation,
                -- which an id's time follows within its transaction).
                AND h.created_at >= p_from - interval '1 hour'
                AND h.created_at < p_to + interval '1 hour'
                AND h.effect_id >= outbox_effect_id_floor(p_from)
                AND h.effect_id < coalesce(p_before, outbox_effect_id_floor(p_to))
                AND h.effect_id < outbox_effect_id_floor(p_to)
              ORDER BY h.effect_id DESC) f
       JOIN outbox_effects o ON o.effect_id = f.effect_id
      WHERE o.state = 'failed'
        AND (p_run_key IS NULL OR o.idempotency_key = p_run_key)
        AND (p_type IS NULL OR o.effect_type = p_type)
        AND (p_effect_key IS NULL OR o.effect_key = p_effect_key)
        AND (p_host IS NULL OR outbox_target_host(o.target) = lower(p_host))
        AND (p_error IS NULL OR strpos(lower(o.last_error), lower(p_error)) > 0)
      ORDER BY o.effect_id DESC
      LIMIT least(greatest(p_limit, 1), 200));
$$;

-- A run's state as outbox_settle_runs would leave it, read without
-- writing (the viewer writes nothing): p_state, the stored one, unless
-- its effects have moved it on: failed_terminal when one of them failed,
-- completed (from approved or processing) when all of them completed.
-- Bounded: at most 101 of the run's effects are read, through its unique
-- key, each probed in the live queue and, finished, by its last state in
-- the history; one failed among them is enough for failed_terminal, but a
-- run of more than 100 effects is not called completed from a part of
-- them (it shows as stored until outboxctl or a worker settles it).
CREATE OR REPLACE FUNCTION outbox_console_run_state(p_key text, p_state text)
RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH e AS MATERIALIZED (
        SELECT CASE WHEN EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)
                    THEN 'open'
                    ELSE coalesce((SELECT h.state FROM effect_history h
                                    WHERE h.effect_id = b.effect_id AND h.created_at = b.created_at
                                      AND h.state IS NOT NULL
                                    ORDER BY h.history_id DESC LIMIT 1), '') END AS st
          FROM (SELECT x.effect_id, x.created_at FROM effect_outbox x
                 WHERE x.idempotency_key = p_key
                   AND p_state NOT IN ('completed', 'failed_terminal')
                 LIMIT 101) b)
    SELECT CASE
        WHEN p_state IN ('completed', 'failed_terminal') THEN p_state
        WHEN EXISTS (SELECT 1 FROM e WHERE e.st = 'failed') THEN 'failed_terminal'
        WHEN p_state IN ('approved', 'processing')
         AND (SELECT count(*) FROM e) BETWEEN 1 AND 100
         AND NOT EXISTS (SELECT 1 FROM e WHERE e.st <> 'completed')
        THEN 'completed'
        ELSE p_state END;
$$;

-- The unknown page's evidence beyond the last attempt, for one effect:
-- the phase its last send reached (from the row the worker or the reaper
-- wrote: the request out and no answer, an answer that does not say, the
-- worker gone mid-send, which the reaper records) and when that send began (its point of no
-- return: the row went `sending` then), the reconcile lookups its history
-- holds (how many, the last one's answer and when) and the late
-- acceptances recorded (a provider's answer that came after the worker had
-- given up on the call).  One effect's history rows, through the
-- history's (created_at, effect_id) index.
DROP FUNCTION IF EXISTS outbox_console_unknown_evidence(uuid);
CREATE OR REPLACE FUNCTION outbox_console_unknown_evidence(p_effect_id uuid)
RETURNS TABLE (lookups bigint, last_lookup text, last_lookup_at timestamptz,
               late_accepted bigint, phase text, sent_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT count(*) FILTER (WHERE h.source = 'reconcile'),
           (array_agg(h.outcome_class || coalesce(', status ' || h.provider_status, '')
                      || coalesce(': ' || h.error_text, '') ORDER BY h.history_id DESC)
              FILTER (WHERE h.source = 'reconcile'))[1],
           max(h.started_at) FILTER (WHERE h.source = 'reconcile'),
           count(*) FILTER (WHERE h.resolution = 'late_accepted'),
           (array_agg(CASE
                WHEN h.source = 'reaper' OR h.outcome_class = 'lease_lost'
                    THEN 'sending; worker lost'
                WHEN coalesce(h.provider_status, 0) > 0
                    THEN 'sent; inconclusive ' || h.provider_status
                ELSE 'sent; no answer' END ORDER BY h.history_id DESC)
              FILTER (WHERE h.source IN ('worker', 'reaper')
                        AND h.outcome_class IN ('ambiguous', 'lease_lost')))[1],
           (array_agg(h.started_at ORDER BY h.history_id DESC)
              FILTER (WHERE h.source IN ('worker', 'reaper')
                        AND h.outcome_class IN ('ambiguous', 'lease_lost')))[1]
      FROM effect_outbox b
      JOIN effect_history h ON h.created_at = b.created_at AND h.effect_id = b.effect_id
     WHERE b.effect_id = p_effect_id;
$$;

-- Runs in one state (NULL: any), by key from the keyset position p_after,
-- each in the state its effects make it (outbox_console_run_state), which
-- the state asked for is matched against.
CREATE OR REPLACE FUNCTION outbox_console_runs(p_state text, p_after text, p_limit integer)
RETURNS TABLE (idempotency_key text, state text, effects bigint, open_effects bigint,
               failure_reason text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    -- Bounded at any size: at most 1,000 runs walked from the keyset
    -- position (a rare state ends a page early; the page goes on from
    -- outbox_console_runs_window_end), and a run's effects counted up to
    -- 101 through its unique key (101: more than 100; open_effects then
    -- counts the open ones among those 101, a lower bound).  Only a run
    -- not yet completed or failed_terminal can have moved on, so a state
    -- asked for is looked for among the runs stored in it and, for those
    -- two, among the runs that can still move.
    SELECT w.idempotency_key, s.state, c.effects, c.open_effects,
           coalesce(w.failure_reason, CASE WHEN s.state = 'failed_terminal'
                                           THEN 'an effect failed terminally' END)
      FROM (SELECT r.idempotency_key, r.state, r.failure_reason FROM workflow_runs r
             WHERE r.idempotency_key > coalesce(p_after, '')
             ORDER BY r.idempotency_key LIMIT 1000) w
     CROSS JOIN LATERAL (SELECT outbox_console_run_state(w.idempotency_key, w.state) AS state) s
     CROSS JOIN LATERAL (
           SELECT count(*) AS effects, count(l.effect_id) AS open_effects
             FROM (SELECT b.effect_id FROM effect_outbox b
                    WHERE b.idempotency_key = w.idempotency_key LIMIT 101) f
             LEFT JOIN effect_live l ON l.effect_id = f.effect_id) c
     WHERE (p_state IS NULL OR w.state = p_state
            OR (p_state IN ('completed', 'failed_terminal')
                AND w.state NOT IN ('completed', 'failed_terminal')))
       AND (p_state IS NULL OR s.state = p_state)
     ORDER BY w.idempotency_key
     LIMIT least(greatest(p_limit, 1), 200);
$$;

-- Where the runs page's walk of 1,000 runs after p_after ends: the key
-- the next page starts after, or NULL when no run is left beyond it.
CREATE OR REPLACE FUNCTION outbox_console_runs_window_end(p_after text)
RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT w.idempotency_key FROM workflow_runs w
     WHERE w.idempotency_key > coalesce(p_after, '')
     ORDER BY w.idempotency_key OFFSET 999 LIMIT 1;
$$;

-- A run's effects (its unique index).
CREATE OR REPLACE FUNCTION outbox_console_run_effects(p_key text)
RETURNS TABLE (effect_id uuid, effect_type text, target text, state text, attempts integer,
               created_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT o.effect_id, o.effect_type, o.target, o.state, o.attempts, o.created_at
      FROM outbox_effects o WHERE o.idempotency_key = p_key
     ORDER BY o.effect_id LIMIT 500;
$$;

-- Operator actions, newest first, of one operator (NULL: all), before the
-- keyset position p_before (an action id).
CREATE OR REPLACE FUNCTION outbox_console_audit(p_operator text, p_before bigint, p_limit integer)
RETURNS TABLE (action_id bigint, acted_at timestamptz, operator text, action text,
               effect_id uuid, run_key text, reason text, detail text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT a.action_id, a.acted_at, a.operator, a.action, a.effect_id, a.run_key, a.reason,
           a.detail::text
      FROM operator_actions a
     WHERE (p_operator IS NULL OR a.operator = p_operator)
       AND a.action_id < coalesce(p_before, 9223372036854775807)
     ORDER BY a.action_id DESC
     LIMIT least(greatest(p_limit, 1), 200);
$$;

-- The approvals waiting (not consumed, not expired), oldest first, with
-- the effects they would enqueue.  No token, no hash.
CREATE OR REPLACE FUNCTION outbox_console_approvals()
RETURNS TABLE (approval_id uuid, idempotency_key text, audience text, created_at timestamptz,
               expires_at timestamptz, proposed integer, proposed_types text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT a.approval_id, a.idempotency_key, a.approver_audience, a.created_at, a.expires_at,
           jsonb_array_length(a.proposed_effects),
           (SELECT string_agg(e->>'effect_type' || ' ' || (e->>'target'), ', ')
              FROM jsonb_array_elements(a.proposed_effects) e)
      FROM approvals a
     WHERE a.consumed_at IS NULL AND a.expires_at > now()
     ORDER BY a.created_at LIMIT 200;
$$;

-- The switch's changes and the scopes', newest first.
CREATE OR REPLACE FUNCTION outbox_console_control_history(p_limit integer)
RETURNS TABLE (changed_at timestamptz, scope text, action text, changed_by text, reason text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    (SELECT c.changed_at, 'all', CASE WHEN c.enabled THEN 'on' ELSE 'off' END, c.changed_by,
            c.reason
       FROM outbox_control_history c ORDER BY c.change_id DESC
      LIMIT least(greatest(p_limit, 1), 200))
    UNION ALL
    (SELECT s.changed_at, s.kind || ':' || s.value,
            s.action || coalesce(' ' || s.rate_per_second || '/s', ''), s.changed_by, s.reason
       FROM outbox_scope_history s ORDER BY s.change_id DESC
      LIMIT least(greatest(p_limit, 1), 200))
    ORDER BY 1 DESC;
$$;

-- The database the console reads, for its banner.
CREATE OR REPLACE FUNCTION outbox_console_database()
RETURNS TABLE (database text, server text, schema_version integer)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT current_database()::text, coalesce(inet_server_addr()::text, 'local socket'),
           (SELECT max(version) FROM schema_migrations);
$$;

REVOKE EXECUTE ON FUNCTION
    outbox_console_counts(integer), outbox_console_ages(), outbox_console_minutes(integer),
    outbox_console_effects(timestamptz, timestamptz, text, text, text, text, text, text, uuid,
                           integer, integer),
    outbox_console_walk_floor(timestamptz, timestamptz, uuid, integer),
    outbox_console_unknown_evidence(uuid),
    outbox_console_runs(text, text, integer), outbox_console_runs_window_end(text),
    outbox_console_run_effects(text), outbox_console_run_state(text, text),
    outbox_console_audit(text, bigint, integer), outbox_console_approvals(),
    outbox_console_control_history(integer), outbox_console_database()
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_console_counts(integer), outbox_console_ages(), outbox_console_minutes(integer),
    outbox_console_effects(timestamptz, timestamptz, text, text, text, text, text, text, uuid,
                           integer, integer),
    outbox_console_walk_floor(timestamptz, timestamptz, uuid, integer),
    outbox_console_unknown_evidence(uuid),
    outbox_console_runs(text, text, integer), outbox_console_runs_window_end(text),
    outbox_console_run_effects(text), outbox_console_run_state(text, text),
    outbox_console_audit(text, bigint, integer), outbox_console_approvals(),
    outbox_console_control_history(integer), outbox_console_database()
    TO outbox_viewer, outbox_operator;

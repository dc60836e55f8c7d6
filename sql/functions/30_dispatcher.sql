-- SPDX-License-Identifier: ISC
-- functions/30_dispatcher.sql: the statements the workers run, as
-- functions, and the kill switch.
--
-- Each takes arrays or a JSON batch so that a worker spends one round trip
-- per batch, not per effect.  The hot-path functions run cached generic
-- plans (plan_cache_mode = force_generic_plan: planning was most of a
-- batch's fixed cost) made with enable_seqscan off (a plan cached while
-- the queue was empty must not stay a scan of the table once it holds
-- millions), and JIT off in the functions that read the small tables
-- (a scan of outbox_scopes, planned with sequential scans off, costs as
-- much as a scan of millions, and JIT would compile it at every call), so
-- every statement is written to plan as index probes whatever the table's
-- size: rows are found by `= ANY (array)` of
-- keys or by a LATERAL probe per key, never by joining a set to a table
-- (tests/sql/test_plans_at_scale.py checks the plans at 2,000,000 rows;
-- docs/performance.md, "Where the time goes").  Every transition is a CAS
-- on (effect, lease owner, state): a worker whose lease is gone changes
-- nothing.  Effects move between states only through the functions listed
-- in docs/design.md, "State changes".

-- The kill-switch lock.  mark_sending holds it shared for the length of its
-- transaction; turning the switch off takes it exclusively.  So once the
-- "off" has committed, every mark_sending either committed before (its rows
-- are listed as in flight) or reads "off" (docs/design.md, "Kill switch").
CREATE OR REPLACE FUNCTION outbox_kill_switch_lock_key() RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT 7262935012345678901::bigint $$;

-- The state of an effect now: its live row's, else the one its last
-- finishing history row gave it (NULL: no such effect, or one being
-- inserted by a statement still running).
CREATE OR REPLACE FUNCTION outbox_effect_state(p_effect_id uuid)
RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT coalesce(
        (SELECT l.state FROM effect_live l WHERE l.effect_id = p_effect_id),
        (SELECT h.state FROM effect_outbox b JOIN effect_history h
                ON h.effect_id = b.effect_id AND h.created_at = b.created_at
          WHERE b.effect_id = p_effect_id AND h.state IS NOT NULL
          ORDER BY h.history_id DESC LIMIT 1));
$$;

-- Lease up to p_limit due pending rows, in (available_at, effect_id) order,
-- starting after (p_after_at, p_after_id) when given (at most 50 ms ago).  Rows come back in
-- that order, with available_at, so the caller's next position is the last
-- row.  Returns nothing while the kill switch is off (env flag or control
-- row): leasing then would only cost a release.  The authoritative check is
-- in outbox_mark_sending.
--
-- A payload longer than p_max_payload_bytes (the worker's limit) or
-- metadata longer than outbox_metadata_max_bytes(), as text, comes back
-- NULL: the worker fails the row as invalid with payload_bytes and
-- metadata_bytes (the text's lengths) as the reason, without ever holding
-- it.  Rows stored before the producer's bound, or written by the table's
-- owner, can carry either.  The text is made once per row.
--
-- (The older signature, without the bound and the two lengths, goes first:
-- a result type cannot be replaced.)
DROP FUNCTION IF EXISTS outbox_lease(uuid, text, integer, integer, text[], boolean,
                                     timestamp with time zone, uuid);
CREATE OR REPLACE FUNCTION outbox_lease(p_owner uuid, p_worker text, p_limit integer,
                             p_lease_seconds integer, p_types text[],
                             p_env_enabled boolean,
                             p_after_at timestamptz DEFAULT NULL,
                             p_after_id uuid DEFAULT NULL,
                             p_max_payload_bytes integer DEFAULT 67108864)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               metadata text, approved_by text, retry_base integer,
               available_at timestamptz, payload_bytes integer, metadata_bytes integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    after_at timestamptz := p_after_at;
    after_id uuid := p_after_id;
    allowed boolean;
    scoped boolean;
BEGIN
    SELECT c.enabled, c.scoped INTO allowed, scoped FROM outbox_control c WHERE c.id = 1;
    IF NOT p_env_enabled OR NOT coalesce(allowed, false) THEN
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
    -- Only a pause parks at the lease (limits are the mark's).
    IF scoped AND EXISTS (SELECT 1 FROM outbox_scopes s WHERE s.paused) THEN
        RETURN QUERY SELECT * FROM outbox_lease_scoped(p_owner, p_worker, p_limit,
                                                       p_lease_seconds, p_types, after_at,
                                                       after_id, p_max_payload_bytes);
        RETURN;
    END IF;
    RETURN QUERY
    WITH due AS (
        SELECT l.ctid AS row_at FROM effect_live l
         WHERE (l.available_at, l.effect_id) > (after_at, after_id)
           AND l.available_at <= now()
           AND l.state = 'pending'
           AND (l.lease_expires_at IS NULL OR l.lease_expires_at < now())
           AND l.effect_type = ANY (p_types)
         ORDER BY l.available_at, l.effect_id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    leased AS (
        UPDATE effect_live l
           SET lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE l.ctid = ANY (ARRAY(SELECT d.row_at FROM due d))
        RETURNING l.effect_id, l.attempts, l.retry_base, l.available_at)
    SELECT l.effect_id, b.idempotency_key, b.effect_type, b.target,
           CASE WHEN octet_length(b.payload_text) <= p_max_payload_bytes THEN b.payload_text END,
           b.payload_hash, b.effect_key, l.attempts,
           CASE WHEN octet_length(b.metadata_text) <= outbox_metadata_max_bytes()
                THEN b.metadata_text END,
           b.approved_by, l.retry_base, l.available_at,
           octet_length(b.payload_text), octet_length(b.metadata_text)
      FROM leased l
     CROSS JOIN LATERAL (
           SELECT e.idempotency_key, e.effect_type, e.target, e.payload::text AS payload_text,
                  e.payload_hash, e.effect_key, e.metadata::text AS metadata_text, e.approved_by
             FROM effect_outbox e WHERE e.effect_id = l.effect_id
            OFFSET 0) b
     ORDER BY l.available_at, l.effect_id;
END $$;

-- The call row of a claim or mark: which rows it moved to `sending`, the
-- host each one connects to (p_hosts, aligned with p_ids; NULL: read from
-- the target) and when the first lease of them ends (docs/design.md,
-- "Tables").  A repeat of the same call adds the rows it moved this time.
DROP FUNCTION IF EXISTS outbox_record_call(uuid, uuid, text, uuid[], timestamp with time zone);
CREATE OR REPLACE FUNCTION outbox_record_call(p_call uuid, p_owner uuid, p_worker text,
                                              p_ids uuid[], p_deadline timestamptz,
                                              p_hosts text[] DEFAULT NULL)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO effect_calls AS c (call, lease_owner, worker, ids, deadline, hosts)
    SELECT p_call, p_owner, p_worker, p_ids, p_deadline, p_hosts WHERE cardinality(p_ids) > 0
    ON CONFLICT (call) DO UPDATE
       SET (ids, hosts) = (SELECT array_agg(u.id ORDER BY u.id), array_agg(u.host ORDER BY u.id)
                             FROM (SELECT DISTINCT ON (x.id) x.id, x.host
                                     FROM (SELECT * FROM unnest(c.ids, c.hosts)
                                           UNION ALL
                                           SELECT * FROM unnest(EXCLUDED.ids, EXCLUDED.hosts))
                                          AS x(id, host)
                                    ORDER BY x.id, x.host NULLS LAST) u),
           deadline = least(c.deadline, EXCLUDED.deadline);
$$;

-- The commit point (docs/design.md, "Effect states"): leased rows of
-- p_owner move to `sending` only while the kill switch allows it, read
-- under its shared lock; blocked rows go back to pending without spending
-- an attempt.  While a scope is paused or limited (docs/design.md, "Scoped
-- pauses and rate limits") the scopes are read under the same lock, with
-- p_hosts[i] the host the worker's provider connects to for p_ids[i]:
-- rows a scope holds come back blocked with held_by naming it and
-- held_until when they are due again ('infinity': until it resumes);
-- a row that went at the slot a limit had deferred it to comes back with
-- held_until when the worker should lease again for the slots after it
-- (outbox_scope_sort).
-- Rows are locked in effect_id order first, as in every batch
-- function.  A call repeated after a lost connection (same p_call) gets
-- back the rows it already moved; that second half is read only when some
-- id did not move.  A call without a token gets one: every `sending` row
-- belongs to a call row.
-- (The signature without p_hosts, and its three columns, stays for
-- workers built before scopes existed, below.)
CREATE OR REPLACE FUNCTION outbox_mark_sending(p_owner uuid, p_ids uuid[], p_env_enabled boolean,
                                               p_idempotent_types text[], p_lease_seconds integer,
                                               p_call uuid, p_hosts text[])
RETURNS TABLE (effect_id uuid, attempts integer, blocked boolean, held_by text,
               held_until timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    allowed boolean;
    scoped boolean;
    go uuid[] := p_ids;
    ids uuid[];
    atts integer[];
    call uuid := coalesce(p_call, gen_random_uuid());
    worker text;
    hosts text[];
    repoll_ids uuid[] := '{}';
    repoll_at timestamptz[] := '{}';
BEGIN
    -- A call the worker gave up on (outbox_unclaim_call, after its repeat
    -- was refused) marks nothing, even if its first delivery reaches the
    -- server only now; the call's lock makes the give-up wait for a first
    -- call still running.  Lock order as in outbox_claim.
    IF p_call IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_call::text, 0));
        IF EXISTS (SELECT 1 FROM outbox_claim_repeats r WHERE r.call = p_call) THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key());
    SELECT c.enabled, c.scoped INTO allowed, scoped FROM outbox_control c WHERE c.id = 1;
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    IF NOT (coalesce(allowed, false) AND p_env_enabled) THEN
        -- The same call again (its first answer was lost with the
        -- connection) after the switch went off: the rows that first call
        -- moved were never seen as marked by the worker, so nothing was
        -- sent.  They go back to pending with the attempt undone, instead
        -- of waiting in `sending` for the reaper to call them unknown.
        -- (Their lease is dropped, so the release below skips them.)
        IF p_call IS NOT NULL THEN
            RETURN QUERY
            UPDATE effect_live o
               SET state = 'pending', attempts = o.attempts - 1, sending_since = NULL,
                   mark_token = NULL, sending_idempotent = false,
                   lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
                   updated_at = now()
             WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner
               AND o.state = 'sending' AND o.mark_token = p_call
            RETURNING o.effect_id, o.attempts, true, NULL::text, NULL::timestamptz;
        END IF;
        RETURN QUERY
        UPDATE effect_live o
           SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL
         WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner AND o.state = 'pending'
        RETURNING o.effect_id, o.attempts, true, NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    IF scoped THEN
        -- The rows that could move, by the scopes' verdict: the held ones
        -- parked or deferred, the rest marked below.
        DECLARE
            cand uuid[];
            cand_hosts text[];
            held uuid[];
            bys text[];
            untils timestamptz[];
            sorted_ids uuid[];
            sorted_by text[];
            sorted_until timestamptz[];
        BEGIN
            -- (Rows by key, then by TID; each one's host by its position:
            -- no join the statistics could make a walk of the queue.)
            SELECT coalesce(array_agg(o.effect_id ORDER BY o.effect_id), '{}'),
                   coalesce(array_agg(p_hosts[array_position(p_ids, o.effect_id)]
                                      ORDER BY o.effect_id), '{}')
              INTO cand, cand_hosts
              FROM effect_live o
             WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                        WHERE k.effect_id = ANY (p_ids) ORDER BY k.effect_id))
               AND o.lease_owner = p_owner AND o.state = 'pending'
               AND o.lease_expires_at > now();
            SELECT coalesce(array_agg(v.effect_id), '{}'), coalesce(array_agg(v.held_by), '{}'),
                   coalesce(array_agg(v.held_until), '{}')
              INTO sorted_ids, sorted_by, sorted_until
              FROM outbox_scope_sort(cand, cand_hosts) v;
            SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.by), '{}'),
                   coalesce(array_agg(x.until), '{}')
              INTO held, bys, untils
              FROM unnest(sorted_ids, sorted_by, sorted_until) AS x(id, by, until)
             WHERE x.by IS NOT NULL;
            -- Rows that go at their deferred slot: when to lease again.
            SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.until), '{}')
              INTO repoll_ids, repoll_at
              FROM unnest(sorted_ids, sorted_by, sorted_until) AS x(id, by, until)
             WHERE x.by IS NULL AND x.until IS NOT NULL;
            IF cardinality(held) > 0 THEN
                RETURN QUERY SELECT h.effect_id, h.attempts, true, h.held_by, h.held_until
                               FROM outbox_scope_hold(p_owner, p_ids, held, bys, untils) h;
                go := ARRAY(SELECT x FROM unnest(p_ids) AS x WHERE NOT x = ANY (held));
            END IF;
        END;
    END IF;
    WITH u AS (
        UPDATE effect_live o
           SET state = 'sending', attempts = o.attempts + 1,
               sending_since = now(), mark_token = call,
               sending_idempotent = o.effect_type = ANY (p_idempotent_types),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds),
               updated_at = now(), held_by = NULL
         WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                    WHERE k.effect_id = ANY (go) ORDER BY k.effect_id))
           AND o.lease_owner = p_owner
           AND o.state = 'pending'
           AND o.lease_expires_at > now()
        RETURNING o.effect_id, o.attempts, o.lease_worker)
    SELECT coalesce(array_agg(u.effect_id), '{}'), coalesce(array_agg(u.attempts), '{}'),
           min(u.lease_worker), array_agg(nullif(p_hosts[array_position(p_ids, u.effect_id)], ''))
      INTO ids, atts, worker, hosts FROM u;
    PERFORM outbox_record_call(call, p_owner, worker, ids,
                               now() + make_interval(secs => p_lease_seconds), hosts);
    RETURN QUERY SELECT x.id, x.att, false, NULL::text,
                        repoll_at[array_position(repoll_ids, x.id)]
                   FROM unnest(ids, atts) AS x(id, att);
    IF p_call IS NOT NULL AND cardinality(ids) < cardinality(go) THEN
        RETURN QUERY
        SELECT o.effect_id, o.attempts, false, NULL::text, NULL::timestamptz FROM effect_live o
         WHERE o.effect_id = ANY (go) AND NOT o.effect_id = ANY (ids)
           AND o.lease_owner = p_owner AND o.state = 'sending'
           AND o.mark_token = p_call
         ORDER BY o.effect_id;
    END IF;
END $$;

-- The sending transition as a worker built before scopes existed calls it:
-- hosts read from the targets by the database.
CREATE OR REPLACE FUNCTION outbox_mark_sending(p_owner uuid, p_ids uuid[], p_env_enabled boolean,
                                               p_idempotent_types text[], p_lease_seconds integer,
                                               p_call uuid DEFAULT NULL)
RETURNS TABLE (effect_id uuid, attempts integer, blocked boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT m.effect_id, m.attempts, m.blocked
      FROM outbox_mark_sending(p_owner, p_ids, p_env_enabled, p_idempotent_types,
                               p_lease_seconds, p_call, NULL::text[]) m;
$$;

CREATE OR REPLACE FUNCTION outbox_renew(p_owner uuid, p_ids uuid[], p_lease_seconds integer,
                                        p_max_lease_seconds integer)
RETURNS TABLE (effect_id uuid, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    RETURN QUERY
    UPDATE effect_live o
       SET lease_expires_at = least(now() + make_interval(secs => p_lease_seconds),
                                    coalesce(o.sending_since, o.leased_at)
                                      + make_interval(secs => p_max_lease_seconds))
     WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                WHERE k.effect_id = ANY (p_ids) ORDER BY k.effect_id))
       AND o.lease_owner = p_owner
       AND o.state IN ('pending', 'sending')
       AND o.lease_expires_at > now()
    RETURNING o.effect_id, o.lease_expires_at;
END $$;

CREATE OR REPLACE FUNCTION outbox_release(p_owner uuid, p_ids uuid[], p_delay_ms bigint DEFAULT 0)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    n integer;
BEGIN
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    UPDATE effect_live o
       SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           available_at = greatest(o.available_at,
                                   now() + make_interval(secs => greatest(p_delay_ms, 0) / 1000.0))
     WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                WHERE k.effect_id = ANY (p_ids) ORDER BY k.effect_id))
       AND o.lease_owner = p_owner AND o.state = 'pending';
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- A run's state as its effects make it: a run not yet completed or
-- failed_terminal whose effect failed becomes failed_terminal; one in
-- processing or approved with effects that are all completed becomes
-- completed (the rules outbox_complete applied when it wrote runs).  The workers no longer write runs when
-- they finish effects (a run update per completion batch was ~5 % of the
-- database's time per effect); every function that reads or changes a
-- run's state calls this first for the runs it reads, and bulk readers
-- with NULL (every run that can move), so each answers as if the runs had
-- moved with their effects.  An effect whose row is still being inserted
-- (no live row, no history row yet) counts as open.  Locks the runs in key
-- order first; the checks after it read with a snapshot taken once the
-- locks are held, so they see every effect committed before.
DROP FUNCTION IF EXISTS outbox_advance_runs(text[], text[]);
CREATE OR REPLACE FUNCTION outbox_settle_runs(p_keys text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    keys text[];
    n integer;
    m integer;
BEGIN
    IF p_keys IS NULL THEN
        SELECT coalesce(array_agg(w.idempotency_key ORDER BY w.idempotency_key), '{}') INTO keys
          FROM workflow_runs w
         WHERE w.state NOT IN ('completed', 'failed_terminal')
           AND EXISTS (SELECT 1 FROM effect_outbox b WHERE b.idempotency_key = w.idempotency_key);
    ELSE
        keys := p_keys;
    END IF;
    IF cardinality(keys) = 0 THEN
        RETURN 0;
    END IF;
    SELECT coalesce(array_agg(x.k), '{}') INTO keys FROM (
        SELECT w.idempotency_key AS k FROM workflow_runs w
         WHERE w.idempotency_key = ANY (keys) AND w.state NOT IN ('completed', 'failed_terminal')
         ORDER BY w.idempotency_key FOR UPDATE) x;
    IF cardinality(keys) = 0 THEN
        RETURN 0;
    END IF;
    UPDATE workflow_runs w
       SET state = 'failed_terminal', version = w.version + 1,
           failure_reason = coalesce(w.failure_reason, 'an effect failed terminally'),
           updated_at = now()
     WHERE w.idempotency_key = ANY (keys)
       AND w.state NOT IN ('completed', 'failed_terminal')
       AND EXISTS (SELECT 1 FROM effect_outbox b
                    WHERE b.idempotency_key = w.idempotency_key
                      AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)
                      AND (SELECT h.state FROM effect_history h
                            WHERE h.effect_id = b.effect_id AND h.created_at = b.created_at
                              AND h.state IS NOT NULL
                            ORDER BY h.history_id DESC LIMIT 1) = 'failed');
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE workflow_runs w
       SET state = 'completed', version = w.version + 1, updated_at = now()
     WHERE w.idempotency_key = ANY (keys)
       AND w.state IN ('approved', 'processing')
       AND EXISTS (SELECT 1 FROM effect_outbox b WHERE b.idempotency_key = w.idempotency_key)
       AND NOT EXISTS (SELECT 1 FROM effect_outbox b
                        WHERE b.idempotency_key = w.idempotency_key
                          AND (EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)
                               OR coalesce((SELECT h.state FROM effect_history h
                                             WHERE h.effect_id = b.effect_id
                                               AND h.created_at = b.created_at
                                               AND h.state IS NOT NULL
                                             ORDER BY h.history_id DESC LIMIT 1), '')
                                  <> 'completed'));
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END $$;

-- Record a batch of provider outcomes.  p_results is a JSON array of
--   {effect_id, attempt, started_ms_ago, outcome, status, provider_id, error,
--    next_state, retry_delay_ms}
-- where the worker has already applied the failure-class matrix to pick
-- next_state.  Every time is the database's: a send's started_at is now()
-- minus started_ms_ago (how long ago the worker started it, by its
-- monotonic clock), never before the row went `sending` (sending_since)
-- nor after now(); without started_ms_ago (a worker of an older version,
-- which sent its own clock's started_at: ignored) it is now().  A worker
-- whose wall clock is off therefore cannot move the attempt's age, which
-- decides when a lookup's "not found" counts (outbox_reconcile_lease).
--
-- Two functions, the worker calling the second only when the first left
-- elements over (docs/design.md, "Recording outcomes"):
-- - outbox_complete_sending, the usual batch (every element's row is
--   `sending` under this lease): one statement, the state change with its
--   history rows (finished effects leave the live queue by a DELETE whose
--   RETURNING makes their finishing history rows, retried ones are updated
--   in place).  It answers only the elements it applied.
-- - outbox_complete_rest, for the elements it did not apply: late evidence
--   for `unknown` rows, rows a concurrent statement (a heartbeat's
--   renewal) changed under the first, and elements whose CAS does not
--   apply (lease lost, a batch delivered twice), which are evidence only.
-- outbox_complete, the two in one call, is what workers before the split
-- call.  Runs are not touched (outbox_settle_runs).

-- The usual batch, one statement.  Rows are locked in effect_id order,
-- the order every batch function takes them in, so two batches cannot
-- wait on each other: the state change walks the batch in that order.  A
-- batch that finishes some effects and retries others changes them in two
-- steps (DELETE, UPDATE), so it takes its locks first (`locked`, read by
-- `r` before any row is changed; a filter without a table column, so a
-- batch that is not mixed reads no row for it).  The same batch sent again
-- after a lost connection (the first may have committed) finds its rows
-- moved on: the CAS records each provider call once.
CREATE OR REPLACE FUNCTION outbox_complete_sending(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH locked AS MATERIALIZED (
        SELECT o.effect_id FROM effect_live o
         WHERE jsonb_path_exists(p_results, '$[*] ? (@.next_state == "completed" || @.next_state == "failed")')
           AND jsonb_path_exists(p_results, '$[*] ? (@.next_state != "completed" && @.next_state != "failed")')
           AND o.effect_id = ANY (ARRAY(SELECT (e ->> 'effect_id')::uuid
                                          FROM jsonb_array_elements(p_results) e))
         ORDER BY o.effect_id FOR UPDATE),
    r AS MATERIALIZED (
        SELECT r.*,
               r.next_state IN ('completed', 'failed') AS finishes,
               CASE WHEN r.outcome = 'accepted' THEN NULL ELSE r.outcome END AS error_class
          FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_ms_ago bigint, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
         WHERE r.next_state IN ('completed', 'pending', 'failed', 'unknown')
           AND (SELECT count(*) FROM locked) >= 0
         ORDER BY r.effect_id),
    -- Each element's live row, found once through the primary key (in key
    -- order: the only plan without a sort) and then by its TID, so that no
    -- statistics can turn the probes into a walk of the queue; with the
    -- row's sending_since before the update.
    cur AS MATERIALIZED (
        SELECT r.*, k.row_at, k.sending_since AS old_sending_since
          FROM r
         CROSS JOIN LATERAL (
               SELECT k.ctid AS row_at, k.sending_since FROM effect_live k
                WHERE k.effect_id = ANY (ARRAY[r.effect_id])
                ORDER BY k.effect_id) k),
    gone AS (
        DELETE FROM effect_live o USING cur r
         WHERE o.ctid = r.row_at AND r.finishes
           AND o.attempts = r.attempt AND o.lease_owner = p_owner AND o.state = 'sending'
        RETURNING o.effect_id, o.created_at, o.sending_since, o.retry_base,
                  coalesce(r.provider_id, o.provider_id) AS effect_provider_id,
                  r.started_ms_ago, r.attempt, r.outcome, r.status, r.provider_id, r.error,
                  r.next_state, r.error_class),
    moved AS (
        UPDATE effect_live o
           SET state = r.next_state,
               provider_id = coalesce(r.provider_id, o.provider_id),
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL,
               available_at = CASE WHEN r.next_state = 'pending'
                                   THEN now() + make_interval(secs => greatest(r.retry_delay_ms, 0) / 1000.0)
                                   ELSE 'infinity' END,
               last_error_class = r.error_class, last_error = r.error,
               last_status = r.status, updated_at = now()
          FROM cur r
         WHERE o.ctid = r.row_at AND NOT r.finishes
           AND o.attempts = r.attempt AND o.lease_owner = p_owner AND o.state = 'sending'
        RETURNING o.effect_id, o.created_at, r.started_ms_ago, r.attempt, r.outcome, r.status,
                  r.provider_id, r.error, r.next_state, r.old_sending_since AS sending_since),
    u AS (
        SELECT g.effect_id, g.created_at, g.sending_since, g.started_ms_ago, g.attempt,
               g.outcome, g.status, g.provider_id, g.error, g.next_state,
               g.next_state AS final_state, g.error_class, g.error AS final_error,
               g.effect_provider_id, g.retry_base
          FROM gone g
        UNION ALL
        SELECT m.effect_id, m.created_at, m.sending_since, m.started_ms_ago, m.attempt,
               m.outcome, m.status, m.provider_id, m.error, m.next_state,
               NULL, NULL, NULL, NULL, NULL
          FROM moved m),
    logged AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, outcome_class, provider_status, provider_id,
                                    error_text, cas_applied, state, last_error_class,
                                    last_error, last_provider_id, retry_base)
        SELECT u.effect_id, u.created_at, u.attempt, p_owner, p_worker, 'worker',
               least(now(), greatest(u.sending_since,
                                     now() - make_interval(secs => coalesce(greatest(
                                                 u.started_ms_ago, 0), 0) / 1000.0))),
               u.outcome, u.status, u.provider_id, u.error, true, u.final_state,
               u.error_class, u.final_error, u.effect_provider_id, u.retry_base
          FROM u)
    SELECT u.effect_id, u.next_state FROM u;
END $$;

-- The elements outbox_complete_sending did not apply (p_results: those
-- only), locked.  Returns, per element, whether the state change applied,
-- the state it set and, when it resolved an `unknown` effect, how
-- (late_accepted, late_not_sent).  The `unknown` rows whose unknown-ness
-- came from this worker's lease on exactly the attempt being recorded (the
-- reaper's row for it names this owner) take late evidence; the rows a
-- concurrent statement changed after the first read their TIDs are tried
-- again.  Every element of an attempt this worker held the lease of
-- becomes a history row, whether or not the CAS still matches (a worker
-- that lost its lease still leaves its evidence).
CREATE OR REPLACE FUNCTION outbox_complete_rest(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text, resolved text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    late_ids uuid[];
    left_ids uuid[];
    done_ids uuid[];
    requeued integer;
BEGIN
    -- What is left: locked in effect_id order, then the late candidates.
    SELECT coalesce(array_agg(l.effect_id), '{}') INTO left_ids
      FROM (SELECT o.effect_id FROM effect_live o
             WHERE o.effect_id = ANY (ARRAY(SELECT (e ->> 'effect_id')::uuid
                                              FROM jsonb_array_elements(p_results) e))
             ORDER BY o.effect_id
               FOR UPDATE) l;
    -- (Each element's rows found by a lookup per element that has only
    -- one plan without a penalty, as `cur` below: where the statistics
    -- could make a statement of this function a walk of the queue or of
    -- the bodies, it did so on a queue analyzed while empty.)
    SELECT coalesce(array_agg(o.effect_id), '{}') INTO late_ids
      FROM jsonb_to_recordset(p_results) AS r(effect_id uuid, attempt integer, outcome text,
                                              next_state text)
     CROSS JOIN LATERAL (
           SELECT k.effect_id, k.created_at, k.state, k.attempts FROM effect_live k
            WHERE k.effect_id = ANY (ARRAY[r.effect_id])
            ORDER BY k.effect_id) o
     WHERE r.effect_id = ANY (left_ids)
       AND o.state = 'unknown'
       AND ((r.outcome = 'accepted' AND r.next_state = 'completed')
            OR (r.outcome = 'not_sent' AND r.next_state IN ('pending', 'failed')))
       AND o.attempts = r.attempt
       AND EXISTS (SELECT 1 FROM effect_history a
                    WHERE a.effect_id = o.effect_id AND a.created_at = o.created_at
                      AND a.attempt = r.attempt
                      AND a.lease_owner = p_owner AND a.source = 'reaper');

    -- The state change of what is left, as in outbox_complete_sending,
    -- for the lease holder's `sending` rows and the late candidates.
    WITH r AS MATERIALIZED (
        SELECT r.*,
               r.next_state IN ('completed', 'failed') AS finishes,
               CASE WHEN r.outcome = 'accepted' THEN NULL ELSE r.outcome END AS error_class,
               CASE WHEN r.effect_id = ANY (late_ids) AND r.outcome = 'not_sent'
                    THEN 'late evidence: the attempt given up on was not sent ('
                         || coalesce(r.error, 'no detail') || ')'
                    ELSE r.error END AS error_text,
               CASE WHEN r.effect_id = ANY (late_ids)
                    THEN CASE WHEN r.outcome = 'accepted' THEN 'late_accepted'
                              ELSE 'late_not_sent' END END AS resolution
          FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_ms_ago bigint, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
         WHERE r.next_state IN ('completed', 'pending', 'failed', 'unknown')
           AND r.effect_id = ANY (left_ids)
         ORDER BY r.effect_id),
    cur AS MATERIALIZED (
        SELECT r.*, k.row_at, k.sending_since AS old_sending_since
          FROM r
         CROSS JOIN LATERAL (
               SELECT k.ctid AS row_at, k.sending_since FROM effect_live k
                WHERE k.effect_id = ANY (ARRAY[r.effect_id])
                ORDER BY k.effect_id) k),
    gone AS (
        DELETE FROM effect_live o USING cur r
         WHERE o.ctid = r.row_at AND r.finishes
           AND o.attempts = r.attempt
           AND ((o.lease_owner = p_owner AND o.state = 'sending')
                OR (o.state = 'unknown' AND o.effect_id = ANY (late_ids)))
        RETURNING o.effect_id, o.created_at, o.sending_since, o.retry_base,
                  coalesce(r.provider_id, o.provider_id) AS effect_provider_id,
                  r.started_ms_ago, r.attempt, r.outcome, r.status, r.provider_id, r.error,
                  r.next_state, r.resolution, r.error_class, r.error_text),
    moved AS (
        UPDATE effect_live o
           SET state = r.next_state,
               provider_id = coalesce(r.provider_id, o.provider_id),
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL,
               available_at = CASE WHEN r.next_state = 'pending'
                                   THEN now() + make_interval(secs => greatest(r.retry_delay_ms, 0) / 1000.0)
                                   ELSE 'infinity' END,
               last_error_class = r.error_class, last_error = r.error_text,
               last_status = r.status, updated_at = now()
          FROM cur r
         WHERE o.ctid = r.row_at AND NOT r.finishes
           AND o.attempts = r.attempt
           AND ((o.lease_owner = p_owner AND o.state = 'sending')
                OR (o.state = 'unknown' AND o.effect_id = ANY (late_ids)))
        RETURNING o.effect_id, o.created_at, r.started_ms_ago, r.attempt, r.outcome, r.status,
                  r.provider_id, r.error, r.next_state, r.resolution,
                  r.old_sending_since AS sending_since),
    u AS (
        SELECT g.effect_id, g.created_at, g.sending_since, g.started_ms_ago, g.attempt,
               g.outcome, g.status, g.provider_id, g.error, g.next_state, g.resolution,
               g.next_state AS final_state, g.error_class, g.error_text AS final_error,
               g.effect_provider_id, g.retry_base
          FROM gone g
        UNION ALL
        SELECT m.effect_id, m.created_at, m.sending_since, m.started_ms_ago, m.attempt,
               m.outcome, m.status, m.provider_id, m.error, m.next_state, m.resolution,
               NULL, NULL, NULL, NULL, NULL
          FROM moved m),
    logged AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, outcome_class, provider_status, provider_id,
                                    error_text, cas_applied, resolution, state,
                                    last_error_class, last_error, last_provider_id, retry_base)
        SELECT u.effect_id, u.created_at, u.attempt, p_owner, p_worker, 'worker',
               least(now(), greatest(u.sending_since,
                                     now() - make_interval(secs => coalesce(greatest(
                                                 u.started_ms_ago, 0), 0) / 1000.0))),
               u.outcome, u.status, u.provider_id, u.error, true, u.resolution, u.final_state,
               u.error_class, u.final_error, u.effect_provider_id, u.retry_base
          FROM u)
    SELECT coalesce(array_agg(u.effect_id), '{}'),
           count(*) FILTER (WHERE u.next_state = 'pending' AND u.effect_id = ANY (late_ids))
      INTO done_ids, requeued
      FROM u;

    -- Elements whose CAS did not apply: evidence only from the worker that
    -- held this attempt's lease, the lease owner now or the owner the
    -- reaper's row for the attempt names (a worker that resumes after its
    -- lease was reaped); once per (attempt, owner): a batch delivered twice
    -- leaves one row.  The rows of the batch that are still live are
    -- locked, so a second delivery waits for the first and then sees its
    -- rows.
    INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                started_at, outcome_class, provider_status, provider_id,
                                error_text, cas_applied)
    SELECT r.effect_id, b.created_at, r.attempt, p_owner, p_worker, 'worker',
           now() - make_interval(secs => coalesce(greatest(r.started_ms_ago, 0), 0) / 1000.0),
           r.outcome, r.status, r.provider_id, r.error, false
      FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_ms_ago bigint, outcome text,
               status integer, provider_id text, error text)
     CROSS JOIN LATERAL (SELECT e.created_at FROM effect_outbox e
                          WHERE e.effect_id = ANY (ARRAY[r.effect_id])
                          ORDER BY e.effect_id OFFSET 0) b
     WHERE NOT r.effect_id = ANY (done_ids)
       AND r.outcome IS NOT NULL
       AND (EXISTS (SELECT 1 FROM (SELECT k.lease_owner FROM effect_live k
                                    WHERE k.effect_id = ANY (ARRAY[r.effect_id])
                                    ORDER BY k.effect_id OFFSET 0) o
                     WHERE o.lease_owner = p_owner)
            OR EXISTS (SELECT 1 FROM effect_history a
                        WHERE a.effect_id = r.effect_id AND a.created_at = b.created_at
                          AND a.attempt = r.attempt
                          AND a.lease_owner = p_owner AND a.source = 'reaper'))
       AND NOT EXISTS (SELECT 1 FROM effect_history a
                        WHERE a.effect_id = r.effect_id AND a.created_at = b.created_at
                          AND a.attempt = r.attempt AND a.lease_owner = p_owner
                          AND a.outcome_class IS NOT NULL
                          AND a.source <> 'reaper');

    IF requeued > 0 THEN
        PERFORM pg_notify('effect_outbox', '');
    END IF;

    -- "applied" also when an earlier delivery of this same batch applied it
    -- (only then is the history probed, by its index).
    RETURN QUERY
    SELECT r.effect_id, r.effect_id = ANY (done_ids) OR coalesce(prev.applied, false),
           CASE WHEN r.effect_id = ANY (done_ids) OR coalesce(prev.applied, false) THEN r.next_state END,
           CASE WHEN NOT r.effect_id = ANY (done_ids) THEN prev.resolution
                WHEN r.effect_id = ANY (late_ids)
                THEN CASE WHEN r.outcome = 'accepted' THEN 'late_accepted'
                          ELSE 'late_not_sent' END END
      FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, outcome text, next_state text)
      LEFT JOIN LATERAL (
          SELECT true AS applied, a.resolution FROM effect_history a
           WHERE NOT r.effect_id = ANY (done_ids)
             AND a.effect_id = r.effect_id AND a.attempt = r.attempt
             AND a.created_at = (SELECT e.created_at FROM effect_outbox e
                                  WHERE e.effect_id = r.effect_id)
             AND a.lease_owner = p_owner AND a.cas_applied
             AND a.outcome_class IS NOT NULL
             AND a.source <> 'reaper'
           LIMIT 1) prev ON true;
END $$;

-- Both in one call, as workers before the split made it: the usual batch,
-- then the rest of it when some element did not apply.
CREATE OR REPLACE FUNCTION outbox_complete(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text, resolved text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    states text[];
BEGIN
    SELECT coalesce(array_agg(c.effect_id), '{}'), coalesce(array_agg(c.state), '{}')
      INTO ids, states
      FROM outbox_complete_sending(p_owner, p_worker, p_results) c;
    RETURN QUERY SELECT x.id, true, x.st, NULL::text FROM unnest(ids, states) AS x(id, st);
    IF cardinality(ids) < jsonb_array_length(p_results) THEN
        RETURN QUERY
        SELECT * FROM outbox_complete_rest(p_owner, p_worker,
                                           (SELECT jsonb_agg(e) FROM jsonb_array_elements(p_results) e
                                             WHERE NOT (e ->> 'effect_id')::uuid = ANY (ids)));
    END IF;
END $$;

-- Rows the worker found invalid before sending: failed with the reason,
-- locked in effect_id order first.  A claimed row (outbox_claim: already
-- `sending`, never sent; the item names its claim's call token, so that a
-- late call cannot fail a row claimed or marked since) gets its attempt
-- undone: no provider was called.  The row leaves the live queue; its
-- history row (no call) carries the reason.
CREATE OR REPLACE FUNCTION outbox_fail_invalid(p_owner uuid, p_items jsonb)
RETURNS TABLE (effect_id uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
BEGIN
    PERFORM outbox_lock_owned(p_owner, ARRAY(SELECT x.effect_id FROM
                              jsonb_to_recordset(p_items) AS x(effect_id uuid)));
    WITH x AS MATERIALIZED (
        SELECT x.* FROM jsonb_to_recordset(p_items) AS x(effect_id uuid, error_class text,
                                                         error text, call uuid)),
    gone AS (
        DELETE FROM effect_live o USING x
         WHERE o.effect_id = ANY (ARRAY(SELECT y.effect_id FROM x y))
           AND o.effect_id = x.effect_id AND o.lease_owner = p_owner
           AND (o.state = 'pending' OR (o.state = 'sending' AND o.mark_token = x.call))
        RETURNING o.effect_id, o.created_at, o.retry_base, o.provider_id, o.last_status,
                  CASE WHEN o.state = 'sending' THEN o.attempts - 1 ELSE o.attempts END AS attempts,
                  coalesce(x.error_class, 'invalid') AS error_class, x.error),
    logged AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, state, last_error_class, last_error,
                                    last_provider_id, provider_status, retry_base)
        SELECT g.effect_id, g.created_at, g.attempts, p_owner, NULL, 'worker', now(), 'failed',
               g.error_class, g.error, g.provider_id, g.last_status, g.retry_base
          FROM gone g)
    SELECT coalesce(array_agg(g.effect_id), '{}') INTO ids FROM gone g;
    RETURN QUERY SELECT unnest(ids);
END $$;

-- The reaper: a `sending` row whose lease passed belonged to a worker that
-- died or stalled mid-send.  It goes to `unknown`, or back to pending with
-- the same key where the provider honours keys; never simply re-sent.  The
-- rows are found through their calls (effect_calls, by deadline): the live
-- rows carry no index that a claim would have to update.  A call whose
-- rows were renewed gets its deadline moved to the first of theirs; a call
-- with no row left in `sending` goes.
CREATE OR REPLACE FUNCTION outbox_reap(p_worker text, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, state text, lost_worker text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    calls uuid[];
    reaped uuid[];
    states text[];
    workers text[];
BEGIN
    SELECT coalesce(array_agg(c.call), '{}') INTO calls FROM (
        SELECT c.call FROM effect_calls c WHERE c.deadline < now()
         ORDER BY c.deadline LIMIT greatest(p_limit / 16, 8)
           FOR UPDATE SKIP LOCKED) c;
    IF cardinality(calls) = 0 THEN
        RETURN;
    END IF;
    -- The calls' rows, found through the primary key in key order and
    -- then by TID (one plan whatever the statistics say; SKIP LOCKED
    -- waits for no lock, so the TID order of the walk is safe).
    WITH expired AS (
        SELECT o.ctid AS row_at, o.effect_id, o.created_at, o.lease_worker, o.lease_owner,
               o.attempts, o.sending_since
          FROM effect_live o
         WHERE o.ctid = ANY (ARRAY(
                   SELECT k.ctid FROM effect_live k
                    WHERE k.effect_id = ANY (ARRAY(SELECT x FROM effect_calls c,
                                                          unnest(c.ids) AS x
                                                    WHERE c.call = ANY (calls)))
                    ORDER BY k.effect_id))
           AND o.mark_token = ANY (calls)
           AND o.state = 'sending' AND o.lease_expires_at < now()
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED),
    moved AS (
        UPDATE effect_live o
           SET state = CASE WHEN o.sending_idempotent THEN 'pending' ELSE 'unknown' END,
               available_at = CASE WHEN o.sending_idempotent THEN now() ELSE 'infinity' END,
               last_error_class = 'ambiguous',
               last_error = 'lease expired while sending (worker '
                            || coalesce(e.lease_worker, '?') || ' lost)',
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL, updated_at = now()
          FROM expired e
         WHERE o.ctid = e.row_at
        RETURNING o.effect_id, o.state, e.created_at, e.lease_worker, e.lease_owner,
                  e.attempts, e.sending_since),
    logged AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, outcome_class, error_text, cas_applied)
        SELECT m.effect_id, m.created_at, m.attempts, m.lease_owner, 'reaper:' || p_worker,
               'reaper', coalesce(m.sending_since, now()), 'ambiguous',
               'lease expired while sending; worker ' || coalesce(m.lease_worker, '?')
               || ' lost; state ' || m.state, true
          FROM moved m)
    SELECT coalesce(array_agg(m.effect_id), '{}'), coalesce(array_agg(m.state), '{}'),
           coalesce(array_agg(m.lease_worker), '{}')
      INTO reaped, states, workers FROM moved m;

    -- The calls looked at: gone when none of their rows is still in
    -- `sending` under them, else due again at their rows' first deadline.
    WITH left_over AS (
        SELECT c.call,
               (SELECT min(o.lease_expires_at) FROM effect_live o
                 WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                            WHERE k.effect_id = ANY (c.ids)
                                            ORDER BY k.effect_id))
                   AND o.mark_token = c.call AND o.state = 'sending'
                   AND NOT o.effect_id = ANY (reaped)) AS deadline
          FROM effect_calls c
         WHERE c.call = ANY (calls)),
    dropped AS (
        DELETE FROM effect_calls c USING left_over x
         WHERE c.call = x.call AND x.deadline IS NULL
        RETURNING c.call)
    UPDATE effect_calls c SET deadline = greatest(x.deadline, now() + interval '1 second')
      FROM left_over x
     WHERE c.call = x.call AND x.deadline IS NOT NULL;

    RETURN QUERY SELECT * FROM unnest(reaped, states, workers);
END $$;

-- Provider names some worker serves (only provider-like names).
CREATE OR REPLACE FUNCTION outbox_register_providers(p_names text[], p_reconcilable text[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    bad text;
BEGIN
    SELECT n INTO bad FROM unnest(p_names) AS n
     WHERE n IS NULL OR n !~ '^[a-z][a-z0-9_]{0,31}$' LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox_register_providers: % is not a provider name (a-z, 0-9, _; at most 32)',
                        coalesce(quote_literal(bad), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(p_names) > 64 THEN
        RAISE EXCEPTION 'outbox_register_providers: at most 64 providers per worker'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO outbox_providers (name, can_reconcile, last_seen)
    SELECT DISTINCT n, n = ANY (p_reconcilable), now() FROM unnest(p_names) AS n
    ON CONFLICT (name) DO UPDATE SET last_seen = now(), can_reconcile = EXCLUDED.can_reconcile;
END $$;

CREATE OR REPLACE FUNCTION outbox_fail_unknown_types(p_grace_seconds integer, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, effect_type text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    types text[];
BEGIN
    WITH doomed AS (
        SELECT p.effect_id FROM effect_live p
         WHERE p.state = 'pending'
           AND p.created_at < now() - make_interval(secs => p_grace_seconds)
           AND (p.lease_expires_at IS NULL OR p.lease_expires_at < now())
           AND NOT EXISTS (SELECT 1 FROM outbox_providers v WHERE v.name = p.effect_type)
         LIMIT p_limit FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM effect_live o
         WHERE o.effect_id = ANY (ARRAY(SELECT d.effect_id FROM doomed d))
        RETURNING o.effect_id, o.effect_type, o.created_at, o.attempts, o.retry_base,
                  o.provider_id, o.last_status),
    logged AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, worker, source, started_at,
                                    state, last_error_class, last_error, last_provider_id,
                                    provider_status, retry_base)
        SELECT g.effect_id, g.created_at, g.attempts, NULL, 'worker', now(), 'failed', 'invalid',
               'unknown effect type "' || g.effect_type || '": no worker serves it',
               g.provider_id, g.last_status, g.retry_base
          FROM gone g)
    SELECT coalesce(array_agg(g.effect_id), '{}'), coalesce(array_agg(g.effect_type), '{}')
      INTO ids, types FROM gone g;
    RETURN QUERY SELECT * FROM unnest(ids, types);
END $$;

CREATE OR REPLACE FUNCTION outbox_kill_switch_set(p_enabled boolean, p_operator text, p_reason text)
RETURNS TABLE (effect_id uuid, effect_key text, effect_type text, target text,
               worker text, sending_since timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF p_operator IS NULL OR p_operator = '' OR p_reason IS NULL OR p_reason = '' THEN
        RAISE EXCEPTION 'outbox_kill_switch_set: operator and reason are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(outbox_kill_switch_lock_key());
    UPDATE outbox_control c
       SET enabled = p_enabled, changed_by = p_operator, reason = p_reason, changed_at = now()
     WHERE c.id = 1;
    INSERT INTO outbox_control_history (enabled, changed_by, reason)
    VALUES (p_enabled, p_operator, p_reason);
    IF p_enabled THEN
        PERFORM pg_notify('effect_outbox', 'kill-switch-on');
    END IF;
    -- Exact when the switch commits: the rows listed stay locked until
    -- then (a send finishing meanwhile waits to record it), and a row
    -- that finished while this waited is re-read and left out.
    RETURN QUERY
    SELECT x.effect_id, x.effect_key, x.effect_type, x.target, x.lease_worker, x.sending_since
      FROM (SELECT o.effect_id, b.effect_key, b.effect_type, b.target, o.lease_worker,
                   o.sending_since
              FROM effect_calls c
              JOIN effect_live o ON o.effect_id = ANY (c.ids) AND o.mark_token = c.call
              JOIN effect_outbox b ON b.effect_id = o.effect_id
             WHERE o.state = 'sending'
             ORDER BY o.effect_id
               FOR SHARE OF o) x
     ORDER BY x.sending_since;
END $$;

-- 5 and 6. One lock order; attempts only from the lease holder ---------------

-- Lock the rows of p_ids that p_owner holds, in effect_id order.  Every
-- batch function that updates several effect rows calls it first, so two
-- batches overlapping in any order wait for each other instead of
-- deadlocking (renew and complete did, in both directions).
CREATE OR REPLACE FUNCTION outbox_lock_owned(p_owner uuid, p_ids uuid[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
BEGIN
    PERFORM 1 FROM effect_live o
     WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner
     ORDER BY o.effect_id FOR UPDATE;
END $$;

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_kill_switch_lock_key(),
    outbox_lease(uuid, text, integer, integer, text[], boolean, timestamp with time zone, uuid,
                 integer),
    outbox_mark_sending(uuid, uuid[], boolean, text[], integer, uuid, text[]),
    outbox_mark_sending(uuid, uuid[], boolean, text[], integer, uuid),
    outbox_renew(uuid, uuid[], integer, integer),
    outbox_release(uuid, uuid[], bigint),
    outbox_effect_state(uuid),
    outbox_record_call(uuid, uuid, text, uuid[], timestamp with time zone, text[]),
    outbox_settle_runs(text[]),
    outbox_complete(uuid, text, jsonb),
    outbox_complete_sending(uuid, text, jsonb),
    outbox_complete_rest(uuid, text, jsonb),
    outbox_fail_invalid(uuid, jsonb),
    outbox_reap(text, integer),
    outbox_register_providers(text[], text[]),
    outbox_fail_unknown_types(integer, integer),
    outbox_kill_switch_set(boolean, text, text),
    outbox_lock_owned(uuid, uuid[])
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_lease(uuid, text, integer, integer, text[], boolean, timestamp with time zone, uuid,
                 integer),
    outbox_mark_sending(uuid, uuid[], boolean, text[], integer, uuid, text[]),
    outbox_mark_sending(uuid, uuid[], boolean, text[], integer, uuid),
    outbox_renew(uuid, uuid[], integer, integer),
    outbox_release(uuid, uuid[], bigint),
    outbox_complete(uuid, text, jsonb),
    outbox_complete_sending(uuid, text, jsonb),
    outbox_complete_rest(uuid, text, jsonb),
    outbox_fail_invalid(uuid, jsonb),
    outbox_reap(text, integer),
    outbox_register_providers(text[], text[]),
    outbox_fail_unknown_types(integer, integer)
    TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION
    outbox_effect_state(uuid),
    outbox_settle_runs(text[])
    TO outbox_dispatcher, outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox_kill_switch_set(boolean, text, text)
    TO outbox_operator;

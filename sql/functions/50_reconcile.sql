-- SPDX-License-Identifier: ISC
-- functions/50_reconcile.sql: reconciliation of `unknown` effects
-- (docs/design.md, "Effect states": unknown -> completed / pending, never
-- an automatic re-send).
--
-- A worker's reconcile pass (periodic, or at once when an operator asks:
-- `outboxctl reconcile` calls outbox_request_reconcile, whose NOTIFY
-- effect_outbox 'reconcile' wakes the workers) leases a batch of
-- `unknown` rows of the types it can reconcile, asks each provider whether
-- the effect reached it, and records the answers in one round trip.
--
-- The lease on an `unknown` row only keeps two workers from asking about
-- the same effect at once; nothing else leases `unknown` rows.  It is
-- short: a worker that dies mid-pass delays that effect by one lease.

-- Seconds a reconcile lease lasts.  Longer than any provider lookup should
-- take (the provider's timeout_ms bounds each lookup).
CREATE OR REPLACE FUNCTION outbox_reconcile_lease_seconds() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 60 $$;

-- The shortest time between two lookups of one effect, whatever interval
-- a worker asks for (the workers' periodic pass asks for this one): an
-- effect asked again sooner only when an operator's request
-- (outbox_request_reconcile) came after its last lookup.
CREATE OR REPLACE FUNCTION outbox_reconcile_min_interval_seconds() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 60 $$;

-- An operator's request for a reconcile pass now: every `unknown` effect
-- asked before it is asked again, by the next pass of each worker (at once
-- on the notification, which only wakes them: the request is this row).
-- Returns the request's time, the database's clock.
CREATE OR REPLACE FUNCTION outbox_request_reconcile()
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    t timestamptz;
BEGIN
    UPDATE outbox_reconcile_requests r
       SET requested_at = clock_timestamp(), requested_by = session_user
     WHERE r.id = 1
    RETURNING r.requested_at INTO t;
    PERFORM pg_notify('effect_outbox', 'reconcile');
    RETURN t;
END $$;

CREATE OR REPLACE FUNCTION outbox_reconcile_lease(p_owner uuid, p_worker text, p_types text[],
                                       p_limit integer, p_min_interval_seconds integer)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               attempt_age_ms bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    IF p_owner IS NULL OR p_limit IS NULL OR p_limit < 1 THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH due AS (
        -- `unknown` rows are never due: they sit at available_at =
        -- 'infinity', the end of the queue's one index.
        SELECT l.effect_id FROM effect_live l
         WHERE l.available_at = 'infinity' AND l.state = 'unknown'
           AND l.effect_type = ANY (p_types)
           AND (l.lease_expires_at IS NULL OR l.lease_expires_at < now())
           -- Asked again after the interval, never sooner than the
           -- floor, unless an operator asked since (a notification is
           -- no request: any login may send one).
           AND (l.last_reconciled_at IS NULL
                OR l.last_reconciled_at
                   <= now() - make_interval(secs => greatest(coalesce(p_min_interval_seconds, 0),
                                                             outbox_reconcile_min_interval_seconds()))
                OR l.last_reconciled_at < (SELECT q.requested_at FROM outbox_reconcile_requests q
                                            WHERE q.id = 1))
         ORDER BY l.last_reconciled_at NULLS FIRST, l.created_at
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    leased AS (
        UPDATE effect_live l
           SET lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
               lease_expires_at = now() + make_interval(secs => outbox_reconcile_lease_seconds())
          FROM due
         WHERE l.effect_id = due.effect_id
        RETURNING l.effect_id, l.created_at, l.attempts, l.updated_at)
    SELECT l.effect_id, b.idempotency_key, b.effect_type, b.target, b.payload::text,
           b.payload_hash, b.effect_key, l.attempts,
           -- The latest start of a send of the current attempt (the
           -- reaper's row carries the sending time); reconciliation and
           -- operator rows are not sends.  Every one of these times is
           -- the database's clock (outbox_complete dates a worker's send
           -- itself), so a worker's wrong clock cannot age an attempt.
           (extract(epoch FROM now() - coalesce(
                (SELECT max(h.started_at) FROM effect_history h
                  WHERE h.effect_id = l.effect_id AND h.created_at = l.created_at
                    AND h.attempt = l.attempts
                    AND h.outcome_class IN ('accepted', 'not_sent', 'retry', 'terminal',
                                            'ambiguous', 'lease_lost')),
                l.updated_at)) * 1000)::bigint
      FROM leased l
      JOIN LATERAL (SELECT x.idempotency_key, x.effect_type, x.target, x.payload, x.payload_hash,
                           x.effect_key
                      FROM effect_outbox x WHERE x.effect_id = l.effect_id) b ON true;
END $$;

-- Record a batch of reconciliation answers.  p_results is a JSON array of
--   {effect_id, verdict: "sent"|"not_sent"|"unknown", provider_id, status, error}
-- Evidence comes only from the holder of the effect's reconcile lease: an
-- element about an effect whose row does not name p_owner as its lease
-- owner (another worker's lease, no lease, no such effect) is dropped,
-- with applied = false, and writes nothing; the worker login could
-- otherwise forge a `reconciled_sent` row, the last attempt an operator
-- sees, for any effect.  Each element of the holder becomes an
-- attempts-log row (outcome reconciled_sent, reconciled_not_sent or
-- reconcile_unknown, attempt = the effect's current attempt count), also
-- when the state no longer matches (the provider's answer is evidence all
-- the same).  Then, by CAS on (state 'unknown', lease owner):
--   sent      -> completed, with the provider id: the live row goes, a
--                history row finishes the effect
--   not_sent  -> pending with the same key, due now (workers are woken)
--   unknown   -> stays unknown (never due), for the next pass or an operator
-- Each releases the lease and stamps last_reconciled_at.
--
-- The attempts-log rows carry no lease_owner: the unique index
-- effect_history_call_uq means "one row per provider call of one lease
-- owner", and a worker may ask about one attempt several times (each
-- "cannot tell"), or ask about an attempt it made itself.  The worker's
-- name is in `worker`.
--
-- Returns, per element, whether the state change applied and the state it
-- set (NULL when it did not apply).
CREATE OR REPLACE FUNCTION outbox_reconcile_record(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    bad text;
    done_ids uuid[];
    done_created timestamptz[];
    done_attempts integer[];
    requeued integer;
BEGIN
    IF p_results IS NULL OR jsonb_typeof(p_results) <> 'array' THEN
        RAISE EXCEPTION 'outbox_reconcile_record: p_results must be a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT coalesce(r.verdict, 'null') INTO bad
      FROM jsonb_to_recordset(p_results) AS r(effect_id uuid, verdict text)
     WHERE r.verdict IS NULL OR r.verdict NOT IN ('sent', 'not_sent', 'unknown')
           OR r.effect_id IS NULL
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox_reconcile_record: every element needs an effect_id and a verdict '
                        'of sent, not_sent or unknown (got %)', bad
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- sent: out of the live queue, with the row that finishes the effect
    -- (its last status kept); not_sent / unknown: the live row rewritten.
    WITH r AS (
        -- One answer per effect: a batch naming an effect twice keeps the
        -- first answer for the state change (every answer is logged).
        SELECT DISTINCT ON (x.effect_id) x.effect_id, x.verdict, x.provider_id
          FROM ROWS FROM (jsonb_to_recordset(p_results)
                          AS (effect_id uuid, verdict text, provider_id text))
               WITH ORDINALITY AS x(effect_id, verdict, provider_id, n)
         ORDER BY x.effect_id, x.n
    ), fin AS (
        DELETE FROM effect_live l USING r
         WHERE l.effect_id = r.effect_id AND r.verdict = 'sent'
           AND l.state = 'unknown' AND l.lease_owner = p_owner
        RETURNING l.effect_id, l.created_at, l.attempts, l.retry_base, l.last_status,
                  coalesce(nullif(r.provider_id, ''), l.provider_id) AS provider_id
    ), fin_rows AS (
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, provider_status, cas_applied, state,
                                    last_provider_id, retry_base)
        SELECT f.effect_id, f.created_at, f.attempts, NULL, p_worker, 'reconcile', now(),
               f.last_status, true, 'completed', f.provider_id, f.retry_base
          FROM fin f
    ), moved AS (
        UPDATE effect_live l
           SET state = CASE r.verdict WHEN 'not_sent' THEN 'pending' ELSE 'unknown' END,
               -- Proven not sent: due now, with a fresh retry budget, as an
               -- operator's --not-sent gives.  Still unknown: never due.
               available_at = CASE WHEN r.verdict = 'not_sent' THEN now() ELSE l.available_at END,
               retry_base = CASE WHEN r.verdict = 'not_sent' THEN l.attempts ELSE l.retry_base END,
               last_error_class = CASE WHEN r.verdict = 'not_sent' THEN 'reconciled_not_sent'
                                       ELSE l.last_error_class END,
               last_error = CASE WHEN r.verdict = 'not_sent'
                                 THEN 'reconciliation: the provider has no trace of '
                                      'it; sending again with the same key'
                                 ELSE l.last_error END,
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               last_reconciled_at = now(), updated_at = now()
          FROM r
         WHERE l.effect_id = r.effect_id AND r.verdict <> 'sent'
           AND l.state = 'unknown' AND l.lease_owner = p_owner
        RETURNING l.effect_id, l.created_at, l.attempts, l.state
    ), done AS (
        SELECT f.effect_id, f.created_at, f.attempts, 'completed' AS state FROM fin f
        UNION ALL
        SELECT m.effect_id, m.created_at, m.attempts, m.state FROM moved m)
    SELECT coalesce(array_agg(d.effect_id), '{}'), coalesce(array_agg(d.created_at), '{}'),
           coalesce(array_agg(d.attempts), '{}'), count(*) FILTER (WHERE d.state = 'pending')
      INTO done_ids, done_created, done_attempts, requeued
      FROM done d;

    -- The answers, as evidence: each element about an effect this worker
    -- held, applied or not.
    INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                started_at, outcome_class, provider_status, provider_id,
                                error_text, cas_applied, metadata)
    SELECT x.effect_id, e.created_at, e.attempts, NULL, p_worker, 'reconcile',
           now(),   -- the database's clock, never the worker's
           CASE x.verdict WHEN 'sent' THEN 'reconciled_sent'
                          WHEN 'not_sent' THEN 'reconciled_not_sent'
                          ELSE 'reconcile_unknown' END,
           nullif(x.status, 0), nullif(x.provider_id, ''), nullif(x.error, ''),
           x.effect_id = ANY (done_ids), NULL
      FROM ROWS FROM (jsonb_to_recordset(p_results)
                      AS (effect_id uuid, verdict text, provider_id text, status integer,
                          error text, started_at timestamptz))
           WITH ORDINALITY AS x(effect_id, verdict, provider_id, status, error, started_at, n)
      JOIN LATERAL (
            SELECT d.created_at, d.attempts
              FROM unnest(done_ids, done_created, done_attempts) AS d(effect_id, created_at, attempts)
             WHERE d.effect_id = x.effect_id
            UNION ALL
            SELECT l.created_at, l.attempts FROM effect_live l
             WHERE l.effect_id = x.effect_id AND l.lease_owner = p_owner
               AND NOT (x.effect_id = ANY (done_ids))
            LIMIT 1) e ON true
     ORDER BY x.n;

    IF requeued > 0 THEN
        PERFORM pg_notify('effect_outbox', '');
    END IF;

    RETURN QUERY
    SELECT x.effect_id, x.effect_id = ANY (done_ids),
           CASE WHEN x.effect_id = ANY (done_ids)
                THEN CASE x.verdict WHEN 'sent' THEN 'completed'
                                    WHEN 'not_sent' THEN 'pending'
                                    ELSE 'unknown' END END
      FROM ROWS FROM (jsonb_to_recordset(p_results) AS (effect_id uuid, verdict text))
           WITH ORDINALITY AS x(effect_id, verdict, n)
     ORDER BY x.n;
END $$;

-- A provider's acceptance that arrived after the worker had already
-- recorded the call as ambiguous (the relay's 250 after the email
-- provider's own timeout).  The acceptance is proof the effect was sent
-- once: an `unknown` effect whose unknown-ness comes from exactly this
-- attempt of this lease owner (its own ambiguous row, or the reaper's row
-- naming it) becomes `completed` with the provider id: it leaves the live
-- queue with one history row, shaped like a lookup's (reconciled_sent,
-- lease_owner NULL: evidence about the call, so the call itself stays one
-- row, the worker's ambiguous one) with resolution = late_accepted, which
-- also finishes it.
-- Called again for an attempt already resolved so (the first answer was
-- lost with the connection): 'late_accepted' again, nothing changes.
-- Anything else (the row moved on, a later attempt, another owner):
-- nothing changes, NULL.
CREATE OR REPLACE FUNCTION outbox_resolve_late_accepted(p_owner uuid, p_worker text,
                                                        p_effect_id uuid, p_attempt integer,
                                                        p_status integer, p_provider_id text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    l effect_live%ROWTYPE;
BEGIN
    SELECT * INTO l
      FROM effect_live x
     WHERE x.effect_id = p_effect_id AND x.state = 'unknown' AND x.attempts = p_attempt
       AND EXISTS (SELECT 1 FROM effect_history a
                    WHERE a.effect_id = p_effect_id AND a.created_at = x.created_at
                      AND a.attempt = p_attempt AND a.lease_owner = p_owner
                      AND a.outcome_class IS NOT NULL
                      AND (a.source = 'reaper' OR a.outcome_class = 'ambiguous'))
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN (SELECT 'late_accepted' FROM effect_history a
                 WHERE a.effect_id = p_effect_id
                   AND a.created_at = (SELECT b.created_at FROM effect_outbox b
                                        WHERE b.effect_id = p_effect_id)
                   AND a.attempt = p_attempt
                   AND a.resolution = 'late_accepted' AND a.lease_owner IS NULL
                   AND a.source = 'worker' AND a.worker = p_worker
                 LIMIT 1);
    END IF;
    WITH done AS (
        DELETE FROM effect_live x WHERE x.effect_id = l.effect_id RETURNING x.*)
    INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                started_at, outcome_class, provider_status, provider_id,
                                error_text, cas_applied, metadata, resolution, state,
                                last_error_class, last_error, last_provider_id, retry_base)
    SELECT d.effect_id, d.created_at, p_attempt, NULL, p_worker, 'worker', now(), 'reconciled_sent',
           p_status, nullif(p_provider_id, ''),
           'late evidence: the provider accepted the call after it had been given up on',
           true, NULL, 'late_accepted', 'completed', NULL, NULL,
           coalesce(nullif(p_provider_id, ''), d.provider_id), d.retry_base
      FROM done d;
    RETURN 'late_accepted';
END $$;

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_reconcile_lease_seconds(),
    outbox_reconcile_min_interval_seconds(),
    outbox_request_reconcile(),
    outbox_reconcile_lease(uuid, text, text[], integer, integer),
    outbox_reconcile_record(uuid, text, jsonb),
    outbox_resolve_late_accepted(uuid, text, uuid, integer, integer, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_request_reconcile() TO outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox_reconcile_lease(uuid, text, text[], integer, integer),
    outbox_reconcile_record(uuid, text, jsonb),
    outbox_resolve_late_accepted(uuid, text, uuid, integer, integer, text)
    TO outbox_dispatcher;

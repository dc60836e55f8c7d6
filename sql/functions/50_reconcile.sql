-- SPDX-License-Identifier: ISC
-- functions/50_reconcile.sql: reconciliation of `unknown` effects
-- (docs/design.md, "Effect states": unknown -> completed / pending, never
-- an automatic re-send).
--
-- A worker's reconcile pass (periodic, or at once on NOTIFY effect_outbox
-- 'reconcile', which `outboxctl reconcile` sends) leases a batch of
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
        SELECT o.effect_id FROM effect_outbox o
         WHERE o.state = 'unknown'
           AND o.effect_type = ANY (p_types)
           AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
           AND (o.last_reconciled_at IS NULL
                OR o.last_reconciled_at
                   <= now() - make_interval(secs => greatest(coalesce(p_min_interval_seconds, 0), 0)))
         ORDER BY o.last_reconciled_at NULLS FIRST, o.created_at
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    leased AS (
        UPDATE effect_outbox o
           SET lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
               lease_expires_at = now() + make_interval(secs => outbox_reconcile_lease_seconds())
          FROM due
         WHERE o.effect_id = due.effect_id
        RETURNING o.effect_id, o.idempotency_key, o.effect_type, o.target, o.payload::text,
                  o.payload_hash, o.effect_key, o.attempts, o.updated_at)
    SELECT l.effect_id, l.idempotency_key, l.effect_type, l.target, l.payload, l.payload_hash,
           l.effect_key, l.attempts,
           -- The latest start of a send of the current attempt (the
           -- reaper's row carries the sending time); reconciliation and
           -- operator rows are not sends.  Every one of these times is
           -- the database's clock (outbox_complete dates a worker's send
           -- itself), so a worker's wrong clock cannot age an attempt.
           (extract(epoch FROM now() - coalesce(
                (SELECT max(a.started_at) FROM effect_attempts a
                  WHERE a.effect_id = l.effect_id AND a.attempt = l.attempts
                    AND a.outcome_class IN ('accepted', 'not_sent', 'retry', 'terminal',
                                            'ambiguous', 'lease_lost')),
                l.updated_at)) * 1000)::bigint
      FROM leased l;
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
--   sent      -> completed, with the provider id
--   not_sent  -> pending with the same key, due now (workers are woken)
--   unknown   -> stays unknown, for the next pass or an operator
-- Each releases the lease and stamps last_reconciled_at.
--
-- The attempts-log rows carry no lease_owner: the unique index
-- effect_attempts_call_uq means "one row per provider call of one lease
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
    completed_keys text[];
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

    WITH r AS (
        -- One answer per effect: a batch naming an effect twice keeps the
        -- first answer for the state change (every answer is logged).
        SELECT DISTINCT ON (x.effect_id) x.effect_id, x.verdict, x.provider_id
          FROM ROWS FROM (jsonb_to_recordset(p_results)
                          AS (effect_id uuid, verdict text, provider_id text))
               WITH ORDINALITY AS x(effect_id, verdict, provider_id, n)
         ORDER BY x.effect_id, x.n
    ), u AS (
        UPDATE effect_outbox o
           SET state = CASE r.verdict WHEN 'sent' THEN 'completed'
                                      WHEN 'not_sent' THEN 'pending'
                                      ELSE 'unknown' END,
               provider_id = CASE WHEN r.verdict = 'sent'
                                  THEN coalesce(nullif(r.provider_id, ''), o.provider_id)
                                  ELSE o.provider_id END,
               completed_at = CASE WHEN r.verdict = 'sent' THEN now() ELSE o.completed_at END,
               -- Proven not sent: a fresh retry budget, as an operator's --not-sent gives.
               retry_base = CASE WHEN r.verdict = 'not_sent' THEN o.attempts ELSE o.retry_base END,
               available_at = CASE WHEN r.verdict = 'not_sent' THEN now() ELSE o.available_at END,
               last_error_class = CASE r.verdict WHEN 'sent' THEN NULL
                                                 WHEN 'not_sent' THEN 'reconciled_not_sent'
                                                 ELSE o.last_error_class END,
               last_error = CASE r.verdict
                                WHEN 'sent' THEN NULL
                                WHEN 'not_sent' THEN 'reconciliation: the provider has no trace of '
                                                     'it; sending again with the same key'
                                ELSE o.last_error END,
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               last_reconciled_at = now(), updated_at = now()
          FROM r
         WHERE o.effect_id = r.effect_id
           AND o.state = 'unknown'
           AND o.lease_owner = p_owner
        RETURNING o.effect_id, o.idempotency_key, o.state)
    SELECT coalesce(array_agg(u.effect_id), '{}'),
           coalesce(array_agg(u.idempotency_key) FILTER (WHERE u.state = 'completed'), '{}'),
           count(*) FILTER (WHERE u.state = 'pending')
      INTO done_ids, completed_keys, requeued
      FROM u;

    INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                 outcome_class, provider_status, provider_id, error_text,
                                 cas_applied, metadata)
    SELECT x.effect_id, coalesce(o.attempts, 0), NULL, p_worker,
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
      JOIN effect_outbox o ON o.effect_id = x.effect_id
     WHERE x.effect_id = ANY (done_ids) OR o.lease_owner = p_owner
     ORDER BY x.n;

    IF cardinality(completed_keys) > 0 THEN
        PERFORM outbox_advance_runs('{}', completed_keys);
    END IF;
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
-- naming it) becomes `completed` with the provider id, and the attempts
-- log gets a resolution row shaped like a lookup's (reconciled_sent,
-- lease_owner NULL: evidence about the call, so the call itself stays one
-- row, the worker's ambiguous one) with resolution = late_accepted.
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
    k text;
BEGIN
    SELECT o.idempotency_key INTO k
      FROM effect_outbox o
     WHERE o.effect_id = p_effect_id AND o.state = 'unknown' AND o.attempts = p_attempt
       AND EXISTS (SELECT 1 FROM effect_attempts a
                    WHERE a.effect_id = p_effect_id AND a.attempt = p_attempt
                      AND a.lease_owner = p_owner
                      AND (a.worker LIKE 'reaper:%' OR a.outcome_class = 'ambiguous'))
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN (SELECT 'late_accepted' FROM effect_attempts a
                 WHERE a.effect_id = p_effect_id AND a.attempt = p_attempt
                   AND a.resolution = 'late_accepted' AND a.lease_owner IS NULL
                   AND a.worker = p_worker
                 LIMIT 1);
    END IF;
    UPDATE effect_outbox o
       SET state = 'completed',
           provider_id = coalesce(nullif(p_provider_id, ''), o.provider_id),
           completed_at = now(), last_error_class = NULL,
           last_error = NULL, last_status = p_status,
           lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           updated_at = now()
     WHERE o.effect_id = p_effect_id;
    INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                 outcome_class, provider_status, provider_id, error_text,
                                 cas_applied, metadata, resolution)
    VALUES (p_effect_id, p_attempt, NULL, p_worker, now(), 'reconciled_sent', p_status,
            nullif(p_provider_id, ''),
            'late evidence: the provider accepted the call after it had been given up on',
            true, NULL, 'late_accepted');
    PERFORM outbox_advance_runs('{}', ARRAY[k]);
    RETURN 'late_accepted';
END $$;

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_reconcile_lease_seconds(),
    outbox_reconcile_lease(uuid, text, text[], integer, integer),
    outbox_reconcile_record(uuid, text, jsonb),
    outbox_resolve_late_accepted(uuid, text, uuid, integer, integer, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_reconcile_lease(uuid, text, text[], integer, integer),
    outbox_reconcile_record(uuid, text, jsonb),
    outbox_resolve_late_accepted(uuid, text, uuid, integer, integer, text)
    TO outbox_dispatcher;

-- 017_unknown_resolution.sql: `unknown` effects resolved from evidence the
-- fleet already holds, never by guessing.
--
-- An effect goes to `unknown` when the reaper finds its `sending` lease
-- expired (the worker died, stopped or lost its database).  A worker that
-- was only stopped still finishes its call and sends its outcome to
-- outbox_complete, which used to log it (cas_applied = false) and leave the
-- effect `unknown`.  That outcome is the evidence an operator would look
-- for, from the only process that could have sent this attempt:
--
--   accepted  (HTTP 2xx, SMTP 250 with a queue id, CRM success): the
--             provider took it once -> `completed` with its provider id;
--   not_sent  (no request byte left the worker: the mark was confirmed too
--             late, connection refused, nothing written) -> the worker's
--             decision for a not-sent call (`pending` with the same key, or
--             `failed` when retries are exhausted).
--
-- Only when the effect is `unknown` because of that same attempt: the
-- reaper's row for (effect, attempt) names this worker's lease owner, and
-- the effect's attempt count is still that attempt (nothing was sent
-- after it, no operator or reconciliation moved it on).  Any other late
-- outcome (ambiguous, retry, terminal) leaves the effect as it is.
--
-- The worker's attempt row then carries cas_applied = true and says what
-- it resolved in effect_attempts.resolution; the function returns it, and
-- the worker counts outbox_unknown_resolved_total{how}.
--
-- Also (the deadlock fix shared with the other batch functions): the rows
-- of a batch are locked in effect_id order before anything is updated, and
-- an attempt row is written only by the worker that held that attempt's
-- lease (its owner, or the owner the reaper's row names).

-- How an attempt row resolved an `unknown` effect (NULL: it did not).
-- Nullable, no default: no table rewrite.
ALTER TABLE effect_attempts ADD COLUMN resolution text;
ALTER TABLE effect_attempts ADD CONSTRAINT effect_attempts_resolution_check
    CHECK (resolution IN ('late_accepted', 'late_not_sent')) NOT VALID;

-- The return type gains `resolved`: drop and create (workers select their
-- columns by name, so a worker of the previous release still works).
DROP FUNCTION outbox_complete(uuid, text, jsonb);

-- Record a batch of provider outcomes.  p_results is a JSON array of
--   {effect_id, attempt, started_at, outcome, status, provider_id, error,
--    next_state, retry_delay_ms}
-- where the worker has already applied the failure-class matrix to pick
-- next_state.  Every element of an attempt this worker held the lease of
-- becomes an attempts-log row, whether or not the CAS still matches (a
-- worker that lost its lease still leaves its evidence).  Returns, per
-- element, whether the state change applied, the state it set and, when
-- it resolved an `unknown` effect, how (late_accepted, late_not_sent).
CREATE FUNCTION outbox_complete(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text, resolved text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    late_ids uuid[];
    done_ids uuid[];
    failed_keys text[];
    completed_keys text[];
    requeued integer;
BEGIN
    SELECT coalesce(array_agg(DISTINCT r.effect_id), '{}') INTO ids
      FROM jsonb_to_recordset(p_results) AS r(effect_id uuid);

    -- Lock the batch's rows in effect_id order, the order every batch
    -- function takes them in, so two batches cannot wait on each other.
    -- The `unknown` rows whose unknown-ness came from this worker's lease
    -- on exactly the attempt being recorded are the candidates for a late
    -- resolution (rare: only then is the attempts log probed, by index).
    WITH locked AS MATERIALIZED (
        SELECT o.effect_id, o.state, o.attempts FROM effect_outbox o
         WHERE o.effect_id = ANY (ids)
         ORDER BY o.effect_id
           FOR UPDATE)
    SELECT coalesce(array_agg(l.effect_id) FILTER (
               WHERE l.state = 'unknown'
                 AND ((r.outcome = 'accepted' AND r.next_state = 'completed')
                      OR (r.outcome = 'not_sent' AND r.next_state IN ('pending', 'failed')))
                 AND l.attempts = r.attempt
                 AND EXISTS (SELECT 1 FROM effect_attempts a
                              WHERE a.effect_id = l.effect_id AND a.attempt = r.attempt
                                AND a.lease_owner = p_owner AND a.worker LIKE 'reaper:%')), '{}')
      INTO late_ids
      FROM locked l
      JOIN jsonb_to_recordset(p_results) AS r(effect_id uuid, attempt integer, outcome text,
                                              next_state text)
        ON r.effect_id = l.effect_id;

    WITH u AS (
        UPDATE effect_outbox o
           SET state = r.next_state,
               provider_id = coalesce(r.provider_id, o.provider_id),
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL,
               available_at = CASE WHEN r.next_state = 'pending'
                                   THEN now() + make_interval(secs => greatest(r.retry_delay_ms, 0) / 1000.0)
                                   ELSE o.available_at END,
               last_error_class = CASE WHEN r.outcome = 'accepted' THEN NULL ELSE r.outcome END,
               last_error = CASE WHEN o.effect_id = ANY (late_ids) AND r.outcome = 'not_sent'
                                 THEN 'late evidence: the attempt given up on was not sent ('
                                      || coalesce(r.error, 'no detail') || ')'
                                 ELSE r.error END,
               last_status = r.status,
               completed_at = CASE WHEN r.next_state IN ('completed', 'failed') THEN now() END,
               updated_at = now()
          FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
         WHERE o.effect_id = r.effect_id
           AND o.attempts = r.attempt
           AND r.next_state IN ('completed', 'pending', 'failed', 'unknown')
           AND ((o.lease_owner = p_owner AND o.state = 'sending')
                OR (o.state = 'unknown' AND o.effect_id = ANY (late_ids)))
        RETURNING o.effect_id, o.idempotency_key, o.state)
    SELECT coalesce(array_agg(u.effect_id), '{}'),
           coalesce(array_agg(u.idempotency_key) FILTER (WHERE u.state = 'failed'), '{}'),
           coalesce(array_agg(u.idempotency_key) FILTER (WHERE u.state = 'completed'), '{}'),
           count(*) FILTER (WHERE u.state = 'pending' AND u.effect_id = ANY (late_ids))
      INTO done_ids, failed_keys, completed_keys, requeued
      FROM u;

    -- Evidence only from the worker that held this attempt's lease: the
    -- lease owner now, or the owner the reaper's row for the attempt names
    -- (a worker that resumes after its lease was reaped).  ON CONFLICT: the
    -- same batch sent again after a lost connection (the first may have
    -- committed) records each provider call once.
    INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                 outcome_class, provider_status, provider_id,
                                 error_text, cas_applied, metadata, resolution)
    SELECT r.effect_id, r.attempt, p_owner, p_worker, coalesce(r.started_at, now()),
           r.outcome, r.status, r.provider_id, r.error, r.effect_id = ANY (done_ids),
           o.metadata,
           CASE WHEN r.effect_id = ANY (done_ids) AND r.effect_id = ANY (late_ids)
                THEN CASE WHEN r.outcome = 'accepted' THEN 'late_accepted'
                          ELSE 'late_not_sent' END END
      FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
      JOIN effect_outbox o ON o.effect_id = r.effect_id
     WHERE r.effect_id = ANY (done_ids)
        OR o.lease_owner = p_owner
        OR EXISTS (SELECT 1 FROM effect_attempts a
                    WHERE a.effect_id = r.effect_id AND a.attempt = r.attempt
                      AND a.lease_owner = p_owner AND a.worker LIKE 'reaper:%')
    ON CONFLICT (effect_id, attempt, lease_owner) WHERE worker NOT LIKE 'reaper:%'
                                                    AND lease_owner IS NOT NULL
    DO NOTHING;

    IF cardinality(failed_keys) > 0 OR cardinality(completed_keys) > 0 THEN
        PERFORM outbox_advance_runs(failed_keys, completed_keys);
    END IF;
    IF requeued > 0 THEN
        PERFORM pg_notify('effect_outbox', '');
    END IF;

    -- "applied" also when an earlier delivery of this same batch applied it
    -- (the rare case: only then is the attempts log probed, by its index).
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
          SELECT true AS applied, a.resolution FROM effect_attempts a
           WHERE NOT r.effect_id = ANY (done_ids)
             AND a.effect_id = r.effect_id AND a.attempt = r.attempt
             AND a.lease_owner = p_owner AND a.cas_applied
             AND a.worker NOT LIKE 'reaper:%'
           LIMIT 1) prev ON true;
END $$;

REVOKE EXECUTE ON FUNCTION outbox_complete(uuid, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_complete(uuid, text, jsonb) TO outbox_dispatcher;

-- The reconcile lease also says how long ago the effect's last attempt
-- started (attempt_age_ms, by the database's clock), so that a provider
-- whose lookup answers "not found" can refuse to call that definitive
-- before a minimum age: a request still on its way, or still being
-- processed, is not found yet.
DROP FUNCTION outbox_reconcile_lease(uuid, text, text[], integer, integer);

CREATE FUNCTION outbox_reconcile_lease(p_owner uuid, p_worker text, p_types text[],
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
           -- operator rows are not sends.
           (extract(epoch FROM now() - coalesce(
                (SELECT max(a.started_at) FROM effect_attempts a
                  WHERE a.effect_id = l.effect_id AND a.attempt = l.attempts
                    AND a.outcome_class IN ('accepted', 'not_sent', 'retry', 'terminal',
                                            'ambiguous', 'lease_lost')),
                l.updated_at)) * 1000)::bigint
      FROM leased l;
END $$;

REVOKE EXECUTE ON FUNCTION outbox_reconcile_lease(uuid, text, text[], integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_reconcile_lease(uuid, text, text[], integer, integer)
    TO outbox_dispatcher;

-- SPDX-License-Identifier: ISC
-- bench/levers/narrow_queue.sql: a prototype of the narrow queue table (a
-- lever measured by bench/levers.sh, not a migration).
--
-- The effect split in two: effect_rows, what the producer wrote and never
-- changes (payload, key, hashes), with the indexes on those; effect_state,
-- one short row per effect with everything a transition writes, and the
-- partial indexes by state.  A claim and a completion then write a short
-- tuple with two index entries instead of the wide row with four; the
-- payload is read by key from effect_rows.  narrow_claim and
-- narrow_complete do what outbox_claim and outbox_complete do for the usual
-- batch (kill switch under its lock, the call's own lock, attempts rows from
-- the UPDATE's RETURNING, run advance with its lock pass), without the rare
-- paths (repeats, late evidence, a lost lease), which cost nothing when not
-- taken.  Readers, the reaper and the operator functions would need a view
-- joining the two: none is written here.
CREATE OR REPLACE FUNCTION levers_sha256_hex(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT encode(sha256(convert_to(t,'UTF8')),'hex') $$;
CREATE TABLE workflow_runs (
    idempotency_key  text PRIMARY KEY,
    state            text NOT NULL,
    payload_hash     text NOT NULL,
    lease_owner      uuid, lease_expires_at timestamptz,
    version          bigint NOT NULL DEFAULT 0,
    result jsonb, replaces_key text REFERENCES workflow_runs (idempotency_key),
    failure_reason   text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 70);
CREATE TABLE effect_rows (
    effect_id        uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    idempotency_key  text NOT NULL REFERENCES workflow_runs (idempotency_key),
    effect_type      text NOT NULL,
    target           text NOT NULL,
    payload          jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    effect_key       text GENERATED ALWAYS AS (levers_sha256_hex(idempotency_key || E'\n' || effect_type || E'\n' || target)) STORED,
    payload_hash     text GENERATED ALWAYS AS (levers_sha256_hex(payload::text)) STORED,
    metadata jsonb, approved_by text,
    replaces_effect  uuid REFERENCES effect_rows (effect_id),
    UNIQUE (idempotency_key, effect_type, target));
CREATE INDEX effect_rows_created_brin ON effect_rows USING brin (created_at) WITH (pages_per_range = 32, autosummarize = on);
CREATE INDEX effect_rows_replaces_idx ON effect_rows (replaces_effect) WHERE replaces_effect IS NOT NULL;
CREATE TABLE effect_state (
    effect_id uuid PRIMARY KEY,
    effect_type text NOT NULL,
    state text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    retry_base integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    lease_owner uuid, lease_expires_at timestamptz, lease_worker text, leased_at timestamptz,
    sending_since timestamptz, mark_token uuid, sending_idempotent boolean NOT NULL DEFAULT false,
    provider_id text, last_error_class text, last_error text, last_status integer,
    completed_at timestamptz, updated_at timestamptz NOT NULL DEFAULT now(), last_reconciled_at timestamptz,
    send_deadline timestamptz GENERATED ALWAYS AS (CASE WHEN state = 'sending' THEN lease_expires_at END) STORED
) WITH (fillfactor = 70);
CREATE INDEX effect_state_due_idx ON effect_state (available_at, effect_id) WHERE state = 'pending';
CREATE INDEX effect_state_sending_idx ON effect_state (send_deadline) WHERE state = 'sending' AND send_deadline IS NOT NULL;
CREATE INDEX effect_state_unknown_idx ON effect_state (effect_id) WHERE state = 'unknown';
CREATE INDEX effect_state_done_idx ON effect_state (completed_at) WHERE state IN ('completed', 'failed');
CREATE TABLE effect_attempts (
    attempt_id bigserial PRIMARY KEY, effect_id uuid NOT NULL, attempt integer NOT NULL,
    lease_owner uuid, worker text, started_at timestamptz NOT NULL, ended_at timestamptz NOT NULL DEFAULT now(),
    outcome_class text NOT NULL, provider_status integer, provider_id text, error_text text,
    cas_applied boolean NOT NULL DEFAULT true, metadata jsonb, resolution text);
CREATE UNIQUE INDEX effect_attempts_call_uq ON effect_attempts (effect_id, attempt, lease_owner, (CASE WHEN worker NOT LIKE 'reaper:%' THEN true END));
CREATE TABLE outbox_control (id int PRIMARY KEY, enabled boolean NOT NULL);
INSERT INTO outbox_control VALUES (1, true);

CREATE FUNCTION narrow_claim(p_owner uuid, p_worker text, p_limit integer, p_lease_seconds integer, p_types text[],
                        p_env_enabled boolean, p_idempotent_types text[], p_call uuid,
                        p_after_at timestamptz DEFAULT NULL, p_after_id uuid DEFAULT NULL)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               metadata text, approved_by text, retry_base integer, available_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE allowed boolean; after_at timestamptz := p_after_at; after_id uuid := p_after_id;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_call::text, 0));
    PERFORM pg_advisory_xact_lock_shared(12345);
    SELECT c.enabled INTO allowed FROM outbox_control c WHERE c.id = 1;
    IF NOT allowed THEN RETURN; END IF;
    -- outbox_claim's position rules.
    IF after_at > now() - interval '50 milliseconds' THEN
        after_at := now() - interval '50 milliseconds';
        after_id := NULL;
    END IF;
    after_at := coalesce(after_at, '-infinity');
    after_id := coalesce(after_id, '00000000-0000-0000-0000-000000000000');
    RETURN QUERY
    WITH due AS (
        SELECT s.effect_id FROM effect_state s
         WHERE s.state = 'pending' AND (s.available_at, s.effect_id) > (after_at, after_id)
           AND s.available_at <= now() AND (s.lease_expires_at IS NULL OR s.lease_expires_at < now())
           AND s.effect_type = ANY (p_types)
         ORDER BY s.available_at, s.effect_id LIMIT p_limit FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE effect_state s
           SET state = 'sending', attempts = s.attempts + 1, lease_owner = p_owner, lease_worker = p_worker,
               leased_at = now(), lease_expires_at = now() + make_interval(secs => p_lease_seconds),
               sending_since = now(), mark_token = p_call,
               sending_idempotent = s.effect_type = ANY (p_idempotent_types), updated_at = now()
          FROM due WHERE s.effect_id = due.effect_id
        RETURNING s.effect_id, s.attempts - 1 AS attempts, s.retry_base, s.available_at)
    SELECT c.effect_id, r.idempotency_key, r.effect_type, r.target, r.payload::text, r.payload_hash,
           r.effect_key, c.attempts, r.metadata::text, r.approved_by, c.retry_base, c.available_at
      FROM claimed c JOIN effect_rows r ON r.effect_id = c.effect_id
     ORDER BY c.available_at, c.effect_id;
END $$;

CREATE FUNCTION narrow_complete(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text, resolved text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE ids uuid[]; any_unknown boolean; done_ids uuid[]; done_states text[]; failed_keys text[]; completed_keys text[];
BEGIN
    SELECT coalesce(array_agg(l.effect_id), '{}'), coalesce(bool_or(l.state = 'unknown'), false) INTO ids, any_unknown
      FROM (SELECT s.effect_id, s.state FROM effect_state s
             WHERE s.effect_id = ANY (ARRAY(SELECT (e ->> 'effect_id')::uuid FROM jsonb_array_elements(p_results) e))
             ORDER BY s.effect_id FOR UPDATE) l;
    WITH u AS (
        UPDATE effect_state s
           SET state = r.next_state, provider_id = coalesce(r.provider_id, s.provider_id),
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL, sending_since = NULL,
               available_at = CASE WHEN r.next_state = 'pending'
                                   THEN now() + make_interval(secs => greatest(r.retry_delay_ms, 0) / 1000.0)
                                   ELSE s.available_at END,
               last_error_class = CASE WHEN r.outcome = 'accepted' THEN NULL ELSE r.outcome END,
               last_error = r.error, last_status = r.status,
               completed_at = CASE WHEN r.next_state IN ('completed', 'failed') THEN now() END,
               updated_at = now()
          FROM jsonb_to_recordset(p_results) AS r(effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text, retry_delay_ms bigint)
         WHERE s.effect_id = r.effect_id AND s.attempts = r.attempt
           AND r.next_state IN ('completed', 'pending', 'failed', 'unknown')
           AND s.lease_owner = p_owner AND s.state = 'sending'
        RETURNING s.effect_id, s.state, r.attempt, r.started_at, r.outcome, r.status, r.provider_id AS r_provider_id, r.error),
    uk AS (SELECT u.*, e.idempotency_key, e.metadata FROM u JOIN effect_rows e ON e.effect_id = u.effect_id),
    logged AS (
        INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at, outcome_class, provider_status,
                                     provider_id, error_text, cas_applied, metadata)
        SELECT uk.effect_id, uk.attempt, p_owner, p_worker, coalesce(uk.started_at, now()), uk.outcome, uk.status,
               uk.r_provider_id, uk.error, true, uk.metadata FROM uk
        ON CONFLICT (effect_id, attempt, lease_owner, (CASE WHEN worker NOT LIKE 'reaper:%' THEN true END)) DO NOTHING)
    SELECT coalesce(array_agg(uk.effect_id), '{}'), coalesce(array_agg(uk.state), '{}'),
           coalesce(array_agg(uk.idempotency_key) FILTER (WHERE uk.state = 'failed'), '{}'),
           coalesce(array_agg(uk.idempotency_key) FILTER (WHERE uk.state = 'completed'), '{}')
      INTO done_ids, done_states, failed_keys, completed_keys FROM uk;
    IF (cardinality(failed_keys) > 0 OR cardinality(completed_keys) > 0) THEN
        PERFORM 1 FROM workflow_runs w WHERE w.idempotency_key = ANY (failed_keys || completed_keys)
         ORDER BY w.idempotency_key FOR UPDATE;
        UPDATE workflow_runs w SET state = 'completed', version = w.version + 1, updated_at = now()
         WHERE w.idempotency_key = ANY (completed_keys) AND w.state IN ('approved', 'processing')
           AND NOT EXISTS (SELECT 1 FROM effect_rows o JOIN effect_state s ON s.effect_id = o.effect_id
                            WHERE o.idempotency_key = w.idempotency_key AND s.state <> 'completed');
    END IF;
    RETURN QUERY SELECT x.id, true, x.st, NULL::text FROM unnest(done_ids, done_states) AS x(id, st);
END $$;

-- 001_schema.sql: the tables of the data model (SPEC.md "Data model").
--
-- workflow_runs, approvals and effect_outbox keep the seeds' columns, states
-- and uniqueness; the rest is what dispatching and auditing need.  Every
-- function lives in later migrations; this file only owns tables, indexes
-- and the NOTIFY trigger.

-- SHA-256 hex of text as UTF-8.  convert_to() is only STABLE in the
-- catalog (encoding names could change); the database encoding cannot, so
-- this wrapper is immutable in fact and may feed generated columns.
CREATE FUNCTION outbox_sha256_hex(t text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(sha256(convert_to(t, 'UTF8')), 'hex');

CREATE TABLE workflow_runs (
    idempotency_key  text PRIMARY KEY,
    state            text NOT NULL CHECK (state IN (
                        'processing', 'awaiting_human', 'approved',
                        'completed', 'failed_retryable', 'failed_terminal')),
    payload_hash     text NOT NULL,
    lease_owner      uuid,
    lease_expires_at timestamptz,
    version          bigint NOT NULL DEFAULT 0,
    result           jsonb,
    -- A replacement event names the run it replaces (re-run protocol step 3).
    replaces_key     text REFERENCES workflow_runs (idempotency_key),
    failure_reason   text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE approvals (
    approval_id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    idempotency_key   text NOT NULL REFERENCES workflow_runs (idempotency_key),
    token_hash        bytea NOT NULL UNIQUE CHECK (octet_length(token_hash) = 32),
    allowed_decisions text[] NOT NULL,
    expires_at        timestamptz NOT NULL,
    consumed_at       timestamptz,
    decision          text,
    approver_subject  text,
    -- Who may approve (an address, a group, an SSO audience): shown on the
    -- approval card, checked by the approving workflow.
    approver_audience text,
    -- The effects to enqueue when the approval is consumed with 'approve':
    -- a JSON array of {effect_type, target, payload, metadata}.
    proposed_effects  jsonb NOT NULL DEFAULT '[]'::jsonb
                      CHECK (jsonb_typeof(proposed_effects) = 'array'),
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX approvals_key_idx ON approvals (idempotency_key);

CREATE TABLE effect_outbox (
    effect_id        uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    idempotency_key  text NOT NULL REFERENCES workflow_runs (idempotency_key),
    effect_type      text NOT NULL,
    target           text NOT NULL,
    payload          jsonb NOT NULL,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'sending', 'completed', 'unknown', 'failed')),
    lease_owner      uuid,
    lease_expires_at timestamptz,
    provider_id      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- What dispatching needs.
    -- The key the provider sees: derived from the run's key, the type and
    -- the target, so it is the same on every attempt and differs between
    -- two effects of one run (SPEC.md "Providers").
    effect_key       text GENERATED ALWAYS AS (outbox_sha256_hex(
                        idempotency_key || E'\n' || effect_type || E'\n' || target)) STORED,
    payload_hash     text GENERATED ALWAYS AS (outbox_sha256_hex(payload::text)) STORED,
    metadata         jsonb,
    approved_by      text,
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- attempts already spent when an operator last gave the effect a fresh
    -- retry budget (requeue, resolve --not-sent): max_attempts counts from
    -- here, while attempt numbers in the log keep increasing.
    retry_base       integer NOT NULL DEFAULT 0 CHECK (retry_base >= 0),
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_worker     text,
    leased_at        timestamptz,
    sending_since    timestamptz,
    -- The outbox_mark_sending() call that moved the row to `sending`: only
    -- that same call, repeated after a lost connection, gets it back.
    mark_token       uuid,
    -- Whether the send in progress went to a provider that honours
    -- idempotency keys: decides pending vs unknown when its lease expires.
    sending_idempotent boolean NOT NULL DEFAULT false,
    last_error_class text,
    last_error       text,
    last_status      integer,
    completed_at     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    replaces_effect  uuid REFERENCES effect_outbox (effect_id),
    last_reconciled_at timestamptz,
    UNIQUE (idempotency_key, effect_type, target)
);

-- The lease query's index: only pending rows, in the order they are due.
-- Partial, so millions of completed rows do not slow the hot path.
CREATE INDEX effect_outbox_due_idx ON effect_outbox (available_at)
    WHERE state = 'pending';
-- The reaper's and the heartbeat's index: rows in flight.
CREATE INDEX effect_outbox_sending_idx ON effect_outbox (lease_expires_at)
    WHERE state = 'sending';
CREATE INDEX effect_outbox_unknown_idx ON effect_outbox (created_at)
    WHERE state = 'unknown';
CREATE INDEX effect_outbox_run_idx ON effect_outbox (idempotency_key);
-- Pruning walks finished rows by completion time.
CREATE INDEX effect_outbox_done_idx ON effect_outbox (completed_at)
    WHERE state IN ('completed', 'failed');

-- Append-only: one row per provider call, and one per reaper or
-- reconciliation verdict.  No foreign key to effect_outbox so that pruning
-- effects does not need to touch the evidence.
CREATE TABLE effect_attempts (
    attempt_id       bigserial PRIMARY KEY,
    effect_id        uuid NOT NULL,
    attempt          integer NOT NULL,
    lease_owner      uuid,
    worker           text,
    started_at       timestamptz NOT NULL,
    ended_at         timestamptz NOT NULL DEFAULT now(),
    outcome_class    text NOT NULL CHECK (outcome_class IN (
                        'accepted', 'not_sent', 'retry', 'terminal', 'ambiguous',
                        'lease_lost', 'reconciled_sent', 'reconciled_not_sent',
                        'reconcile_unknown', 'operator_sent', 'operator_not_sent')),
    provider_status  integer,
    provider_id      text,
    error_text       text,
    -- Whether the worker still held the lease when it recorded this.
    cas_applied      boolean NOT NULL DEFAULT true,
    metadata         jsonb
);
CREATE INDEX effect_attempts_effect_idx ON effect_attempts (effect_id, attempt);
-- One row per provider call of one lease owner: a completion batch sent
-- again after a lost connection is not counted twice.
CREATE UNIQUE INDEX effect_attempts_call_uq ON effect_attempts (effect_id, attempt, lease_owner)
    WHERE worker NOT LIKE 'reaper:%' AND lease_owner IS NOT NULL;

-- Append-only, enforced for every role (the table owner included).
CREATE FUNCTION effect_attempts_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'effect_attempts is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE TRIGGER effect_attempts_append_only
    BEFORE UPDATE OR DELETE ON effect_attempts
    FOR EACH ROW EXECUTE FUNCTION effect_attempts_append_only();

-- Fleet-wide kill switch: exactly one row.  Deny by default.
CREATE TABLE outbox_control (
    id          integer PRIMARY KEY CHECK (id = 1),
    enabled     boolean NOT NULL DEFAULT false,
    changed_by  text NOT NULL,
    reason      text NOT NULL,
    changed_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_control (id, enabled, changed_by, reason)
VALUES (1, false, 'migration', 'new database: sends disabled until an operator enables them');

CREATE TABLE outbox_control_history (
    change_id   bigserial PRIMARY KEY,
    enabled     boolean NOT NULL,
    changed_by  text NOT NULL,
    reason      text NOT NULL,
    changed_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_control_history (enabled, changed_by, reason)
SELECT enabled, changed_by, reason FROM outbox_control;

-- Every claim of a run key, for the "duplicate deliveries" figure.
CREATE TABLE run_claims (
    claim_id        bigserial PRIMARY KEY,
    idempotency_key text NOT NULL,
    outcome         text NOT NULL CHECK (outcome IN (
                        'claimed', 'reclaimed', 'busy', 'done', 'payload_mismatch')),
    claimed_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_claims_at_idx ON run_claims (claimed_at);

-- Operators' recorded decisions (resolve, requeue, replace, cancel, prune).
CREATE TABLE operator_actions (
    action_id   bigserial PRIMARY KEY,
    action      text NOT NULL,
    effect_id   uuid,
    run_key     text,
    operator    text NOT NULL,
    reason      text NOT NULL,
    detail      jsonb,
    acted_at    timestamptz NOT NULL DEFAULT now()
);

-- Provider names that some worker serves; effects of any other type are
-- failed as "unknown effect type" by the workers' maintenance pass.
CREATE TABLE outbox_providers (
    name          text PRIMARY KEY,
    can_reconcile boolean NOT NULL DEFAULT false,
    last_seen     timestamptz NOT NULL DEFAULT now()
);

-- Wake idle workers at once.  Statement level: a bulk insert is one NOTIFY.
CREATE FUNCTION effect_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('effect_outbox', '');
    RETURN NULL;
END $$;

CREATE TRIGGER effect_outbox_notify_ins
    AFTER INSERT ON effect_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION effect_outbox_notify();

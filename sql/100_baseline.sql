-- SPDX-License-Identifier: ISC
-- 100_baseline.sql: the tables, indexes and roles of the schema, as one
-- readable file (docs/design.md, "Data model").
--
-- Tables and indexes live in numbered migrations like this one, applied once
-- each and never edited after a release; every function, trigger and view
-- lives in sql/functions/, re-applied whenever its file changes, so that each
-- has exactly one definition in the tree.  This baseline squashes the first
-- fourteen migrations (001_schema .. 014_weekly_this_week): `outboxctl
-- migrate` records it as applied, without running it, on a database that
-- has all fourteen, because they created exactly these objects.
--
-- The one function here is the hash behind two generated columns: a column's
-- expression must exist before the table, and it never changes.

-- SHA-256 hex of text as UTF-8.  convert_to() is only STABLE in the
-- catalog (encoding names could change); the database encoding cannot, so
-- this wrapper is immutable in fact and may feed generated columns.
CREATE OR REPLACE FUNCTION outbox_sha256_hex(t text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(sha256(convert_to(t, 'UTF8')), 'hex');

-- Least-privilege roles.  They are NOLOGIN groups: grant
-- them to the login roles of a deployment (n8n's credential, the workers'
-- user, the operators), e.g. GRANT outbox_producer TO n8n;
--
--   outbox_producer   enqueue and consume approvals through the functions,
--                     a plain INSERT into effect_outbox; cannot change an
--                     effect's state or read token hashes
--   outbox_dispatcher the workers' functions; cannot touch approvals
--   outbox_operator   both, through outboxctl's functions
--
-- Roles are cluster-wide, so creating them tolerates another database of
-- the same cluster having done it first.

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_dispatcher', 'outbox_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END $$;

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
    -- two effects of one run (docs/design.md, "Providers").
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
    -- The lease expiry while the row is `sending`, else NULL: the key of the
    -- reaper's index.  Leasing a pending row leaves it NULL and changes no
    -- other indexed column, so PostgreSQL updates the row in place (HOT: no
    -- new index entries, no dead entries at the head of the due index).
    send_deadline    timestamptz
                     GENERATED ALWAYS AS (CASE WHEN state = 'sending' THEN lease_expires_at END) STORED,
    UNIQUE (idempotency_key, effect_type, target)
)
-- Room on every page for the leased version of each row on it: a backlog
-- is leased in the order it was written, whole pages per batch, and a HOT
-- update needs free space on the row's own page (docs/performance.md).
WITH (fillfactor = 45);

-- The lease reads due rows in (available_at, effect_id) order, from the head
-- or from just after the last row a worker leased (see outbox_lease).
CREATE INDEX effect_outbox_due_idx ON effect_outbox (available_at, effect_id)
    WHERE state = 'pending';

CREATE INDEX effect_outbox_unknown_idx ON effect_outbox (created_at)
    WHERE state = 'unknown';

-- Pruning walks finished rows by completion time.
CREATE INDEX effect_outbox_done_idx ON effect_outbox (completed_at)
    WHERE state IN ('completed', 'failed');

-- Replacements are found by the original they name: the foreign key check
-- when pruning an original, and prune's own "is it still referenced" test,
-- would otherwise scan the whole table per row.  Few rows carry it, so the
-- index is small (and quick to build on an upgraded database).
CREATE INDEX effect_outbox_replaces_idx ON effect_outbox (replaces_effect)
    WHERE replaces_effect IS NOT NULL;

-- Rows in flight, for the reaper (by deadline) and the kill switch's list.
-- Every row outbox_mark_sending moves to `sending` has a deadline; a
-- `sending` row without one exists only if someone set the state by hand,
-- and the second, normally empty, index holds exactly those so the list
-- still reads indexes only.  outbox_complete finds its rows by key, never
-- by these.
CREATE INDEX effect_outbox_sending_idx ON effect_outbox (send_deadline)
    WHERE state = 'sending' AND send_deadline IS NOT NULL;
CREATE INDEX effect_outbox_sending_nodeadline_idx ON effect_outbox (effect_id)
    WHERE state = 'sending' AND send_deadline IS NULL;

-- This week's figures read recent rows only: block range (BRIN) indexes on
-- creation and consumption time.  Rows are written in time order and a
-- lease stays on its page, so a range of pages covers a narrow span of
-- time; a BRIN index costs next to nothing per insert (autovacuum makes its
-- summaries).  Once `outboxctl prune` has freed pages that new rows reuse,
-- the ranges holding them widen and a refresh reads more.
CREATE INDEX effect_outbox_created_brin ON effect_outbox USING brin (created_at)
    WITH (pages_per_range = 32, autosummarize = on);

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

-- When the fleet last swept, and which worker did.
CREATE TABLE outbox_sweeps (
    id          integer PRIMARY KEY CHECK (id = 1),
    last_run    timestamptz NOT NULL,
    last_worker text
);

INSERT INTO outbox_sweeps (id, last_run) VALUES (1, '-infinity');

-- The current week's figures for the workers' metrics, computed by one
-- worker of the fleet at most every few minutes and kept here, so that
-- workers do not each aggregate the week's rows.
CREATE TABLE outbox_weekly_cache (
    id                        integer PRIMARY KEY CHECK (id = 1),
    refreshed_at              timestamptz NOT NULL,
    refreshed_by              text,
    duplicate_share           numeric,
    approval_wait_p50_seconds numeric,
    approval_wait_p95_seconds numeric,
    validation_failure_share  numeric,
    automatic_share           numeric,
    retries_exhausted         bigint
);

INSERT INTO outbox_weekly_cache (id, refreshed_at) VALUES (1, '-infinity');

CREATE INDEX approvals_consumed_brin ON approvals USING brin (consumed_at)
    WITH (pages_per_range = 32, autosummarize = on);

-- Nothing by default (tables grant nothing to PUBLIC; functions do, so
-- every file in sql/functions/ revokes it for its own).
REVOKE EXECUTE ON FUNCTION outbox_sha256_hex(text) FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO outbox_producer, outbox_dispatcher, outbox_operator;

-- The generated columns effect_key and payload_hash call it on insert.
GRANT EXECUTE ON FUNCTION outbox_sha256_hex(text) TO outbox_producer, outbox_dispatcher;

-- Producer: read runs and effects (to report the current state on a
-- duplicate delivery), insert effects with the columns a producer owns,
-- read approvals without the token hash, call the producer functions.
GRANT SELECT ON workflow_runs, effect_outbox TO outbox_producer;

GRANT INSERT (idempotency_key, effect_type, target, payload, metadata, available_at)
    ON effect_outbox TO outbox_producer;

GRANT SELECT (approval_id, idempotency_key, allowed_decisions, expires_at, consumed_at,
              decision, approver_subject, approver_audience, created_at)
    ON approvals TO outbox_producer;

-- Dispatcher: read what it sends, call its functions.  No table writes of
-- its own; no access to approvals at all.
GRANT SELECT ON effect_outbox, outbox_control, outbox_providers TO outbox_dispatcher;

-- Operator: everything the others can do, plus reading the whole record
-- (never the token hashes) and the kill switch.
GRANT outbox_producer, outbox_dispatcher TO outbox_operator;

GRANT SELECT ON workflow_runs, effect_outbox, effect_attempts, outbox_control,
                outbox_control_history, run_claims, operator_actions, outbox_providers,
                outbox_sweeps, outbox_weekly_cache, schema_migrations
    TO outbox_operator;

GRANT SELECT (approval_id, idempotency_key, allowed_decisions, expires_at, consumed_at,
              decision, approver_subject, approver_audience, proposed_effects, created_at)
    ON approvals TO outbox_operator;

GRANT SELECT ON outbox_sweeps TO outbox_dispatcher;

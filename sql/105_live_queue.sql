-- SPDX-License-Identifier: ISC
-- 105_live_queue.sql: open effects in a narrow live queue, finished ones in
-- an append-only history partitioned by time (docs/design.md, "Tables").
--
-- One wide row per effect that every transition rewrote (three versions
-- per effect, none HOT, eight or nine index entries) becomes:
--   effect_outbox   what the producer wrote, once: key, type, target,
--                   payload, hashes, metadata.  Never updated.  Still the
--                   table producers insert into (a plain INSERT into a
--                   table: through a view it cost a one-row INSERT 10 %).
--   effect_live     the state of an effect still moving (pending, sending,
--                   unknown): a narrow row that the claim rewrites in place
--                   (HOT: no indexed column changes), deleted by the
--                   statement that finishes the effect.
--   effect_history  one row per provider call, reaper or reconciliation
--                   verdict, and per state change without a call; the row
--                   that finishes an effect carries its final state.
--                   Append-only, partitioned by the effect's creation month,
--                   so prune detaches and drops whole months.
--   effect_calls    one row per claim or mark call: which rows it moved to
--                   `sending` and until when, for the reaper and the kill
--                   switch's in-flight list (the live rows carry no index a
--                   state change would touch).
-- outbox_effects is the effect as one row with every column the single
-- table had (state, attempts, provider id, errors ...): a view over the
-- three, for reading.  effect_attempts stays, as a view: the history's
-- provider-call rows.

-- Move the old tables aside; their rows are copied below, then they go.
-- Their indexes get other names first: the new tables reuse them.
DROP VIEW IF EXISTS outbox_weekly_stats;
DROP TRIGGER IF EXISTS effect_outbox_gate ON effect_outbox;
DROP TRIGGER IF EXISTS effect_outbox_notify_ins ON effect_outbox;
DROP TRIGGER IF EXISTS effect_attempts_append_only ON effect_attempts;
ALTER TABLE effect_outbox RENAME TO effect_outbox_old;
ALTER TABLE effect_attempts RENAME TO effect_attempts_old;
DO $$
DECLARE
    i regclass;
BEGIN
    FOR i IN SELECT x.indexrelid::regclass FROM pg_index x
              WHERE x.indrelid IN ('effect_outbox_old'::regclass, 'effect_attempts_old'::regclass) LOOP
        EXECUTE format('ALTER INDEX %s RENAME TO %I', i, i::text || '_old');
    END LOOP;
END $$;

-- Effect ids ordered by creation time (the UUID version 7 layout: 48 bits
-- of Unix milliseconds, then random bits): the primary keys and the
-- history's index take new entries at their right-hand edge, where a
-- random id would touch a random page of a large index for every insert
-- and every finished effect.
CREATE OR REPLACE FUNCTION outbox_new_effect_id() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
                                      PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp())
                                                                       * 1000)::bigint) FROM 3)
                                      FROM 1 FOR 6),
                              52, 1), 53, 1), 'hex')::uuid;
REVOKE EXECUTE ON FUNCTION outbox_new_effect_id() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_new_effect_id()
    TO outbox_producer, outbox_dispatcher, outbox_operator;

CREATE TABLE effect_outbox (
    effect_id        uuid PRIMARY KEY DEFAULT outbox_new_effect_id(),
    idempotency_key  text NOT NULL REFERENCES workflow_runs (idempotency_key),
    effect_type      text NOT NULL,
    target           text NOT NULL,
    payload          jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- The key the provider sees: derived from the run's key, the type and
    -- the target, so it is the same on every attempt and differs between
    -- two effects of one run (docs/design.md, "Providers").
    effect_key       text GENERATED ALWAYS AS (outbox_sha256_hex(
                        idempotency_key || E'\n' || effect_type || E'\n' || target)) STORED,
    payload_hash     text GENERATED ALWAYS AS (outbox_sha256_hex(payload::text)) STORED,
    metadata         jsonb,
    approved_by      text,
    -- When the effect is first due (outbox_enqueue's delay); the live row
    -- carries the due time from then on.
    available_at     timestamptz NOT NULL DEFAULT now(),
    replaces_effect  uuid REFERENCES effect_outbox (effect_id),
    UNIQUE (idempotency_key, effect_type, target)
);

-- Replacements are found by the original they name (prune's "is it still
-- referenced" test and the foreign key check).
CREATE INDEX effect_outbox_replaces_idx ON effect_outbox (replaces_effect)
    WHERE replaces_effect IS NOT NULL;

-- This week's figures and prune read by creation time: rows are written in
-- time order and never updated, so a block range covers a narrow span.
CREATE INDEX effect_outbox_created_brin ON effect_outbox USING brin (created_at)
    WITH (pages_per_range = 32, autosummarize = on);

CREATE TABLE effect_live (
    effect_id        uuid PRIMARY KEY,
    effect_type      text NOT NULL,
    -- The effect's creation time: the history partition its rows go to.
    created_at       timestamptz NOT NULL,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'sending', 'unknown')),
    -- When the effect is due.  An `unknown` effect is never due: 'infinity'
    -- keeps it out of the claim's range, and the reconciliation pass finds
    -- those rows at the end of the same index.
    available_at     timestamptz NOT NULL,
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- attempts already spent when an operator last gave the effect a fresh
    -- retry budget (requeue, resolve --not-sent): max_attempts counts from
    -- here, while attempt numbers in the log keep increasing.
    retry_base       integer NOT NULL DEFAULT 0 CHECK (retry_base >= 0),
    lease_owner      uuid,
    lease_worker     text,
    leased_at        timestamptz,
    lease_expires_at timestamptz,
    sending_since    timestamptz,
    -- The claim or mark call that moved the row to `sending` (its
    -- effect_calls row): only that same call, repeated after a lost
    -- connection, gets it back.
    mark_token       uuid,
    -- Whether the send in progress went to a provider that honours
    -- idempotency keys: decides pending vs unknown when its lease expires.
    sending_idempotent boolean NOT NULL DEFAULT false,
    provider_id      text,
    last_error_class text,
    last_error       text,
    last_status      integer,
    last_reconciled_at timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
)
-- Room on every page for the claimed version of each row on it: a HOT
-- update needs free space on the row's own page, and the claimed version
-- is wider than the inserted one (lease, worker, call token).  At 50 a
-- third of the claims found no room and wrote two index entries each; at
-- 35 every claim of a backlog stays on its page (claim + completion 0.40 ->
-- 0.37 of the single table's CPU at 64 and 128 rows per call).  A row is
-- ~150 bytes, so a backlog of 2,000,000 takes ~850 MB, a third of what
-- the single table took.
WITH (fillfactor = 35);

-- The one index besides the key.  The claim reads due rows in
-- (available_at, effect_id) order and changes neither column, so its
-- update stays on the page (HOT) and writes no index entry; `state` is in
-- no index for the same reason.
CREATE INDEX effect_live_due_idx ON effect_live (available_at, effect_id);

CREATE SEQUENCE effect_history_id_seq AS bigint;

CREATE TABLE effect_history (
    history_id       bigint NOT NULL DEFAULT nextval('effect_history_id_seq'),
    effect_id        uuid NOT NULL,
    -- The effect's creation time (effect_outbox.created_at): the partition key.
    created_at       timestamptz NOT NULL,
    attempt          integer NOT NULL,
    lease_owner      uuid,
    worker           text,
    started_at       timestamptz NOT NULL,
    ended_at         timestamptz NOT NULL DEFAULT now(),
    -- NULL: a state change without a provider call (an invalid row, a
    -- cancel, an operator's verdict); effect_attempts leaves those out.
    outcome_class    text CHECK (outcome_class IN (
                        'accepted', 'not_sent', 'retry', 'terminal', 'ambiguous',
                        'lease_lost', 'reconciled_sent', 'reconciled_not_sent',
                        'reconcile_unknown', 'operator_sent', 'operator_not_sent')),
    provider_status  integer,
    provider_id      text,
    error_text       text,
    -- Whether the worker still held the lease when it recorded this.
    cas_applied      boolean NOT NULL DEFAULT true,
    metadata         jsonb,
    -- How an attempt row resolved an `unknown` effect (NULL: it did not).
    resolution       text,
    -- The state this row finished the effect in ('completed', 'failed'),
    -- with the effect's last error and provider id at that moment; NULL
    -- on every row that did not take the effect out of the live queue.
    state            text CHECK (state IN ('completed', 'failed')),
    last_error_class text,
    last_error       text,
    last_provider_id text,
    retry_base       integer
) PARTITION BY RANGE (created_at);

-- An effect's rows, found by the effect's creation time and id (both on
-- its body row): the partition, then the rows.  Effects finish in about
-- the order they were created, so new entries land at the right-hand
-- edge of the index instead of at random pages, as an index led by the
-- random effect_id would take them.  No uniqueness: the completion's CAS
-- records each provider call once, and the evidence of a call whose CAS
-- failed is written only when the same owner's row for that attempt is
-- not there yet (sql/functions/30_dispatcher.sql).
CREATE INDEX effect_history_effect_idx ON effect_history (created_at, effect_id);

-- The weekly figures read recent rows by end time.
CREATE INDEX effect_history_ended_brin ON effect_history USING brin (ended_at)
    WITH (pages_per_range = 32);

-- Rows whose month has no partition (none should: the workers keep months
-- ahead) land here instead of failing the completion.
CREATE TABLE effect_history_default PARTITION OF effect_history DEFAULT;

-- The partition of each month from p_from to p_to, made when missing.
-- Run by migrations and the workers' housekeeping; safe to run anywhere.
CREATE OR REPLACE FUNCTION outbox_history_partitions(p_from timestamptz, p_to timestamptz)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    m timestamptz := date_trunc('month', p_from AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    made integer := 0;
    name text;
BEGIN
    WHILE m < p_to LOOP
        name := 'effect_history_' || to_char(m AT TIME ZONE 'UTC', 'YYYYMM');
        IF to_regclass(name) IS NULL
           AND NOT EXISTS (SELECT 1 FROM effect_history_default d
                            WHERE d.created_at >= m AND d.created_at < m + interval '1 month') THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF effect_history FOR VALUES FROM (%L) TO (%L)',
                           name, m, m + interval '1 month');
            made := made + 1;
        END IF;
        m := m + interval '1 month';
    END LOOP;
    RETURN made;
END $$;
REVOKE EXECUTE ON FUNCTION outbox_history_partitions(timestamptz, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_history_partitions(timestamptz, timestamptz)
    TO outbox_dispatcher, outbox_operator;

SELECT outbox_history_partitions(
    least(coalesce((SELECT min(created_at) FROM effect_outbox_old), now()), now()),
    now() + interval '3 months');

-- One row per claim or mark call while any of its rows may be `sending`.
CREATE TABLE effect_calls (
    call             uuid PRIMARY KEY,
    lease_owner      uuid NOT NULL,
    worker           text,
    ids              uuid[] NOT NULL,
    -- No row of the call is past its lease before this (renewals move
    -- rows' leases on; the reaper moves this on when it finds them so).
    deadline         timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX effect_calls_deadline_idx ON effect_calls (deadline);

-- The rows of today, moved.
INSERT INTO effect_outbox (effect_id, idempotency_key, effect_type, target, payload, created_at,
                         metadata, approved_by, available_at, replaces_effect)
SELECT effect_id, idempotency_key, effect_type, target, payload, created_at,
       metadata, approved_by, available_at, NULL
  FROM effect_outbox_old;
UPDATE effect_outbox b SET replaces_effect = o.replaces_effect
  FROM effect_outbox_old o
 WHERE o.effect_id = b.effect_id AND o.replaces_effect IS NOT NULL;

-- A `sending` row without a call token (set by hand) gets one of its own.
UPDATE effect_outbox_old SET mark_token = gen_random_uuid()
 WHERE state = 'sending' AND mark_token IS NULL;

INSERT INTO effect_live (effect_id, effect_type, created_at, state, available_at, attempts,
                         retry_base, lease_owner, lease_worker, leased_at, lease_expires_at,
                         sending_since, mark_token, sending_idempotent, provider_id,
                         last_error_class, last_error, last_status, last_reconciled_at,
                         updated_at)
SELECT effect_id, effect_type, created_at, state,
       CASE WHEN state = 'unknown' THEN 'infinity' ELSE available_at END, attempts,
       retry_base, lease_owner, lease_worker, leased_at, lease_expires_at,
       sending_since, mark_token, sending_idempotent, provider_id,
       last_error_class, last_error, last_status, last_reconciled_at, updated_at
  FROM effect_outbox_old
 WHERE state IN ('pending', 'sending', 'unknown');

INSERT INTO effect_calls (call, lease_owner, worker, ids, deadline)
SELECT mark_token, min(lease_owner::text)::uuid, min(lease_worker), array_agg(effect_id),
       coalesce(min(lease_expires_at), now())
  FROM effect_outbox_old
 WHERE state = 'sending'
 GROUP BY mark_token;

INSERT INTO effect_history (history_id, effect_id, created_at, attempt, lease_owner, worker,
                            started_at, ended_at, outcome_class, provider_status, provider_id,
                            error_text, cas_applied, metadata, resolution)
SELECT a.attempt_id, a.effect_id, coalesce(o.created_at, a.started_at), a.attempt,
       a.lease_owner, a.worker, a.started_at, a.ended_at, a.outcome_class, a.provider_status,
       a.provider_id, a.error_text, a.cas_applied, a.metadata, a.resolution
  FROM effect_attempts_old a LEFT JOIN effect_outbox_old o USING (effect_id);
SELECT setval('effect_history_id_seq',
              greatest(coalesce((SELECT max(attempt_id) FROM effect_attempts_old), 0), 1));

-- A finished effect's final state: one row without a call.
INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, ended_at,
                            state, last_error_class, last_error, last_provider_id,
                            provider_status, retry_base)
SELECT effect_id, created_at, attempts, 'migration', coalesce(completed_at, updated_at),
       coalesce(completed_at, updated_at), state, last_error_class, last_error, provider_id,
       last_status, retry_base
  FROM effect_outbox_old
 WHERE state IN ('completed', 'failed');

-- Policies and grants of the old tables go with them.
DROP TABLE effect_attempts_old;
DROP TABLE effect_outbox_old;

-- Append-only, enforced for every role (the table owner included).
-- Dropping a partition is not a DELETE: prune stays possible.
CREATE OR REPLACE FUNCTION effect_history_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'effect_history is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;
REVOKE EXECUTE ON FUNCTION effect_history_append_only() FROM PUBLIC;
CREATE TRIGGER effect_history_append_only
    BEFORE UPDATE OR DELETE ON effect_history
    FOR EACH ROW EXECUTE FUNCTION effect_history_append_only();
DROP FUNCTION IF EXISTS effect_attempts_append_only();

-- The lease holder, apart: producer logins may not read it (the view's
-- column privileges leave it out; a column the view took from effect_live
-- itself would be checked for every reader of the view, used or not).
CREATE OR REPLACE FUNCTION outbox_effect_lease_owner(p_effect_id uuid)
RETURNS uuid
LANGUAGE sql STABLE AS $$
    SELECT l.lease_owner FROM public.effect_live l WHERE l.effect_id = p_effect_id
$$;
REVOKE EXECUTE ON FUNCTION outbox_effect_lease_owner(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_effect_lease_owner(uuid) TO outbox_dispatcher, outbox_operator;

-- The effect as one row, as before: what the producer wrote, and the state
-- from the live row while the effect moves, else from the row that
-- finished it (an effect whose INSERT is still running has neither: it is
-- pending).  security_invoker: every reader's own rights and row-level
-- security apply to the tables underneath.  Found by effect_id or key, it
-- is three index probes.
CREATE VIEW outbox_effects WITH (security_invoker = true) AS
SELECT b.effect_id, b.idempotency_key, b.effect_type, b.target, b.payload,
       coalesce(l.state, f.state, 'pending') AS state,
       outbox_effect_lease_owner(b.effect_id) AS lease_owner, l.lease_expires_at,
       CASE WHEN l.effect_id IS NOT NULL THEN l.provider_id ELSE f.last_provider_id END
           AS provider_id,
       b.created_at, b.effect_key, b.payload_hash, b.metadata, b.approved_by,
       coalesce(l.attempts, f.attempt, 0) AS attempts,
       coalesce(l.retry_base, f.retry_base, 0) AS retry_base,
       coalesce(l.available_at, b.available_at) AS available_at,
       l.lease_worker, l.leased_at, l.sending_since, l.mark_token,
       coalesce(l.sending_idempotent, false) AS sending_idempotent,
       CASE WHEN l.effect_id IS NOT NULL THEN l.last_error_class ELSE f.last_error_class END
           AS last_error_class,
       CASE WHEN l.effect_id IS NOT NULL THEN l.last_error ELSE f.last_error END AS last_error,
       CASE WHEN l.effect_id IS NOT NULL THEN l.last_status ELSE f.provider_status END
           AS last_status,
       CASE WHEN l.effect_id IS NULL THEN f.ended_at END AS completed_at,
       coalesce(l.updated_at, f.ended_at, b.created_at) AS updated_at,
       b.replaces_effect, l.last_reconciled_at,
       CASE WHEN l.state = 'sending' THEN l.lease_expires_at END AS send_deadline
  FROM effect_outbox b
  LEFT JOIN effect_live l ON l.effect_id = b.effect_id
  LEFT JOIN LATERAL (
      SELECT h.state, h.attempt, h.retry_base, h.last_provider_id, h.last_error_class,
             h.last_error, h.provider_status, h.ended_at
        FROM effect_history h
       WHERE l.effect_id IS NULL
         AND h.created_at = b.created_at AND h.effect_id = b.effect_id AND h.state IS NOT NULL
       ORDER BY h.history_id DESC LIMIT 1) f ON true;

-- The provider calls and verdicts, as before: the history without its
-- rows of state changes made without a call.
CREATE VIEW effect_attempts WITH (security_invoker = true) AS
SELECT h.history_id AS attempt_id, h.effect_id, h.attempt, h.lease_owner, h.worker,
       h.started_at, h.ended_at, h.outcome_class, h.provider_status, h.provider_id,
       h.error_text, h.cas_applied, h.metadata, h.resolution
  FROM effect_outbox b
  JOIN effect_history h ON h.created_at = b.created_at AND h.effect_id = b.effect_id
 WHERE h.outcome_class IS NOT NULL;

-- Row-level security: a producer login sees the effects of its own runs
-- (or of runs without an owner) only, in every table an effect lives in
-- (sql/104_producer_isolation.sql).  Workers and operators see every row.
ALTER TABLE effect_outbox ENABLE ROW LEVEL SECURITY;
ALTER TABLE effect_live ENABLE ROW LEVEL SECURITY;
ALTER TABLE effect_history ENABLE ROW LEVEL SECURITY;

CREATE POLICY outbox_producer_own_effects ON effect_outbox FOR SELECT TO outbox_producer
    USING (EXISTS (SELECT 1 FROM workflow_runs w
                    WHERE w.idempotency_key = effect_outbox.idempotency_key
                      AND (w.owner_role IS NULL OR w.owner_role = session_user)));
CREATE POLICY outbox_producer_own_live ON effect_live FOR SELECT TO outbox_producer
    USING (EXISTS (SELECT 1 FROM effect_outbox b JOIN workflow_runs w USING (idempotency_key)
                    WHERE b.effect_id = effect_live.effect_id
                      AND (w.owner_role IS NULL OR w.owner_role = session_user)));
CREATE POLICY outbox_producer_own_history ON effect_history FOR SELECT TO outbox_producer
    USING (EXISTS (SELECT 1 FROM effect_outbox b JOIN workflow_runs w USING (idempotency_key)
                    WHERE b.effect_id = effect_history.effect_id
                      AND (w.owner_role IS NULL OR w.owner_role = session_user)));
CREATE POLICY outbox_staff_all_effects ON effect_outbox TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);
CREATE POLICY outbox_staff_all_live ON effect_live TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);
CREATE POLICY outbox_staff_all_history ON effect_history TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);
-- The producer's INSERT policy (outbox_producer_own_inserts) is made with
-- its function in sql/functions/20_producer.sql.

-- Grants: as before.  The views run with the reader's rights, so each role
-- reads the tables as it read the one table; no role but the owner writes
-- them directly (the functions do, as the owner), the producer's INSERT
-- aside.
DO $$
DECLARE
    cols text;
BEGIN
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'outbox_effects' AND column_name <> 'lease_owner';
    EXECUTE format('GRANT SELECT (%s) ON outbox_effects TO outbox_producer, outbox_dispatcher', cols);
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'effect_live' AND column_name <> 'lease_owner';
    EXECUTE format('GRANT SELECT (%s) ON effect_live TO outbox_producer, outbox_dispatcher', cols);
END $$;
GRANT SELECT ON effect_outbox, effect_history TO outbox_producer, outbox_dispatcher;
GRANT INSERT (idempotency_key, effect_type, target, payload, metadata, available_at)
    ON effect_outbox TO outbox_producer;
GRANT SELECT ON outbox_effects, effect_attempts, effect_outbox, effect_live, effect_history,
                effect_calls
    TO outbox_operator;

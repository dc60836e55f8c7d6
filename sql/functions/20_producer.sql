-- SPDX-License-Identifier: ISC
-- functions/20_producer.sql: the functions n8n workflows (and other
-- producers) call, one statement per step of the reference sequence
-- (docs/n8n.md, "The steps at a glance").
--
-- All are SECURITY DEFINER with a fixed search_path: the producer role gets
-- EXECUTE on them and nothing that lets it change an effect's state.

-- A run belongs to the producer login that claimed it (owner_role,
-- sql/104_producer_isolation.sql): no other producer login may renew,
-- transition, enqueue into, approve for or cancel it.  A run with no owner
-- is shared; an operator (and a superuser) may act on every run.
CREATE OR REPLACE FUNCTION outbox_run_is_mine(p_owner_role text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = public, pg_temp
RETURN p_owner_role IS NULL OR p_owner_role = session_user
       OR pg_has_role(session_user, 'outbox_operator', 'MEMBER');

-- A claim of a key another login holds.  The claim's INSERT has already
-- met the key, so the refusal cannot hide that it exists; it does not say
-- whose it is.  Run keys are one namespace per database (docs/design.md,
-- "Roles").
CREATE OR REPLACE FUNCTION outbox_refuse_foreign_run(p_fn text, p_key text) RETURNS void
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
    RAISE EXCEPTION '%: refused: run key "%" is not available to this login', p_fn, p_key
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'run keys are shared by the producer logins of a database; give each login its own key prefix';
END $$;

-- An effect goes into a run the caller may use (its own, or one with no
-- owner): outbox_enqueue calls this.  The run must be found, by a fresh read (a VOLATILE function
-- reads with a snapshot of its own, so a run claimed by another login
-- while the insert waited is seen), and is locked FOR KEY SHARE until
-- commit, so what was checked is what the foreign key finds.  One
-- primary-key probe.  A missing run and another login's run give the same
-- error (the foreign key's SQLSTATE), so the check tells nobody which keys
-- other logins hold; it locks only rows the caller may use.
CREATE OR REPLACE FUNCTION outbox_lock_run_for_effect(p_key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM 1 FROM workflow_runs w
     WHERE w.idempotency_key = p_key AND outbox_run_is_mine(w.owner_role)
       FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'effect refused: no run "%"', p_key
            USING ERRCODE = 'foreign_key_violation',
                  HINT = 'claim the run first (outbox_claim_run); an effect belongs to a run of its own producer login';
    END IF;
    RETURN true;
END $$;

-- An effect's metadata says which workflow, model and trigger made it; it
-- is logged with every attempt of the effect, so it is bounded: 64 KiB of
-- its text form, the bytes a worker reads, logs and measures (the claim's
-- metadata_bytes).  Not pg_column_size: for a value read from a table
-- (INSERT ... SELECT from the producer's own table) that is its
-- compressed size, and 12 MiB of repetitive jsonb compresses to 48 KiB.
-- Data belongs in the payload.  Raises with the sizes, else true; the
-- policy below calls it only past the bound, so the usual insert pays for
-- no PL/pgSQL call.
CREATE OR REPLACE FUNCTION outbox_metadata_max_bytes() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 65536 $$;

CREATE OR REPLACE FUNCTION outbox_metadata_ok(p_metadata jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE SET search_path = public, pg_temp AS $$
BEGIN
    IF p_metadata IS NOT NULL AND octet_length(p_metadata::text) > outbox_metadata_max_bytes() THEN
        RAISE EXCEPTION 'effect refused: metadata is % bytes, more than the % allowed',
                        octet_length(p_metadata::text), outbox_metadata_max_bytes()
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'metadata names the workflow version, model and trigger; data goes in the payload';
    END IF;
    RETURN true;
END $$;

DROP POLICY IF EXISTS outbox_producer_own_inserts ON effect_outbox;
-- The plain INSERT's check is inline (a PL/pgSQL call per row cost a
-- bulk insert 2.6x): the run must be one the login sees, its own or a
-- shared one (workflow_runs' policy in sql/104_producer_isolation.sql).
-- A positive check on the
-- statement's snapshot is safe against a run claimed meanwhile by another
-- login: that run is not in the snapshot, so the row is refused; and the
-- foreign key locks the run it finds.  A missing run and another login's
-- run give the same answer (42501, the policy's).
CREATE POLICY outbox_producer_own_inserts ON effect_outbox FOR INSERT TO outbox_producer
    WITH CHECK (EXISTS (SELECT 1 FROM workflow_runs w
                         WHERE w.idempotency_key = effect_outbox.idempotency_key
                           AND (w.owner_role IS NULL OR w.owner_role = session_user))
                AND (metadata IS NULL OR octet_length(metadata::text) <= outbox_metadata_max_bytes()
                     OR outbox_metadata_ok(metadata)));
-- Replaced by outbox_lock_run_for_effect: it passed a key that named no
-- run yet, and answered any producer whether a key was another login's.
DROP FUNCTION IF EXISTS outbox_run_not_foreign(text);

-- A run that becomes failed_terminal (its approver's rejection, its lease
-- holder's transition) cancels its still-pending effects in the same
-- transaction: defence in depth, with no check on the send path.

-- Cancel the pending effects of a run that has just been refused (leased
-- ones too: the worker's CAS to `sending` then finds them gone).  The
-- caller locks them first, in effect_id order, before the run row (the
-- order every function takes: effects, then runs).  A cancel finishes the
-- effect: its live row goes and the history row that finishes it
-- (failed, cancelled) is written by the same statement.
CREATE OR REPLACE FUNCTION outbox_cancel_pending_of_run(p_key text, p_why text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    WITH gone AS (
        DELETE FROM effect_live l
         USING effect_outbox b
         WHERE b.idempotency_key = p_key AND l.effect_id = b.effect_id AND l.state = 'pending'
        RETURNING l.*)
    INSERT INTO effect_history (effect_id, created_at, attempt, worker, source, started_at,
                                ended_at, state, last_error_class, last_error, last_provider_id,
                                provider_status, retry_base)
    SELECT g.effect_id, g.created_at, g.attempts, 'cancel', 'producer', now(), now(),
           'failed', 'cancelled', 'cancelled: ' || p_why, g.provider_id, g.last_status,
           g.retry_base
      FROM gone g;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

CREATE OR REPLACE FUNCTION outbox_lock_pending_of_run(p_key text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM 1 FROM effect_outbox b JOIN effect_live l USING (effect_id)
     WHERE b.idempotency_key = p_key AND l.state = 'pending'
     ORDER BY l.effect_id FOR UPDATE OF l;
END $$;

-- Step 2: claim a run.  The seed's INSERT ... ON CONFLICT ... WHERE, plus a
-- row that always comes back so a workflow can branch on `status`:
--   claimed          new key, lease granted
--   reclaimed        failed_retryable or expired processing lease, taken over
--   busy             another execution holds a live lease
--   done             the run is past the point where a re-run may act
--                    (awaiting_human, approved, completed, failed_terminal):
--                    return `state`/`result` to the caller, do nothing else
--   payload_mismatch same key, different payload hash: stop and investigate
--   unavailable      (outbox_claim_run_status only) the key is another
--                    producer login's: never this login's to claim, so a
--                    retry cannot succeed.  Nothing else of that run comes
--                    back, not even that it is another login's rather than
--                    refused for some other reason; nothing is locked or
--                    recorded.
-- outbox_claim_run answers `unavailable` with 42501 instead (its callers
-- know that answer).
CREATE OR REPLACE FUNCTION outbox_claim_run_status(p_key text, p_payload_hash text, p_owner uuid,
                                                   p_lease_seconds integer DEFAULT 300)
RETURNS TABLE (status text, idempotency_key text, state text, lease_owner uuid,
               version bigint, result jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r workflow_runs%ROWTYPE;
    st text;
BEGIN
    IF p_key IS NULL OR p_key = '' OR p_payload_hash IS NULL OR p_owner IS NULL THEN
        RAISE EXCEPTION 'outbox_claim_run: key, payload hash and owner are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        RAISE EXCEPTION 'outbox_claim_run: lease_seconds must be 1..86400'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Another login's key is answered before anything locks it (the
    -- settle below locks the run row): no other login can hold a run's
    -- lock by claiming its key in a transaction it keeps open.  A run's
    -- owner never changes, so a read without a lock decides.
    IF NOT outbox_run_is_mine((SELECT w.owner_role FROM workflow_runs w
                                WHERE w.idempotency_key = p_key)) THEN
        RETURN QUERY SELECT 'unavailable'::text, p_key, NULL::text, NULL::uuid, NULL::bigint,
                            NULL::jsonb;
        RETURN;
    END IF;
    -- A run whose effects have all finished is completed (or
    -- failed_terminal) before anything reads it: an expired processing
    -- lease over finished effects is `done`, never reclaimed.
    PERFORM outbox_settle_runs(ARRAY[p_key]);

    INSERT INTO workflow_runs AS w (idempotency_key, state, payload_hash,
                                    lease_owner, lease_expires_at, owner_role)
    VALUES (p_key, 'processing', p_payload_hash, p_owner,
            now() + make_interval(secs => p_lease_seconds), session_user)
    ON CONFLICT ON CONSTRAINT workflow_runs_pkey DO UPDATE
    SET lease_owner = EXCLUDED.lease_owner,
        lease_expires_at = EXCLUDED.lease_expires_at,
        state = 'processing',
        version = w.version + 1,
        updated_at = now()
    WHERE w.payload_hash = EXCLUDED.payload_hash
      AND (w.state = 'failed_retryable'
           OR (w.state = 'processing' AND w.lease_expires_at < now()))
      AND outbox_run_is_mine(w.owner_role)
    RETURNING w.* INTO r;

    IF FOUND THEN
        st := CASE WHEN r.version = 0 THEN 'claimed' ELSE 'reclaimed' END;
    ELSE
        SELECT * INTO r FROM workflow_runs w WHERE w.idempotency_key = p_key;
        IF NOT outbox_run_is_mine(r.owner_role) THEN
            -- Claimed by another login since the check above: the
            -- conflict locked its row, so this must end the transaction
            -- (an error releases the lock; a row would keep it).
            PERFORM outbox_refuse_foreign_run('outbox_claim_run', p_key);
        END IF;
        IF r.payload_hash <> p_payload_hash THEN
            st := 'payload_mismatch';
        ELSIF r.state IN ('processing', 'failed_retryable') THEN
            st := 'busy';
        ELSE
            st := 'done';
        END IF;
    END IF;

    INSERT INTO run_claims (idempotency_key, outcome) VALUES (p_key, st);
    IF st IN ('claimed', 'reclaimed') THEN
        RETURN QUERY SELECT st, r.idempotency_key, r.state, r.lease_owner, r.version, r.result;
    ELSE
        -- Never hand out the lease owner of someone else's execution.
        RETURN QUERY SELECT st, r.idempotency_key, r.state, NULL::uuid, r.version, r.result;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION outbox_claim_run(p_key text, p_payload_hash text, p_owner uuid,
                                 p_lease_seconds integer DEFAULT 300)
RETURNS TABLE (status text, idempotency_key text, state text, lease_owner uuid,
               version bigint, result jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT * FROM outbox_claim_run_status(p_key, p_payload_hash, p_owner, p_lease_seconds) LOOP
        IF c.status = 'unavailable' THEN
            PERFORM outbox_refuse_foreign_run('outbox_claim_run', p_key);
        END IF;
        status := c.status;
        idempotency_key := c.idempotency_key;
        state := c.state;
        lease_owner := c.lease_owner;
        version := c.version;
        result := c.result;
        RETURN NEXT;
    END LOOP;
END $$;

-- Renew the run's lease: only its live owner at its version, while the run
-- is processing, and each renewal at most a day ahead.  There is no cap on
-- the total time yet (that needs the claim time, which workflow_runs does
-- not record): a workflow must not renew forever.  A run whose effects
-- have all finished is settled first, so it is no longer processing.
CREATE OR REPLACE FUNCTION outbox_renew_run(p_key text, p_owner uuid, p_version bigint,
                                 p_lease_seconds integer DEFAULT 300)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v bigint;
BEGIN
    -- Ownership first, without a lock (a run's owner never changes): the
    -- settle locks the run row, and another login's renewal must leave
    -- nothing of the run locked.
    IF NOT outbox_run_is_mine((SELECT w.owner_role FROM workflow_runs w
                                WHERE w.idempotency_key = p_key)) THEN
        RETURN NULL;
    END IF;
    PERFORM outbox_settle_runs(ARRAY[p_key]);
    UPDATE workflow_runs w
       SET lease_expires_at = now() + make_interval(secs => least(greatest(p_lease_seconds, 1), 86400)),
           updated_at = now()
     WHERE w.idempotency_key = p_key AND w.lease_owner = p_owner AND w.version = p_version
       AND w.state = 'processing' AND w.lease_expires_at > now()
       AND outbox_run_is_mine(w.owner_role)
    RETURNING w.version INTO v;
    RETURN v;
END $$;

-- CAS transition of a run by its lease holder; a transition to
-- failed_terminal cancels the run's pending effects.
CREATE OR REPLACE FUNCTION outbox_transition_run(p_key text, p_owner uuid, p_version bigint,
                                                 p_state text, p_result jsonb DEFAULT NULL)
RETURNS TABLE (version bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v bigint;
BEGIN
    IF p_state NOT IN ('processing', 'awaiting_human', 'approved', 'completed',
                       'failed_retryable', 'failed_terminal') THEN
        RAISE EXCEPTION 'outbox_transition_run: unknown state %', p_state
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT outbox_run_is_mine((SELECT w.owner_role FROM workflow_runs w
                                WHERE w.idempotency_key = p_key)) THEN
        RETURN;
    END IF;
    IF p_state = 'failed_terminal' THEN
        PERFORM outbox_lock_pending_of_run(p_key);
    END IF;
    PERFORM outbox_settle_runs(ARRAY[p_key]);
    UPDATE workflow_runs w
       SET state = p_state,
           version = w.version + 1,
           result = coalesce(p_result, w.result),
           updated_at = now()
     WHERE w.idempotency_key = p_key
       AND w.lease_owner = p_owner
       AND w.version = p_version
       AND w.lease_expires_at > now()
       AND w.state = 'processing'
    RETURNING w.version INTO v;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_state = 'failed_terminal' THEN
        PERFORM outbox_cancel_pending_of_run(p_key, 'the run was moved to failed_terminal');
    END IF;
    RETURN QUERY SELECT v;
END $$;

-- Step 6: CAS the run to awaiting_human and create a one-time approval.
-- Only the SHA-256 of the token is passed and stored; the raw token exists
-- only in the message to the approver.  No row: the caller lost its lease.
CREATE OR REPLACE FUNCTION outbox_create_approval(p_key text, p_owner uuid, p_version bigint,
                                       p_token_sha256 bytea,
                                       p_allowed_decisions text[],
                                       p_expires_in_seconds integer,
                                       p_effects jsonb,
                                       p_approver_audience text DEFAULT NULL,
                                       p_result jsonb DEFAULT NULL)
RETURNS TABLE (approval_id uuid, expires_at timestamptz, version bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v bigint;
    e jsonb;
BEGIN
    IF p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32 THEN
        RAISE EXCEPTION 'outbox_create_approval: token hash must be 32 bytes of SHA-256'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_allowed_decisions IS NULL OR cardinality(p_allowed_decisions) = 0
       OR NOT p_allowed_decisions <@ ARRAY['approve', 'reject'] THEN
        RAISE EXCEPTION 'outbox_create_approval: allowed decisions must be a non-empty subset of {approve,reject}'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_expires_in_seconds IS NULL OR p_expires_in_seconds < 1 THEN
        RAISE EXCEPTION 'outbox_create_approval: expiry must be positive'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_effects IS NULL OR jsonb_typeof(p_effects) <> 'array' THEN
        RAISE EXCEPTION 'outbox_create_approval: effects must be a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR e IN SELECT * FROM jsonb_array_elements(p_effects) LOOP
        IF jsonb_typeof(e) <> 'object' OR jsonb_typeof(e->'effect_type') <> 'string'
           OR jsonb_typeof(e->'target') <> 'string' OR e->>'effect_type' = ''
           OR e->>'target' = '' OR coalesce(jsonb_typeof(e->'payload'), 'null') = 'null' THEN
            RAISE EXCEPTION 'outbox_create_approval: each effect needs effect_type, target and payload'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        PERFORM outbox_metadata_ok(e->'metadata');
    END LOOP;
    -- An approval whose effects collide on (type, target) could never be
    -- consumed (the outbox's unique constraint): refuse it now, not when
    -- the approver clicks.
    IF (SELECT count(DISTINCT (x->>'effect_type', x->>'target')) <> count(*)
          FROM jsonb_array_elements(p_effects) AS x) THEN
        RAISE EXCEPTION 'outbox_create_approval: two effects with the same effect_type and target'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- Ownership first, without a lock, as in outbox_renew_run.
    IF NOT outbox_run_is_mine((SELECT w.owner_role FROM workflow_runs w
                                WHERE w.idempotency_key = p_key)) THEN
        RETURN;
    END IF;
    PERFORM outbox_settle_runs(ARRAY[p_key]);
    UPDATE workflow_runs w
       SET state = 'awaiting_human', version = w.version + 1,
           result = coalesce(p_result, w.result), updated_at = now()
     WHERE w.idempotency_key = p_key AND w.lease_owner = p_owner
       AND w.version = p_version AND w.lease_expires_at > now()
       AND w.state = 'processing' AND outbox_run_is_mine(w.owner_role)
    RETURNING w.version INTO v;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    RETURN QUERY
    INSERT INTO approvals AS a (idempotency_key, token_hash, allowed_decisions,
                                expires_at, approver_audience, proposed_effects)
    VALUES (p_key, p_token_sha256, p_allowed_decisions,
            now() + make_interval(secs => p_expires_in_seconds),
            p_approver_audience, p_effects)
    RETURNING a.approval_id, a.expires_at, v;
END $$;

-- What a confirmation page may show (GET decides nothing): no hash, no
-- other approvals, nothing once the token is used or expired.  The run's
-- state is settled first (the only write: what its finished effects
-- already decided), so the page shows the state every other reader sees.
CREATE OR REPLACE FUNCTION outbox_peek_approval(p_token_sha256 bytea)
RETURNS TABLE (idempotency_key text, allowed_decisions text[], expires_at timestamptz,
               approver_audience text, proposed_effects jsonb, run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    k text;
BEGIN
    -- Ownership first, without a lock: the settle locks the run row.
    SELECT a.idempotency_key INTO k FROM approvals a JOIN workflow_runs w USING (idempotency_key)
     WHERE a.token_hash = p_token_sha256 AND a.consumed_at IS NULL AND a.expires_at > now()
       AND outbox_run_is_mine(w.owner_role);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM outbox_settle_runs(ARRAY[k]);
    RETURN QUERY
    SELECT a.idempotency_key, a.allowed_decisions, a.expires_at, a.approver_audience,
           a.proposed_effects, w.state
      FROM approvals a JOIN workflow_runs w USING (idempotency_key)
     WHERE a.token_hash = p_token_sha256
       AND a.consumed_at IS NULL
       AND a.expires_at > now()
       AND outbox_run_is_mine(w.owner_role);
END $$;

-- Consume an approval (one transaction: token once, run awaiting_human ->
-- approved, the proposed effects inserted); a rejection cancels the run's
-- pending effects instead.
CREATE OR REPLACE FUNCTION outbox_consume_approval(p_token_sha256 bytea, p_decision text,
                                                   p_approver text)
RETURNS TABLE (idempotency_key text, decision text, effect_id uuid,
               effect_type text, target text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    a approvals%ROWTYPE;
    run_state text;
BEGIN
    IF p_approver IS NULL OR p_approver = '' THEN
        RAISE EXCEPTION 'outbox_consume_approval: the approver must be named'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- Ownership first, without a lock (an approval's run and a run's
    -- owner never change): another login's approval is not found and
    -- never locked, whoever holds its token.
    IF NOT EXISTS (SELECT 1 FROM approvals x JOIN workflow_runs w USING (idempotency_key)
                    WHERE x.token_hash = p_token_sha256 AND outbox_run_is_mine(w.owner_role)) THEN
        RETURN;
    END IF;
    SELECT * INTO a FROM approvals x
     WHERE x.token_hash = p_token_sha256
       AND x.consumed_at IS NULL
       AND x.expires_at > now()
       AND p_decision = ANY (x.allowed_decisions)
       FOR UPDATE;
    IF NOT FOUND OR NOT outbox_run_is_mine((SELECT w.owner_role FROM workflow_runs w
                                             WHERE w.idempotency_key = a.idempotency_key)) THEN
        RETURN;
    END IF;

    IF p_decision = 'reject' THEN
        PERFORM outbox_lock_pending_of_run(a.idempotency_key);
    END IF;
    PERFORM outbox_settle_runs(ARRAY[a.idempotency_key]);
    SELECT w.state INTO run_state FROM workflow_runs w
     WHERE w.idempotency_key = a.idempotency_key FOR UPDATE;
    IF run_state IS DISTINCT FROM 'awaiting_human' THEN
        RETURN;
    END IF;

    UPDATE approvals x
       SET consumed_at = now(), decision = p_decision, approver_subject = p_approver
     WHERE x.approval_id = a.approval_id;

    IF p_decision = 'reject' THEN
        UPDATE workflow_runs w
           SET state = 'failed_terminal', version = w.version + 1,
               failure_reason = 'rejected by ' || p_approver, updated_at = now()
         WHERE w.idempotency_key = a.idempotency_key;
        PERFORM outbox_cancel_pending_of_run(a.idempotency_key, 'rejected by ' || p_approver);
        RETURN QUERY SELECT a.idempotency_key, p_decision, NULL::uuid, NULL::text, NULL::text;
        RETURN;
    END IF;

    UPDATE workflow_runs w
       SET state = 'approved', version = w.version + 1, updated_at = now()
     WHERE w.idempotency_key = a.idempotency_key;

    RETURN QUERY
    INSERT INTO effect_outbox AS o (idempotency_key, effect_type, target, payload,
                                  metadata, approved_by)
    SELECT a.idempotency_key, e->>'effect_type', e->>'target', e->'payload',
           e->'metadata', p_approver
      FROM jsonb_array_elements(a.proposed_effects) AS e
    RETURNING o.idempotency_key, p_decision, o.effect_id, o.effect_type, o.target;
    IF NOT FOUND THEN
        UPDATE workflow_runs w
           SET state = 'completed', version = w.version + 1, updated_at = now()
         WHERE w.idempotency_key = a.idempotency_key;
        RETURN QUERY SELECT a.idempotency_key, p_decision, NULL::uuid, NULL::text, NULL::text;
    END IF;
END $$;

-- Approve-by-exception and act-with-window: enqueue one effect directly.
-- A duplicate (key, type, target) inserts nothing and returns the existing
-- effect with inserted = false, so at-least-once producers can call it twice.
CREATE OR REPLACE FUNCTION outbox_enqueue(p_key text, p_effect_type text, p_target text,
                               p_payload jsonb, p_metadata jsonb DEFAULT NULL,
                               p_delay_seconds integer DEFAULT 0)
RETURNS TABLE (effect_id uuid, inserted boolean, state text, available_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    -- Its plans are cached for the session: one made while effect_outbox was
    -- nearly empty must not stay a scan of it as it grows.
    SET enable_seqscan = off AS $$
DECLARE
    id uuid;
    due timestamptz;
BEGIN
    IF p_delay_seconds IS NULL OR p_delay_seconds < 0 THEN
        RAISE EXCEPTION 'outbox_enqueue: delay must be >= 0 seconds'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A processing run of this login whose effects have all finished is
    -- completed (or failed_terminal): settled first, so the gate refuses
    -- the new effect as when the completion moved the run itself.  Not an
    -- `approved` run (the lease holder's approve-by-exception enqueues
    -- what it approved).  Before the run's share lock below, so two
    -- enqueues into one run queue on the settle's lock, never deadlock.
    IF EXISTS (SELECT 1 FROM effect_outbox o WHERE o.idempotency_key = p_key)
       AND EXISTS (SELECT 1 FROM workflow_runs w
                    WHERE w.idempotency_key = p_key AND w.state = 'processing'
                      AND outbox_run_is_mine(w.owner_role)) THEN
        PERFORM outbox_settle_runs(ARRAY[p_key]);
    END IF;
    PERFORM outbox_lock_run_for_effect(p_key);
    PERFORM outbox_metadata_ok(p_metadata);
    -- The delay is the body's first due time; the insert's trigger makes
    -- the live row, pending and due then, so a new effect is returned as
    -- the insert wrote it, without reading it back.
    INSERT INTO effect_outbox AS o (idempotency_key, effect_type, target, payload,
                                  metadata, available_at)
    VALUES (p_key, p_effect_type, p_target, p_payload, p_metadata,
            now() + make_interval(secs => p_delay_seconds))
    ON CONFLICT (idempotency_key, effect_type, target) DO NOTHING
    RETURNING o.effect_id, o.available_at INTO id, due;
    IF FOUND THEN
        RETURN QUERY SELECT id, true, 'pending'::text, due;
    ELSE
        RETURN QUERY SELECT b.effect_id, false, outbox_effect_state(b.effect_id),
                            coalesce(l.available_at, b.available_at)
                       FROM effect_outbox b LEFT JOIN effect_live l USING (effect_id)
                      WHERE b.idempotency_key = p_key AND b.effect_type = p_effect_type
                        AND b.target = p_target;
    END IF;
END $$;

-- Cancel one pending effect: it finishes failed ("cancelled: <reason>")
-- and its run becomes failed_terminal.  Its live row goes and the history
-- row that finishes it is written by the same statement.
CREATE OR REPLACE FUNCTION outbox_cancel_as(p_effect_id uuid, p_owner uuid, p_reason text, p_actor text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    o effect_live%ROWTYPE;
    run_key text;
    holder uuid;
    run_owner text;
    window_end timestamptz;
    why text := coalesce(nullif(p_reason, ''), 'no reason given');
BEGIN
    -- Ownership first, without a lock (an effect's run and a run's owner
    -- never change): another login's effect is not found, whatever its
    -- state, and is never locked, so no other login can stall its
    -- completion by holding a transaction open.
    SELECT b.idempotency_key, w.owner_role, b.available_at INTO run_key, run_owner, window_end
      FROM effect_outbox b JOIN workflow_runs w USING (idempotency_key)
     WHERE b.effect_id = p_effect_id;
    IF NOT FOUND OR NOT outbox_run_is_mine(run_owner) THEN
        RETURN false;
    END IF;
    -- A finished effect has no live row: nothing to cancel.
    SELECT * INTO o FROM effect_live l WHERE l.effect_id = p_effect_id FOR UPDATE;
    IF NOT FOUND OR o.state <> 'pending' THEN
        RETURN false;
    END IF;
    -- The effect is locked, then the run (effects first, then runs).
    PERFORM outbox_settle_runs(ARRAY[run_key]);
    SELECT w.lease_owner INTO holder
      FROM workflow_runs w WHERE w.idempotency_key = run_key;
    IF NOT (pg_has_role(session_user, 'outbox_operator', 'MEMBER')
            OR (p_owner IS NOT NULL AND holder IS NOT DISTINCT FROM p_owner)
            -- Inside the producer's window: before the effect's first
            -- due time, and not due since (a pause's 'infinity' or a
            -- retry's wait does not reopen it).
            OR least(o.available_at, window_end) > now()) THEN
        RAISE EXCEPTION 'outbox_cancel: refused: effect % of run "%" is due; only the run''s lease holder (outbox_cancel with its owner) or the operator role may cancel it; a producer may cancel inside the effect''s delay window only',
                        p_effect_id, run_key
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    WITH gone AS (
        DELETE FROM effect_live l WHERE l.effect_id = p_effect_id RETURNING l.*)
    INSERT INTO effect_history (effect_id, created_at, attempt, worker, source, started_at,
                                ended_at, state, last_error_class, last_error, last_provider_id,
                                provider_status, retry_base)
    SELECT g.effect_id, g.created_at, g.attempts, 'cancel',
           CASE WHEN NOT (p_owner IS NOT NULL AND holder = p_owner)
                     AND pg_has_role(session_user, 'outbox_operator', 'MEMBER')
                THEN 'operator' ELSE 'producer' END,
           now(), now(), 'failed', 'cancelled', 'cancelled: ' || why, g.provider_id,
           g.last_status, g.retry_base
      FROM gone g;
    UPDATE workflow_runs w
       SET state = 'failed_terminal', version = w.version + 1,
           failure_reason = coalesce(w.failure_reason, 'effect ' || p_effect_id || ' cancelled: ' || why),
           updated_at = now()
     WHERE w.idempotency_key = run_key AND w.state NOT IN ('completed', 'failed_terminal');
    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES ('cancel', p_effect_id, run_key, coalesce(p_actor, 'producer'),
            coalesce(nullif(p_reason, ''), 'cancelled'),
            jsonb_build_object('as', CASE WHEN p_owner IS NOT NULL AND holder = p_owner
                                          THEN 'lease holder'
                                          WHEN pg_has_role(session_user, 'outbox_operator', 'MEMBER')
                                          THEN 'operator' ELSE 'inside the window' END));
    RETURN true;
END $$;

CREATE OR REPLACE FUNCTION outbox_cancel(p_effect_id uuid, p_reason text DEFAULT 'cancelled',
                                         p_actor text DEFAULT 'producer')
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
RETURN outbox_cancel_as(p_effect_id, NULL, p_reason, p_actor);

-- The lease holder's cancel: p_owner is the run's lease owner from the
-- claim (no producer can read another execution's owner: see 6).
CREATE OR REPLACE FUNCTION outbox_cancel(p_effect_id uuid, p_owner uuid, p_reason text, p_actor text)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
RETURN outbox_cancel_as(p_effect_id, p_owner, p_reason, p_actor);

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_lock_run_for_effect(text),
    outbox_metadata_max_bytes(),
    outbox_metadata_ok(jsonb),
    outbox_run_is_mine(text),
    outbox_refuse_foreign_run(text, text),
    outbox_claim_run(text, text, uuid, integer),
    outbox_claim_run_status(text, text, uuid, integer),
    outbox_renew_run(text, uuid, bigint, integer),
    outbox_transition_run(text, uuid, bigint, text, jsonb),
    outbox_create_approval(text, uuid, bigint, bytea, text[], integer, jsonb, text, jsonb),
    outbox_peek_approval(bytea),
    outbox_consume_approval(bytea, text, text),
    outbox_enqueue(text, text, text, jsonb, jsonb, integer),
    outbox_cancel(uuid, text, text),
    outbox_cancel_pending_of_run(text, text),
    outbox_lock_pending_of_run(text),
    outbox_cancel_as(uuid, uuid, text, text),
    outbox_cancel(uuid, uuid, text, text)
    FROM PUBLIC;

GRANT EXECUTE ON FUNCTION
    outbox_lock_run_for_effect(text),
    outbox_metadata_max_bytes(),
    outbox_metadata_ok(jsonb),
    outbox_claim_run(text, text, uuid, integer),
    outbox_claim_run_status(text, text, uuid, integer),
    outbox_renew_run(text, uuid, bigint, integer),
    outbox_transition_run(text, uuid, bigint, text, jsonb),
    outbox_create_approval(text, uuid, bigint, bytea, text[], integer, jsonb, text, jsonb),
    outbox_peek_approval(bytea),
    outbox_consume_approval(bytea, text, text),
    outbox_enqueue(text, text, text, jsonb, jsonb, integer),
    outbox_cancel(uuid, text, text),
    outbox_cancel(uuid, uuid, text, text)
    TO outbox_producer;

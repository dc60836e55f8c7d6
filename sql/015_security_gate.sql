-- 015_security_gate.sql: the approval gate in the database, one lock order
-- for effect rows, and the smaller holes of an outside security review.
--
--  1. The approval gate.  A BEFORE INSERT trigger on effect_outbox accepts
--     a new effect only for a run that may still act:
--       - `processing` (the execution working on it; a plain INSERT or
--         outbox_enqueue cannot say which execution it is, the CAS
--         functions do);
--       - `approved` by this very transaction: the lease holder's
--         approve-by-exception (outbox_transition_run to approved and
--         outbox_enqueue in one statement), an operator's replacement
--         (outbox_replace), or outbox_consume_approval, whose effects must
--         be exactly the ones the human saw (type, target and payload of
--         the approval's proposed_effects).
--     Every other state (awaiting_human, approved earlier, completed,
--     failed_retryable, failed_terminal) is refused with SQLSTATE 55000
--     (object_not_in_prerequisite_state) and a message naming the run and
--     its state.  "This transaction" is the run row's xmin: no producer
--     function can write a run row that is not processing (a GUC or a
--     temporary table, which a producer can set or create itself, would
--     not be a proof).  An insert that would only repeat an existing
--     (key, type, target) passes: it adds nothing (ON CONFLICT DO NOTHING
--     returns the existing row, a plain INSERT gets 23505).
--  2. A run that becomes failed_terminal through a human's rejection or its
--     lease holder's transition cancels its still-pending effects in the
--     same transaction (defence in depth; no check on the send path).
--  3. Operators' requeue and replace refuse an effect whose run is
--     awaiting_human or was rejected by its approver.
--  4. outbox_cancel: the operator role, the run's lease holder (new
--     overload with the owner), or a producer cancelling inside the
--     effect's act-with-window delay (available_at still ahead).  Every
--     operator_actions row records the database role (session_user).
--  5. One lock order: every function that updates several effect rows
--     locks them in effect_id order first (renew vs complete deadlocked).
--  6. outbox_complete records attempts only for effects the worker leased
--     (the row's lease owner, or an earlier attempt row of that owner: the
--     reaper's row keeps the lost owner, so a late outcome is still
--     evidence); lease owners are no longer readable by producers and
--     dispatchers, so they cannot be borrowed.
--  7. outbox_register_providers accepts only provider-like names.

-- 1. The gate ----------------------------------------------------------------

CREATE FUNCTION outbox_effect_gate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    st text;
    ours boolean;
    me xid := pg_current_xact_id()::xid;
BEGIN
    -- FOR SHARE: a concurrent state change waits for this insert (or this
    -- insert for it), so the state checked is the state at commit.
    SELECT w.state, w.xmin = me INTO st, ours
      FROM workflow_runs w WHERE w.idempotency_key = NEW.idempotency_key FOR SHARE;
    IF NOT FOUND OR st = 'processing' OR NEW.payload IS NULL OR NEW.target IS NULL
       OR NEW.effect_type IS NULL THEN
        RETURN NEW;                     -- the foreign key or NOT NULL refuses the rest
    END IF;
    IF EXISTS (SELECT 1 FROM effect_outbox o
                WHERE o.idempotency_key = NEW.idempotency_key
                  AND o.effect_type = NEW.effect_type AND o.target = NEW.target) THEN
        RETURN NEW;                     -- a repeat: adds nothing
    END IF;
    IF st = 'approved' AND ours THEN
        IF EXISTS (SELECT 1 FROM approvals a
                    WHERE a.idempotency_key = NEW.idempotency_key
                      AND a.decision = 'approve' AND a.xmin = me)
           AND NOT EXISTS (SELECT 1 FROM approvals a,
                                 jsonb_array_elements(a.proposed_effects) AS e
                            WHERE a.idempotency_key = NEW.idempotency_key
                              AND a.decision = 'approve' AND a.xmin = me
                              AND e->>'effect_type' = NEW.effect_type
                              AND e->>'target' = NEW.target
                              AND e->'payload' = NEW.payload) THEN
            RAISE EXCEPTION 'effect refused: run "%" was approved by a human for its proposed effects only; % to "%" is not one of them',
                            NEW.idempotency_key, NEW.effect_type, NEW.target
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'effect refused: run "%" is %; effects are accepted only while the run is processing (approved effects come from outbox_consume_approval)',
                    NEW.idempotency_key, st
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'enqueue before moving the run on, or send the effect down the approval path';
END $$;

CREATE TRIGGER effect_outbox_gate
    BEFORE INSERT ON effect_outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_effect_gate();

-- 2. failed_terminal cancels what has not started ----------------------------

-- Cancel the pending effects of a run that has just been refused (leased
-- ones too: the worker's CAS to `sending` then finds them gone).  The
-- caller locks them first, in effect_id order, before the run row (the
-- order outbox_complete and outbox_fail_invalid use: effects, then runs).
CREATE FUNCTION outbox_cancel_pending_of_run(p_key text, p_why text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    UPDATE effect_outbox o
       SET state = 'failed', last_error_class = 'cancelled', last_error = 'cancelled: ' || p_why,
           lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           completed_at = now(), updated_at = now()
     WHERE o.idempotency_key = p_key AND o.state = 'pending';
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

CREATE FUNCTION outbox_lock_pending_of_run(p_key text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM 1 FROM effect_outbox o
     WHERE o.idempotency_key = p_key AND o.state = 'pending'
     ORDER BY o.effect_id FOR UPDATE;
END $$;

-- As in 002, plus: a transition to failed_terminal cancels the run's
-- pending effects.
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
    IF p_state = 'failed_terminal' THEN
        PERFORM outbox_lock_pending_of_run(p_key);
    END IF;
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

-- As in 002, plus: a rejection cancels the run's pending effects.
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

    SELECT * INTO a FROM approvals x
     WHERE x.token_hash = p_token_sha256
       AND x.consumed_at IS NULL
       AND x.expires_at > now()
       AND p_decision = ANY (x.allowed_decisions)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    IF p_decision = 'reject' THEN
        PERFORM outbox_lock_pending_of_run(a.idempotency_key);
    END IF;
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

-- 3. Operators' acts on effects of refused runs ------------------------------

-- Why an operator may not put an effect of this run back on the way to a
-- provider, or NULL when it may: a run still waiting for its human, or one
-- the human rejected (its effects were cancelled by the rejection).  Any
-- other failed_terminal run is the ordinary case of requeue and replace
-- (an effect failed); the operator's act is recorded.
CREATE FUNCTION outbox_operator_refusal(p_key text)
RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT CASE
        WHEN w.state = 'awaiting_human'
            THEN format('run "%s" is awaiting_human: its approval decides', w.idempotency_key)
        WHEN EXISTS (SELECT 1 FROM approvals a
                      WHERE a.idempotency_key = w.idempotency_key AND a.decision = 'reject')
            THEN format('run "%s" is %s: its approver rejected it', w.idempotency_key, w.state)
        END
      FROM workflow_runs w WHERE w.idempotency_key = p_key;
$$;

CREATE FUNCTION outbox_operator_gate(p_fn text, p_key text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    why text := outbox_operator_refusal(p_key);
BEGIN
    IF why IS NOT NULL THEN
        RAISE EXCEPTION '%: refused: %', p_fn, why
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END $$;

-- outbox_requeue_locked as in 005, behind the gate (outbox_requeue reaches
-- it; outbox_requeue_failed_since skips such effects, below).
CREATE OR REPLACE FUNCTION outbox_requeue_locked(p_effect_id uuid, p_operator text, p_reason text,
                                                 p_detail jsonb)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o effect_outbox%ROWTYPE;
    run_before text;
    run_after text;
BEGIN
    PERFORM outbox_operator_gate('outbox_requeue',
                                 (SELECT x.idempotency_key FROM effect_outbox x
                                   WHERE x.effect_id = p_effect_id));
    UPDATE effect_outbox x
       SET state = 'pending', available_at = now(), retry_base = x.attempts,
           lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           sending_since = NULL, completed_at = NULL, updated_at = now()
     WHERE x.effect_id = p_effect_id AND x.state = 'failed'
    RETURNING x.* INTO o;

    SELECT w.state INTO run_before FROM workflow_runs w
     WHERE w.idempotency_key = o.idempotency_key FOR UPDATE;
    UPDATE workflow_runs w
       SET state = 'approved', version = w.version + 1, failure_reason = NULL, updated_at = now()
     WHERE w.idempotency_key = o.idempotency_key
       AND w.state = 'failed_terminal'
       AND NOT EXISTS (SELECT 1 FROM effect_outbox e
                        WHERE e.idempotency_key = w.idempotency_key AND e.state = 'failed')
    RETURNING w.state INTO run_after;

    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES ('requeue', o.effect_id, o.idempotency_key, p_operator, p_reason,
            coalesce(p_detail, '{}'::jsonb)
            || jsonb_build_object('from_state', 'failed', 'attempts', o.attempts,
                                  'last_error_class', o.last_error_class,
                                  'last_error', o.last_error,
                                  'run_state_before', run_before,
                                  'run_state_after', coalesce(run_after, run_before)));
    RETURN coalesce(run_after, run_before);
END $$;

-- As in 005, skipping effects whose run the gate refuses.
CREATE OR REPLACE FUNCTION outbox_requeue_failed_since(p_since timestamptz, p_operator text,
                                                       p_reason text)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               last_error_class text, run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o record;
    rs text;
BEGIN
    PERFORM outbox_op_check('outbox_requeue_failed_since', p_operator, p_reason);
    IF p_since IS NULL THEN
        RAISE EXCEPTION 'outbox_requeue_failed_since: a start time is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR o IN SELECT x.effect_id, x.idempotency_key, x.effect_type, x.target, x.last_error_class
               FROM effect_outbox x
              WHERE x.state = 'failed' AND x.completed_at >= p_since
                AND x.last_error_class IS DISTINCT FROM 'cancelled'
                AND outbox_operator_refusal(x.idempotency_key) IS NULL
              ORDER BY x.completed_at, x.effect_id
                FOR UPDATE LOOP
        rs := outbox_requeue_locked(o.effect_id, p_operator, p_reason,
                                    jsonb_build_object('failed_since', p_since));
        effect_id := o.effect_id;
        idempotency_key := o.idempotency_key;
        effect_type := o.effect_type;
        target := o.target;
        last_error_class := o.last_error_class;
        run_state := rs;
        RETURN NEXT;
    END LOOP;
    IF FOUND THEN
        PERFORM pg_notify('effect_outbox', '');
    END IF;
END $$;

-- outbox_replace keeps its body (005); the gate runs first.  The new run
-- it creates is `approved` by this transaction, which the insert gate
-- accepts.
ALTER FUNCTION outbox_replace(uuid, text, text, text, text, jsonb)
    RENAME TO outbox_replace_ungated;
REVOKE ALL ON FUNCTION outbox_replace_ungated(uuid, text, text, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_replace_ungated(uuid, text, text, text, text, jsonb) FROM outbox_operator;

CREATE FUNCTION outbox_replace(p_effect_id uuid, p_new_key text, p_operator text, p_reason text,
                               p_target text DEFAULT NULL, p_payload jsonb DEFAULT NULL)
RETURNS TABLE (status text, state text, new_effect_id uuid, new_key text, original_key text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM outbox_operator_gate('outbox_replace',
                                 (SELECT x.idempotency_key FROM effect_outbox x
                                   WHERE x.effect_id = p_effect_id));
    RETURN QUERY SELECT * FROM outbox_replace_ungated(p_effect_id, p_new_key, p_operator,
                                                      p_reason, p_target, p_payload);
END $$;
REVOKE ALL ON FUNCTION outbox_replace(uuid, text, text, text, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_replace(uuid, text, text, text, text, jsonb) TO outbox_operator;

-- 4. Cancel: who may, and who did ---------------------------------------------

-- The database role that acted, whatever name it gave (session_user: the
-- login role, which SECURITY DEFINER does not change).
ALTER TABLE operator_actions ADD COLUMN db_role text DEFAULT session_user;

CREATE FUNCTION outbox_cancel_as(p_effect_id uuid, p_owner uuid, p_reason text, p_actor text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    o effect_outbox%ROWTYPE;
    holder uuid;
    why text := coalesce(nullif(p_reason, ''), 'no reason given');
BEGIN
    SELECT * INTO o FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR UPDATE;
    IF NOT FOUND OR o.state <> 'pending' THEN
        RETURN false;
    END IF;
    SELECT w.lease_owner INTO holder FROM workflow_runs w WHERE w.idempotency_key = o.idempotency_key;
    IF NOT (pg_has_role(session_user, 'outbox_operator', 'MEMBER')
            OR (p_owner IS NOT NULL AND holder IS NOT DISTINCT FROM p_owner)
            OR o.available_at > now()) THEN
        RAISE EXCEPTION 'outbox_cancel: refused: effect % of run "%" is due; only the run''s lease holder (outbox_cancel with its owner) or the operator role may cancel it; a producer may cancel inside the effect''s delay window only',
                        p_effect_id, o.idempotency_key
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    UPDATE effect_outbox x
       SET state = 'failed', last_error_class = 'cancelled', last_error = 'cancelled: ' || why,
           lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           completed_at = now(), updated_at = now()
     WHERE x.effect_id = p_effect_id;
    UPDATE workflow_runs w
       SET state = 'failed_terminal', version = w.version + 1,
           failure_reason = coalesce(w.failure_reason, 'effect ' || p_effect_id || ' cancelled: ' || why),
           updated_at = now()
     WHERE w.idempotency_key = o.idempotency_key AND w.state NOT IN ('completed', 'failed_terminal');
    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES ('cancel', p_effect_id, o.idempotency_key, coalesce(p_actor, 'producer'),
            coalesce(nullif(p_reason, ''), 'cancelled'),
            jsonb_build_object('as', CASE WHEN p_owner IS NOT NULL AND holder = p_owner
                                          THEN 'lease holder'
                                          WHEN pg_has_role(session_user, 'outbox_operator', 'MEMBER')
                                          THEN 'operator' ELSE 'inside the window' END));
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION outbox_cancel_as(uuid, uuid, text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox_cancel(p_effect_id uuid, p_reason text DEFAULT 'cancelled',
                                         p_actor text DEFAULT 'producer')
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
RETURN outbox_cancel_as(p_effect_id, NULL, p_reason, p_actor);

-- The lease holder's cancel: p_owner is the run's lease owner from the
-- claim (no producer can read another execution's owner: see 6).
CREATE FUNCTION outbox_cancel(p_effect_id uuid, p_owner uuid, p_reason text, p_actor text)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
RETURN outbox_cancel_as(p_effect_id, p_owner, p_reason, p_actor);
REVOKE ALL ON FUNCTION outbox_cancel(uuid, uuid, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_cancel(uuid, uuid, text, text) TO outbox_producer;

-- 5 and 6. One lock order; attempts only from the lease holder ---------------

-- Lock the rows of p_ids that p_owner holds, in effect_id order.  Every
-- batch function that updates several effect rows calls it first, so two
-- batches overlapping in any order wait for each other instead of
-- deadlocking (renew and complete did, in both directions).
CREATE FUNCTION outbox_lock_owned(p_owner uuid, p_ids uuid[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    PERFORM 1 FROM effect_outbox o
     WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner
     ORDER BY o.effect_id FOR UPDATE;
END $$;

CREATE OR REPLACE FUNCTION outbox_renew(p_owner uuid, p_ids uuid[], p_lease_seconds integer,
                                        p_max_lease_seconds integer)
RETURNS TABLE (effect_id uuid, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    RETURN QUERY
    UPDATE effect_outbox o
       SET lease_expires_at = least(now() + make_interval(secs => p_lease_seconds),
                                    coalesce(o.sending_since, o.leased_at)
                                      + make_interval(secs => p_max_lease_seconds))
     WHERE o.effect_id = ANY (p_ids)
       AND o.lease_owner = p_owner
       AND o.state IN ('pending', 'sending')
       AND o.lease_expires_at > now()
    RETURNING o.effect_id, o.lease_expires_at;
END $$;

CREATE OR REPLACE FUNCTION outbox_release(p_owner uuid, p_ids uuid[], p_delay_ms bigint DEFAULT 0)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    n integer;
BEGIN
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    UPDATE effect_outbox o
       SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
           available_at = greatest(o.available_at,
                                   now() + make_interval(secs => greatest(p_delay_ms, 0) / 1000.0))
     WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner AND o.state = 'pending';
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- As in 007, with the rows locked in effect_id order first.
CREATE OR REPLACE FUNCTION outbox_mark_sending(p_owner uuid, p_ids uuid[], p_env_enabled boolean,
                                               p_idempotent_types text[], p_lease_seconds integer,
                                               p_call uuid DEFAULT NULL)
RETURNS TABLE (effect_id uuid, attempts integer, blocked boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    allowed boolean;
    ids uuid[];
    atts integer[];
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key());
    SELECT c.enabled INTO allowed FROM outbox_control c WHERE c.id = 1;
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    IF NOT (coalesce(allowed, false) AND p_env_enabled) THEN
        RETURN QUERY
        UPDATE effect_outbox o
           SET lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL
         WHERE o.effect_id = ANY (p_ids) AND o.lease_owner = p_owner AND o.state = 'pending'
        RETURNING o.effect_id, o.attempts, true;
        RETURN;
    END IF;
    WITH u AS (
        UPDATE effect_outbox o
           SET state = 'sending', attempts = o.attempts + 1,
               sending_since = now(), mark_token = p_call,
               sending_idempotent = o.effect_type = ANY (p_idempotent_types),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds),
               updated_at = now()
         WHERE o.effect_id = ANY (p_ids)
           AND o.lease_owner = p_owner
           AND o.state = 'pending'
           AND o.lease_expires_at > now()
        RETURNING o.effect_id, o.attempts)
    SELECT coalesce(array_agg(u.effect_id), '{}'), coalesce(array_agg(u.attempts), '{}')
      INTO ids, atts FROM u;
    RETURN QUERY SELECT x.id, x.att, false FROM unnest(ids, atts) AS x(id, att);
    IF p_call IS NOT NULL AND cardinality(ids) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT o.effect_id, o.attempts, false FROM effect_outbox o
         WHERE o.effect_id = ANY (p_ids) AND NOT o.effect_id = ANY (ids)
           AND o.lease_owner = p_owner AND o.state = 'sending'
           AND o.mark_token = p_call;
    END IF;
END $$;

-- As in 003, with the rows locked in effect_id order first.
CREATE OR REPLACE FUNCTION outbox_fail_invalid(p_owner uuid, p_items jsonb)
RETURNS TABLE (effect_id uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    keys text[];
    ids uuid[];
BEGIN
    PERFORM outbox_lock_owned(p_owner, ARRAY(SELECT x.effect_id FROM
                              jsonb_to_recordset(p_items) AS x(effect_id uuid)));
    WITH u AS (
        UPDATE effect_outbox o
           SET state = 'failed', last_error_class = coalesce(x.error_class, 'invalid'),
               last_error = x.error, lease_owner = NULL, lease_expires_at = NULL,
               lease_worker = NULL, completed_at = now(), updated_at = now()
          FROM jsonb_to_recordset(p_items) AS x(effect_id uuid, error_class text, error text)
         WHERE o.effect_id = x.effect_id AND o.lease_owner = p_owner AND o.state = 'pending'
        RETURNING o.effect_id, o.idempotency_key)
    SELECT coalesce(array_agg(u.effect_id), '{}'), coalesce(array_agg(u.idempotency_key), '{}')
      INTO ids, keys FROM u;
    IF cardinality(keys) > 0 THEN
        PERFORM outbox_advance_runs(keys, '{}');
    END IF;
    RETURN QUERY SELECT unnest(ids);
END $$;

-- outbox_complete as in 003 with two changes, each marked "015:":
--  (a) lock order: the rows this owner holds are locked in effect_id order
--      before the UPDATE (which otherwise locked them in the batch's order);
--  (b) lease ownership: an attempts row is written only for an effect this
--      owner leased: the row's lease owner is p_owner (the CAS applies, or
--      the row is still leased but moved on), or an attempts row of this
--      effect and attempt already names p_owner (the reaper's row keeps the
--      owner it took the lease from; a batch sent again after a lost
--      connection finds its own first row).  So a late outcome for a row
--      the reaper moved to `unknown` is still recorded by the worker that
--      held the lease, and no other owner can add rows.
CREATE OR REPLACE FUNCTION outbox_complete(p_owner uuid, p_worker text, p_results jsonb)
RETURNS TABLE (effect_id uuid, applied boolean, state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    done_ids uuid[];
    held_ids uuid[];
    failed_keys text[];
    completed_keys text[];
BEGIN
    -- 015 (a) and (b): lock what this owner holds, in effect_id order, and
    -- remember it (the UPDATE below clears the lease owner).
    SELECT coalesce(array_agg(l.effect_id), '{}') INTO held_ids
      FROM (SELECT o.effect_id FROM effect_outbox o
             WHERE o.effect_id IN (SELECT r.effect_id FROM jsonb_to_recordset(p_results)
                                                          AS r(effect_id uuid))
               AND o.lease_owner = p_owner
             ORDER BY o.effect_id FOR UPDATE) AS l;

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
               last_error = r.error,
               last_status = r.status,
               completed_at = CASE WHEN r.next_state IN ('completed', 'failed') THEN now() END,
               updated_at = now()
          FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
         WHERE o.effect_id = r.effect_id
           AND o.lease_owner = p_owner
           AND o.state = 'sending'
           AND o.attempts = r.attempt
           AND r.next_state IN ('completed', 'pending', 'failed', 'unknown')
        RETURNING o.effect_id, o.idempotency_key, o.state)
    SELECT coalesce(array_agg(u.effect_id), '{}'),
           coalesce(array_agg(u.idempotency_key) FILTER (WHERE u.state = 'failed'), '{}'),
           coalesce(array_agg(u.idempotency_key) FILTER (WHERE u.state = 'completed'), '{}')
      INTO done_ids, failed_keys, completed_keys
      FROM u;

    INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                 outcome_class, provider_status, provider_id,
                                 error_text, cas_applied, metadata)
    SELECT r.effect_id, r.attempt, p_owner, p_worker, coalesce(r.started_at, now()),
           r.outcome, r.status, r.provider_id, r.error, r.effect_id = ANY (done_ids),
           (SELECT o.metadata FROM effect_outbox o WHERE o.effect_id = r.effect_id)
      FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
     -- 015 (b): only effects this owner leased.
     WHERE r.effect_id = ANY (held_ids)
        OR EXISTS (SELECT 1 FROM effect_attempts a
                    WHERE a.effect_id = r.effect_id AND a.attempt = r.attempt
                      AND a.lease_owner = p_owner)
    ON CONFLICT (effect_id, attempt, lease_owner) WHERE worker NOT LIKE 'reaper:%'
                                                    AND lease_owner IS NOT NULL
    DO NOTHING;

    IF cardinality(failed_keys) > 0 OR cardinality(completed_keys) > 0 THEN
        PERFORM outbox_advance_runs(failed_keys, completed_keys);
    END IF;

    RETURN QUERY
    SELECT r.effect_id, x.applied, CASE WHEN x.applied THEN r.next_state END
      FROM jsonb_to_recordset(p_results) AS r(
               effect_id uuid, attempt integer, started_at timestamptz, outcome text,
               status integer, provider_id text, error text, next_state text,
               retry_delay_ms bigint)
      CROSS JOIN LATERAL (
          SELECT r.effect_id = ANY (done_ids)
                 OR EXISTS (SELECT 1 FROM effect_attempts a
                             WHERE a.effect_id = r.effect_id AND a.attempt = r.attempt
                               AND a.lease_owner = p_owner AND a.cas_applied
                               AND a.worker NOT LIKE 'reaper:%') AS applied) x;
END $$;

-- Lease owners are the proof of a lease: producers and dispatchers no
-- longer read them (the functions do).  Every other column stays readable.
DO $$
DECLARE
    cols text;
BEGIN
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'effect_outbox' AND column_name <> 'lease_owner';
    REVOKE SELECT ON effect_outbox FROM outbox_producer, outbox_dispatcher;
    EXECUTE format('GRANT SELECT (%s) ON effect_outbox TO outbox_producer, outbox_dispatcher', cols);
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'workflow_runs' AND column_name <> 'lease_owner';
    REVOKE SELECT ON workflow_runs FROM outbox_producer;
    EXECUTE format('GRANT SELECT (%s) ON workflow_runs TO outbox_producer', cols);
END $$;

-- 7. Provider names -------------------------------------------------------------

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

-- Nothing new is executable by PUBLIC; the internal helpers are reached
-- only through the functions above.
REVOKE ALL ON FUNCTION outbox_effect_gate(), outbox_cancel_pending_of_run(text, text),
    outbox_lock_pending_of_run(text), outbox_operator_refusal(text),
    outbox_operator_gate(text, text), outbox_lock_owned(uuid, uuid[]) FROM PUBLIC;

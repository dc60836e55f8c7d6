-- SPDX-License-Identifier: ISC
-- functions/40_operator.sql: the operator's acts behind outboxctl
-- (docs/design.md, "Operations"; docs/operating.md).
--
-- Each act is one SECURITY DEFINER function: it locks the effect, checks
-- its state, changes it and records who did it and why in
-- operator_actions, all in one transaction.  A missing effect returns no
-- row and an effect in another state returns applied = false with its
-- current state, instead of raising, so that outboxctl and scripts can
-- tell "refused" (nothing changed, here is why) from "broken".  Bad
-- arguments raise invalid_parameter_value.  Only outbox_operator may call
-- them.
--
-- The re-run protocol (seeds, "forced re-runs"): an operator may put an
-- effect back on the queue with the same key (a failed delivery, or an
-- unknown one the provider proves was never received), because the key
-- makes a second delivery harmless; anything that must differ is a new
-- business event with its own key, linked to the original, which is
-- never edited.

-- The checks every act shares.
CREATE OR REPLACE FUNCTION outbox_op_check(p_fn text, p_operator text, p_reason text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_operator IS NULL OR btrim(p_operator) = '' OR p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION '%: operator and reason are required', p_fn
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END $$;

-- unknown -> completed (the provider has it) or pending with the same key
-- (the provider proves it never received it).  Never anything automatic:
-- this is the operator's recorded decision (docs/design.md, "Effect states").
-- A sent effect with no provider id gets a local reference to the
-- decision, so every completed effect has one.
CREATE OR REPLACE FUNCTION outbox_resolve_unknown(p_effect_id uuid, p_sent boolean, p_operator text,
                                       p_reason text, p_provider_id text DEFAULT NULL)
RETURNS TABLE (applied boolean, state text, idempotency_key text, provider_id text,
               run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o effect_outbox%ROWTYPE;
    act bigint;
    pid text;
BEGIN
    PERFORM outbox_op_check('outbox_resolve_unknown', p_operator, p_reason);
    IF p_sent IS NULL THEN
        RAISE EXCEPTION 'outbox_resolve_unknown: say whether it was sent'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT p_sent AND nullif(p_provider_id, '') IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_resolve_unknown: a provider id means it was sent'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    SELECT * INTO o FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF o.state <> 'unknown' THEN
        RETURN QUERY SELECT false, o.state, o.idempotency_key, o.provider_id, w.state
                       FROM workflow_runs w WHERE w.idempotency_key = o.idempotency_key;
        RETURN;
    END IF;

    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES (CASE WHEN p_sent THEN 'resolve_sent' ELSE 'resolve_not_sent' END,
            o.effect_id, o.idempotency_key, p_operator, p_reason,
            jsonb_build_object('from_state', o.state, 'attempts', o.attempts,
                               'provider_id', nullif(p_provider_id, ''),
                               'last_error', o.last_error))
    RETURNING action_id INTO act;

    IF p_sent THEN
        pid := coalesce(nullif(p_provider_id, ''), o.provider_id, 'operator:' || act);
        UPDATE effect_outbox x
           SET state = 'completed', provider_id = pid,
               last_error_class = NULL, last_error = NULL,
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL, completed_at = now(), updated_at = now()
         WHERE x.effect_id = o.effect_id;
    ELSE
        -- Attempts are not reset (attempt numbers in the log stay unique);
        -- the retry budget starts again from here.
        UPDATE effect_outbox x
           SET state = 'pending', available_at = now(), retry_base = x.attempts,
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL, completed_at = NULL, updated_at = now()
         WHERE x.effect_id = o.effect_id;
    END IF;

    -- The decision is evidence like any provider call.  No lease owner, so
    -- it never collides with a worker's row for the same attempt.
    INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at,
                                 outcome_class, provider_id, error_text, cas_applied, metadata)
    VALUES (o.effect_id, o.attempts, NULL, 'operator:' || p_operator, now(),
            CASE WHEN p_sent THEN 'operator_sent' ELSE 'operator_not_sent' END,
            pid, p_reason, true, NULL);

    IF p_sent THEN
        PERFORM outbox_advance_runs('{}', ARRAY[o.idempotency_key]);
    ELSE
        PERFORM pg_notify('effect_outbox', '');
    END IF;

    RETURN QUERY SELECT true, x.state, x.idempotency_key, x.provider_id, w.state
                   FROM effect_outbox x JOIN workflow_runs w ON w.idempotency_key = x.idempotency_key
                  WHERE x.effect_id = o.effect_id;
END $$;

-- Put a failed or not-sent effect back with the same key, behind the gate (outbox_requeue reaches
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

CREATE OR REPLACE FUNCTION outbox_requeue(p_effect_id uuid, p_operator text, p_reason text)
RETURNS TABLE (applied boolean, state text, idempotency_key text, last_error_class text,
               run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o effect_outbox%ROWTYPE;
    rs text;
BEGIN
    PERFORM outbox_op_check('outbox_requeue', p_operator, p_reason);
    SELECT * INTO o FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF o.state <> 'failed' THEN
        RETURN QUERY SELECT false, o.state, o.idempotency_key, o.last_error_class, w.state
                       FROM workflow_runs w WHERE w.idempotency_key = o.idempotency_key;
        RETURN;
    END IF;
    rs := outbox_requeue_locked(o.effect_id, p_operator, p_reason, NULL);
    PERFORM pg_notify('effect_outbox', '');
    RETURN QUERY SELECT true, 'pending'::text, o.idempotency_key, o.last_error_class, rs;
END $$;

-- Requeue every failed effect since a time, skipping effects whose run the
-- gate refuses.
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

-- Re-run protocol step 3: a replacement is a new business event.  A new
-- run under the key the operator brings from the source system (never a
-- made-up suffix), linked by replaces_key, already approved (the
-- operator is the approver), and its effect, linked by replaces_effect,
-- inserted through the ordinary INSERT (so the workers are notified).
-- The original is not touched.
--   status created     done
--          exists      this same replacement was made before: returned
--          wrong_state the original may still be sent (pending, sending,
--                      unknown): cancel or resolve it first
--          key_taken   the new key belongs to another run (state = its state)
CREATE OR REPLACE FUNCTION outbox_replace_ungated(p_effect_id uuid, p_new_key text, p_operator text, p_reason text,
                               p_target text DEFAULT NULL, p_payload jsonb DEFAULT NULL)
RETURNS TABLE (status text, state text, new_effect_id uuid, new_key text, original_key text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o effect_outbox%ROWTYPE;
    r workflow_runs%ROWTYPE;
    nid uuid;
    np jsonb;
BEGIN
    PERFORM outbox_op_check('outbox_replace', p_operator, p_reason);
    IF p_new_key IS NULL OR btrim(p_new_key) = '' THEN
        RAISE EXCEPTION 'outbox_replace: the new key is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_target IS NOT NULL AND btrim(p_target) = '' THEN
        RAISE EXCEPTION 'outbox_replace: the new target is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- FOR SHARE: the original cannot move while its replacement is made.
    SELECT * INTO o FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR SHARE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_new_key = o.idempotency_key THEN
        RAISE EXCEPTION 'outbox_replace: the new key must differ from the original run''s key'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    SELECT * INTO r FROM workflow_runs w WHERE w.idempotency_key = p_new_key;
    IF FOUND THEN
        SELECT x.effect_id INTO nid FROM effect_outbox x
         WHERE x.idempotency_key = p_new_key AND x.replaces_effect = o.effect_id;
        IF r.replaces_key = o.idempotency_key AND nid IS NOT NULL THEN
            RETURN QUERY SELECT 'exists'::text, x.state, x.effect_id, p_new_key, o.idempotency_key
                           FROM effect_outbox x WHERE x.effect_id = nid;
        ELSE
            RETURN QUERY SELECT 'key_taken'::text, r.state, NULL::uuid, p_new_key, o.idempotency_key;
        END IF;
        RETURN;
    END IF;
    IF o.state IN ('pending', 'sending', 'unknown') THEN
        RETURN QUERY SELECT 'wrong_state'::text, o.state, NULL::uuid, p_new_key, o.idempotency_key;
        RETURN;
    END IF;

    np := coalesce(p_payload, o.payload);
    -- The replacement belongs to the producer login the original's run
    -- belongs to.
    INSERT INTO workflow_runs AS w (idempotency_key, state, payload_hash, replaces_key, result,
                                    owner_role)
    VALUES (p_new_key, 'approved', outbox_sha256_hex(np::text), o.idempotency_key,
            jsonb_build_object('replaces_effect', o.effect_id, 'replaced_by', p_operator),
            (SELECT x.owner_role FROM workflow_runs x WHERE x.idempotency_key = o.idempotency_key))
    ON CONFLICT ON CONSTRAINT workflow_runs_pkey DO NOTHING;
    IF NOT FOUND THEN
        -- Created by someone else since we looked.
        RETURN QUERY SELECT 'key_taken'::text, w.state, NULL::uuid, p_new_key, o.idempotency_key
                       FROM workflow_runs w WHERE w.idempotency_key = p_new_key;
        RETURN;
    END IF;

    INSERT INTO effect_outbox AS x (idempotency_key, effect_type, target, payload, metadata,
                                    approved_by, replaces_effect)
    VALUES (p_new_key, o.effect_type, coalesce(p_target, o.target), np,
            coalesce(o.metadata, '{}'::jsonb)
            || jsonb_build_object('replaces_effect', o.effect_id, 'replaces_key', o.idempotency_key),
            p_operator, o.effect_id)
    RETURNING x.effect_id INTO nid;

    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES ('replace', o.effect_id, o.idempotency_key, p_operator, p_reason,
            jsonb_build_object('original_state', o.state, 'new_key', p_new_key,
                               'new_effect_id', nid,
                               'target_changed', coalesce(p_target, o.target) <> o.target,
                               'payload_changed', np <> o.payload));
    RETURN QUERY SELECT 'created'::text, 'pending'::text, nid, p_new_key, o.idempotency_key;
END $$;

-- `outboxctl replace`: the gate first (outbox_operator_gate: not for a run
-- awaiting its human or rejected by its approver), then the replacement
-- itself, which only this function may call.
CREATE OR REPLACE FUNCTION outbox_replace(p_effect_id uuid, p_new_key text, p_operator text, p_reason text,
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

-- Retention: delete up to p_batch completed or failed effects that ended
-- more than p_older_than ago, and return how many went.  outboxctl calls
-- it in a loop, one short transaction per batch, so the workers never wait
-- behind a long delete; rows someone has locked are skipped this time.
-- Never pending, sending or unknown rows; never the attempts log (the
-- evidence is append-only); never an original whose replacement is still
-- here (its link would break).
CREATE OR REPLACE FUNCTION outbox_prune(p_older_than interval, p_batch integer, p_operator text,
                             p_reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    PERFORM outbox_op_check('outbox_prune', p_operator, p_reason);
    IF p_older_than IS NULL OR p_older_than <= interval '0' THEN
        RAISE EXCEPTION 'outbox_prune: the age must be positive'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_batch IS NULL OR p_batch < 1 OR p_batch > 100000 THEN
        RAISE EXCEPTION 'outbox_prune: the batch size must be 1..100000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH victims AS (
        SELECT o.effect_id FROM effect_outbox o
         WHERE o.state IN ('completed', 'failed')
           AND o.completed_at < now() - p_older_than
           AND NOT EXISTS (SELECT 1 FROM effect_outbox r WHERE r.replaces_effect = o.effect_id)
         ORDER BY o.completed_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED)
    DELETE FROM effect_outbox o USING victims v WHERE o.effect_id = v.effect_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        INSERT INTO operator_actions (action, operator, reason, detail)
        VALUES ('prune', p_operator, p_reason,
                jsonb_build_object('deleted', n, 'older_than', p_older_than::text,
                                   'batch', p_batch));
    END IF;
    RETURN n;
END $$;

-- Why an operator may not put an effect of this run back on the way to a
-- provider, or NULL when it may: a run still waiting for its human, or one
-- the human rejected (its effects were cancelled by the rejection).  Any
-- other failed_terminal run is the ordinary case of requeue and replace
-- (an effect failed); the operator's act is recorded.
CREATE OR REPLACE FUNCTION outbox_operator_refusal(p_key text)
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

CREATE OR REPLACE FUNCTION outbox_operator_gate(p_fn text, p_key text)
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

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_op_check(text, text, text),
    outbox_resolve_unknown(uuid, boolean, text, text, text),
    outbox_requeue_locked(uuid, text, text, jsonb),
    outbox_requeue(uuid, text, text),
    outbox_requeue_failed_since(timestamp with time zone, text, text),
    outbox_replace_ungated(uuid, text, text, text, text, jsonb),
    outbox_replace(uuid, text, text, text, text, jsonb),
    outbox_prune(interval, integer, text, text),
    outbox_operator_refusal(text),
    outbox_operator_gate(text, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_resolve_unknown(uuid, boolean, text, text, text),
    outbox_requeue(uuid, text, text),
    outbox_requeue_failed_since(timestamp with time zone, text, text),
    outbox_replace(uuid, text, text, text, text, jsonb),
    outbox_prune(interval, integer, text, text)
    TO outbox_operator;

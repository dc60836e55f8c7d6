-- SPDX-License-Identifier: ISC
-- functions/25_kit.sql: two acts the n8n kit (examples/n8n/) and its
-- operators need beyond the producer functions of 20_producer.sql:
--
--   outbox_cancel_status   a cancel that says why it did not cancel, so a
--                          webhook can answer "too late" (never retry)
--                          apart from "failed, try again";
--   outbox_reopen_approval the way on for a run whose approval expired
--                          unused: the run goes back to failed_retryable,
--                          so delivering the same event again drafts anew
--                          and asks a human again.

-- Cancel an effect and say what happened, as one row:
--   cancelled  it was pending and is now failed ("cancelled: <reason>"),
--              never to be sent (outbox_cancel's rule: a producer inside
--              the effect's delay window, the operator role at any time
--              before it is sent)
--   too_late   its window has passed (its first due time, even while an
--              operator's pause holds it back) or it is in flight (`sending`):
--              a producer may not cancel it; the operator's
--              `outboxctl cancel` may while it is still pending
--   finished   it was already completed, failed (cancelled earlier too) or
--              unknown: nothing to cancel
--   not_found  no such effect
-- The row lock is taken here, and outbox_cancel_as decides under it with
-- the same now(), so a "too_late" here is never an error there.
CREATE OR REPLACE FUNCTION outbox_cancel_status(p_effect_id uuid, p_reason text, p_actor text)
RETURNS TABLE (status text, state text, available_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    o effect_live%ROWTYPE;
    live boolean;
    run_key text;
    window_end timestamptz;
BEGIN
    -- Another producer login's effect is not this login's to see
    -- (sql/104_producer_isolation.sql): not found, checked before any lock
    -- so that no other login can hold its row (an effect's run and a
    -- run's owner never change).
    SELECT b.idempotency_key, b.available_at INTO run_key, window_end
      FROM effect_outbox b JOIN workflow_runs w USING (idempotency_key)
     WHERE b.effect_id = p_effect_id AND outbox_run_is_mine(w.owner_role);
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT * INTO o FROM effect_live l WHERE l.effect_id = p_effect_id FOR UPDATE;
    live := FOUND;
    -- The effect is locked (effects first, then runs): its run's state is
    -- what its other finished effects already decided.
    PERFORM outbox_settle_runs(ARRAY[run_key]);
    IF NOT live THEN
        -- No live row: the effect has finished (completed or failed).
        RETURN QUERY SELECT 'finished'::text, outbox_effect_state(b.effect_id), b.available_at
                       FROM effect_outbox b WHERE b.effect_id = p_effect_id;
        RETURN;
    END IF;
    IF o.state = 'sending' THEN
        RETURN QUERY SELECT 'too_late'::text, o.state, o.available_at;
        RETURN;
    END IF;
    IF o.state <> 'pending' THEN
        RETURN QUERY SELECT 'finished'::text, o.state, o.available_at;
        RETURN;
    END IF;
    -- The window is the producer's: it closes at the effect's first due
    -- time (its body's available_at, the enqueue's delay), whatever moved
    -- the live row's due time since.  A scope's pause parks a due effect
    -- at 'infinity' and a retry waits past it: neither reopens the window
    -- (outbox_cancel_as decides the same way).
    IF least(o.available_at, window_end) <= now()
       AND NOT pg_has_role(session_user, 'outbox_operator', 'MEMBER') THEN
        RETURN QUERY SELECT 'too_late'::text, o.state, o.available_at;
        RETURN;
    END IF;
    PERFORM outbox_cancel_as(p_effect_id, NULL, p_reason, p_actor);
    RETURN QUERY SELECT 'cancelled'::text, outbox_effect_state(p_effect_id), o.available_at;
END $$;

-- Re-open the approval path of a run whose approvals all expired unused
-- (the approver never decided): awaiting_human -> failed_retryable, so the
-- next delivery of the same event (same key, same payload) reclaims it and
-- goes down the approval path again with a new draft and a new link.  The
-- expired approvals stay as they are (the record of what was asked).
-- Refused (55000) while an approval of the run is still open, or when the
-- run is not awaiting_human; the operator's act is recorded.
CREATE OR REPLACE FUNCTION outbox_reopen_approval(p_key text, p_operator text, p_reason text)
RETURNS TABLE (idempotency_key text, state text, version bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r workflow_runs%ROWTYPE;
    open_until timestamptz;
BEGIN
    PERFORM outbox_op_check('outbox_reopen_approval', p_operator, p_reason);
    PERFORM outbox_settle_runs(ARRAY[p_key]);
    SELECT * INTO r FROM workflow_runs w WHERE w.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox_reopen_approval: no run "%"', p_key
            USING ERRCODE = 'no_data_found';
    END IF;
    IF r.state <> 'awaiting_human' THEN
        RAISE EXCEPTION 'outbox_reopen_approval: run "%" is %, not awaiting_human: nothing to re-open', p_key, r.state
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT max(a.expires_at) INTO open_until FROM approvals a
     WHERE a.idempotency_key = p_key AND a.consumed_at IS NULL AND a.expires_at > now();
    IF open_until IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_reopen_approval: run "%" has an approval open until %: let it be decided or expire first', p_key, open_until
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE workflow_runs w
       SET state = 'failed_retryable', version = w.version + 1,
           lease_owner = NULL, lease_expires_at = NULL,
           result = jsonb_build_object('reopened_by', p_operator, 'reason', p_reason,
                                       'previous_result', w.result),
           updated_at = now()
     WHERE w.idempotency_key = p_key
    RETURNING w.* INTO r;
    INSERT INTO operator_actions (action, run_key, operator, reason, detail)
    VALUES ('reopen_approval', p_key, p_operator, p_reason,
            jsonb_build_object('expired_approvals',
                               (SELECT count(*) FROM approvals a
                                 WHERE a.idempotency_key = p_key AND a.consumed_at IS NULL)));
    RETURN QUERY SELECT r.idempotency_key, r.state, r.version;
END $$;

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    outbox_cancel_status(uuid, text, text),
    outbox_reopen_approval(text, text, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_cancel_status(uuid, text, text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox_reopen_approval(text, text, text) TO outbox_operator;

-- SPDX-License-Identifier: ISC
-- Append-only, enforced for every role (the table owner included).
CREATE OR REPLACE FUNCTION effect_attempts_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'effect_attempts is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;

DROP TRIGGER IF EXISTS effect_attempts_append_only ON effect_attempts;

CREATE TRIGGER effect_attempts_append_only
    BEFORE UPDATE OR DELETE ON effect_attempts
    FOR EACH ROW EXECUTE FUNCTION effect_attempts_append_only();

-- Wake idle workers at once.  Statement level: a bulk insert is one NOTIFY.
CREATE OR REPLACE FUNCTION effect_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('effect_outbox', '');
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS effect_outbox_notify_ins ON effect_outbox;

CREATE TRIGGER effect_outbox_notify_ins
    AFTER INSERT ON effect_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION effect_outbox_notify();

-- The approval gate (docs/design.md, "The approval gate").  A new effect is
-- accepted only for a run that may still act:
--   - `processing` (the execution working on it; a plain INSERT or
--     outbox_enqueue cannot say which execution it is, the CAS functions do);
--   - `approved` by this very transaction: the lease holder's
--     approve-by-exception (outbox_transition_run to approved and
--     outbox_enqueue in one statement), an operator's replacement
--     (outbox_replace), or outbox_consume_approval, whose effects must be
--     exactly the ones the human saw (type, target and payload of the
--     approval's proposed_effects).
-- Every other state (awaiting_human, approved earlier, completed,
-- failed_retryable, failed_terminal) is refused with SQLSTATE 55000
-- (object_not_in_prerequisite_state) and a message naming the run and its
-- state.  "This transaction" is the run row's xmin: no producer function
-- can write a run row that is not processing (a GUC or a temporary table,
-- which a producer can set or create itself, would not be a proof).  An
-- insert that would only repeat an existing (key, type, target) passes: it
-- adds nothing (ON CONFLICT DO NOTHING returns the existing row, a plain
-- INSERT gets 23505).
CREATE OR REPLACE FUNCTION outbox_effect_gate() RETURNS trigger
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

DROP TRIGGER IF EXISTS effect_outbox_gate ON effect_outbox;
CREATE TRIGGER effect_outbox_gate
    BEFORE INSERT ON effect_outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_effect_gate();

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    effect_attempts_append_only(),
    effect_outbox_notify(),
    outbox_effect_gate()
    FROM PUBLIC;

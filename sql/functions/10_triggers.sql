-- SPDX-License-Identifier: ISC
-- functions/10_triggers.sql: what runs on every producer insert.

-- A new effect's live row, and the wake-up of idle workers.  Statement
-- level, from the rows the statement inserted: a bulk insert is one more
-- INSERT and one NOTIFY, not a trigger call per row.  ON CONFLICT DO
-- NOTHING rows that added nothing are not among them.
--
-- SECURITY DEFINER without SET search_path, unlike every other definer
-- function here: setting the path on each call cost a producer's one-row
-- INSERT about 5 %.  Instead every name it uses is schema-qualified (the
-- transition table is the statement's own and is found before any table),
-- and it uses no operator, so nothing in the caller's path is ever reached.
CREATE OR REPLACE FUNCTION effect_outbox_queue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO public.effect_live (effect_id, effect_type, created_at, available_at)
    SELECT n.effect_id, n.effect_type, n.created_at, n.available_at FROM new_effects n;
    PERFORM pg_catalog.pg_notify('effect_outbox', '');
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS effect_outbox_queue ON effect_outbox;
CREATE TRIGGER effect_outbox_queue
    AFTER INSERT ON effect_outbox REFERENCING NEW TABLE AS new_effects
    FOR EACH STATEMENT EXECUTE FUNCTION effect_outbox_queue();
DROP FUNCTION IF EXISTS effect_outbox_notify();

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
--
-- The state checked is the run row's: a processing run whose effects have
-- all finished is not settled here (that would cost every insert a probe
-- of the run's effects); outbox_enqueue settles it first.
CREATE OR REPLACE FUNCTION outbox_effect_gate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    st text;
    ours boolean;
    owner text;
    me xid := pg_current_xact_id()::xid;
BEGIN
    -- Another producer login's run first, with no lock and no word about
    -- it: this trigger runs before row-level security, so it lets the row
    -- through for the INSERT policy to refuse (42501, exactly as for a key
    -- that names no run).  A state or an existing (type, target) of that
    -- run must never show in the answer, nor its locks in how long the
    -- answer takes.  A run's owner never changes.
    SELECT w.owner_role INTO owner
      FROM workflow_runs w WHERE w.idempotency_key = NEW.idempotency_key;
    -- (A login that is also a worker passes the staff policy, which sees
    -- every run anyway: the gate below holds for it.)
    IF NOT FOUND OR (NOT outbox_run_is_mine(owner)
                     AND NOT pg_has_role(session_user, 'outbox_dispatcher', 'MEMBER')) THEN
        RETURN NEW;                     -- the policy or the foreign key refuses it
    END IF;
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
    effect_outbox_queue(),
    outbox_effect_gate()
    FROM PUBLIC;

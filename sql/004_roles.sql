-- 004_roles.sql: least-privilege roles.  They are NOLOGIN groups: grant
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

-- Nothing by default: functions are executable by PUBLIC unless revoked.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC;

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
GRANT EXECUTE ON FUNCTION
    outbox_claim_run(text, text, uuid, integer),
    outbox_renew_run(text, uuid, bigint, integer),
    outbox_transition_run(text, uuid, bigint, text, jsonb),
    outbox_create_approval(text, uuid, bigint, bytea, text[], integer, jsonb, text, jsonb),
    outbox_peek_approval(bytea),
    outbox_consume_approval(bytea, text, text),
    outbox_enqueue(text, text, text, jsonb, jsonb, integer),
    outbox_cancel(uuid, text, text)
    TO outbox_producer;

-- Dispatcher: read what it sends, call its functions.  No table writes of
-- its own; no access to approvals at all.
GRANT SELECT ON effect_outbox, outbox_control, outbox_providers TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION
    outbox_lease(uuid, text, integer, integer, text[], boolean),
    outbox_mark_sending(uuid, uuid[], boolean, text[], integer, uuid),
    outbox_renew(uuid, uuid[], integer, integer),
    outbox_release(uuid, uuid[], bigint),
    outbox_complete(uuid, text, jsonb),
    outbox_fail_invalid(uuid, jsonb),
    outbox_reap(text, integer),
    outbox_register_providers(text[], text[]),
    outbox_fail_unknown_types(integer, integer)
    TO outbox_dispatcher;

-- Operator: everything the others can do, plus reading the whole record
-- (never the token hashes) and the kill switch.
GRANT outbox_producer, outbox_dispatcher TO outbox_operator;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO outbox_operator;
REVOKE SELECT ON approvals FROM outbox_operator;
GRANT SELECT (approval_id, idempotency_key, allowed_decisions, expires_at, consumed_at,
              decision, approver_subject, approver_audience, proposed_effects, created_at)
    ON approvals TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_kill_switch_set(boolean, text, text) TO outbox_operator;

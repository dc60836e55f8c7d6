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

-- Nobody may call these but the roles named here.
REVOKE EXECUTE ON FUNCTION
    effect_attempts_append_only(),
    effect_outbox_notify()
    FROM PUBLIC;

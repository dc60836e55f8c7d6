-- 011_inflight_list.sql: the kill switch's list of effects in flight reads
-- indexes again, not the whole table.
--
-- Since 010 the index of rows in flight only holds `sending` rows with a
-- send_deadline (every row outbox_mark_sending moves there has one), so
-- that outbox_complete cannot pick it.  outbox_kill_switch_set's list
-- (`state = 'sending'`) then read the whole outbox, on a large one half a
-- second or more, while holding the kill-switch lock that every
-- outbox_mark_sending waits for.  A `sending` row without a deadline only
-- exists if someone set the state by hand; a second partial index holds
-- exactly those (empty in practice, so it costs nothing to keep), and the
-- list reads both: still every row in flight, from two index scans.
-- `outboxctl status` counts `sending` rows the same way.

CREATE INDEX effect_outbox_sending_nodeadline_idx ON effect_outbox (effect_id)
    WHERE state = 'sending' AND send_deadline IS NULL;

CREATE OR REPLACE FUNCTION outbox_kill_switch_set(p_enabled boolean, p_operator text, p_reason text)
RETURNS TABLE (effect_id uuid, effect_key text, effect_type text, target text,
               worker text, sending_since timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF p_operator IS NULL OR p_operator = '' OR p_reason IS NULL OR p_reason = '' THEN
        RAISE EXCEPTION 'outbox_kill_switch_set: operator and reason are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(outbox_kill_switch_lock_key());
    UPDATE outbox_control c
       SET enabled = p_enabled, changed_by = p_operator, reason = p_reason, changed_at = now()
     WHERE c.id = 1;
    INSERT INTO outbox_control_history (enabled, changed_by, reason)
    VALUES (p_enabled, p_operator, p_reason);
    IF p_enabled THEN
        PERFORM pg_notify('effect_outbox', 'kill-switch-on');
    END IF;
    RETURN QUERY
    SELECT i.effect_id, i.effect_key, i.effect_type, i.target, i.lease_worker, i.sending_since
      FROM (SELECT o.effect_id, o.effect_key, o.effect_type, o.target, o.lease_worker, o.sending_since
              FROM effect_outbox o WHERE o.state = 'sending' AND o.send_deadline IS NOT NULL
            UNION ALL
            SELECT o.effect_id, o.effect_key, o.effect_type, o.target, o.lease_worker, o.sending_since
              FROM effect_outbox o WHERE o.state = 'sending' AND o.send_deadline IS NULL) i
     ORDER BY i.sending_since;
END $$;

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
--
-- The decision is evidence like any provider call: a history row with
-- outcome operator_sent / operator_not_sent and no lease owner (so it
-- never collides with a worker's row for the same attempt).  --sent also
-- takes the effect out of the live queue, in the same statement, with the
-- row that finishes it (the effect's last status kept, as before).
CREATE OR REPLACE FUNCTION outbox_resolve_unknown(p_effect_id uuid, p_sent boolean, p_operator text,
                                       p_reason text, p_provider_id text DEFAULT NULL)
RETURNS TABLE (applied boolean, state text, idempotency_key text, provider_id text,
               run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    b effect_outbox%ROWTYPE;
    l effect_live%ROWTYPE;
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

    SELECT * INTO b FROM effect_outbox x WHERE x.effect_id = p_effect_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO l FROM effect_live x WHERE x.effect_id = p_effect_id FOR UPDATE;
    IF NOT FOUND OR l.state <> 'unknown' THEN
        PERFORM outbox_settle_runs(ARRAY[b.idempotency_key]);
        RETURN QUERY SELECT false, o.state, o.idempotency_key, o.provider_id, w.state
                       FROM outbox_effects o
                       JOIN workflow_runs w ON w.idempotency_key = o.idempotency_key
                      WHERE o.effect_id = p_effect_id;
        RETURN;
    END IF;

    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES (CASE WHEN p_sent THEN 'resolve_sent' ELSE 'resolve_not_sent' END,
            b.effect_id, b.idempotency_key, p_operator, p_reason,
            jsonb_build_object('from_state', l.state, 'attempts', l.attempts,
                               'provider_id', nullif(p_provider_id, ''),
                               'last_error', l.last_error))
    RETURNING action_id INTO act;

    IF p_sent THEN
        pid := coalesce(nullif(p_provider_id, ''), l.provider_id, 'operator:' || act);
        WITH done AS (
            DELETE FROM effect_live x WHERE x.effect_id = l.effect_id RETURNING x.*),
        verdict AS (
            INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                        started_at, outcome_class, provider_id, error_text,
                                        cas_applied)
            SELECT d.effect_id, d.created_at, d.attempts, NULL, 'operator:' || p_operator, 'operator', now(),
                   'operator_sent', pid, p_reason, true
              FROM done d)
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, provider_status, cas_applied, state,
                                    last_provider_id, retry_base)
        SELECT d.effect_id, d.created_at, d.attempts, NULL, 'operator:' || p_operator, 'operator', now(),
               d.last_status, true, 'completed', pid, d.retry_base
          FROM done d;
    ELSE
        -- Attempts are not reset (attempt numbers in the log stay unique);
        -- the retry budget starts again from here.
        UPDATE effect_live x
           SET state = 'pending', available_at = now(), retry_base = x.attempts,
               lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL,
               sending_since = NULL, updated_at = now()
         WHERE x.effect_id = l.effect_id;
        INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                    started_at, outcome_class, provider_id, error_text,
                                    cas_applied)
        VALUES (l.effect_id, l.created_at, l.attempts, NULL, 'operator:' || p_operator, 'operator', now(),
                'operator_not_sent', NULL, p_reason, true);
        PERFORM pg_notify('effect_outbox', '');
    END IF;

    -- The run as its effects now make it (completed with its last effect).
    PERFORM outbox_settle_runs(ARRAY[b.idempotency_key]);
    RETURN QUERY SELECT true, CASE WHEN p_sent THEN 'completed' ELSE 'pending' END,
                        b.idempotency_key, CASE WHEN p_sent THEN pid ELSE l.provider_id END,
                        w.state
                   FROM workflow_runs w WHERE w.idempotency_key = b.idempotency_key;
END $$;

-- Put a failed effect back with the same key, behind the gate (outbox_requeue reaches
-- it; outbox_requeue_failed_since skips such effects, below).  A failed
-- effect lives in the history only: it gets a new live row, due now, with
-- the attempts and errors of the row that finished it and a fresh retry
-- budget, and the history a row saying who requeued it (no call, no
-- outcome: resolution 'requeued').  Its run goes back from failed_terminal
-- to approved when no other effect of it is failed.  The body row, locked
-- here, is what two requeues of one effect (or a requeue and a prune or a
-- replacement) queue on.  Returns the run's state, or NULL when the effect
-- is not failed (nothing changed).
CREATE OR REPLACE FUNCTION outbox_requeue_locked(p_effect_id uuid, p_operator text, p_reason text,
                                                 p_detail jsonb)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    b effect_outbox%ROWTYPE;
    h effect_history%ROWTYPE;
    run_before text;
    run_after text;
BEGIN
    SELECT * INTO b FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM outbox_operator_gate('outbox_requeue', b.idempotency_key);
    IF EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id) THEN
        RETURN NULL;
    END IF;
    SELECT * INTO h FROM effect_history x
     WHERE x.effect_id = b.effect_id AND x.created_at = b.created_at AND x.state IS NOT NULL
     ORDER BY x.history_id DESC LIMIT 1;
    IF NOT FOUND OR h.state <> 'failed' THEN
        RETURN NULL;
    END IF;

    -- The run as its effects have it before this one moves (an effect that
    -- failed makes it failed_terminal), locked: effects first, then runs.
    PERFORM outbox_settle_runs(ARRAY[b.idempotency_key]);
    SELECT w.state INTO run_before FROM workflow_runs w
     WHERE w.idempotency_key = b.idempotency_key FOR UPDATE;

    INSERT INTO effect_live (effect_id, effect_type, created_at, state, available_at, attempts,
                             retry_base, provider_id, last_error_class, last_error, last_status,
                             updated_at)
    VALUES (b.effect_id, b.effect_type, b.created_at, 'pending', now(), h.attempt, h.attempt,
            h.last_provider_id, h.last_error_class, h.last_error, h.provider_status, now());
    INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, source,
                                started_at, outcome_class, error_text, cas_applied, resolution,
                                last_error_class)
    VALUES (b.effect_id, b.created_at, h.attempt, NULL, 'operator:' || p_operator, 'operator',
            now(), NULL, p_reason, true, 'requeued', h.last_error_class);

    UPDATE workflow_runs w
       SET state = 'approved', version = w.version + 1, failure_reason = NULL, updated_at = now()
     WHERE w.idempotency_key = b.idempotency_key
       AND w.state = 'failed_terminal'
       AND NOT EXISTS (SELECT 1 FROM effect_outbox e
                        WHERE e.idempotency_key = w.idempotency_key
                          AND e.effect_id <> b.effect_id
                          AND outbox_effect_state(e.effect_id) = 'failed')
    RETURNING w.state INTO run_after;

    INSERT INTO operator_actions (action, effect_id, run_key, operator, reason, detail)
    VALUES ('requeue', b.effect_id, b.idempotency_key, p_operator, p_reason,
            coalesce(p_detail, '{}'::jsonb)
            || jsonb_build_object('from_state', 'failed', 'attempts', h.attempt,
                                  'last_error_class', h.last_error_class,
                                  'last_error', h.last_error,
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
    b effect_outbox%ROWTYPE;
    st text;
    cls text;
    rs text;
BEGIN
    PERFORM outbox_op_check('outbox_requeue', p_operator, p_reason);
    SELECT * INTO b FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT o.state, o.last_error_class INTO st, cls FROM outbox_effects o
     WHERE o.effect_id = p_effect_id;
    IF st IS DISTINCT FROM 'failed' THEN
        PERFORM outbox_settle_runs(ARRAY[b.idempotency_key]);
        RETURN QUERY SELECT false, st, b.idempotency_key, cls, w.state
                       FROM workflow_runs w WHERE w.idempotency_key = b.idempotency_key;
        RETURN;
    END IF;
    rs := outbox_requeue_locked(b.effect_id, p_operator, p_reason, NULL);
    PERFORM pg_notify('effect_outbox', '');
    RETURN QUERY SELECT true, 'pending'::text, b.idempotency_key, cls, rs;
END $$;

-- Requeue every failed effect since a time, skipping effects whose run the
-- gate refuses.  The failures are the history's finishing rows that ended
-- since then (its BRIN index on ended_at), each still the effect's last
-- word: no later finishing row, no live row.
CREATE OR REPLACE FUNCTION outbox_requeue_failed_since(p_since timestamptz, p_operator text,
                                                       p_reason text)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               last_error_class text, run_state text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o record;
    rs text;
    n integer := 0;
BEGIN
    PERFORM outbox_op_check('outbox_requeue_failed_since', p_operator, p_reason);
    IF p_since IS NULL THEN
        RAISE EXCEPTION 'outbox_requeue_failed_since: a start time is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR o IN SELECT b.effect_id, b.idempotency_key, b.effect_type, b.target, h.last_error_class
               FROM effect_history h
               JOIN effect_outbox b ON b.effect_id = h.effect_id
              WHERE h.state = 'failed' AND h.ended_at >= p_since
                AND h.last_error_class IS DISTINCT FROM 'cancelled'
                AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = h.effect_id)
                AND NOT EXISTS (SELECT 1 FROM effect_history later
                                 WHERE later.effect_id = h.effect_id
                                   AND later.created_at = h.created_at
                                   AND later.state IS NOT NULL
                                   AND later.history_id > h.history_id)
                AND outbox_operator_refusal(b.idempotency_key) IS NULL
              ORDER BY h.ended_at, b.effect_id
                FOR NO KEY UPDATE OF b LOOP
        -- NULL: it moved between the scan and the lock.
        rs := outbox_requeue_locked(o.effect_id, p_operator, p_reason,
                                    jsonb_build_object('failed_since', p_since));
        CONTINUE WHEN rs IS NULL;
        n := n + 1;
        effect_id := o.effect_id;
        idempotency_key := o.idempotency_key;
        effect_type := o.effect_type;
        target := o.target;
        last_error_class := o.last_error_class;
        run_state := rs;
        RETURN NEXT;
    END LOOP;
    IF n > 0 THEN
        PERFORM pg_notify('effect_outbox', '');
    END IF;
END $$;

-- Re-run protocol step 3: a replacement is a new business event.  A new
-- run under the key the operator brings from the source system (never a
-- made-up suffix), linked by replaces_key, already approved (the
-- operator is the approver), and its effect, linked by replaces_effect,
-- inserted as a producer's is (so its live row is made and the workers
-- are notified).  The original is not touched.
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
    st text;
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

    -- FOR SHARE: a finished original cannot be put back on the queue
    -- (requeue locks the same row) while its replacement is made.
    SELECT * INTO o FROM effect_outbox x WHERE x.effect_id = p_effect_id FOR SHARE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_new_key = o.idempotency_key THEN
        RAISE EXCEPTION 'outbox_replace: the new key must differ from the original run''s key'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    st := outbox_effect_state(o.effect_id);

    PERFORM outbox_settle_runs(ARRAY[p_new_key]);
    SELECT * INTO r FROM workflow_runs w WHERE w.idempotency_key = p_new_key;
    IF FOUND THEN
        SELECT x.effect_id INTO nid FROM effect_outbox x
         WHERE x.idempotency_key = p_new_key AND x.replaces_effect = o.effect_id;
        IF r.replaces_key = o.idempotency_key AND nid IS NOT NULL THEN
            RETURN QUERY SELECT 'exists'::text, outbox_effect_state(nid), nid, p_new_key,
                                o.idempotency_key;
        ELSE
            RETURN QUERY SELECT 'key_taken'::text, r.state, NULL::uuid, p_new_key, o.idempotency_key;
        END IF;
        RETURN;
    END IF;
    IF st IN ('pending', 'sending', 'unknown') THEN
        RETURN QUERY SELECT 'wrong_state'::text, st, NULL::uuid, p_new_key, o.idempotency_key;
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
            jsonb_build_object('original_state', st, 'new_key', p_new_key,
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

-- How many open effects of a month may linger when prune finishes the
-- month around them (their history rows are copied, under the history's
-- exclusive lock, into the month's new partition).
CREATE OR REPLACE FUNCTION outbox_prune_linger_max() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1000 $$;

-- The bodies of the month [p_lo, p_hi) that linger: the open effects
-- (still in effect_live) and the originals an open replacement of the
-- month keeps (the foreign key).  At most outbox_prune_linger_max() + 1
-- of them, else NULL: too many to finish the month around.
CREATE OR REPLACE FUNCTION outbox_prune_lingering(p_lo timestamptz, p_hi timestamptz)
RETURNS uuid[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH RECURSIVE open AS (
        SELECT b.effect_id, b.replaces_effect FROM effect_outbox b
         WHERE b.created_at >= p_lo AND b.created_at < p_hi
           AND EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)
        UNION
        SELECT o.effect_id, o.replaces_effect
          FROM effect_outbox o JOIN open ON o.effect_id = open.replaces_effect
         WHERE o.created_at >= p_lo AND o.created_at < p_hi)
    SELECT CASE WHEN count(*) <= outbox_prune_linger_max()
                THEN coalesce(array_agg(effect_id), '{}') END
      FROM (SELECT effect_id FROM open LIMIT outbox_prune_linger_max() + 1) x
$$;

-- Retention, by whole months.  The history is partitioned by the month an
-- effect was created in; a month goes when every effect of it is finished
-- and nothing in it happened since the cutoff (now() - p_older_than):
--   - the month ended before the cutoff (no new effect can land in it);
--   - at most outbox_prune_linger_max() effects of it are open (still in
--     effect_live: unknown, held back by a scope's pause at 'infinity',
--     or simply not finished yet); those few linger, and do not keep the
--     month's finished effects (see below);
--   - no history row of it ended after the cutoff, but those of the
--     effects that linger;
--   - no effect of it is the original of a replacement that stays (its
--     link would break): a replacement is made later than its original,
--     so months are taken newest first and a replacement in a month
--     pruned in the same pass does not hold its original back.
-- The body rows of such a month are deleted in batches of at most p_batch
-- per call (outboxctl calls it in a loop, one short transaction per call,
-- so the workers never wait behind a long delete; rows someone has locked
-- are skipped this time and keep their month for the next).  effect_outbox
-- cannot be partitioned like the history: the (key, type, target)
-- uniqueness needs one index over every effect kept, and a unique index
-- on a partitioned table must contain the partition key.  Once a month has
-- no body row left, its history partition (the attempts log of those
-- effects with it) is detached and dropped: no DELETE churn, no vacuum
-- debt.  A month whose only bodies left are the few that linger (open
-- effects, and originals such an open replacement keeps) is finished the
-- same way, around them: its partition is detached, a new one for the
-- month takes the history rows of the effects that linger (and every row
-- they write later), and the old one is dropped.  The month is then as
-- small as what lingers, and goes whole once they have finished.  The
-- drop takes the history's exclusive lock for a moment; when that lock
-- is not granted within a second (a long reader), the month is dropped
-- by the next call instead of holding up every worker's
-- completion behind it.  Months whose rows went to the default partition
-- (no partition existed for them) stay.  Returns the number of effects
-- deleted; each call that did something is one operator_actions row.
CREATE OR REPLACE FUNCTION outbox_prune(p_older_than interval, p_batch integer, p_operator text,
                             p_reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    cutoff timestamptz;
    budget integer := p_batch;
    n integer := 0;
    got integer;
    ids uuid[];
    m record;
    open_months timestamptz[];
    ok_months timestamptz[] := '{}';
    empty text[] := '{}';
    dropped text[] := '{}';
    part text;
    blocked boolean;
    old_timeout text;
    lo timestamptz;
    hi timestamptz;
    keep uuid[];
    cols text;
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
    cutoff := now() - p_older_than;
    -- One read of the (small) live queue for the months still open: those
    -- with more open effects than may linger.
    SELECT coalesce(array_agg(x.month), '{}') INTO open_months
      FROM (SELECT date_trunc('month', l.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month
              FROM effect_live l GROUP BY 1
            HAVING count(*) > outbox_prune_linger_max()) x;

    FOR m IN
        SELECT p.name, p.lo, ((p.lo AT TIME ZONE 'UTC') + interval '1 month') AT TIME ZONE 'UTC' AS hi
          FROM (SELECT c.relname::text AS name,
                       to_date(substr(c.relname, 16), 'YYYYMM')::timestamp AT TIME ZONE 'UTC' AS lo
                  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 WHERE i.inhparent = 'effect_history'::regclass
                   AND c.relname ~ '^effect_history_[0-9]{6}$') p
         ORDER BY p.lo DESC
    LOOP
        CONTINUE WHEN m.hi > cutoff OR m.lo = ANY (open_months);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I h WHERE h.ended_at >= $1 '
                       'AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = h.effect_id))',
                       m.name)
           INTO blocked USING cutoff;
        CONTINUE WHEN blocked;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM effect_outbox o JOIN effect_outbox r ON r.replaces_effect = o.effect_id
             WHERE o.created_at >= m.lo AND o.created_at < m.hi
               AND NOT (r.created_at >= m.lo AND r.created_at < m.hi)
               AND NOT (date_trunc('month', r.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                        = ANY (ok_months)));
        ok_months := ok_months || m.lo;

        -- The month's bodies, replacements before their originals (the
        -- foreign key), locked first; then deleted by a statement whose
        -- snapshot is taken with the locks held, so an effect requeued
        -- meanwhile (it held the lock, or committed before we took it) is
        -- seen open and kept.
        WHILE budget > 0 LOOP
            SELECT array_agg(s.effect_id) INTO ids
              FROM (SELECT b.effect_id FROM effect_outbox b
                     WHERE b.created_at >= m.lo AND b.created_at < m.hi
                       AND NOT EXISTS (SELECT 1 FROM effect_outbox r
                                        WHERE r.replaces_effect = b.effect_id)
                       AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)
                     LIMIT budget
                       FOR UPDATE SKIP LOCKED) s;
            EXIT WHEN ids IS NULL;
            DELETE FROM effect_outbox b
             WHERE b.effect_id = ANY (ids)
               AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id);
            GET DIAGNOSTICS got = ROW_COUNT;
            n := n + got;
            budget := budget - got;
            EXIT WHEN got < cardinality(ids);
        END LOOP;

        -- Done when what is left lingers (outbox_prune_lingering).
        keep := outbox_prune_lingering(m.lo, m.hi);
        IF keep IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM effect_outbox b
                            WHERE b.created_at >= m.lo AND b.created_at < m.hi
                              AND NOT (b.effect_id = ANY (keep))) THEN
            empty := empty || m.name;
        END IF;
        EXIT WHEN budget = 0;
    END LOOP;

    -- The drops last: the lock they take is held to the commit.
    IF cardinality(empty) > 0 THEN
        old_timeout := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            LOCK TABLE effect_history IN ACCESS EXCLUSIVE MODE;
            SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO cols
              FROM pg_attribute a
             WHERE a.attrelid = 'effect_history'::regclass AND a.attnum > 0 AND NOT a.attisdropped;
            FOREACH part IN ARRAY empty LOOP
                lo := to_date(substr(part, 16), 'YYYYMM')::timestamp AT TIME ZONE 'UTC';
                hi := (to_date(substr(part, 16), 'YYYYMM')::timestamp + interval '1 month')
                      AT TIME ZONE 'UTC';
                -- Under the lock, with a fresh snapshot (no history row
                -- is being written): every body row left is one that
                -- lingers (a live row always has its body row).
                keep := outbox_prune_lingering(lo, hi);
                CONTINUE WHEN keep IS NULL OR EXISTS (
                    SELECT 1 FROM effect_outbox b
                     WHERE b.created_at >= lo AND b.created_at < hi
                       AND NOT (b.effect_id = ANY (keep)));
                IF cardinality(keep) > 0 THEN
                    -- Nothing to gain when the partition holds only their rows.
                    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I h WHERE NOT (h.effect_id = ANY ($1)))',
                                   part)
                       INTO blocked USING keep;
                    CONTINUE WHEN NOT blocked;
                END IF;
                EXECUTE format('ALTER TABLE effect_history DETACH PARTITION %I', part);
                IF cardinality(keep) > 0 THEN
                    EXECUTE format('ALTER TABLE %I RENAME TO %I', part, part || '_pruned');
                    EXECUTE format('CREATE TABLE %I PARTITION OF effect_history FOR VALUES FROM (%L) TO (%L)',
                                   part, lo, hi);
                    EXECUTE format('INSERT INTO effect_history (%s) SELECT %s FROM %I h '
                                   'WHERE h.effect_id = ANY ($1) ORDER BY h.history_id',
                                   cols, cols, part || '_pruned')
                       USING keep;
                    EXECUTE format('DROP TABLE %I', part || '_pruned');
                ELSE
                    EXECUTE format('DROP TABLE %I', part);
                END IF;
                dropped := dropped || part;
            END LOOP;
            PERFORM set_config('lock_timeout', old_timeout, true);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            -- Waiting for the lock: the next call drops them.
            dropped := '{}';
        END;
    END IF;

    IF n > 0 OR cardinality(dropped) > 0 THEN
        INSERT INTO operator_actions (action, operator, reason, detail)
        VALUES ('prune', p_operator, p_reason,
                jsonb_build_object('deleted', n, 'older_than', p_older_than::text,
                                   'batch', p_batch, 'dropped_partitions', to_jsonb(dropped)));
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
    outbox_prune_linger_max(),
    outbox_prune_lingering(timestamp with time zone, timestamp with time zone),
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

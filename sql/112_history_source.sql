-- SPDX-License-Identifier: ISC
-- 112_history_source.sql: effect_history.source, who wrote the row
-- ('worker', 'reaper', 'reconcile', 'operator', 'producer'), instead of
-- the worker-name patterns ('reaper:NAME', 'operator:NAME', 'cancel')
-- that the completion, the late evidence and the console matched with
-- LIKE.  Every function that writes history rows sets it
-- (sql/functions/); effect_calls keeps no source: only a worker's claim or
-- mark writes its rows.
--
-- Safe under a serving fleet (docs/design.md, "Upgrades under a serving
-- fleet"): the column is added with a constant default, which PostgreSQL
-- stores in the catalogue without touching a row (no rewrite of the
-- history, however big), and its CHECK is added NOT VALID (no scan under
-- the locks).  The history is not small at an upgrade (every call since
-- the last prune), so it is not backfilled here as a whole: only the rows
-- of the effects still live, found through the history's index from the
-- live queue (which is small by design), because those are the rows the
-- completion's late evidence and the reconciliation read the source of.
-- The rest is backfilled after the commit, in short transactions of a
-- few thousand pages each, by `outboxctl migrate`
-- (outbox_history_source_backfill, sql/functions/60_housekeeping.sql),
-- which validates the CHECK once every page is done.  Until then a
-- finished effect's older reaper, operator, reconcile or cancel row reads
-- 'worker'.  Old workers serve throughout: they call the functions, which
-- this migrate replaces with ones that write the column.

ALTER TABLE effect_history ADD COLUMN source text NOT NULL DEFAULT 'worker';
ALTER TABLE effect_history ADD CONSTRAINT effect_history_source_check
    CHECK (source IN ('worker', 'reaper', 'reconcile', 'operator', 'producer')) NOT VALID;

-- Who wrote a row of the history before it had a source, from its other
-- columns: the reaper named itself 'reaper:WORKER', an operator
-- 'operator:NAME', a cancel 'cancel' (the producer's: its run was
-- refused or it cancelled inside the window; an operator's cancel before
-- 112 counts as the producer's too), a reconciliation wrote its verdicts
-- as reconciled_* (and the row that finished the effect with no lease
-- owner); a late acceptance, a failed validation, the sweep and the
-- live-queue migration's final rows are the workers'.
CREATE OR REPLACE FUNCTION outbox_history_source_of(p_worker text, p_lease_owner uuid,
                                                    p_outcome_class text, p_resolution text,
                                                    p_state text)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_worker LIKE 'reaper:%' THEN 'reaper'
        WHEN p_worker LIKE 'operator:%' THEN 'operator'
        WHEN p_worker = 'cancel' THEN 'producer'
        WHEN p_worker IS NULL OR p_worker = 'migration' THEN 'worker'
        WHEN p_resolution IS NOT DISTINCT FROM 'late_accepted' THEN 'worker'
        WHEN p_outcome_class IN ('reconciled_sent', 'reconciled_not_sent', 'reconcile_unknown')
        THEN 'reconcile'
        WHEN p_lease_owner IS NULL AND p_outcome_class IS NULL AND p_state = 'completed'
        THEN 'reconcile'
        ELSE 'worker' END
$$;
REVOKE EXECUTE ON FUNCTION outbox_history_source_of(text, uuid, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_history_source_of(text, uuid, text, text, text)
    TO outbox_dispatcher, outbox_operator;

-- Still append-only, for every role: the one update allowed is the
-- backfill's, which sets a row's source from the default to what its
-- other columns say and changes nothing else (so it can only ever write
-- the value the backfill would).
CREATE OR REPLACE FUNCTION effect_history_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF OLD.source = 'worker'
           AND NEW.source = outbox_history_source_of(OLD.worker, OLD.lease_owner,
                                                     OLD.outcome_class, OLD.resolution, OLD.state)
           AND to_jsonb(NEW) - 'source' = to_jsonb(OLD) - 'source' THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'effect_history is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;

-- The live effects' rows now (index probes from the live queue).
UPDATE effect_history h
   SET source = outbox_history_source_of(h.worker, h.lease_owner, h.outcome_class,
                                         h.resolution, h.state)
  FROM effect_live l
 WHERE h.created_at = l.created_at AND h.effect_id = l.effect_id
   AND outbox_history_source_of(h.worker, h.lease_owner, h.outcome_class, h.resolution,
                                h.state) <> 'worker';

-- The rest after the commit: every partition's pages as they are now
-- (rows written from here on carry their source).
CREATE TABLE outbox_history_backfill (
    part       regclass PRIMARY KEY,
    next_page  bigint NOT NULL DEFAULT 0,
    end_page   bigint NOT NULL
);
INSERT INTO outbox_history_backfill (part, end_page)
SELECT c.oid::regclass, pg_relation_size(c.oid) / current_setting('block_size')::bigint
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'effect_history'::regclass
   AND pg_relation_size(c.oid) > 0;

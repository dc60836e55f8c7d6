-- 013_sweep_reads_no_table.sql: the fleet's sweep no longer reads the
-- whole outbox to tidy expired leases of pending rows.
--
-- outbox_sweep() (007) cleared the lease columns of pending rows whose
-- lease had expired (a worker that leased and died before marking).  Its
-- index went in 009 (a lease had to write no index entry to be HOT), so
-- since then that UPDATE has been a sequential scan of effect_outbox,
-- completed rows and all, once per sweep interval: 368 ms at 200,000 rows
-- on an idle server, ~1 s in the bench's 4-worker run (two of the 2.7 s of
-- PostgreSQL time the sweep took in a 44 s run), ten times that with
-- 2,000,000 completed rows.
--
-- The clearing was tidying, not correctness: outbox_lease() and
-- outbox_fail_unknown_types() treat an expired lease as no lease (so do
-- the sweep's other half and the reaper), the next lease overwrites the
-- columns, and a worker clears its own leases when it stops
-- (outbox_release).  The calls that check only lease_owner (release,
-- fail_invalid, mark's blocked branch) behaved the same before: the
-- clearing ran every 30 s at most.  So it goes; a
-- pending row's lease columns mean something only while lease_expires_at
-- is in the future, and the next lease overwrites them.
--
-- Failing rows of a type nobody serves stays, as before.

CREATE OR REPLACE FUNCTION outbox_sweep(p_worker text, p_grace_seconds integer,
                                        p_every_seconds integer, p_limit integer DEFAULT 500)
RETURNS TABLE (effect_id uuid, effect_type text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF NOT pg_try_advisory_xact_lock(7262935012345678902) THEN
        RETURN;
    END IF;
    UPDATE outbox_sweeps s SET last_run = now(), last_worker = p_worker
     WHERE s.id = 1 AND s.last_run <= now() - make_interval(secs => greatest(p_every_seconds, 0));
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM outbox_fail_unknown_types(p_grace_seconds, p_limit);
END $$;

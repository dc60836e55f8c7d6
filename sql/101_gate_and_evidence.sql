-- SPDX-License-Identifier: ISC
-- 101_gate_and_evidence.sql: what the approval gate, the lease-ownership
-- rules, least-privilege logins and evidence-based resolution of `unknown`
-- effects need of the tables.  Their functions are in sql/functions/.

-- The database role that acted in an operator_actions row, whatever name
-- it gave (session_user: the login role, which SECURITY DEFINER does not
-- change).
ALTER TABLE operator_actions ADD COLUMN db_role text DEFAULT session_user;

-- Lease owners are the proof of a lease: producers and dispatchers do not
-- read them (the functions do).  Every other column stays readable.
DO $$
DECLARE
    cols text;
BEGIN
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'effect_outbox' AND column_name <> 'lease_owner';
    REVOKE SELECT ON effect_outbox FROM outbox_producer, outbox_dispatcher;
    EXECUTE format('GRANT SELECT (%s) ON effect_outbox TO outbox_producer, outbox_dispatcher', cols);
    SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) INTO cols
      FROM information_schema.columns
     WHERE table_schema = 'public' AND table_name = 'workflow_runs' AND column_name <> 'lease_owner';
    REVOKE SELECT ON workflow_runs FROM outbox_producer;
    EXECUTE format('GRANT SELECT (%s) ON workflow_runs TO outbox_producer', cols);
END $$;

-- Every role may read the schema version: a worker checks it on every new
-- connection and leases nothing until the database was migrated far
-- enough.  The table holds versions, names, checksums and times.
GRANT SELECT ON schema_migrations TO outbox_dispatcher, outbox_producer, outbox_operator;

-- How an attempt row resolved an `unknown` effect (NULL: it did not):
-- late_accepted (the provider's acceptance arrived after the reaper gave
-- the attempt up), late_not_sent (proof that nothing left the worker).
-- Nullable, no default, the check NOT VALID: no rewrite, no scan.
ALTER TABLE effect_attempts ADD COLUMN resolution text;
ALTER TABLE effect_attempts ADD CONSTRAINT effect_attempts_resolution_check
    CHECK (resolution IN ('late_accepted', 'late_not_sent')) NOT VALID;

-- Result types changed (outbox_complete returns `resolved`,
-- outbox_reconcile_lease `attempt_age_ms`): CREATE OR REPLACE cannot
-- change them, so the old ones go here, once; sql/functions/ creates the
-- new ones.
DROP FUNCTION IF EXISTS outbox_complete(uuid, text, jsonb);
DROP FUNCTION IF EXISTS outbox_reconcile_lease(uuid, text, text[], integer, integer);

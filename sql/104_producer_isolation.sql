-- SPDX-License-Identifier: ISC
-- 104_producer_isolation.sql: each producer login sees and acts on its own
-- runs only (docs/design.md, "Roles").
--
-- A run claimed through outbox_claim_run belongs to the login that claimed
-- it (session_user: the login role, which neither SECURITY DEFINER nor SET
-- ROLE changes).  Its effects and approvals belong to it through the run.
-- Another producer login can neither read them nor enqueue into the run,
-- renew, transition or cancel it (the producer functions check
-- owner_role; row-level security below filters direct reads and the plain
-- INSERT).  Runs with no owner (created before this migration, or written
-- by an administrator directly) stay visible to every producer, as before;
-- one shared producer login keeps today's behaviour.
--
-- Row-level security binds the producer group only.  The workers and
-- operators have a policy that admits every row, and the functions run as
-- the tables' owner, to whom row-level security does not apply (it is not
-- FORCEd): the workers' lease, send and completion paths are unchanged.

-- Nullable, no default: no rewrite, no scan.
ALTER TABLE workflow_runs ADD COLUMN owner_role text;

GRANT SELECT (owner_role) ON workflow_runs TO outbox_producer, outbox_operator;

ALTER TABLE workflow_runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE effect_outbox ENABLE ROW LEVEL SECURITY;
ALTER TABLE approvals ENABLE ROW LEVEL SECURITY;

CREATE POLICY outbox_producer_own_runs ON workflow_runs FOR SELECT TO outbox_producer
    USING (owner_role IS NULL OR owner_role = session_user);

-- Reading an effect needs its run to be the login's own (or shared): one
-- primary-key probe.
CREATE POLICY outbox_producer_own_effects ON effect_outbox FOR SELECT TO outbox_producer
    USING (EXISTS (SELECT 1 FROM workflow_runs w
                    WHERE w.idempotency_key = effect_outbox.idempotency_key
                      AND (w.owner_role IS NULL OR w.owner_role = session_user)));

-- Inserting one (the plain INSERT path) is checked by the policy
-- outbox_producer_own_inserts, made with its function in
-- sql/functions/20_producer.sql.

CREATE POLICY outbox_producer_own_approvals ON approvals FOR SELECT TO outbox_producer
    USING (EXISTS (SELECT 1 FROM workflow_runs w
                    WHERE w.idempotency_key = approvals.idempotency_key
                      AND (w.owner_role IS NULL OR w.owner_role = session_user)));

-- Workers and operators: every row, as before (their grants still decide
-- what they may do with it).
CREATE POLICY outbox_staff_all_runs ON workflow_runs TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);
CREATE POLICY outbox_staff_all_effects ON effect_outbox TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);
CREATE POLICY outbox_staff_all_approvals ON approvals TO outbox_dispatcher, outbox_operator
    USING (true) WITH CHECK (true);

-- SPDX-License-Identifier: ISC
-- 107_reconcile_requests.sql: an operator's request for a reconcile pass
-- is a row, not a notification (docs/crm.md, "Reconciliation").
--
-- NOTIFY needs no privilege: any login of the database could send the
-- 'reconcile' payload that `outboxctl reconcile` sent, and every worker
-- asked every provider about every `unknown` effect at once, each lookup
-- carrying the provider's credential.  A request is now the time in this
-- one row, which only the owner writes (outbox_request_reconcile, for the
-- operator role); the lease of a reconcile pass re-asks an effect early
-- only when it was last asked before that time.  The notification stays
-- a wake-up and nothing more.
CREATE TABLE outbox_reconcile_requests (
    id            smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    requested_at  timestamptz NOT NULL DEFAULT '-infinity',
    requested_by  text
);
INSERT INTO outbox_reconcile_requests (id) VALUES (1);
GRANT SELECT ON outbox_reconcile_requests TO outbox_dispatcher, outbox_operator;

-- The partition maker makes any range it is given (24,000 months ran
-- until the statement timeout): the workers and operators call
-- outbox_history_months (sql/functions/60_housekeeping.sql), which bounds
-- it; migrations and the housekeeping pass, as the owner, call it as before.
REVOKE EXECUTE ON FUNCTION outbox_history_partitions(timestamptz, timestamptz)
    FROM outbox_dispatcher, outbox_operator;

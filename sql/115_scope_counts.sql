-- SPDX-License-Identifier: ISC
-- 115_scope_counts.sql: two counts of the scopes kept exact without a
-- wait that could close a cycle of locks.
--
-- outbox_scope_held_log, the rows a lease parked
-- for a paused scope whose row another transaction held at that moment,
-- counted here instead of in outbox_scopes.held_total.  The lease takes
-- the paused scopes' rows without waiting (SKIP LOCKED): it runs inside a
-- claim that may already hold a limit's bucket, and a mark locks the
-- scopes in key order, so a lease that waited for a paused scope's row
-- behind a mark waiting for that bucket would be a deadlock.
-- outbox_scope_status adds the log to held_total; the sweep folds it in
-- (sql/functions/33_scopes.sql, outbox_scope_held_fold).
--
-- effect_calls.drawn, what each row of a claim drew from the limits'
-- buckets, by effect id ({"<id>": ["host:api.example", "type:http"]}):
-- a claimed row given back unsent (outbox_unclaim: to be marked, the
-- worker stopping, its connection lost) is refunded what it drew, and the
-- claim's repeat tells each row's unpaid hosts as the first call did.
--
-- Safe under a serving fleet (docs/design.md, "Upgrades under a serving
-- fleet"): a new, empty table and a nullable column without a default (the
-- catalogue alone); old workers call the functions, which this migrate
-- replaces.  A call claimed before it has no record: its rows are not
-- refunded, as before.

CREATE TABLE outbox_scope_held_log (
    kind  text NOT NULL,
    value text NOT NULL,
    n     bigint NOT NULL CHECK (n > 0),
    at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_scope_held_log_scope_idx ON outbox_scope_held_log (kind, value);

ALTER TABLE effect_calls ADD COLUMN drawn jsonb;

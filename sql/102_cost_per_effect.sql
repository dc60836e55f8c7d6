-- SPDX-License-Identifier: ISC
-- 102_cost_per_effect.sql: fewer index entries and more in-place (HOT)
-- updates per effect (docs/performance.md, "Cost per effect in the
-- database").

-- A run is updated when its last effect completes (outbox_advance_runs).
-- With the default fillfactor (100) its page is full, so the new version
-- goes to another page and adds a primary-key entry; the room left here
-- lets most of those updates stay on the row's page (HOT).  It applies to
-- pages written from now on: no rewrite.
ALTER TABLE workflow_runs SET (fillfactor = 70);

-- One index on (effect_id, attempt, ...) instead of two: the unique index
-- that makes "one row per provider call of one lease owner" (a completion
-- batch sent again after a lost connection is not counted twice) now holds
-- every row, so it also serves every lookup by effect and attempt (the
-- reaper's rows, reconciliation, `outboxctl unknown list`), which the
-- separate (effect_id, attempt) index did.  The rows the partial index left
-- out (the reaper's, those without a worker or a lease owner) get a NULL
-- in a key column, and NULLs are never equal: they stay free of the
-- constraint, as before.  Rows the old index held have the same key here
-- (the fourth column is true for all of them), so the old one's rows
-- cannot violate the new one.  INSERT ... ON CONFLICT names it by its
-- columns and expression (sql/functions/30_dispatcher.sql).
DROP INDEX effect_attempts_call_uq;
DROP INDEX effect_attempts_effect_idx;
CREATE UNIQUE INDEX effect_attempts_call_uq ON effect_attempts
    (effect_id, attempt, lease_owner, (CASE WHEN worker NOT LIKE 'reaper:%' THEN true END));

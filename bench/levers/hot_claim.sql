-- SPDX-License-Identifier: ISC
-- bench/levers/hot_claim.sql: the claim as a HOT update (a lever measured
-- by bench/levers.sh, not a migration).
--
-- PostgreSQL updates a row in place, without new index entries (HOT), only
-- when no indexed column changes value, and a column named in a partial
-- index's predicate counts.  Every index that names `state` makes
-- pending -> sending a full update: a new entry in the primary key, the
-- unique key, the BRIN and the sending index.  Here the partial indexes
-- name a generated column whose value is the same for pending and sending
-- ('open'), so the claim leaves every indexed value as it was.  What it
-- gives up: the reaper's index of rows in flight by deadline (the reaper
-- would need another way to find them, e.g. one row per claim call), and
-- every reader that finds rows by `state` through a partial index would
-- have to name `stage` as well.
ALTER TABLE effect_outbox ADD COLUMN stage text GENERATED ALWAYS AS
    (CASE WHEN state IN ('pending', 'sending') THEN 'open' ELSE state END) STORED;
DROP INDEX effect_outbox_due_idx, effect_outbox_unknown_idx, effect_outbox_done_idx,
    effect_outbox_sending_idx, effect_outbox_sending_nodeadline_idx;
CREATE INDEX effect_outbox_due_idx ON effect_outbox (available_at, effect_id) WHERE stage = 'open';
CREATE INDEX effect_outbox_unknown_idx ON effect_outbox (created_at) WHERE stage = 'unknown';
CREATE INDEX effect_outbox_done_idx ON effect_outbox (completed_at) WHERE stage IN ('completed', 'failed');

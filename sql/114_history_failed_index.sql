-- SPDX-License-Identifier: ISC
-- 114_history_failed_index.sql: effect_history_failed_idx, the history's
-- failing rows by effect id (a partial index, WHERE state = 'failed'), so
-- that the console's failed effects of a window are a walk of the few
-- rows that failed, newest first, stopped at the page's limit, instead of
-- every history row that ended in the window (docs/performance.md, "The
-- operator's reads and the console's pages").
--
-- Safe under a serving fleet (docs/design.md, "Upgrades under a serving
-- fleet"): under the locks only the partitioned index is made, ON ONLY the
-- parent, which PostgreSQL records in the catalogue without reading a row
-- (it stays invalid until every partition has its own).  A month made
-- from now on (outbox_history_partitions) gets its part as it is created,
-- empty.  The partitions that exist get theirs after the commit, each
-- built CONCURRENTLY (the fleet goes on writing the history while it is
-- read) and then attached, by `outboxctl migrate`
-- (outbox_history_index_pending, sql/functions/60_housekeeping.sql); the
-- last one attached makes the parent valid.  Until then the console reads
-- a partition of the window without its part through its (created_at,
-- effect_id) index.

CREATE INDEX effect_history_failed_idx ON ONLY effect_history (effect_id)
    WHERE state = 'failed';

-- 010_sending_index.sql: the index of rows in flight serves the reaper
-- only, not outbox_complete.
--
-- outbox_complete's UPDATE names its rows by effect_id and checks
-- state = 'sending'; that check let the planner read the partial index of
-- rows in flight for it instead of probing the primary key (statistics say
-- that index holds a handful of rows), the whole index on every call.
-- While a long transaction holds vacuum back, that index keeps a dead
-- entry for every effect ever sent: measured 21,000 pages and 58 ms per
-- call, and throughput one third of the fresh table's.  With a predicate
-- that queries by key do not imply (send_deadline IS NOT NULL, true of
-- every `sending` row), only the reaper (send_deadline < now()) can use it.
-- The kill switch's list of effects in flight and `outboxctl status` count
-- `sending` rows exactly as before (by scanning, on a rare operator path).

DROP INDEX effect_outbox_sending_idx;
CREATE INDEX effect_outbox_sending_idx ON effect_outbox (send_deadline)
    WHERE state = 'sending' AND send_deadline IS NOT NULL;

-- SPDX-License-Identifier: ISC
-- bench/ceiling.sql: the database ceiling for bench/run.sh.
--
-- One pgbench transaction = what one dispatcher worker does for one batch
-- at its defaults ([dispatcher] claim = true), through the same SQL
-- functions and as the same two autocommit statements (two commits), with
-- no provider call in between:
--   outbox_claim    (lease and CAS to `sending` under the kill-switch lock in
--                    one call, batch of :batch rows like [dispatcher]
--                    batch_size, with a call token as the worker passes one)
--   outbox_complete_sending (the history row that finishes each effect,
--                    the live row gone, in one statement; what a worker
--                    calls for a batch whose rows all apply)
-- Each pgbench client is one lease owner.  Variables: batch (rows per
-- claim).  The worker passes its outcomes as a JSON array; so does this
-- script.  outbox_claim returns the attempts made before this one; the
-- outcome names this attempt (+ 1).  started_ms_ago is a day: the
-- completion clamps a send's start to when its row went to `sending` (the
-- claim), which is the start this script would report.
\set batch 64
SELECT quote_literal(coalesce(jsonb_agg(jsonb_build_object(
           'effect_id', effect_id, 'attempt', attempts + 1, 'started_ms_ago', 86400000,
           'outcome', 'accepted', 'next_state', 'completed', 'retry_delay_ms', 0,
           'status', 200, 'provider_id', 'x')), '[]')::text) AS results
  FROM outbox_claim(('00000000-0000-4000-8000-' || lpad(':client_id', 12, '0'))::uuid,
                    'pgbench-:client_id', :batch, 30, '{http}', true, '{http}',
                    gen_random_uuid()) \gset
SELECT count(*) FROM outbox_complete_sending(('00000000-0000-4000-8000-' || lpad(':client_id', 12, '0'))::uuid,
                                             'pgbench-:client_id', :results::jsonb);

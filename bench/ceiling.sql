-- SPDX-License-Identifier: ISC
-- bench/ceiling.sql: the database ceiling for bench/run.sh.
--
-- One pgbench transaction = what one dispatcher worker does for one batch,
-- through the same SQL functions and as the same three autocommit
-- statements (three commits), with no provider call in between:
--   outbox_lease       (batch of :batch rows, like [dispatcher] batch_size)
--   outbox_mark_sending (the CAS to `sending` under the kill-switch lock, with a
--                        call token as the worker passes one)
--   outbox_complete    (attempts-log rows + CAS to `completed` + run update)
-- Each pgbench client is one lease owner.  Variables: batch (rows per
-- lease).  The worker passes its ids as a uuid[] literal and its outcomes
-- as a JSON array; so does this script.
\set batch 64
SELECT quote_literal(coalesce(array_agg(effect_id)::text, '{}')) AS ids
  FROM outbox_lease(('00000000-0000-4000-8000-' || lpad(':client_id', 12, '0'))::uuid,
                    'pgbench-:client_id', :batch, 30, '{http}', true) \gset
SELECT quote_literal(coalesce(jsonb_agg(jsonb_build_object(
           'effect_id', effect_id, 'attempt', attempts,
           'started_at', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
           'outcome', 'accepted', 'next_state', 'completed', 'retry_delay_ms', 0,
           'status', 200, 'provider_id', 'x')), '[]')::text) AS results
  FROM outbox_mark_sending(('00000000-0000-4000-8000-' || lpad(':client_id', 12, '0'))::uuid,
                           :ids::uuid[], true, '{http}', 30, gen_random_uuid()) \gset
SELECT count(*) FROM outbox_complete(('00000000-0000-4000-8000-' || lpad(':client_id', 12, '0'))::uuid,
                                     'pgbench-:client_id', :results::jsonb);

-- SPDX-License-Identifier: ISC
-- bench/insert.sql: one producer insert (the run exists already), as n8n
-- would commit it.  pgbench -R drives it at a fixed rate; :target is the
-- sink's /lat URL.  The run keys lat-1, lat-2, ... were created beforehand;
-- bench_seq hands them out in order.
INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload)
VALUES ('lat-' || nextval('bench_seq'), 'http', ':target', '{"body": {"event": "bench"}}');

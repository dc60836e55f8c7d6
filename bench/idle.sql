-- SPDX-License-Identifier: ISC
-- bench/idle.sql: one effect at a time.  The pause is far longer than the
-- insert-to-send latency, so each effect finds the worker idle (waiting on
-- LISTEN) and the figure is the wake-up path: NOTIFY -> lease -> mark ->
-- send.
INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload)
VALUES ('lat-' || nextval('bench_seq'), 'http', ':target', '{"body": {"event": "bench"}}');
\sleep 50 ms

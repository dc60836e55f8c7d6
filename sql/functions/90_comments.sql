-- SPDX-License-Identifier: ISC
-- 90_comments.sql: what each table and view is for, as COMMENT ON, so that
-- \d+ in psql, pg_dump and sql/schema.sql (make schema) carry the
-- explanation beside the definition.  Applied after the migrations, like
-- every file here, whenever its text changes; COMMENT ON replaces the
-- previous text and takes only a lock that inserts and updates do not
-- wait for.  A table or view a migration adds gets its comment here
-- (tests/sql/test_sql_schema_file.py checks that every one has one).

-- The effect's path: what the producer wrote, its live state, its history.
COMMENT ON TABLE effect_outbox IS
'What the producer wrote, once per effect: idempotency key, type, target,
payload, hashes, metadata. Never updated. Producers (n8n) insert here;
the statement trigger effect_outbox_queue puts each new row on
effect_live and notifies the workers.';
COMMENT ON TABLE effect_live IS
'The state of an effect still moving (pending, sending, unknown): a
narrow row that the claim rewrites in place (HOT: no indexed column
changes), deleted by the statement that finishes the effect, which
writes its final row to effect_history.';
COMMENT ON TABLE effect_history IS
'Append-only: one row per provider call, reaper or reconciliation
verdict, and per state change without a call; the row that finishes an
effect carries its final state. Partitioned by the effect''s creation
month (effect_history_YYYYMM, made for the current month and the next
three by migrate and housekeeping), so prune detaches and drops whole
months.';
COMMENT ON COLUMN effect_history.source IS
'Who wrote the row: worker (its own provider call, a late answer to it, a
validation failure, the sweep), reaper (a lease that expired while
sending), reconcile (a lookup''s verdict), operator (resolve, requeue,
cancel) or producer (a cancel of the run''s effects). The worker column
names which one. Rows from before migration 112 were given it from the
worker name''s old patterns (outbox_history_source_of).';
COMMENT ON TABLE outbox_history_backfill IS
'The pages of each history partition that migration 112 left for
outbox_history_source_backfill (run by outboxctl migrate after the
commit) to give a source: done when next_page reaches end_page.';
COMMENT ON TABLE effect_history_default IS
'The history''s default partition: rows whose creation month has no
partition of its own (none should: housekeeping makes the months ahead)
land here instead of failing the completion.';
COMMENT ON TABLE effect_calls IS
'One row per claim or mark call while any of its rows may be sending:
which rows it moved to sending and until when, for the reaper and the
kill switch''s in-flight list.';
COMMENT ON TABLE workflow_runs IS
'One row per workflow run (an n8n execution''s idempotency key): its state
(processing, awaiting_human, approved, completed, failed_retryable,
failed_terminal), lease and result. The workers do not write runs when
effects finish: outbox_settle_runs() moves a run as its effects made it,
and every function that reads or changes runs calls it first; read the
state after it.';
COMMENT ON TABLE approvals IS
'The approvals a run waits for: only the SHA-256 of each approval token
is stored, with the decisions it allows, its expiry and, once used, who
decided what and when.';
COMMENT ON TABLE run_claims IS
'Every claim of a run key, for the duplicate-deliveries figure of the
weekly statistics.';
COMMENT ON TABLE operator_actions IS
'Operators'' recorded decisions (resolve, requeue, replace, cancel,
prune): who, what, why, when.';

-- The controls: the kill switch and the scoped pauses and limits.
COMMENT ON TABLE outbox_control IS
'The fleet-wide kill switch: exactly one row, deny by default (a new
database has sends disabled until an operator enables them).';
COMMENT ON TABLE outbox_control_history IS
'Every change of the kill switch: who turned it on or off, why, and when.';
COMMENT ON TABLE outbox_reconcile_requests IS
'An operator''s request for a reconcile pass (outboxctl reconcile): one
row, written only through outbox_request_reconcile. The NOTIFY that
follows only wakes the workers; any login may send one, so it is never
trusted as the request itself.';
COMMENT ON TABLE outbox_scopes IS
'Pauses of one scope (an effect type, a host, a CRM object) and
fleet-wide rate limits per type or host: a token bucket kept in the row,
so that every worker draws on the same budget.';
COMMENT ON TABLE outbox_scope_history IS
'Every change of a scope''s pause or limit: who, what, why, when.';
COMMENT ON TABLE outbox_scope_held_log IS
'Rows a lease parked for a paused scope whose row another transaction
held then, counted here rather than waited for; outbox_scope_status adds
them to held_total and the sweep folds them in.';

-- The workers' own bookkeeping.
COMMENT ON TABLE outbox_claim_repeats IS
'The claim calls a worker repeated or gave up on: a first outbox_claim
call that reaches the server only after its repeat finds its token here
and claims nothing. Rows are removed an hour later.';
COMMENT ON TABLE outbox_providers IS
'Provider names that some worker serves; effects of any other type are
failed as unknown effect type by the workers'' maintenance pass.';
COMMENT ON TABLE outbox_sweeps IS
'When the fleet last swept (reaper, maintenance, partitions), and which
worker did.';
COMMENT ON TABLE outbox_weekly_cache IS
'The current week''s figures for the workers'' metrics, computed by one
worker of the fleet at most every few minutes and kept here, so that
workers do not each aggregate the week''s rows.';
COMMENT ON TABLE schema_migrations IS
'The migrations (sql/NNN_*.sql) applied to this database, with their
checksums (outboxctl migrate).';
COMMENT ON TABLE schema_functions IS
'The function files (sql/functions/*.sql) applied to this database, with
their checksums: a file is applied again when its text changes
(outboxctl migrate).';

-- Views, for reading.
COMMENT ON VIEW outbox_effects IS
'The effect as one row with every column (state, attempts, provider id,
errors ...): effect_outbox joined with its live row or its last history
row. For reading, not for the hot path.';
COMMENT ON VIEW effect_attempts IS
'The provider calls and verdicts of every effect: effect_history without
its rows of state changes made without a call.';
COMMENT ON VIEW outbox_scope_status IS
'Every scope (pause or limit), with the rows it holds back now.';
COMMENT ON VIEW outbox_weekly_stats IS
'Figures per ISO week (duplicate share, approval waits, validation
failures, retries exhausted ...) for the reports of docs/operating.md.';

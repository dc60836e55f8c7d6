/* SPDX-License-Identifier: ISC */
/*
 * worker_sql.c: the text of every statement the worker runs (see
 * worker_sql.h for their names and columns).  The functions they call are
 * defined in sql/functions/; the column lists here are what the callbacks'
 * COL_* indexes count.
 */
#include "worker_sql.h"

#include "migrate.h"

/* The gauges' last column: every scope, as JSON (read only while one is
 * set: outbox_control.scoped). */
#define SCOPES_COLUMN \
	" CASE WHEN (SELECT scoped FROM outbox_control WHERE id = 1) THEN" \
	" (SELECT json_agg(json_build_object('scope', kind || ':' || value, 'paused', paused," \
	" 'rate', coalesce(rate_per_second, 0), 'waiting', waiting, 'held_total', held_total," \
	" 'paused_seconds', CASE WHEN paused THEN extract(epoch FROM now() - paused_at) ELSE 0 END," \
	" 'oldest_held_seconds', coalesce((SELECT extract(epoch FROM now() - min(o.created_at))" \
	" FROM effect_live o WHERE o.held_by = outbox_scope_name(kind, value)" \
	" AND o.state = 'pending'), 0)))" \
	" FROM outbox_scope_status) END"

const struct worker_sql worker_sql[SQL_STATEMENTS] = {
	[SQL_LEASE] = { "outbox_lease",
		"SELECT effect_id, idempotency_key, effect_type, target, payload, payload_hash, "
		"effect_key, attempts, metadata, approved_by, retry_base, available_at, "
		"payload_bytes, metadata_bytes "
		"FROM outbox_lease($1, $2, $3, $4, $5, $6, $7, $8, $9)", 9 },
	[SQL_CLAIM] = { "outbox_claim",
		"SELECT effect_id, idempotency_key, effect_type, target, payload, payload_hash, "
		"effect_key, attempts, metadata, approved_by, retry_base, available_at, "
		"payload_bytes, metadata_bytes, leased_only, check_hosts, due_entries "
		"FROM outbox_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, "
		"p_max_payload_bytes => $11, p_lease_if_scoped => $12, p_type_hosts => $13, "
		"p_repeat => $14)", 14 },
	[SQL_UNCLAIM] = { "outbox_unclaim",
		"SELECT outbox_unclaim($1, $2, $3, $4, $5)", 5 },
	[SQL_UNCLAIM_CALL] = { "outbox_unclaim_call",
		"SELECT outbox_unclaim_call($1, $2)", 2 },
	[SQL_FAIL_INVALID] = { "outbox_fail_invalid",
		"SELECT effect_id FROM outbox_fail_invalid($1, $2)", 2 },
	[SQL_RELEASE] = { "outbox_release",
		"SELECT outbox_release($1, $2, $3)", 3 },
	[SQL_MARK_SENDING] = { "outbox_mark_sending",
		"SELECT effect_id, attempts, blocked, coalesce(held_by, ''),"
		" CASE WHEN held_until IS NULL OR held_until = 'infinity' THEN -1"
		" ELSE greatest(ceil(extract(epoch FROM held_until - now()) * 1000), 0) END"
		" FROM outbox_mark_sending($1, $2, $3, $4, $5, $6, $7)", 7 },
	[SQL_COMPLETE] = { "outbox_complete_sending",
		"SELECT effect_id, true, state, NULL::text FROM outbox_complete_sending($1, $2, $3)", 3 },
	[SQL_COMPLETE_REST] = { "outbox_complete_rest",
		"SELECT effect_id, applied, state, resolved FROM outbox_complete_rest($1, $2, $3)", 3 },
	[SQL_RENEW] = { "outbox_renew",
		"SELECT effect_id FROM outbox_renew($1, $2, $3, $4)", 4 },
	[SQL_RECONCILE_LEASE] = { "outbox_reconcile_lease",
		"SELECT effect_id, idempotency_key, effect_type, target, payload, payload_hash, "
		"effect_key, attempts, attempt_age_ms FROM outbox_reconcile_lease($1, $2, $3, $4, $5)", 5 },
	[SQL_RECONCILE_RECORD] = { "outbox_reconcile_record",
		"SELECT * FROM outbox_reconcile_record($1, $2, $3)", 3 },
	[SQL_REAP] = { "outbox_reap",
		"SELECT effect_id, state, coalesce(lost_worker, '') FROM outbox_reap($1, $2)", 2 },
	[SQL_SWEEP] = { "outbox_sweep",
		"SELECT effect_id, effect_type FROM outbox_sweep($1, $2, $3, $4)", 4 },
	[SQL_REGISTER_PROVIDERS] = { "outbox_register_providers",
		"SELECT outbox_register_providers($1, $2)", 2 },
	[SQL_WEEKLY_FIGURES] = { "outbox_weekly_figures",
		"SELECT duplicate_share, approval_wait_p50_seconds, approval_wait_p95_seconds,"
		" validation_failure_share, automatic_share, retries_exhausted"
		" FROM outbox_weekly_figures($1, $2)", 2 },
	/* The live queue's one index, both ends: the oldest due pending row
	 * (past the rows being sent, which keep their due time), and the
	 * `unknown` rows, parked at available_at = 'infinity'. */
	[SQL_GAUGES_WITH_LAG] = { "gauges",
		"SELECT coalesce((SELECT extract(epoch FROM now() - min(available_at)) FROM effect_live "
		"  WHERE state = 'pending' AND available_at <= now()), 0),"
		" (SELECT count(*) FROM effect_live WHERE available_at = 'infinity' AND state = 'unknown'),"
		" (SELECT enabled FROM outbox_control WHERE id = 1)," SCOPES_COLUMN, 0 },
	[SQL_GAUGES] = { "gauges",
		"SELECT NULL, (SELECT count(*) FROM effect_live"
		"  WHERE available_at = 'infinity' AND state = 'unknown'),"
		" (SELECT enabled FROM outbox_control WHERE id = 1)," SCOPES_COLUMN, 0 },
	[SQL_SCHEMA_VERSION] = { "schema version", MIGRATE_VERSION_SQL, 0 },
	[SQL_RESOLVE_LATE] = { "outbox_resolve_late_accepted",
		"SELECT outbox_resolve_late_accepted($1, $2, $3, $4, $5, $6)", 6 },
};

void worker_query(struct db *db, enum worker_stmt stmt, const char *const *params,
                  db_result_fn cb, void *arg, unsigned flags)
{
	const struct worker_sql *q = &worker_sql[stmt];

	db_query(db, q->text, q->nparams, params, cb, arg, flags);
}

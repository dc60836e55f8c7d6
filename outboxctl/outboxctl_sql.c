/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_sql.c: the text of every statement outboxctl runs (see
 * outboxctl_sql.h for their names and columns).  Each calls one function
 * of sql/functions/; the column lists here are what the callers' column
 * names count.  Times are shown in UTC, to the second (the sends in
 * flight to the millisecond).
 */
#include "outboxctl_sql.h"

#define UTC(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
#define UTC_MS(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
#define IN_FLIGHT_COLUMNS \
	"effect_id, effect_key, effect_type, target, coalesce(worker, ''), " UTC_MS("sending_since")

const struct ctl_sql ctl_sql[CTL_SQL_STATEMENTS] = {
	[CTL_SQL_SWITCH] = { "outbox_read_switch",
		"SELECT enabled, changed_by, reason, " UTC("changed_at") " FROM outbox_read_switch()", 0 },
	/* One statement: the function takes the kill-switch lock, so when it
	 * returns (committed) no send can start, and the list is complete. */
	[CTL_SQL_SWITCH_SET] = { "outbox_kill_switch_set",
		"SELECT " IN_FLIGHT_COLUMNS " FROM outbox_kill_switch_set($1, $2, $3)", 3 },
	[CTL_SQL_STATUS] = { "outbox_read_status",
		"SELECT pending, sending, completed, unknown, failed, oldest_pending_age_seconds, "
		"failed_last_hour, window_hours, enabled, changed_by, reason, " UTC("changed_at") ", "
		"held, oldest_held_age_seconds FROM outbox_read_status()", 0 },
	[CTL_SQL_UNKNOWN_SETTLE] = { "outbox_settle_unknown_runs",
		"SELECT outbox_settle_unknown_runs()", 0 },
	[CTL_SQL_UNKNOWN_LIST] = { "outbox_read_unknown",
		"SELECT effect_id, idempotency_key, effect_key, effect_type, target, attempts, "
		UTC("unknown_since") ", " UTC("created_at") ", last_error_class, last_error, "
		"last_attempt_worker, last_attempt_outcome, last_attempt_status, run_state "
		"FROM outbox_read_unknown()", 0 },
	[CTL_SQL_EFFECT] = { "outbox_read_effect",
		"SELECT effect_id, idempotency_key, effect_type, target, state, attempts, "
		UTC("created_at") ", " UTC("updated_at") ", " UTC("completed_at") ", provider_id, "
		"last_error_class, last_error, last_status, effect_key, run_state "
		"FROM outbox_read_effect($1::uuid)", 1 },
	[CTL_SQL_EFFECT_HISTORY] = { "outbox_read_effect_history",
		"SELECT attempt, worker, " UTC_MS("started_at") ", " UTC_MS("ended_at") ", outcome_class, "
		"provider_status, provider_id, error_text, state "
		"FROM outbox_read_effect_history($1::uuid)", 1 },
	[CTL_SQL_RESOLVE] = { "outbox_resolve_unknown",
		"SELECT applied, state, idempotency_key, coalesce(provider_id, ''), "
		"coalesce(run_state, '') "
		"FROM outbox_resolve_unknown($1::uuid, $2::boolean, $3, $4, $5)", 5 },
	/* An age ("2h") counts back from the database's clock, not this host's. */
	[CTL_SQL_REQUEUE_SINCE_AGO] = { "outbox_requeue_failed_since",
		"SELECT effect_id, idempotency_key, effect_type, target, "
		"coalesce(last_error_class, ''), coalesce(run_state, '') "
		"FROM outbox_requeue_failed_since(now() - $1::interval, $2, $3)", 3 },
	[CTL_SQL_REQUEUE_SINCE_AT] = { "outbox_requeue_failed_since",
		"SELECT effect_id, idempotency_key, effect_type, target, "
		"coalesce(last_error_class, ''), coalesce(run_state, '') "
		"FROM outbox_requeue_failed_since($1::timestamptz, $2, $3)", 3 },
	[CTL_SQL_REQUEUE] = { "outbox_requeue",
		"SELECT applied, state, idempotency_key, coalesce(last_error_class, ''), "
		"coalesce(run_state, '') FROM outbox_requeue($1::uuid, $2, $3)", 3 },
	[CTL_SQL_REPLACE] = { "outbox_replace",
		"SELECT status, state, coalesce(new_effect_id::text, ''), new_key, original_key "
		"FROM outbox_replace($1::uuid, $2, $3, $4, $5, $6::jsonb)", 6 },
	[CTL_SQL_HISTORY_MONTHS] = { "outbox_read_history_months",
		"SELECT outbox_read_history_months()", 0 },
	[CTL_SQL_PRUNE] = { "outbox_prune",
		"SELECT outbox_prune($1::interval, $2::integer, coalesce($3, session_user::text), $4)", 4 },
	[CTL_SQL_CANCEL] = { "outbox_cancel",
		"SELECT outbox_cancel($1::uuid, $2, coalesce($3, session_user::text))", 3 },
	[CTL_SQL_RECONCILE_START] = { "outbox_read_reconcile_start",
		"SELECT clock, reconcilable, others FROM outbox_read_reconcile_start()", 0 },
	/* The request is a row only operators may write; its NOTIFY only
	 * wakes the workers (any login may send one). */
	[CTL_SQL_RECONCILE_NOTIFY] = { "outbox_request_reconcile",
		"SELECT outbox_request_reconcile()", 0 },
	[CTL_SQL_RECONCILE_LEFT] = { "outbox_read_reconcile_remaining",
		"SELECT outbox_read_reconcile_remaining($1::timestamptz)", 1 },
	[CTL_SQL_RECONCILE_VERDICTS] = { "outbox_read_reconcile_verdicts",
		"SELECT history_id, effect_id, coalesce(effect_type, '?'), outcome_class, "
		"coalesce(provider_status::text, ''), coalesce(provider_id, ''), "
		"coalesce(error_text, ''), coalesce(worker, ''), cas_applied "
		"FROM outbox_read_reconcile_verdicts($1::timestamptz, $2::bigint)", 2 },
	/* As the global switch: the function takes the kill-switch lock, so
	 * the list of sends in flight is complete. */
	[CTL_SQL_SCOPE_PAUSE] = { "outbox_scope_pause",
		"SELECT " IN_FLIGHT_COLUMNS " FROM outbox_scope_pause($1, $2, $3::boolean, $4, $5)", 5 },
	[CTL_SQL_SCOPE_LIMIT] = { "outbox_scope_limit",
		"SELECT outbox_scope_limit($1, $2, $3::double precision, $4::integer, $5, $6)", 6 },
	[CTL_SQL_SCOPES] = { "outbox_read_scopes",
		"SELECT kind, value, paused, paused_by, " UTC("paused_at") ", paused_reason, "
		"rate_per_second, burst, limit_by, " UTC("limit_at") ", limit_reason, waiting, "
		"held_total FROM outbox_read_scopes($1::boolean)", 1 },
};

PGresult *ctl_run(struct ctl *ctl, const char *what, enum ctl_stmt stmt,
                  const char *const *params, int *rc)
{
	return ctl_exec_rc(ctl, what, ctl_sql[stmt].text, ctl_sql[stmt].nparams, params, rc);
}

PGresult *ctl_run_db(struct ctl *ctl, const char *what, enum ctl_stmt stmt,
                     const char *const *params)
{
	return ctl_exec(ctl, what, ctl_sql[stmt].text, ctl_sql[stmt].nparams, params);
}

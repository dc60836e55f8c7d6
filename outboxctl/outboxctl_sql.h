/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_sql.h: every statement outboxctl runs, by name, with the
 * indexes of the columns it reads (the text is in outboxctl_sql.c; the
 * functions are in sql/functions/: the reads in 45_reads.sql, the acts in
 * 40_operator.sql, 33_scopes.sql, 30_dispatcher.sql and 20_producer.sql).
 * No statement names a table: only sql/ knows them.
 */
#ifndef OUTBOXCTL_SQL_H
#define OUTBOXCTL_SQL_H

#include "outboxctl.h"

enum ctl_stmt {
	CTL_SQL_SWITCH,            /* outbox_read_switch: the kill switch */
	CTL_SQL_SWITCH_SET,        /* outbox_kill_switch_set: off/on, the sends in flight */
	CTL_SQL_STATUS,            /* outbox_read_status: counts and the switch */
	CTL_SQL_UNKNOWN_SETTLE,    /* outbox_settle_unknown_runs: their runs' states first */
	CTL_SQL_UNKNOWN_LIST,      /* outbox_read_unknown: unknown effects, oldest first */
	CTL_SQL_EFFECT,            /* outbox_read_effect: one effect */
	CTL_SQL_EFFECT_HISTORY,    /* outbox_read_effect_history: its history rows */
	CTL_SQL_RESOLVE,           /* outbox_resolve_unknown */
	CTL_SQL_REQUEUE_SINCE_AGO, /* outbox_requeue_failed_since, an interval back */
	CTL_SQL_REQUEUE_SINCE_AT,  /* outbox_requeue_failed_since, a timestamp */
	CTL_SQL_REQUEUE,           /* outbox_requeue: one effect */
	CTL_SQL_REPLACE,           /* outbox_replace */
	CTL_SQL_HISTORY_MONTHS,    /* outbox_read_history_months: prune's report */
	CTL_SQL_PRUNE,             /* outbox_prune: one batch */
	CTL_SQL_CANCEL,            /* outbox_cancel */
	CTL_SQL_RECONCILE_START,   /* outbox_read_reconcile_start: clock and counts */
	CTL_SQL_RECONCILE_NOTIFY,  /* outbox_request_reconcile: the fleet is asked */
	CTL_SQL_RECONCILE_LEFT,    /* outbox_read_reconcile_remaining */
	CTL_SQL_RECONCILE_VERDICTS,/* outbox_read_reconcile_verdicts */
	CTL_SQL_SCOPE_PAUSE,       /* outbox_scope_pause: the sends in flight */
	CTL_SQL_SCOPE_LIMIT,       /* outbox_scope_limit */
	CTL_SQL_SCOPES,            /* outbox_read_scopes: every scope or the limited ones */
	CTL_SQL_STATEMENTS
};

/* The sends in flight outbox_kill_switch_set and outbox_scope_pause return. */
enum in_flight_col { IF_EFFECT_ID, IF_EFFECT_KEY, IF_EFFECT_TYPE, IF_TARGET, IF_WORKER,
                     IF_STARTED };
enum switch_col { SW_ENABLED, SW_CHANGED_BY, SW_REASON, SW_CHANGED_AT };
enum status_col { ST_PENDING, ST_SENDING, ST_COMPLETED, ST_UNKNOWN, ST_FAILED,
                  ST_OLDEST_PENDING_AGE, ST_FAILED_LAST_HOUR, ST_WINDOW_HOURS, ST_ENABLED,
                  ST_CHANGED_BY, ST_REASON, ST_CHANGED_AT, ST_HELD, ST_OLDEST_HELD_AGE };
enum unknown_col { UK_EFFECT_ID, UK_IDEMPOTENCY_KEY, UK_EFFECT_KEY, UK_EFFECT_TYPE, UK_TARGET,
                   UK_ATTEMPTS, UK_UNKNOWN_SINCE, UK_CREATED_AT, UK_LAST_ERROR_CLASS,
                   UK_LAST_ERROR, UK_LAST_WORKER, UK_LAST_OUTCOME, UK_LAST_STATUS,
                   UK_RUN_STATE, UK_COLUMNS };
enum effect_col { EF_EFFECT_ID, EF_IDEMPOTENCY_KEY, EF_EFFECT_TYPE, EF_TARGET, EF_STATE,
                  EF_ATTEMPTS, EF_CREATED_AT, EF_UPDATED_AT, EF_COMPLETED_AT, EF_PROVIDER_ID,
                  EF_LAST_ERROR_CLASS, EF_LAST_ERROR, EF_LAST_STATUS, EF_EFFECT_KEY,
                  EF_RUN_STATE };
enum history_col { HI_ATTEMPT, HI_WORKER, HI_STARTED, HI_ENDED, HI_OUTCOME, HI_STATUS,
                   HI_PROVIDER_ID, HI_ERROR, HI_STATE };
enum resolve_col { RS_APPLIED, RS_STATE, RS_IDEMPOTENCY_KEY, RS_PROVIDER_ID, RS_RUN_STATE };
enum requeue_since_col { RQS_EFFECT_ID, RQS_IDEMPOTENCY_KEY, RQS_EFFECT_TYPE, RQS_TARGET,
                         RQS_LAST_ERROR_CLASS, RQS_RUN_STATE };
enum requeue_col { RQ_APPLIED, RQ_STATE, RQ_IDEMPOTENCY_KEY, RQ_LAST_ERROR_CLASS, RQ_RUN_STATE };
enum replace_col { RP_STATUS, RP_STATE, RP_NEW_EFFECT_ID, RP_NEW_KEY, RP_ORIGINAL_KEY };
enum count_col { CNT_VALUE };
enum reconcile_start_col { RC_CLOCK, RC_RECONCILABLE, RC_OTHERS };
enum verdict_col { VD_HISTORY_ID, VD_EFFECT_ID, VD_EFFECT_TYPE, VD_OUTCOME, VD_STATUS,
                   VD_PROVIDER_ID, VD_ERROR, VD_WORKER, VD_APPLIED };
enum scope_col { SC_KIND, SC_VALUE, SC_PAUSED, SC_PAUSED_BY, SC_PAUSED_AT, SC_PAUSED_REASON,
                 SC_RATE, SC_BURST, SC_LIMIT_BY, SC_LIMIT_AT, SC_LIMIT_REASON, SC_WAITING,
                 SC_HELD_TOTAL, SC_COLS };

struct ctl_sql {
	const char *name;   /* for messages: the function called */
	const char *text;
	int nparams;
};

extern const struct ctl_sql ctl_sql[CTL_SQL_STATEMENTS];

/* ctl_exec_rc() of a named statement: `what` names the command in
 * messages; *rc is set on failure (CTL_USAGE for SQLSTATE class 22). */
PGresult *ctl_run(struct ctl *ctl, const char *what, enum ctl_stmt stmt,
                  const char *const *params, int *rc);
/* ctl_exec() of a named statement: every failure is the database's. */
PGresult *ctl_run_db(struct ctl *ctl, const char *what, enum ctl_stmt stmt,
                     const char *const *params);

#endif

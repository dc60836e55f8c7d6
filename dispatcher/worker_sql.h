/* SPDX-License-Identifier: ISC */
/*
 * worker_sql.h: every statement the worker runs, by name, with the
 * indexes of the columns it reads (the text is in worker_sql.c; the
 * functions are in sql/functions/).
 */
#ifndef OUTBOX_WORKER_SQL_H
#define OUTBOX_WORKER_SQL_H

#include "db.h"

enum worker_stmt {
	SQL_LEASE,               /* outbox_lease: pending rows get our lease */
	SQL_CLAIM,               /* outbox_claim: lease and mark in one (claim.c) */
	SQL_UNCLAIM,             /* outbox_unclaim: claimed rows not sent, back */
	SQL_UNCLAIM_CALL,        /* outbox_unclaim_call: a refused claim given up on */
	SQL_FAIL_INVALID,        /* outbox_fail_invalid: rows that failed validation */
	SQL_RELEASE,             /* outbox_release: leases given back, nothing sent */
	SQL_MARK_SENDING,        /* outbox_mark_sending: the kill-switch commit point */
	SQL_COMPLETE,            /* outbox_complete_sending: the usual batch's outcomes */
	SQL_COMPLETE_REST,       /* outbox_complete_rest: what it did not apply */
	SQL_RENEW,               /* outbox_renew: the heartbeat */
	SQL_RECONCILE_LEASE,     /* outbox_reconcile_lease: unknown effects to ask about */
	SQL_RECONCILE_RECORD,    /* outbox_reconcile_record: the providers' verdicts */
	SQL_REAP,                /* outbox_reap: expired sending leases */
	SQL_SWEEP,               /* outbox_sweep: pending rows no worker serves */
	SQL_REGISTER_PROVIDERS,  /* outbox_register_providers */
	SQL_WEEKLY_FIGURES,      /* outbox_weekly_figures */
	SQL_GAUGES_WITH_LAG,     /* queue lag, unknown count, kill switch */
	SQL_GAUGES,              /* unknown count, kill switch (lag NULL) */
	SQL_SCHEMA_VERSION,      /* the applied migration version */
	SQL_RESOLVE_LATE,        /* outbox_resolve_late_accepted: a late acceptance */
	SQL_STATEMENTS
};

/* An effect's row: SQL_LEASE (and SQL_CLAIM, the same columns) and
 * SQL_RECONCILE_LEASE share the first eight
 * columns (effect_from_row()). */
/* outbox_metadata_max_bytes() in sql/functions/20_producer.sql: metadata
 * longer than this (as text) is not fetched by the lease or the claim. */
#define OUTBOX_METADATA_MAX_BYTES 65536

enum effect_row_col {
	COL_EFFECT_ID, COL_IDEMPOTENCY_KEY, COL_EFFECT_TYPE, COL_TARGET, COL_PAYLOAD,
	COL_PAYLOAD_HASH, COL_EFFECT_KEY, COL_ATTEMPTS,
	/* SQL_LEASE only */
	COL_LEASE_METADATA = COL_ATTEMPTS + 1, COL_LEASE_APPROVED_BY, COL_LEASE_RETRY_BASE,
	COL_LEASE_AVAILABLE_AT,
	/* the payload's and metadata's lengths as text: the column above is
	 * NULL when its length is over the bound (payload_bytes: the worker's
	 * max_payload_bytes; metadata_bytes: OUTBOX_METADATA_MAX_BYTES) */
	COL_LEASE_PAYLOAD_BYTES, COL_LEASE_METADATA_BYTES,
	/* SQL_CLAIM only: true when the rows were leased, not marked (a scope
	 * is set: the sending transition decides, outbox_mark_sending) */
	COL_CLAIM_LEASED_ONLY,
	/* SQL_CLAIM only: the hosts scoped when the rows were claimed ({a,b};
	 * NULL: none): a row whose provider connects to one of them is given
	 * back, to be marked (claim.c) */
	COL_CLAIM_CHECK_HOSTS,
	/* SQL_CLAIM only: the due index's entries the call's walk read (the
	 * same on every row; NULL from a repeat): take.c's measure of a head
	 * full of entries no claim can take */
	COL_CLAIM_DUE_ENTRIES,
	/* SQL_RECONCILE_LEASE only */
	COL_RECON_ATTEMPT_AGE_MS = COL_ATTEMPTS + 1,
};

/* held_by: the scope holding a blocked row ('' when the kill switch did);
 * held_in_ms: when it is due again (-1: when its scope resumes). */
enum mark_col { COL_MARK_EFFECT_ID, COL_MARK_ATTEMPTS, COL_MARK_BLOCKED, COL_MARK_HELD_BY,
                COL_MARK_HELD_IN_MS };
/* SQL_COMPLETE and SQL_COMPLETE_REST: the first answers only the elements
 * it applied (applied true, resolved NULL). */
enum complete_col { COL_COMPLETE_EFFECT_ID, COL_COMPLETE_APPLIED, COL_COMPLETE_STATE,
                    COL_COMPLETE_RESOLVED };
enum renew_col { COL_RENEW_EFFECT_ID };
enum recon_record_col { COL_RECORD_EFFECT_ID, COL_RECORD_APPLIED, COL_RECORD_STATE };
enum reap_col { COL_REAP_EFFECT_ID, COL_REAP_STATE, COL_REAP_LOST_WORKER };
enum sweep_col { COL_SWEEP_EFFECT_ID, COL_SWEEP_EFFECT_TYPE };
/* In the order of the weekly gauges (housekeeping.c). */
enum weekly_col { COL_WEEK_DUPLICATE_SHARE, COL_WEEK_APPROVAL_WAIT_P50, COL_WEEK_APPROVAL_WAIT_P95,
                  COL_WEEK_VALIDATION_FAILURE_SHARE, COL_WEEK_AUTOMATIC_SHARE,
                  COL_WEEK_RETRIES_EXHAUSTED, COL_WEEK_COLUMNS };
enum gauges_col { COL_GAUGE_QUEUE_LAG, COL_GAUGE_UNKNOWN, COL_GAUGE_KILL_SWITCH, COL_GAUGE_SCOPES };
enum schema_col { COL_SCHEMA_VERSION };
enum resolve_late_col { COL_LATE_RESOLVED };

struct worker_sql {
	const char *name;   /* for logs: the function called */
	const char *text;
	int nparams;
};

extern const struct worker_sql worker_sql[SQL_STATEMENTS];

/* db_query() of a named statement with its parameters. */
void worker_query(struct db *db, enum worker_stmt stmt, const char *const *params,
                  db_result_fn cb, void *arg, unsigned flags);

#endif

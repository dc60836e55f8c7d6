/* SPDX-License-Identifier: ISC */
/*
 * housekeeping.c: the maintenance timer's pass on the records connection:
 * the reaper (expired `sending` leases -> unknown, or pending where keys
 * are honoured), the fleet-wide sweep of pending rows no worker serves,
 * provider registration, the weekly figures, and the gauges (queue lag,
 * unknown count, kill switch).  Also the schema check that gates
 * readiness, and starts the periodic reconciliation pass.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "log.h"
#include "metrics.h"
#include "migrate.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

/* A maintenance pass (reaper, sweep, gauges) starts at least this many
 * times its predecessor's duration after it ended: under a held-back
 * vacuum the reaper's and the gauge's index scans walk dead entries, and
 * a pass every maintenance_interval_ms took a large share of the records
 * connection's time (docs/performance.md, "Where the time goes").  Never
 * more than half of lease_seconds, so the reaper still comes round within
 * a lease period. */
#ifndef MAINT_BACKOFF_FACTOR
#define MAINT_BACKOFF_FACTOR 10
#endif
/* The queue-lag gauge reads the due index from its head: asked again after
 * this many times its last answer's wait (a gauge a few seconds old is
 * still a gauge; walking a held-back head every few seconds cost the
 * database a measurable share of its CPU).  Both can be set with -D for an
 * A/B build (docs/performance.md, "Where the time goes"). */
#ifndef GAUGE_LAG_FACTOR
#define GAUGE_LAG_FACTOR 30
#endif
/* The fleet-wide sweep of the pending backlog runs at most this often. */
#define SWEEP_MAX_EVERY_S 30
/* The weekly figures (an aggregate over this week's rows, outbox_weekly_figures) are recomputed
 * by one worker of the fleet at most this often; the others read them. */
#define WEEKLY_REFRESH_S "300"

static void on_reaped(struct db *db, PGresult *r, void *arg)
{
	(void)db;
	(void)arg;
	if (!pg_ok(r, worker_sql[SQL_REAP].name))
		return;
	for (int row = 0; row < PQntuples(r); row++) {
		const char *state = PQgetvalue(r, row, COL_REAP_STATE);
		bool unknown = strcmp(state, "unknown") == 0;

		metrics_inc(unknown ? M_REAPED_UNKNOWN : M_REAPED_PENDING, 1);
		log_event(OLOG_WARN, "reaped",
		          json_pack("{s:s,s:s,s:s,s:s}", "effect_id", PQgetvalue(r, row, COL_REAP_EFFECT_ID),
		                    "state", state, "lost_worker", PQgetvalue(r, row, COL_REAP_LOST_WORKER),
		                    "msg",
		                    unknown ? "lease expired while sending: outcome unknown, not re-sent"
		                            : "lease expired while sending: provider honours keys, retried with the same key"));
	}
}

static void on_swept(struct db *db, PGresult *r, void *arg)
{
	(void)db;
	(void)arg;
	if (!pg_ok(r, worker_sql[SQL_SWEEP].name))
		return;
	for (int row = 0; row < PQntuples(r); row++) {
		metrics_inc(M_INVALID, 1);
		log_event(OLOG_WARN, "effect_invalid",
		          json_pack("{s:s,s:s,s:s}", "effect_id", PQgetvalue(r, row, COL_SWEEP_EFFECT_ID),
		                    "type", PQgetvalue(r, row, COL_SWEEP_EFFECT_TYPE), "error",
		                    "unknown effect type: no worker serves it"));
	}
}

/* Only a whole pass on one connection is timed: one that a lost
 * connection cut (its rest ran after the reconnect) would charge the
 * outage to housekeeping and stop it for ten times as long. */
static void maint_pass_timed(struct worker *w)
{
	int64_t took = now_mono_ms() - w->hk.maint_started_mono;
	int64_t wait = took * MAINT_BACKOFF_FACTOR;
	/* The reaper must still come round within a lease period. */
	int64_t cap = w->s.lease_seconds * 1000 / 2;

	w->hk.maint_due_mono = now_mono_ms() + (wait < cap ? wait : cap);
	metrics_inc(M_MAINT_PASSES, 1);
	metrics_set(G_MAINT_PASS_SECONDS, (double)took / 1000.0);
}

/* The scopes column of the gauges (NULL: none set). */
static void scope_gauges(const char *js)
{
	struct scope_gauge g[METRICS_MAX_SCOPES];
	json_t *a = js ? json_loads(js, 0, NULL) : NULL;
	size_t i, n = 0;
	json_t *v;

	json_array_foreach(a, i, v) {
		if (n == METRICS_MAX_SCOPES)
			break;
		memset(&g[n], 0, sizeof(g[n]));
		text_copy(g[n].scope, json_string_value(json_object_get(v, "scope")) ?
		         json_string_value(json_object_get(v, "scope")) : "", sizeof(g[n].scope));
		g[n].paused = json_is_true(json_object_get(v, "paused"));
		g[n].rate = json_number_value(json_object_get(v, "rate"));
		g[n].waiting = json_number_value(json_object_get(v, "waiting"));
		g[n].held_total = json_number_value(json_object_get(v, "held_total"));
		g[n].paused_seconds = json_number_value(json_object_get(v, "paused_seconds"));
		g[n].oldest_held_seconds = json_number_value(json_object_get(v, "oldest_held_seconds"));
		n++;
	}
	json_decref(a);
	metrics_set_scopes(g, n);
}

static void on_gauges(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;
	bool lag = w->hk.gauge_lag_asked;
	bool ok = pg_ok(r, worker_sql[SQL_GAUGES].name) && PQntuples(r) == 1;

	w->hk.maint_busy = false;
	w->hk.gauge_lag_asked = false;
	if (ok && !w->hk.maint_lost)
		maint_pass_timed(w);
	if (!ok)
		return;
	if (lag) {
		/* The lag reads the head of the due index, which a held-back
		 * vacuum makes slow: ask again after GAUGE_LAG_FACTOR times this
		 * answer's wait, at the soonest on the next pass. */
		w->hk.gauge_lag_due_mono =
			now_mono_ms() + (now_mono_ms() - db_head_sent_mono(db)) * GAUGE_LAG_FACTOR;
		metrics_set(G_QUEUE_LAG_SECONDS, strtod(PQgetvalue(r, 0, COL_GAUGE_QUEUE_LAG), NULL));
	}
	metrics_set(G_UNKNOWN, strtod(PQgetvalue(r, 0, COL_GAUGE_UNKNOWN), NULL));
	metrics_set(G_KILL_SWITCH_ON,
	            w->env_enabled && PQgetvalue(r, 0, COL_GAUGE_KILL_SWITCH)[0] == 't');
	scope_gauges(PQgetisnull(r, 0, COL_GAUGE_SCOPES) ? NULL : PQgetvalue(r, 0, COL_GAUGE_SCOPES));
}

static void on_weekly(struct db *db, PGresult *r, void *arg)
{
	static const enum metric_gauge gauges[COL_WEEK_COLUMNS] = {
		[COL_WEEK_DUPLICATE_SHARE] = G_WEEK_DUPLICATE_SHARE,
		[COL_WEEK_APPROVAL_WAIT_P50] = G_WEEK_APPROVAL_WAIT_P50,
		[COL_WEEK_APPROVAL_WAIT_P95] = G_WEEK_APPROVAL_WAIT_P95,
		[COL_WEEK_VALIDATION_FAILURE_SHARE] = G_WEEK_VALIDATION_FAILURE_SHARE,
		[COL_WEEK_AUTOMATIC_SHARE] = G_WEEK_AUTOMATIC_SHARE,
		[COL_WEEK_RETRIES_EXHAUSTED] = G_WEEK_RETRIES_EXHAUSTED,
	};

	(void)db;
	(void)arg;
	if (!pg_ok(r, worker_sql[SQL_WEEKLY_FIGURES].name) || PQntuples(r) != 1)
		return;
	for (int col = 0; col < COL_WEEK_COLUMNS; col++)
		metrics_set(gauges[col], PQgetisnull(r, 0, col) ? 0 : strtod(PQgetvalue(r, 0, col), NULL));
}

static void register_providers(struct worker *w)
{
	const char *params[2] = { w->types_array, w->recon_array };

	worker_query(w->rec, SQL_REGISTER_PROVIDERS, params, NULL, NULL, 0);
	w->hk.last_register_mono = now_mono_ms();
}

/* The schema check's refusal (e.g. "permission denied for table
 * schema_migrations": the login lacks a grant, which
 * sql/101_gate_and_evidence.sql gives) or a schema behind this worker. */
static void schema_not_ok(struct worker *w, PGresult *r)
{
	char line[200];
	int have;

	if (!pg_ok(r, worker_sql[SQL_SCHEMA_VERSION].name)) {
		error_line(r, line, sizeof(line));
		snprintf(w->life.schema_error, sizeof(w->life.schema_error), "schema check failed: %s",
		         line);
		return;
	}
	have = atoi(PQgetvalue(r, 0, COL_SCHEMA_VERSION));
	w->life.schema_ok = false;
	snprintf(w->life.schema_error, sizeof(w->life.schema_error),
	         "database schema behind (too old: version %d, this worker needs %d): "
	         "run outboxctl migrate", have, migrate_latest_version());
	log_msg(OLOG_ERROR, "schema_behind",
	        "database schema is at version %d, this worker needs %d: run 'outboxctl migrate'",
	        have, migrate_latest_version());
}

void on_schema(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;

	(void)db;
	if (r == NULL)
		return;   /* connection lost: checked again on reconnect */
	if (PQresultStatus(r) != PGRES_TUPLES_OK ||
	    atoi(PQgetvalue(r, 0, COL_SCHEMA_VERSION)) < migrate_latest_version()) {
		schema_not_ok(w, r);
		readiness_update(w);
		return;
	}
	w->life.schema_error[0] = '\0';
	if (!w->life.schema_ok) {
		w->life.schema_ok = true;
		register_providers(w);
	}
	readiness_update(w);
	w->lease.wanted = true;
	worker_kick(w);
}

/* Reaper and sweep: the first queries of a pass. */
static void reap_and_sweep(struct worker *w)
{
	char grace[24], every[24];
	const char *params[4];
	long sweep_every = w->s.unknown_type_grace_seconds / 2;

	params[0] = w->name;
	params[1] = "500";
	worker_query(w->rec, SQL_REAP, params, on_reaped, w, 0);
	/* One worker of the fleet, at most every half grace (and 30 s): it
	 * walks the whole pending backlog. */
	snprintf(grace, sizeof(grace), "%ld", w->s.unknown_type_grace_seconds);
	snprintf(every, sizeof(every), "%ld",
	         sweep_every < SWEEP_MAX_EVERY_S ? sweep_every : SWEEP_MAX_EVERY_S);
	params[0] = w->name;
	params[1] = grace;
	params[2] = every;
	params[3] = "500";
	worker_query(w->rec, SQL_SWEEP, params, on_swept, w, 0);
}

/* Registration, the weekly figures and the gauges (last: its answer ends
 * the pass and clears maint_busy). */
static void figures_and_gauges(struct worker *w)
{
	if (now_mono_ms() - w->hk.last_register_mono > 30000)
		register_providers(w);
	if (w->hk.last_weekly_mono == 0 || now_mono_ms() - w->hk.last_weekly_mono > 30000) {
		/* The seeds' weekly figures, this week so far: an aggregate over
		 * the week's rows, so not on every pass. */
		const char *params[2] = { w->name, WEEKLY_REFRESH_S };

		w->hk.last_weekly_mono = now_mono_ms();
		worker_query(w->rec, SQL_WEEKLY_FIGURES, params, on_weekly, w, 0);
	}
	w->hk.gauge_lag_asked = now_mono_ms() >= w->hk.gauge_lag_due_mono;
	worker_query(w->rec, w->hk.gauge_lag_asked ? SQL_GAUGES_WITH_LAG : SQL_GAUGES, NULL,
	             on_gauges, w, 0);
}

void on_maintenance(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;

	(void)fd;
	(void)what;
	metrics_heartbeat();
	metrics_set(G_DB_UP, db_is_up(w->db) && db_is_up(w->rec));
	metrics_set(G_IN_FLIGHT, w->fx.n_sending);
	/* A connection that never came up calls no state callback: say why
	 * the worker still is not ready on every pass. */
	readiness_update(w);
	if (!w->life.schema_ok) {
		if (db_is_up(w->db))
			worker_query(w->db, SQL_SCHEMA_VERSION, NULL, on_schema, w, 0);
		return;
	}
	if (!db_is_up(w->rec))
		return;
	if (w->hk.maint_busy || now_mono_ms() < w->hk.maint_due_mono)
		return;   /* the database is slow; do not pile up */
	w->hk.maint_busy = true;
	w->hk.maint_started_mono = now_mono_ms();
	w->hk.maint_lost = false;
	reap_and_sweep(w);
	figures_and_gauges(w);
	if (now_mono_ms() >= w->recon.next_mono) {
		w->recon.next_mono = now_mono_ms() + RECONCILE_INTERVAL_MS;
		reconcile_pass(w, false);
	}
	worker_kick(w);
}

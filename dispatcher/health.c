/* SPDX-License-Identifier: ISC */
/*
 * health.c: whether the worker can serve, and who is told: READY=1 and
 * STATUS= for systemd (readiness_update()), /healthz (worker_ready()),
 * and the count of statements the database refused in a row (job_ok()).
 */
#include <stdio.h>
#include <string.h>

#include "db.h"
#include "log.h"
#include "metrics.h"
#include "sdnotify.h"
#include "util.h"
#include "worker_internal.h"

bool pg_ok(PGresult *r, const char *what)
{
	if (r == NULL)
		return false;
	if (PQresultStatus(r) == PGRES_TUPLES_OK || PQresultStatus(r) == PGRES_COMMAND_OK)
		return true;
	log_msg(OLOG_ERROR, "db_error", "%s: %s", what, PQresultErrorMessage(r));
	return false;
}

/* The first line of a result's error, for STATUS= and /healthz. */
void error_line(PGresult *r, char *buf, size_t len)
{
	text_copy(buf, r ? PQresultErrorMessage(r) : "connection lost", len);
	buf[strcspn(buf, "\r\n")] = '\0';
	if (strncmp(buf, "ERROR:  ", 8) == 0)
		memmove(buf, buf + 8, strlen(buf + 8) + 1);
}

/* pg_ok() for the statements a worker needs to do its job (lease, mark,
 * renew, complete): counts the database's refusals for /healthz, STATUS=
 * and outbox_lease_errors_total.  A lost connection (r == NULL) is not
 * counted here: db_up and the reconnects say that. */
bool job_ok(struct worker *w, PGresult *r, const char *what)
{
	if (pg_ok(r, what)) {
		if (w->life.lease_error_streak >= LEASE_ERRORS_UNHEALTHY)
			sdnotify_status("serving again after %d refused statements",
			                w->life.lease_error_streak);
		w->life.lease_error_streak = 0;
		return true;
	}
	if (r != NULL) {
		char line[200];

		error_line(r, line, sizeof(line));
		snprintf(w->life.lease_error, sizeof(w->life.lease_error), "%s: %s", what, line);
		metrics_inc(M_LEASE_ERRORS, 1);
		if (++w->life.lease_error_streak == LEASE_ERRORS_UNHEALTHY)
			sdnotify_status("cannot lease: %s", w->life.lease_error);
	}
	return false;
}

/* Why the worker cannot serve, or false when it can.  Shared by /healthz
 * and the STATUS= shown while it starts. */
bool worker_why_not(const struct worker *w, char *why, size_t len)
{
	if (!db_is_up(w->db) || !db_is_up(w->rec)) {
		snprintf(why, len, "database unreachable: %s",
		         db_last_error(db_is_up(w->db) ? w->rec : w->db));
		return true;
	}
	if (!w->life.schema_ok) {
		snprintf(why, len, "%s",
		         w->life.schema_error[0] ? w->life.schema_error : "checking the database schema");
		return true;
	}
	if (w->life.lease_error_streak >= LEASE_ERRORS_UNHEALTHY) {
		snprintf(why, len, "cannot lease: %s", w->life.lease_error);
		return true;
	}
	return false;
}

/* /healthz's question (metrics.c). */
bool worker_ready(void *arg, char *why, size_t len)
{
	return !worker_why_not(arg, why, len);
}

/* Whether the worker knows it cannot serve yet for a reason that may last
 * (a connection attempt failed, the schema was refused or is behind), as
 * opposed to still connecting or checking. */
static bool known_unready(const struct worker *w)
{
	if (!db_is_up(w->db) || !db_is_up(w->rec))
		return (!db_is_up(w->db) && db_last_error(w->db)[0]) ||
		       (!db_is_up(w->rec) && db_last_error(w->rec)[0]);
	return w->life.schema_error[0] != '\0';
}

/* READY=1 once: when the worker can serve, or as soon as it knows it
 * cannot yet (the database unreachable at start, the schema behind).  It
 * is up then, and says so: /healthz answers 503 and outbox_ready is 0, so
 * that OutboxWorkerNotReady and OutboxDatabaseDown fire as for a worker
 * that lost an established connection; held in `activating` instead,
 * systemd's start timeout would restart it every minute and each restart
 * would reset the alerts' `for:`.  STATUS= says what it waits for. */
void readiness_update(struct worker *w)
{
	char why[512];

	if (w->life.serving || w->life.stopping)
		return;
	if (worker_why_not(w, why, sizeof(why))) {
		if (w->life.ready_sent) {
			sdnotify_status("up, not ready: %s", why);
		} else if (known_unready(w)) {
			w->life.ready_sent = true;
			log_msg(OLOG_WARN, "started_unready",
			        "up but not ready (/healthz 503, outbox_ready 0): %s", why);
			{
				char status[600];

				snprintf(status, sizeof(status), "up, not ready: %s", why);
				sdnotify_ready(status);
			}
		} else {
			sdnotify_status("starting: %s", why);
		}
		return;
	}
	w->life.serving = true;
	log_msg(OLOG_INFO, "serving", "both database connections up and the schema checked: serving");
	if (!w->life.ready_sent) {
		w->life.ready_sent = true;
		sdnotify_ready(w->env_enabled ? "ready" : "ready; AI_ACTIONS_ENABLED is not true: not sending");
	} else {
		sdnotify_status(w->env_enabled ? "ready" : "ready; AI_ACTIONS_ENABLED is not true: not sending");
	}
}

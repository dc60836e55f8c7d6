/* SPDX-License-Identifier: ISC */
/*
 * wire.c: the leases, claims and marks on the wire (sent or queued,
 * answer not seen), and what an exit does about them: at a forced exit
 * the claims and marks are given up, at teardown their batches freed
 * (their callbacks never run: db_free() drops the queries).
 *
 * A claim or a mark whose answer the worker never saw may have committed:
 * its rows are then `sending` although nothing was sent.  A worker that
 * exits before the answer (a second SIGTERM, shutdown_grace_ms over)
 * cancels those statements on the server (a cancel aborts one still
 * waiting, on a lock say; a committed one stays) and gives their calls up
 * on a short connection of its own (outbox_unclaim_call): rows a committed
 * call moved go back to pending with the attempt undone, and a call still
 * on its way moves nothing.  Without this the reaper would find them
 * `sending` at lease expiry and, for a provider without idempotency keys,
 * make them `unknown`: an operator's decision about a send that never
 * happened.  If the database cannot be reached the rows are left to the
 * reaper, as before.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "db.h"
#include "log.h"
#include "util.h"
#include "worker_internal.h"

/* Per statement of the give-up: a first call still running holds its
 * call's lock until it ends, and a forced exit must end. */
#define WIRE_GIVE_UP_TIMEOUT "3000"
/* How long a cancel request may take to reach the server. */
#define WIRE_CANCEL_WAIT_MS 2000

void wire_sent(struct worker *w, struct db *db, const struct batch *b)
{
	for (int i = 0; i < WIRE_CALLS_MAX; i++) {
		if (w->wire.b[i] == NULL) {
			w->wire.b[i] = b;
			w->wire.db[i] = db;
			return;
		}
	}
	/* More than the worker ever has at once (a lease or claim on each
	 * connection and a mark): left to the reaper at a forced exit. */
	log_msg(OLOG_WARN, "wire_full", "more than %d leases, claims and marks on the wire",
	        WIRE_CALLS_MAX);
}

void wire_answered(struct worker *w, const struct batch *b)
{
	for (int i = 0; i < WIRE_CALLS_MAX; i++)
		if (w->wire.b[i] == b)
			w->wire.b[i] = NULL;
}

static bool give_up_one(PGconn *c, const char *owner, const char *call, long *rows)
{
	const char *params[3] = { WIRE_GIVE_UP_TIMEOUT, owner, call };
	PGresult *r;
	bool ok;

	r = PQexec(c, "BEGIN");
	PQclear(r);
	/* A statement's timeout is read when it starts: set in a statement of
	 * its own, for the transaction (SET LOCAL: a pooler in transaction
	 * mode hands the server connection on afterwards). */
	r = PQexecParams(c, "SELECT set_config('statement_timeout', $1, true), "
	                 "set_config('lock_timeout', $1, true)", 1, NULL, params, NULL, NULL, 0);
	PQclear(r);
	r = PQexecParams(c, "SELECT outbox_unclaim_call($1::uuid, $2::uuid)", 2, NULL, params + 1,
	                 NULL, NULL, 0);
	ok = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1;
	if (ok)
		*rows += strtol(PQgetvalue(r, 0, 0), NULL, 10);
	else
		log_msg(OLOG_WARN, "give_up_failed", "giving up call %s: %s", call,
		        PQresultErrorMessage(r));
	PQclear(r);
	r = PQexec(c, ok ? "COMMIT" : "ROLLBACK");
	PQclear(r);
	return ok;
}

/* A cancel request runs on a thread of its own, so that an unreachable
 * server (PQcancel() has no timeout) cannot hold up the exit it is made
 * for.  The thread owns the request and, until it has written to `done`,
 * the pipe; a caller that stops waiting leaves both to the exit. */
struct cancel_job {
	PGcancel *c;
	int done[2];
};

static void *cancel_thread(void *arg)
{
	struct cancel_job *j = arg;
	char err[200];

	(void)PQcancel(j->c, err, sizeof(err));
	PQfreeCancel(j->c);
	(void)!write(j->done[1], "x", 1);
	return NULL;
}

/* Ask the server to cancel b's statement if it is the one on the wire of
 * `db` (never what is there instead: recorded outcomes, say), waiting at
 * most timeout_ms for the request to be delivered (a statement that
 * already committed stays committed). */
static bool cancel_running(struct db *db, const struct batch *b, int timeout_ms)
{
	struct cancel_job *j;
	pthread_t t;
	struct pollfd pfd;
	PGcancel *c = db_cancel_handle(db, b);

	if (c == NULL)
		return false;
	j = text_alloc(sizeof(*j));
	j->c = c;
	if (pipe(j->done) < 0) {
		PQfreeCancel(j->c);
		free(j);
		return false;
	}
	if (pthread_create(&t, NULL, cancel_thread, j) != 0) {
		PQfreeCancel(j->c);
		close(j->done[0]);
		close(j->done[1]);
		free(j);
		return false;
	}
	pfd.fd = j->done[0];
	pfd.events = POLLIN;
	int64_t until = now_mono_ms() + timeout_ms;
	int got;

	while ((got = poll(&pfd, 1, (int)(until - now_mono_ms()))) < 0 && errno == EINTR &&
	       now_mono_ms() < until)
		;
	if (got != 1) {
		pthread_detach(t);
		return false;
	}
	pthread_join(t, NULL);
	close(j->done[0]);
	close(j->done[1]);
	free(j);
	return true;
}

void wire_give_up(struct worker *w)
{
	const char *keys[] = { "dbname", "connect_timeout", "tcp_user_timeout", "fallback_application_name",
	                       NULL };
	const char *vals[] = { w->s.conninfo, "3", "5000", "outbox-dispatcher exit", NULL };
	int n = 0, given_up = 0;
	long rows = 0;
	PGconn *c;

	for (int i = 0; i < WIRE_CALLS_MAX; i++) {
		if (w->wire.b[i] == NULL || w->wire.b[i]->call[0] == '\0')
			continue;       /* a lease moves nothing to `sending` */
		n++;
		(void)cancel_running(w->wire.db[i], w->wire.b[i], WIRE_CANCEL_WAIT_MS);
	}
	if (n == 0)
		return;
	c = PQconnectdbParams(keys, vals, 1);
	if (PQstatus(c) != CONNECTION_OK) {
		log_msg(OLOG_WARN, "give_up_failed",
		        "%d claims or marks on the wire at exit, and no connection to give them up: "
		        "rows they moved stay sending until the reaper (%s)", n, PQerrorMessage(c));
		PQfinish(c);
		return;
	}
	for (int i = 0; i < WIRE_CALLS_MAX; i++)
		if (w->wire.b[i] != NULL && w->wire.b[i]->call[0] != '\0' &&
		    give_up_one(c, w->owner, w->wire.b[i]->call, &rows))
			given_up++;
	PQfinish(c);
	log_msg(OLOG_INFO, "gave_up_calls",
	        "exiting with %d claims or marks on the wire: %d given up, %ld rows back to pending unsent",
	        n, given_up, rows);
}

void wire_free_all(struct worker *w)
{
	for (int i = 0; i < WIRE_CALLS_MAX; i++) {
		struct batch *b = (struct batch *)w->wire.b[i];

		/* A mark's effects are on no list while it is out: its batch
		 * holds them. */
		for (size_t k = 0; b != NULL && k < b->n; k++)
			effect_free(b->items[k]);
		free(b);
		w->wire.b[i] = NULL;
	}
}

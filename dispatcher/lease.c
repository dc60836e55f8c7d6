/* SPDX-License-Identifier: ISC */
/*
 * lease.c: the leases a worker holds.  The lease kind of take.c's
 * requests (lease_take: outbox_lease(), its parameters, its rows): each
 * leased row is validated and queued (PH_WAITING) or failed as invalid; a
 * row this worker already holds is kept or given back, never a second
 * copy; the invalid ones of a lease's or a claim's answer are failed in one
 * call (fail_invalid()).  The heartbeat renews the leases of waiting and sending effects
 * (outbox_renew); release_waiting() gives unstarted leases back at a stop.
 */
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

/* ---- leasing ------------------------------------------------------------- */

/* The rows effect_invalid() collected from one answer (a lease's or a
 * claim's), failed in one outbox_fail_invalid() call on the records
 * connection; the array is consumed.  NULL: none. */
void fail_invalid(struct worker *w, json_t *invalid)
{
	char *js;

	if (invalid == NULL)
		return;
	js = json_dumps(invalid, JSON_COMPACT);
	{
		const char *params[2] = { w->owner, js };
		worker_query(w->rec, SQL_FAIL_INVALID, params, NULL, NULL, DBQ_RETRY);
	}
	free(js);
	json_decref(invalid);
}

/* A new row: validated and queued, or added to *invalid (failed in one
 * outbox_fail_invalid() call). */
static void leased_new(struct worker *w, PGresult *r, int row, json_t **invalid)
{
	struct effect *e = effect_from_row(w, r, row, true);
	char err[OUTBOX_ERROR_MAX];

	if (effect_validate(w, e, err, sizeof(err)))
		effect_set_phase(w, e, PH_WAITING);
	else
		effect_invalid(e, err, NULL, invalid);
}

/* Whether a leased row is one this worker holds past its send: a retry
 * whose outcome (or reconciliation verdict) committed on the other
 * connection before we read its answer. */
static bool held_past_send(const struct effect *held)
{
	return held->phase == PH_DONE || held->phase == PH_RECORDING ||
	       held->phase == PH_RECONCILING || held->phase == PH_RECONCILED ||
	       held->phase == PH_RECORDING_VERDICT;
}

static void leased_rows(struct worker *w, PGresult *r)
{
	json_t *invalid = NULL;
	struct effect **again = NULL;
	size_t n_again = 0;

	for (int row = 0; row < PQntuples(r); row++) {
		struct effect *held = held_find(w, PQgetvalue(r, row, COL_EFFECT_ID));

		if (held && held_past_send(held)) {
			/* Not ours to send yet: back to the queue, due again shortly. */
			if (again == NULL)
				again = text_array((size_t)PQntuples(r), sizeof(*again));
			again[n_again++] = held;
		} else if (held == NULL) {
			leased_new(w, r, row, &invalid);
		}
		/* else ours already (its lease had lapsed while it waited): the
		 * lease is fresh again; keep the one copy we have. */
	}
	fail_invalid(w, invalid);
	if (again) {
		char *ids = ids_array(again, n_again);
		const char *params[3] = { w->owner, ids, "100" };
		worker_query(w->db, SQL_RELEASE, params, NULL, NULL, DBQ_RETRY);
		free(ids);
		free(again);
	}
}

/* The statement's parameters, in outbox_lease()'s order. */
static void lease_params(const struct take_args *a, const char *params[TAKE_PARAMS_MAX])
{
	params[0] = a->owner;
	params[1] = a->name;
	params[2] = a->limit;
	params[3] = a->lease_seconds;
	params[4] = a->types;
	params[5] = a->env_enabled;
	params[6] = a->after_at;
	params[7] = a->after_id;
	params[8] = a->max_payload;
}

static void lease_rows(struct worker *w, const struct batch *b, PGresult *r)
{
	(void)b;
	leased_rows(w, r);
	/* A lease that was on the wire when SIGTERM came: give it back. */
	if (w->life.stopping)
		release_waiting(w);
}

/* A refused lease took nothing: nothing to undo, and the pump is left to
 * the next NOTIFY, poll tick or answer. */
static bool lease_refused(struct worker *w, const struct batch *b, PGresult *r)
{
	(void)w;
	(void)b;
	(void)r;
	return false;
}

/* The lease as take.c sends it.  Not DBQ_RETRY: a lease cut by a lost
 * connection comes back to on_taken() as refused (its rows' leases lapse),
 * and the reconnect leases again. */
const struct take_handlers lease_take = {
	.stmt = SQL_LEASE,
	.flags = 0,
	.has_call = false,
	.params = lease_params,
	.answered_as = NULL,
	.rows = lease_rows,
	.refused = lease_refused,
	.entries_col = -1,
};

/* ---- heartbeat: lease renewal ------------------------------------------- */

static bool renewed_row(PGresult *r, const struct effect *e)
{
	for (int row = 0; row < PQntuples(r); row++)
		if (strcmp(PQgetvalue(r, row, COL_RENEW_EFFECT_ID), e->id) == 0)
			return true;
	return false;
}

static void on_renewed(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	struct effect *e, *next;

	(void)db;
	if (!job_ok(w, r, worker_sql[SQL_RENEW].name)) {
		free(b);
		return;
	}
	/* Effects included in this renewal that did not come back lost their
	 * lease: a waiting one is dropped, a sending one is flagged (its
	 * outcome is still recorded; the CAS will say it was lost). */
	TAILQ_FOREACH_SAFE(e, &w->fx.sending, link, next) {
		if (e->renew_gen != b->renew_gen || e->lease_lost || renewed_row(r, e))
			continue;
		e->lease_lost = true;
		log_event(OLOG_WARN, "lease_lost",
		          json_pack("{s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
		                    "phase", "sending"));
	}
	TAILQ_FOREACH_SAFE(e, &w->fx.waiting, link, next) {
		if (e->renew_gen != b->renew_gen || renewed_row(r, e))
			continue;
		metrics_inc(M_LEASE_LOST, 1);
		effect_free(e);
	}
	free(b);
	worker_kick(w);   /* room for a lease */
}

void on_heartbeat(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;
	struct effect *e;
	struct batch *b;
	char *ids, lease[16], cap[16];
	const char *params[4];

	(void)fd;
	(void)what;
	if (!db_is_up(w->db) || (TAILQ_EMPTY(&w->fx.sending) && TAILQ_EMPTY(&w->fx.waiting)))
		return;
	b = batch_new(w, (size_t)w->fx.n_active + 1);
	b->renew_gen = ++w->lease.renew_gen;
	TAILQ_FOREACH(e, &w->fx.sending, link) {
		/* cppcheck-suppress uninitvar ; e is a list element, set by the macro */
		if (e->lease_lost)
			continue;
		e->renew_gen = b->renew_gen;
		b->items[b->n++] = e;
	}
	TAILQ_FOREACH(e, &w->fx.waiting, link) {
		e->renew_gen = b->renew_gen;
		b->items[b->n++] = e;
	}
	ids = ids_array(b->items, b->n);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	snprintf(cap, sizeof(cap), "%ld", w->s.max_lease_seconds);
	params[0] = w->owner;
	params[1] = ids;
	params[2] = lease;
	params[3] = cap;
	/* The batch is only a generation marker now: effects may be freed
	 * before the answer, so on_renewed walks the live lists instead. */
	b->n = 0;
	/* On the lease connection, like mark and release, which update the
	 * same waiting rows: two connections could lock them in opposite
	 * orders and deadlock. */
	worker_query(w->db, SQL_RENEW, params, on_renewed, b, 0);
	free(ids);
}

/* ---- giving leases back -------------------------------------------------- */

/* Every waiting effect's lease back to the queue, due at once (a stop). */
void release_waiting(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	char *ids;
	const char *params[3];

	if (TAILQ_EMPTY(&w->fx.waiting))
		return;
	b = batch_new(w, (size_t)w->fx.n_active + 1);
	TAILQ_FOREACH(e, &w->fx.waiting, link) {
		/* cppcheck-suppress uninitvar ; e is a list element, set by the macro */
		b->items[b->n++] = e;
	}
	ids = ids_array(b->items, b->n);
	params[0] = w->owner;
	params[1] = ids;
	params[2] = "0";
	worker_query(w->db, SQL_RELEASE, params, NULL, NULL, DBQ_RETRY);
	log_msg(OLOG_INFO, "leases_released", "released %zu unstarted leases", b->n);
	for (size_t i = 0; i < b->n; i++)
		effect_free(b->items[i]);
	free(ids);
	free(b);
}

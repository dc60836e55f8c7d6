/* SPDX-License-Identifier: ISC */
/*
 * reconcile.c: asking providers what became of `unknown` effects.
 * reconcile_pass() leases a batch of them (outbox_reconcile_lease), every
 * RECONCILE_INTERVAL_MS and when an operator asks (outbox_request_reconcile:
 * its NOTIFY reconcile wakes the worker, at most a pass a second);
 * each goes to its provider's reconcile() (PH_RECONCILING), and the
 * verdicts are recorded in batches (flush_reconciled(),
 * outbox_reconcile_record: unknown -> completed / pending).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

static const char *const verdict_names[] = { "sent", "not_sent", "unknown" };

static void on_recon_recorded(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;

	(void)db;
	/* Count what the answers resolved (applied: the effect was still
	 * unknown and ours to move). */
	if (pg_ok(r, worker_sql[SQL_RECONCILE_RECORD].name))
		for (int row = 0; row < PQntuples(r); row++) {
			const char *st = PQgetvalue(r, row, COL_RECORD_STATE);
			if (PQgetvalue(r, row, COL_RECORD_APPLIED)[0] != 't')
				continue;
			if (strcmp(st, "completed") == 0)
				metrics_count_unknown_resolved("lookup_sent");
			else if (strcmp(st, "pending") == 0)
				metrics_count_unknown_resolved("lookup_not_sent");
		}
	for (size_t i = 0; i < b->n; i++)
		effect_free(b->items[i]);
	free(b);
	w->recon.record_busy = false;
	worker_kick(w);
}

/* One verdict as an element of outbox_reconcile_record()'s argument. */
static json_t *verdict_json(const struct effect *e)
{
	json_t *o = json_pack("{s:s,s:s}", "effect_id", e->id, "verdict",
	                      verdict_names[e->recon.verdict]);

	if (e->recon.status)
		json_object_set_new(o, "status", json_integer(e->recon.status));
	if (e->recon.provider_id[0])
		json_object_set_new(o, "provider_id", json_string(e->recon.provider_id));
	if (e->recon.error[0])
		json_object_set_new(o, "error", json_string(e->recon.error));
	return o;
}

void flush_reconciled(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	json_t *arr;
	char *js;
	const char *params[3];

	if (w->recon.record_busy || TAILQ_EMPTY(&w->fx.recon_q) || !db_is_up(w->rec))
		return;
	b = batch_new(w, RECONCILE_BATCH);
	arr = json_array();
	while ((e = TAILQ_FIRST(&w->fx.recon_q)) != NULL && b->n < RECONCILE_BATCH) {
		effect_set_phase(w, e, PH_RECORDING_VERDICT);
		b->items[b->n++] = e;
		json_array_append_new(arr, verdict_json(e));
		log_event(OLOG_INFO, "reconciled",
		          json_pack("{s:s,s:s,s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
		                    "type", e->type, "verdict", verdict_names[e->recon.verdict],
		                    "provider_id", e->recon.provider_id));
	}
	js = json_dumps(arr, JSON_COMPACT);
	json_decref(arr);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = js;
	w->recon.record_busy = true;
	worker_query(w->rec, SQL_RECONCILE_RECORD, params, on_recon_recorded, b, DBQ_RETRY);
	free(js);
}

static void on_recon_done(void *token, const struct outbox_recon_result *res)
{
	struct effect *e = token;
	struct worker *w = e->w;

	e->recon = *res;
	e->recon.provider_id[sizeof(e->recon.provider_id) - 1] = '\0';
	e->recon.error[sizeof(e->recon.error) - 1] = '\0';
	providers_scrub(e->recon.error, sizeof(e->recon.error));
	providers_scrub(e->recon.provider_id, sizeof(e->recon.provider_id));
	if (!utf8_valid(e->recon.error, strlen(e->recon.error)))
		e->recon.error[0] = '\0';
	if (!utf8_valid(e->recon.provider_id, strlen(e->recon.provider_id)))
		e->recon.provider_id[0] = '\0';
	if ((unsigned)e->recon.verdict > RECON_CANNOT_TELL)
		e->recon.verdict = RECON_CANNOT_TELL;
	effect_set_phase(w, e, PH_RECONCILED);
	worker_kick(w);
}

/* One leased unknown effect to its provider's reconcile(); "cannot tell"
 * at once when no provider here can ask. */
static void recon_ask(struct worker *w, PGresult *r, int row)
{
	struct effect *e = effect_from_row(w, r, row, false);
	char err[OUTBOX_ERROR_MAX] = "";
	json_error_t jerr;

	effect_set_phase(w, e, PH_RECONCILING);
	e->payload = payload_parse(e, &jerr);
	if (e->prov == NULL || !e->prov->can_reconcile || e->payload == NULL) {
		struct outbox_recon_result rr = { .verdict = RECON_CANNOT_TELL };
		text_copy(rr.error, "no provider here can reconcile it", sizeof(rr.error));
		on_recon_done(e, &rr);
		return;
	}
	effect_fill_view(e, e->prior_attempts);
	if (!PQgetisnull(r, row, COL_RECON_ATTEMPT_AGE_MS))
		e->view.attempt_age_ms = strtoll(PQgetvalue(r, row, COL_RECON_ATTEMPT_AGE_MS), NULL, 10);
	if (!e->prov->ops->reconcile(e->prov->self, &e->view, on_recon_done, e, err, sizeof(err))) {
		struct outbox_recon_result rr = { .verdict = RECON_CANNOT_TELL };
		snprintf(rr.error, sizeof(rr.error), "could not ask: %.480s", err);
		on_recon_done(e, &rr);
	}
}

static void on_recon_leased(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;

	(void)db;
	w->recon.busy = false;
	if (!pg_ok(r, worker_sql[SQL_RECONCILE_LEASE].name))
		return;
	/* A full batch of an operator's pass: more may be waiting; otherwise
	 * the pass is over. */
	if (w->recon.pass_asked && PQntuples(r) >= RECONCILE_BATCH)
		w->recon.requested = true;
	else
		w->recon.pass_asked = false;
	for (int row = 0; row < PQntuples(r); row++)
		if (!held_find(w, PQgetvalue(r, row, COL_EFFECT_ID)))
			recon_ask(w, r, row);
	worker_kick(w);
}

/* A NOTIFY 'reconcile' came: start a pass that re-asks what an
 * operator's request (outbox_request_reconcile, a row only operators may
 * write) made due again, at most one per RECONCILE_NOTIFY_GAP_MS however
 * many notifications come.  The lease decides which effects: one asked
 * since the last request, or within the floor interval, is not asked. */
void reconcile_on_notify(struct worker *w)
{
	int64_t now = now_mono_ms(), wait;

	if (!w->recon.notified)
		return;
	wait = w->recon.notified_pass_mono + RECONCILE_NOTIFY_GAP_MS - now;
	if (w->recon.notified_pass_mono != 0 && wait > 0) {
		worker_kick_in(w, wait);
		return;
	}
	w->recon.notified = false;
	w->recon.notified_pass_mono = now;
	w->recon.requested = true;
	w->recon.pass_asked = false;   /* a new request starts a new pass */
}

void reconcile_pass(struct worker *w, bool asked)
{
	const char *params[5];
	char interval[24];

	if (w->recon.busy || w->life.stopping || !w->life.schema_ok || !db_is_up(w->rec) ||
	    strcmp(w->recon_array, "{}") == 0 || w->fx.n_reconciling > 0)
		return;
	/* The periodic pass leaves recently asked effects alone.  An
	 * operator's request re-asks everything in its first batch; its later
	 * batches skip what this pass has already asked. */
	if (!asked) {
		snprintf(interval, sizeof(interval), "%d", RECONCILE_INTERVAL_MS / 1000);
	} else if (!w->recon.pass_asked) {
		w->recon.pass_start_mono = now_mono_ms();
		snprintf(interval, sizeof(interval), "0");
	} else {
		snprintf(interval, sizeof(interval), "%ld",
		         (long)((now_mono_ms() - w->recon.pass_start_mono) / 1000 + 1));
	}
	w->recon.pass_asked = asked;
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = w->recon_array;
	params[3] = RECONCILE_BATCH_STR;
	params[4] = interval;
	w->recon.busy = true;
	w->recon.requested = false;
	worker_query(w->rec, SQL_RECONCILE_LEASE, params, on_recon_leased, w, 0);
}

/* SPDX-License-Identifier: ISC */
/*
 * mark.c: the sending transition of leased effects, the commit point.
 * mark_ready() picks waiting effects whose provider and host have room
 * (releasing those whose host's breaker is open) and makes them `sending`
 * in one outbox_mark_sending() call, with the host each provider connects
 * to; the call reads the kill switch and the scopes under the switch's
 * lock (docs/design.md, "Kill switch", "Scoped pauses and rate limits").
 * on_marked() starts the sends of the rows that moved (start_send(),
 * send.c) and tallies the rest: lost, blocked by the kill switch, held by
 * a paused or limited scope (a limit's next slot wakes the worker).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "decide.h"
#include "hosts.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

static int mark_row(PGresult *r, const struct effect *e)
{
	for (int k = 0; k < PQntuples(r); k++)
		if (strcmp(PQgetvalue(r, k, COL_MARK_EFFECT_ID), e->id) == 0)
			return k;
	return -1;
}

/* What a mark batch's answer held back: rows the kill switch blocked, and
 * rows a paused or limited scope held (by scope), with when the first of
 * the deferred ones is due again. */
struct mark_tally {
	size_t blocked;
	json_t *blocked_ids;
	json_t *held;               /* {scope: {"count": n, "effect_ids": [...]}} */
	int64_t held_due_ms;        /* -1: none deferred; else the first deferred
	                             * row's slot, or, for a row sent at its
	                             * slot, when the slots after it come */
};

static void log_blocked(const struct mark_tally *t)
{
	metrics_inc(M_KILL_SWITCH_BLOCKED, t->blocked);
	metrics_set(G_KILL_SWITCH_ON, 0);
	log_event(OLOG_WARN, "kill_switch_blocked",
	          json_pack("{s:I,s:O,s:s}", "count", (json_int_t)t->blocked, "effect_ids",
	                    t->blocked_ids, "msg",
	                    "kill switch is off: leases released, no attempt spent"));
}

/* One line per scope: a pause at warn (an operator's decision, worth
 * seeing), a rate limit's deferral at info (its normal work). */
static void log_held(const struct mark_tally *t)
{
	const char *scope;
	json_t *v;

	json_object_foreach(t->held, scope, v) {
		bool paused = json_is_true(json_object_get(v, "paused"));
		json_int_t n = json_integer_value(json_object_get(v, "count"));

		metrics_inc(M_SCOPE_HELD, (unsigned long)n);
		log_event(paused ? OLOG_WARN : OLOG_INFO, "scope_held",
		          json_pack("{s:s,s:s,s:I,s:O,s:s}", "scope", scope, "why",
		                    paused ? "paused" : "limited", "count", n, "effect_ids",
		                    json_object_get(v, "effect_ids"), "msg",
		                    paused ? "scope paused: parked until it resumes, no attempt spent"
		                           : "over the scope's rate limit: due at its next slot, no "
		                             "attempt spent"));
	}
}

/* When to lease again: the soonest of the rows' times (-1: none). */
static void tally_due(struct mark_tally *t, int64_t due_ms)
{
	if (due_ms >= 0 && (t->held_due_ms < 0 || due_ms < t->held_due_ms))
		t->held_due_ms = due_ms;
}

/* A row a scope held: counted under its scope, its id kept (20 per scope). */
static void tally_held(struct mark_tally *t, const struct effect *e, const char *scope,
                       int64_t due_ms)
{
	json_t *v;

	if (t->held == NULL)
		t->held = json_object();
	v = json_object_get(t->held, scope);
	if (v == NULL) {
		v = json_pack("{s:I,s:[],s:b}", "count", (json_int_t)0, "effect_ids", "paused", due_ms < 0);
		json_object_set_new(t->held, scope, v);
	}
	json_object_set_new(v, "count", json_integer(json_integer_value(json_object_get(v, "count")) + 1));
	if (json_array_size(json_object_get(v, "effect_ids")) < 20)
		json_array_append_new(json_object_get(v, "effect_ids"), json_string(e->id));
	tally_due(t, due_ms);
}

/* One effect of a mark batch, by its row of the answer: lost, blocked by
 * the kill switch or held by a scope (tallied), or sent. */
static void marked_one(struct worker *w, struct batch *b, struct effect *e, PGresult *r,
                       struct mark_tally *t)
{
	int row = mark_row(r, e);

	if (row < 0) {
		/* CAS found the lease gone (expired, cancelled, taken). */
		metrics_inc(M_LEASE_LOST, 1);
		log_event(OLOG_WARN, "lease_lost",
		          json_pack("{s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
		                    "phase", "mark_sending"));
		unmark_probe(e);
		effect_free(e);
	} else if (PQgetvalue(r, row, COL_MARK_BLOCKED)[0] == 't') {
		const char *scope = PQgetvalue(r, row, COL_MARK_HELD_BY);

		if (scope[0]) {
			tally_held(t, e, scope, strtoll(PQgetvalue(r, row, COL_MARK_HELD_IN_MS), NULL, 10));
		} else {
			t->blocked++;
			if (t->blocked_ids == NULL)
				t->blocked_ids = json_array();
			if (json_array_size(t->blocked_ids) < 20)
				json_array_append_new(t->blocked_ids, json_string(e->id));
		}
		unmark_probe(e);
		effect_free(e);
	} else {
		/* Sent at the slot a limit deferred it to: more deferred rows are
		 * due at the slots after it, lease again then (not at the poll). */
		const char *again = PQgetvalue(r, row, COL_MARK_HELD_IN_MS);

		tally_due(t, again[0] ? strtoll(again, NULL, 10) : -1);
		start_send(w, e, atoi(PQgetvalue(r, row, COL_MARK_ATTEMPTS)), b->sent_mono);
	}
}

static void on_marked(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	struct mark_tally t = { .held_due_ms = -1 };

	(void)db;
	w->send.mark_busy = false;
	wire_answered(w, b);
	if (!job_ok(w, r, worker_sql[SQL_MARK_SENDING].name)) {
		/* Refused, so rolled back, and nothing was sent.  But a refused
		 * repeat (the first call's answer was lost with the connection)
		 * leaves what the first call marked: give the call up, which puts
		 * those rows back to pending with the attempt undone and makes a
		 * first call still on its way mark nothing, instead of leaving
		 * them `sending` for the reaper.  Leased rows the call did not
		 * mark expire and are leased again.  (r is never NULL here: a
		 * repeatable query outlives a lost connection.) */
		if (r != NULL) {
			const char *params[2] = { w->owner, b->call };
			worker_query(w->db, SQL_UNCLAIM_CALL, params, NULL, NULL, DBQ_RETRY | DBQ_URGENT);
		}
		for (size_t i = 0; i < b->n; i++) {
			unmark_probe(b->items[i]);
			effect_free(b->items[i]);
		}
		free(b);
		worker_kick(w);
		return;
	}
	for (size_t i = 0; i < b->n; i++)
		marked_one(w, b, b->items[i], r, &t);
	if (t.blocked)
		log_blocked(&t);
	if (t.held)
		log_held(&t);
	if (t.held_due_ms >= 0)
		worker_lease_in(w, t.held_due_ms);
	json_decref(t.blocked_ids);
	json_decref(t.held);
	free(b);
	worker_kick(w);
}

/* Waiting effects whose host's breaker is open go back, due when the
 * breaker half-opens; no attempt is spent. */
static void release_open_breakers(struct worker *w, struct batch *rel, int64_t delay_ms)
{
	char delay[24];
	char *ids = ids_array(rel->items, rel->n);
	const char *params[3] = { w->owner, ids, delay };

	snprintf(delay, sizeof(delay), "%lld", (long long)delay_ms);
	worker_query(w->db, SQL_RELEASE, params, NULL, NULL, DBQ_RETRY);
	free(ids);
	for (size_t i = 0; i < rel->n; i++)
		effect_free(rel->items[i]);
	free(rel);
}

/* Waiting effects that have a slot into b (PH_MARKING); those whose
 * breaker is open into *rel (still waiting, freed when released). */
static void mark_pick(struct worker *w, struct batch *b, struct batch **rel, int64_t *rel_delay)
{
	struct effect *e, *next;
	int64_t now = now_mono_ms(), wait_ms;
	bool half_open, free_slot;

	for (e = TAILQ_FIRST(&w->fx.waiting); e && b->n < (size_t)w->s.batch_size * 4; e = next) {
		next = TAILQ_NEXT(e, link);
		if (decide_mark_later(e->prov))
			continue;
		free_slot = slot_free(b, e, now, &wait_ms, &half_open);
		/* The breaker's wait is over: half-open now, so that the effect
		 * picked next is its one probe (mark_probe()). */
		if (half_open)
			host_half_open(e->host);
		if (!free_slot) {
			if (wait_ms > 0) {
				if (*rel == NULL)
					*rel = batch_new(w, (size_t)w->fx.n_active + 1);
				(*rel)->items[(*rel)->n++] = e;
				if (wait_ms > *rel_delay)
					*rel_delay = wait_ms;
			}
			continue;
		}
		effect_set_phase(w, e, PH_MARKING);
		b->items[b->n++] = e;
		mark_probe(e);
	}
}

/* Move effects whose provider and host have room from waiting to a mark
 * batch; release those whose host's breaker is open. */
void mark_ready(struct worker *w)
{
	struct batch *b, *rel = NULL;
	int64_t rel_delay = 0;
	char *ids, *hosts, lease[16];
	const char *params[7];

	/* Both connections: a send needs its lease renewed and its outcome
	 * recorded, which happen on the other one. */
	if (w->send.mark_busy || TAILQ_EMPTY(&w->fx.waiting) || !db_is_up(w->db) ||
	    !db_is_up(w->rec) || w->life.stopping)
		return;
	b = batch_new(w, (size_t)w->s.batch_size * 4);
	mark_pick(w, b, &rel, &rel_delay);
	if (rel) {
		release_open_breakers(w, rel, rel_delay);
		/* Lease them again when the breaker half-opens, not at the next
		 * poll tick (the margin: the release's now() is a little later
		 * than ours). */
		worker_lease_in(w, rel_delay + 50);
	}
	if (b->n == 0) {
		free(b);
		return;
	}
	ids = ids_array(b->items, b->n);
	hosts = hosts_array(b->items, b->n);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	uuid_v4(b->call);
	b->sent_mono = now_mono_ms();
	params[0] = w->owner;
	params[1] = ids;
	params[2] = w->env_enabled ? "true" : "false";
	params[3] = w->idem_array;
	params[4] = lease;
	params[5] = b->call;
	params[6] = hosts;
	w->send.mark_busy = true;
	wire_sent(w, w->db, b);
	/* Repeatable: the same call token gets its own rows back. */
	worker_query(w->db, SQL_MARK_SENDING, params, on_marked, b, DBQ_RETRY | DBQ_URGENT);
	free(ids);
	free(hosts);
}

/* SPDX-License-Identifier: ISC */
/*
 * claim.c: the claim kind of take.c's requests (claim_take): the lease
 * and the sending transition in one call (outbox_claim(),
 * sql/functions/35_claim.sql) for rows this worker can send at once.
 * claim_limit() decides, for each take take_batch() issues, whether it
 * can be a claim and of how many rows: only while nothing waits for a
 * slot and the providers and the busiest host have room for every row
 * asked for, so that each claimed row starts its send when the
 * answer arrives, as a marked row does; and only for a worker whose every
 * provider starts its sends at once (OUTBOX_CAP_STARTS_AT_ONCE; not
 * email's thread pool, where a claimed row could wait `sending` in a
 * queue).  claim_rows() sends them; a row that cannot go after all
 * (invalid, already held, its host's breaker open, the worker stopping,
 * its host one of the scoped hosts the claim drew no token for:
 * host_scoped()) is failed or given back (outbox_unclaim(), attempt
 * undone).  When a due row meets a pause, or a limit the claim cannot pay
 * for, it only leases, and its answer is the lease kind's
 * (claim_answered_as(): on_taken() hands it to lease.c).  Everything else
 * goes through outbox_lease and outbox_mark_sending (lease.c, send.c).
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

/* decide_claim_limit() on this worker's state (decide.h), which says when
 * to ask again. */
int claim_limit(struct worker *w, int limit, int full)
{
	const struct effect *oldest = TAILQ_FIRST(&w->fx.sending);
	struct claim_view v = {
		.claim_on = w->s.claim, .claimable = w->claimable,
		.waiting = !TAILQ_EMPTY(&w->fx.waiting),
		.lease_wire_busy = w->send.mark_busy || w->lease.busy,
		.oldest_send_age_ms = oldest ? now_mono_ms() - oldest->started_mono_ms : -1,
	};
	int busiest, rows;
	int64_t kick_in_ms;

	hosts_summary(w->hosts, &busiest, &v.breakers_open);
	v.room = decide_claim_room(&w->providers, busiest, w->lease.leasing_rows);
	rows = decide_claim_limit(&v, limit, full, &kick_in_ms);
	if (kick_in_ms > 0)
		worker_kick_in(w, kick_in_ms);
	return rows;
}

/* The host each served type's rows connect to, aligned with the types the
 * claim takes (w->types_array): its provider's one_host(), else NULL (the
 * database reads an http URL's host from the target).
 * The claim records it with each row it moves to `sending`, for the list a
 * host pause returns.  Freed by the caller. */
char *claim_type_hosts(const struct worker *w)
{
	size_t len = 3, at = 0;
	char *s;

	for (size_t i = 0; i < w->providers.n; i++)
		len += 2 * strlen(w->providers.slots[i].one_host) + 6;
	s = text_alloc(len);
	s[at++] = '{';
	for (size_t i = 0; i < w->providers.n; i++) {
		const struct provider_slot *p = &w->providers.slots[i];

		if (i)
			s[at++] = ',';
		if (p->one_host[0] == '\0') {
			memcpy(s + at, "NULL", 4);
			at += 4;
			continue;
		}
		s[at++] = '"';
		for (const char *c = p->one_host; *c; c++) {
			if (*c == '"' || *c == '\\')
				s[at++] = '\\';
			s[at++] = *c;
		}
		s[at++] = '"';
	}
	s[at++] = '}';
	s[at] = '\0';
	return s;
}

/* ---- the answer ----------------------------------------------------------- */

/* Give claimed rows back: pending again, attempt undone; with `release`
 * the lease too (due again after 100 ms), else kept for a later mark.  On
 * the lease connection, before any mark of the kept rows (issued later,
 * and urgent queries keep their order). */
static void unclaim(struct worker *w, const char *call, struct effect **items, size_t n,
                    bool release)
{
	char *ids = ids_array(items, n);
	const char *params[5] = { w->owner, ids, call, release ? "true" : "false", "100" };

	worker_query(w->db, SQL_UNCLAIM, params, NULL, NULL, DBQ_RETRY | DBQ_URGENT);
	free(ids);
}

/* What became of the rows of one answer, by what is still to be done. */
struct claimed {
	json_t *invalid;                /* outbox_fail_invalid() items */
	struct effect **back, **kept;   /* given back (freed after); kept, waiting */
	size_t n_back, n_kept;
};

/* Whether e's provider connects to one of the hosts scoped when the claim
 * ran that the claim drew no token for (check_hosts, the row's own, a
 * text[] as PostgreSQL writes it: {a,"b"}).  The database claimed the row
 * by its own reading of the target; this is the reading that counts, the
 * host the breaker and the mark use. */
static bool host_scoped(const struct effect *e, const char *check_hosts)
{
	char host[sizeof(e->host_key)];
	const char *p;
	size_t n;

	if (check_hosts == NULL)
		return false;
	if (check_hosts[0] != '{' || strchr(check_hosts, '\\') != NULL)
		return true;    /* unreadable: the sending transition decides */
	host_key_host(e->host_key, host, sizeof(host));
	n = strlen(host);
	for (p = check_hosts + 1; *p != '\0' && *p != '}';) {
		bool quoted = *p == '"';
		const char *start = p + quoted;
		const char *end = quoted ? strchr(start, '"') : start + strcspn(start, ",}");

		if (end == NULL)
			return true;    /* unreadable: the sending transition decides */
		if ((size_t)(end - start) == n && memcmp(start, host, n) == 0)
			return true;
		p = end + quoted;
		if (*p == ',')
			p++;
	}
	return false;
}

/* A new row: sent, failed as invalid, given back or kept waiting. */
static void claimed_new(struct worker *w, const struct batch *b, PGresult *r, int row,
                        struct claimed *c)
{
	struct effect *e = effect_from_row(w, r, row, true);
	char err[OUTBOX_ERROR_MAX];
	int64_t wait_ms;
	bool half_open, free_slot;

	if (!effect_validate(w, e, err, sizeof(err))) {
		effect_invalid(e, err, b->call, &c->invalid);
		return;
	}
	if (w->life.stopping || !db_is_up(w->db) || !db_is_up(w->rec)) {
		/* No send starts unless both connections are up (its lease is
		 * renewed on one, its outcome recorded on the other). */
		c->back[c->n_back++] = e;
		return;
	}
	if (host_scoped(e, PQgetisnull(r, row, COL_CLAIM_CHECK_HOSTS)
	                   ? NULL : PQgetvalue(r, row, COL_CLAIM_CHECK_HOSTS))) {
		/* Its host is paused or limited, and the claim paid for none
		 * of it: kept, and marked with the host (the sending
		 * transition holds it or draws on the bucket). */
		effect_set_phase(w, e, PH_WAITING);
		c->kept[c->n_kept++] = e;
		return;
	}
	free_slot = slot_free(NULL, e, now_mono_ms(), &wait_ms, &half_open);
	/* The breaker's wait is over: half-open, so that a send now is its
	 * one probe (mark_probe()). */
	if (half_open)
		host_half_open(e->host);
	if (!free_slot) {
		/* Its host filled up or its breaker opened since claim_limit():
		 * it waits for a slot like a leased row (send.c releases it
		 * while the breaker is open). */
		effect_set_phase(w, e, PH_WAITING);
		c->kept[c->n_kept++] = e;
	} else {
		mark_probe(e);
		effect_set_phase(w, e, PH_MARKING);
		start_send(w, e, e->prior_attempts + 1, b->sent_mono);
	}
}

static void claimed_rows(struct worker *w, const struct batch *b, PGresult *r)
{
	size_t n = (size_t)PQntuples(r);
	struct claimed c = { .back = text_array(n + 1, sizeof(struct effect *)),
	                     .kept = text_array(n + 1, sizeof(struct effect *)) };

	for (int row = 0; row < PQntuples(r); row++) {
		struct effect *held = held_find(w, PQgetvalue(r, row, COL_EFFECT_ID));

		/* Held already.  A waiting row whose lease lapsed: back to
		 * pending with our lease, for its waiting copy to mark.  A retry
		 * whose outcome committed on the other connection: back to the
		 * queue, due again shortly.  Never a second copy. */
		if (held && held->phase == PH_WAITING)
			c.kept[c.n_kept++] = held;
		else if (held)
			c.back[c.n_back++] = held;
		else
			claimed_new(w, b, r, row, &c);
	}
	fail_invalid(w, c.invalid);
	if (c.n_kept)
		unclaim(w, b->call, c.kept, c.n_kept, false);
	if (c.n_back) {
		unclaim(w, b->call, c.back, c.n_back, true);
		for (size_t i = 0; i < c.n_back; i++)
			if (c.back[i]->phase == PH_NEW)
				effect_free(c.back[i]);
	}
	free(c.back);
	free(c.kept);
}

/* When a due row meets a pause or a limit the claim cannot pay for, the
 * claim only leases (leased_only, the same for every row of an answer): its
 * rows are the lease kind's, to be marked with the host each provider
 * connects to, and on_taken() hands them to it. */
static enum take_kind claim_answered_as(const PGresult *r)
{
	return PQntuples(r) > 0 && PQgetvalue(r, 0, COL_CLAIM_LEASED_ONLY)[0] == 't'
	       ? TAKE_LEASE : TAKE_CLAIM;
}

/* Rows claimed (sending already): sent, or failed, given back or kept. */
static void claim_rows(struct worker *w, const struct batch *b, PGresult *r)
{
	metrics_inc(M_CLAIMED, (unsigned long)PQntuples(r));
	claimed_rows(w, b, r);
}

/* Refused, so rolled back.  But a refused repeat (DBQ_RETRY sets p_repeat
 * after a lost connection, and the answer cannot tell) leaves what its
 * first call claimed: give the call up, which puts any such rows back and
 * makes a late first call claim nothing (NULL: the connection is being
 * freed); then the pump runs again. */
static bool claim_refused(struct worker *w, const struct batch *b, PGresult *r)
{
	if (r != NULL) {
		const char *params[2] = { w->owner, b->call };
		worker_query(w->db, SQL_UNCLAIM_CALL, params, NULL, NULL, DBQ_RETRY | DBQ_URGENT);
	}
	return true;
}

/* The statement's parameters: p_lease_if_scoped, p_type_hosts, then p_repeat last,
 * false (DBQ_REPEAT_FLAG sets the last one on a repeat). */
static void claim_params(const struct take_args *a, const char *params[TAKE_PARAMS_MAX])
{
	params[0] = a->owner;
	params[1] = a->name;
	params[2] = a->limit;
	params[3] = a->lease_seconds;
	params[4] = a->types;
	params[5] = a->env_enabled;
	params[6] = a->idem_types;
	params[7] = a->call;
	params[8] = a->after_at;
	params[9] = a->after_id;
	params[10] = a->max_payload;
	params[11] = "true";    /* p_lease_if_scoped: this worker reads leased_only */
	params[12] = a->type_hosts;
	params[13] = "false";
}

/* The claim as take.c sends it, with a call token of its own.  Repeated
 * with p_repeat = true if the connection breaks with it on the wire: the
 * repeat returns the rows the first call moved. */
const struct take_handlers claim_take = {
	.stmt = SQL_CLAIM,
	.flags = DBQ_RETRY | DBQ_REPEAT_FLAG,
	.has_call = true,
	.params = claim_params,
	.answered_as = claim_answered_as,
	.rows = claim_rows,
	.refused = claim_refused,
	.entries_col = COL_CLAIM_DUE_ENTRIES,
};

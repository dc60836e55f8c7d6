/* SPDX-License-Identifier: ISC */
/*
 * lease.c: the effects a worker takes and keeps.  lease_batch() asks
 * outbox_claim() (claim.c: rows that can all be sent at once) or
 * outbox_lease() for due rows (from the head of the due index, or from
 * the position after the last row leased while the head is slow:
 * lease_cursor_update()); on_leased() validates each row and queues it
 * (PH_WAITING) or fails it as invalid.  The heartbeat renews the leases of
 * waiting and sending effects (outbox_renew); release_waiting() gives
 * unstarted leases back at a stop.
 */
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "decide.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

/* Leasing from the position (see lease_batch()): scans from the head at
 * least this far apart, and at least HEAD_SCAN_FACTOR times as long as the
 * last one took, so that a head full of dead entries (vacuum held back)
 * costs the lease path at most a tenth of its time. */
#define HEAD_SCAN_MIN_MS 1000
#define HEAD_SCAN_FACTOR 10
/* Slow leases from the head in a row before leasing from the position: one
 * slow answer is more often a busy machine than a head full of dead
 * entries, and a switch makes late-committed rows wait for a head scan. */
#define HEAD_SLOW_STREAK 3
/* A head this slow is worth an operator's look (a long transaction holding
 * vacuum back): lease_mode is logged at warn.  Between lease_head_slow_ms
 * and this, a busy queue between two autovacuums: info. */
#define HEAD_SLOW_WARN_MS 100

/* ---- the due-index position ---------------------------------------------- */

/* A change of mode at info; a slow head at warn, also while the mode
 * stays (a snapshot held for an hour is still news). */
static void log_lease_mode(bool slow, bool warn, int64_t took)
{
	const char *msg =
		!slow ? "the due index's head is fast again: leasing from the head"
		: warn ? "the due index's head is slow (dead entries: is a long transaction "
		         "holding vacuum back?): leasing from the last position, from the "
		         "head only now and then"
		       : "the due index's head is slower than lease_head_slow_ms (dead entries "
		         "of a busy queue between vacuums): leasing from the last position, "
		         "from the head only now and then";

	log_event(warn ? OLOG_WARN : OLOG_INFO, "lease_mode",
	          json_pack("{s:s,s:I,s:s}", "mode", slow ? "position" : "head",
	                    "head_scan_ms", (json_int_t)took, "msg", msg));
}

/* After a scan from the head that took `took` ms: into position mode
 * after HEAD_SLOW_STREAK slow ones in a row, out of it at the first fast
 * one; the next scan from the head HEAD_SCAN_FACTOR times `took` later. */
static void head_scan_timed(struct worker *w, int64_t took, int64_t now)
{
	struct worker_lease *l = &w->lease;
	int64_t wait = took * HEAD_SCAN_FACTOR;
	bool slow, warn;

	l->head_slow_streak = w->s.lease_head_slow_ms == 0 || took > w->s.lease_head_slow_ms
	                      ? l->head_slow_streak + 1 : 0;
	slow = l->from_position ? l->head_slow_streak > 0 : l->head_slow_streak >= HEAD_SLOW_STREAK;
	/* Warn once a minute at most: under a held-back vacuum the head can
	 * be fast and slow by turns. */
	warn = slow && took >= HEAD_SLOW_WARN_MS && now - l->mode_warned_mono > 60000;
	if (warn)
		l->mode_warned_mono = now;
	if (slow != l->from_position || warn)
		log_lease_mode(slow, warn, took);
	l->from_position = slow;
	l->head_scan_due_mono = now + (wait > HEAD_SCAN_MIN_MS ? wait : HEAD_SCAN_MIN_MS);
}

/* Rows come back in due-index order; the position is after the last one.
 * In position mode a scan from the head only picks up what became due
 * behind the position, which stays where it is (ahead).  `took` is the
 * lease's time on the wire and in the server (not its wait in the queue). */
static void lease_cursor_update(struct worker *w, PGresult *r, bool from_head, int64_t took)
{
	int n = PQntuples(r);
	bool was_position = w->lease.from_position;

	if (from_head)
		head_scan_timed(w, took, now_mono_ms());
	/* While leasing from the head the position follows every lease, so that
	 * it is current when the head turns slow. */
	if (n == 0 || (from_head && was_position && w->lease.after_id[0]))
		return;
	str_copy(w->lease.after_at, PQgetvalue(r, n - 1, COL_LEASE_AVAILABLE_AT),
	         sizeof(w->lease.after_at));
	str_copy(w->lease.after_id, PQgetvalue(r, n - 1, COL_EFFECT_ID), sizeof(w->lease.after_id));
}

/* Forget the position: the next lease scans from the head (rows given back
 * behind it, e.g. while the kill switch was off, or a new connection). */
void lease_cursor_reset(struct worker *w)
{
	w->lease.after_at[0] = '\0';
	w->lease.after_id[0] = '\0';
}

/* ---- leasing ------------------------------------------------------------- */

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
				again = xcalloc((size_t)PQntuples(r), sizeof(*again));
			again[n_again++] = held;
		} else if (held == NULL) {
			leased_new(w, r, row, &invalid);
		}
		/* else ours already (its lease had lapsed while it waited): the
		 * lease is fresh again; keep the one copy we have. */
	}
	if (invalid) {
		char *js = json_dumps(invalid, JSON_COMPACT);
		const char *params[2] = { w->owner, js };
		worker_query(w->rec, SQL_FAIL_INVALID, params, NULL, NULL, DBQ_RETRY);
		free(js);
		json_decref(invalid);
	}
	if (again) {
		char *ids = ids_array(again, n_again);
		const char *params[3] = { w->owner, ids, "100" };
		worker_query(w->db, SQL_RELEASE, params, NULL, NULL, DBQ_RETRY);
		free(ids);
		free(again);
	}
}

/* A lease or a claim of `limit` rows going out on `db`: the batch its
 * answer gets (the limit in gen, from_head, on_rec, sent_mono), and the
 * rows counted as on the wire. */
struct batch *lease_on_wire(struct worker *w, struct db *db, bool from_head, int limit)
{
	struct batch *b = batch_new(w, 0);

	b->gen = (uint64_t)limit;
	b->from_head = from_head;
	b->on_rec = db == w->rec;
	b->sent_mono = now_mono_ms();
	if (b->on_rec)
		w->lease.head_busy = true;
	else
		w->lease.busy = true;
	w->lease.leasing_rows += limit;
	wire_sent(w, db, b);
	return b;
}

/* The answer to a lease or a claim: off the wire; false when the database
 * refused it; else the burst (more_due), the backlog count, the metric and
 * the due-index position follow it. */
bool lease_answered(struct worker *w, struct db *db, const struct batch *b, PGresult *r,
                    const char *what)
{
	int limit = (int)b->gen;

	wire_answered(w, b);
	if (b->on_rec)
		w->lease.head_busy = false;
	else
		w->lease.busy = false;
	w->lease.leasing_rows -= limit;
	if (!job_ok(w, r, what)) {
		w->lease.more_due = false;
		return false;
	}
	w->lease.more_due = PQntuples(r) >= limit;
	if (!b->on_rec)
		w->lease.full_leases = w->lease.more_due ? w->lease.full_leases + 1 : 0;
	metrics_inc(M_LEASED, (unsigned long)PQntuples(r));
	lease_cursor_update(w, r, b->from_head, now_mono_ms() - db_head_sent_mono(db));
	return true;
}

static void on_leased(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	bool ok = lease_answered(w, db, b, r, worker_sql[SQL_LEASE].name);

	free(b);
	if (!ok)
		return;
	leased_rows(w, r);
	/* A lease that was on the wire when SIGTERM came: give it back. */
	if (w->life.stopping)
		release_waiting(w);
	worker_kick(w);
}

/* One outbox_lease() call on `db`, from the head or from the position. */
static void lease_send(struct worker *w, struct db *db, bool from_head, int limit)
{
	char lim[16], lease[16], max_payload[24];
	const char *params[9];
	struct batch *b = lease_on_wire(w, db, from_head, limit);

	snprintf(lim, sizeof(lim), "%d", limit);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = lim;
	params[3] = lease;
	params[4] = w->types_array;
	params[5] = w->env_enabled ? "true" : "false";
	params[6] = from_head ? NULL : w->lease.after_at;
	params[7] = from_head ? NULL : w->lease.after_id;
	snprintf(max_payload, sizeof(max_payload), "%ld", w->s.max_payload_bytes);
	params[8] = max_payload;
	worker_query(db, SQL_LEASE, params, on_leased, b, b->on_rec ? 0 : DBQ_URGENT);
}

/* decide_lease_worth_it(): a busy worker leases only once half a batch fits. */
static bool lease_worth_it(const struct worker *w, int limit, int full)
{
	return decide_lease_worth_it(w->fx.n_active + w->lease.leasing_rows, limit, full);
}

/* One lease of `limit` rows on `db`: a claim of as many as claim_limit()
 * allows, else the old lease.  False when neither is worth it now. */
static bool lease_or_claim(struct worker *w, struct db *db, bool from_head, int limit, int full)
{
	int claim = claim_limit(w, limit, full);

	if (claim < 0)
		return false;
	if (claim > 0 && lease_worth_it(w, claim, full)) {
		claim_send(w, db, from_head, claim);
		return true;
	}
	if (claim > 0 || !lease_worth_it(w, limit, full))
		return false;
	lease_send(w, db, from_head, limit);
	return true;
}

void lease_batch(struct worker *w)
{
	int full = w->s.max_in_flight < w->s.batch_size ? (int)w->s.max_in_flight : (int)w->s.batch_size;
	int room = (int)w->s.max_in_flight - w->fx.n_active - w->lease.leasing_rows;
	int limit = room < full ? room : full;
	bool position = w->lease.from_position && w->lease.after_id[0] != '\0';
	bool issued = false;

	if (w->life.stopping || !w->life.schema_ok || !db_is_up(w->db) || !db_is_up(w->rec))
		return;
	/* Lease only when there may be work: after a full batch, a NOTIFY, a
	 * poll tick or a reconnect.  An empty answer ends the burst. */
	if (!w->lease.more_due && !w->lease.wanted)
		return;
	/* Do not lease more than can be marked soon: rows waiting for a slot
	 * already cover the next batch. */
	if (!TAILQ_EMPTY(&w->fx.waiting) && w->fx.n_active - w->fx.n_sending >= (int)w->s.batch_size)
		return;
	/* From the head of the due index, which finds every due row.  While
	 * that is slow (the entries earlier rows left there pile up when a
	 * long transaction holds vacuum back), from the position after the
	 * last row leased; and from the head now and then for rows that became
	 * due behind it, on the other connection, so that its walk never holds
	 * up the latency path. */
	if (position && !w->lease.head_busy && now_mono_ms() >= w->lease.head_scan_due_mono &&
	    lease_or_claim(w, w->rec, true, limit, full)) {
		issued = true;
		room = (int)w->s.max_in_flight - w->fx.n_active - w->lease.leasing_rows;
		limit = room < full ? room : full;
	}
	if (!w->lease.busy && lease_or_claim(w, w->db, !position, limit, full))
		issued = true;
	if (issued) {
		w->lease.more_due = false;
		w->lease.wanted = false;
	}
}

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
		if (e->renew_gen != b->gen || e->lease_lost || renewed_row(r, e))
			continue;
		e->lease_lost = true;
		log_event(OLOG_WARN, "lease_lost",
		          json_pack("{s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
		                    "phase", "sending"));
	}
	TAILQ_FOREACH_SAFE(e, &w->fx.waiting, link, next) {
		if (e->renew_gen != b->gen || renewed_row(r, e))
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
	b->gen = ++w->lease.renew_gen;
	TAILQ_FOREACH(e, &w->fx.sending, link) {
		/* cppcheck-suppress uninitvar ; e is a list element, set by the macro */
		if (e->lease_lost)
			continue;
		e->renew_gen = b->gen;
		b->items[b->n++] = e;
	}
	TAILQ_FOREACH(e, &w->fx.waiting, link) {
		e->renew_gen = b->gen;
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

/* SPDX-License-Identifier: ISC */
/*
 * take.c: taking due rows.  take_batch() decides, when the pump runs,
 * whether to ask for rows, on which connection (the lease connection; in
 * position mode also a head scan on the records connection), of which kind
 * and how many (claim_limit(), decide_take()): a claim (outbox_claim:
 * lease and mark in one call, claim.c) or a lease (outbox_lease, lease.c).
 * Both leave through one sender, take_send(), and come back through one
 * answer path, on_taken(): the wire bookkeeping, the burst (more_due), the
 * backlog count, the metric and the due-index position are the same for
 * both; what differs (statement, parameters, what becomes of the rows, a
 * refusal) is the kind's entry in take_kinds[], and which kind's rows
 * handler an answer goes to is the kind's to say (answered_as: a claim
 * that only leased is the lease kind's).  The position: leasing
 * from the head of the due index, or from the position after the last row
 * taken while the head is slow (take_cursor_update()).
 */
#include <stdio.h>
#include <stdlib.h>

#include "db.h"
#include "decide.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

/* The kinds of request, by enum take_kind: what each one's statement is
 * and what becomes of its answer. */
static const struct take_handlers *const take_kinds[TAKE_KINDS] = {
	[TAKE_LEASE] = &lease_take,
	[TAKE_CLAIM] = &claim_take,
};

/* ---- the due-index position ---------------------------------------------- */

/* A change of mode at info; a slow head at warn, also while the mode
 * stays (a snapshot held for an hour is still news).  head_entries: the
 * index entries the scan passed over (negative: not known, decide.h). */
static void log_lease_mode(bool slow, bool warn, int64_t took, int64_t passed)
{
	const char *msg =
		!slow ? "the due index's head is fast again: leasing from the head"
		: warn ? "the due index's head is slow (dead entries: is a long transaction "
		         "holding vacuum back?): leasing from the last position, from the "
		         "head only now and then"
		       : "the due index's head is slower than lease_head_slow_ms or full of "
		         "entries no lease can take (dead entries of a busy queue between "
		         "vacuums, sends in flight): leasing from the last position, from the "
		         "head only now and then";

	log_event(warn ? OLOG_WARN : OLOG_INFO, "lease_mode",
	          json_pack("{s:s,s:I,s:I,s:s}", "mode", slow ? "position" : "head",
	                    "head_scan_ms", (json_int_t)took, "head_entries", (json_int_t)passed,
	                    "msg", msg));
}

/* After a scan from the head that took `took` ms and passed over `passed`
 * index entries: decide_head_scan() on the lease state, and what it says
 * done (decide.h: the streak, the mode, the next scan from the head, the
 * log line). */
static void head_scan_timed(struct worker *w, int64_t took, int64_t passed, int64_t now)
{
	struct worker_lease *l = &w->lease;
	const struct head_scan_view v = {
		.from_position = l->from_position, .slow_streak = l->head_slow_streak,
		.slow_ms = w->s.lease_head_slow_ms, .warned_mono = l->mode_warned_mono,
		.unseen_streak = l->head_unseen_streak,
	};
	const struct head_scan_verdict d = decide_head_scan(&v, took, passed, now);

	if (d.warn)
		l->mode_warned_mono = now;
	if (d.log)
		log_lease_mode(d.from_position, d.warn, took, passed);
	l->head_slow_streak = d.slow_streak;
	l->head_unseen_streak = d.unseen_streak;
	l->from_position = d.from_position;
	l->head_scan_due_mono = d.next_scan_mono;
}

/* The index entries a take's walk passed over without taking them: those
 * it read (entries_col) less the rows it returned; HEAD_PASSED_UNKNOWN
 * from a statement that does not count them (a lease), HEAD_PASSED_UNSEEN
 * from an answer with no row to say it on (or a repeat's). */
static int64_t take_passed(const PGresult *r, int entries_col)
{
	int n = PQntuples(r);
	long long read;

	if (entries_col < 0 || entries_col >= PQnfields(r))
		return HEAD_PASSED_UNKNOWN;
	if (n == 0 || PQgetisnull(r, 0, entries_col))
		return HEAD_PASSED_UNSEEN;
	read = strtoll(PQgetvalue(r, 0, entries_col), NULL, 10);
	return read > n ? (int64_t)(read - n) : 0;
}

/* Rows come back in due-index order; the position is after the last one.
 * In position mode a scan from the head only picks up what became due
 * behind the position, which stays where it is (ahead).  `took` is the
 * lease's time on the wire and in the server (not its wait in the queue). */
static void take_cursor_update(struct worker *w, PGresult *r, bool from_head, int64_t took,
                               int entries_col)
{
	int n = PQntuples(r);
	bool was_position = w->lease.from_position;

	if (from_head)
		head_scan_timed(w, took, take_passed(r, entries_col), now_mono_ms());
	/* While leasing from the head the position follows every lease, so that
	 * it is current when the head turns slow. */
	if (n == 0 || (from_head && was_position && w->lease.after_id[0]))
		return;
	text_copy(w->lease.after_at, PQgetvalue(r, n - 1, COL_LEASE_AVAILABLE_AT),
	         sizeof(w->lease.after_at));
	text_copy(w->lease.after_id, PQgetvalue(r, n - 1, COL_EFFECT_ID), sizeof(w->lease.after_id));
}

/* Forget the position: the next lease scans from the head (rows given back
 * behind it, e.g. while the kill switch was off, or a new connection). */
void take_cursor_reset(struct worker *w)
{
	w->lease.after_at[0] = '\0';
	w->lease.after_id[0] = '\0';
}

/* ---- one sender, one answer path ----------------------------------------- */

/* A take of `rows` going out on `db`: its batch and the rows counted as
 * on the wire. */
static struct batch *take_on_wire(struct worker *w, struct db *db, enum take_kind kind,
                                  bool from_head, int rows)
{
	struct batch *b = batch_new(w, 0);

	b->kind = kind;
	b->rows_asked = rows;
	b->from_head = from_head;
	b->on_rec = db == w->rec;
	b->sent_mono = now_mono_ms();
	if (b->on_rec)
		w->lease.head_busy = true;
	else
		w->lease.busy = true;
	w->lease.leasing_rows += rows;
	wire_sent(w, db, b);
	return b;
}

/* The answer to a take: off the wire; false when the database refused it;
 * else the burst (more_due), the backlog count, the metric and the
 * due-index position follow it. */
static bool take_answered(struct worker *w, struct db *db, const struct batch *b, PGresult *r,
                          const struct take_handlers *k)
{
	const char *what = worker_sql[k->stmt].name;

	wire_answered(w, b);
	if (b->on_rec)
		w->lease.head_busy = false;
	else
		w->lease.busy = false;
	w->lease.leasing_rows -= b->rows_asked;
	if (!job_ok(w, r, what)) {
		w->lease.more_due = false;
		return false;
	}
	w->lease.more_due = PQntuples(r) >= b->rows_asked;
	if (!b->on_rec)
		w->lease.full_leases = w->lease.more_due ? w->lease.full_leases + 1 : 0;
	metrics_inc(M_LEASED, (unsigned long)PQntuples(r));
	take_cursor_update(w, r, b->from_head, now_mono_ms() - db_head_sent_mono(db), k->entries_col);
	return true;
}

static void on_taken(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	const struct take_handlers *k = take_kinds[b->kind];
	bool kick = true;

	if (take_answered(w, db, b, r, k))
		take_kinds[k->answered_as ? k->answered_as(r) : b->kind]->rows(w, b, r);
	else
		kick = k->refused(w, b, r);
	free(b);
	if (kick)
		worker_kick(w);
}

/* One take of `rows` on `db`, from the head or from the position. */
static void take_send(struct worker *w, struct db *db, enum take_kind kind, bool from_head,
                      int rows)
{
	const struct take_handlers *k = take_kinds[kind];
	char lim[16], lease[16], max_payload[24];
	const char *params[TAKE_PARAMS_MAX];
	struct batch *b = take_on_wire(w, db, kind, from_head, rows);
	/* Only a claim moves rows to `sending` without a mark. */
	char *type_hosts = kind == TAKE_CLAIM ? claim_type_hosts(w) : NULL;
	struct take_args a = {
		.owner = w->owner, .name = w->name, .limit = lim, .lease_seconds = lease,
		.types = w->types_array, .env_enabled = w->env_enabled ? "true" : "false",
		.idem_types = w->idem_array, .call = b->call,
		.after_at = from_head ? NULL : w->lease.after_at,
		.after_id = from_head ? NULL : w->lease.after_id,
		.max_payload = max_payload,
		.type_hosts = type_hosts,
	};

	snprintf(lim, sizeof(lim), "%d", rows);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	snprintf(max_payload, sizeof(max_payload), "%ld", w->s.max_payload_bytes);
	if (k->has_call)
		uuid_v4(b->call);
	k->params(&a, params);
	worker_query(db, k->stmt, params, on_taken, b, k->flags | (b->on_rec ? 0 : DBQ_URGENT));
	free(type_hosts);
}

/* ---- what to take -------------------------------------------------------- */

/* One take of up to `limit` rows on `db`: decide_take() on claim_limit()
 * and what is in flight.  False when nothing is worth it now. */
static bool take_one(struct worker *w, struct db *db, bool from_head, int limit, int full)
{
	int claim = claim_limit(w, limit, full), rows;
	enum take_kind kind;

	if (!decide_take(claim, limit, full, w->fx.n_active + w->lease.leasing_rows, &kind, &rows))
		return false;
	take_send(w, db, kind, from_head, rows);
	return true;
}

void take_batch(struct worker *w)
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
	    take_one(w, w->rec, true, limit, full)) {
		issued = true;
		room = (int)w->s.max_in_flight - w->fx.n_active - w->lease.leasing_rows;
		limit = room < full ? room : full;
	}
	if (!w->lease.busy && take_one(w, w->db, !position, limit, full))
		issued = true;
	if (issued) {
		w->lease.more_due = false;
		w->lease.wanted = false;
	}
}

/* SPDX-License-Identifier: ISC */
/*
 * send.c: an effect from the sending transition to its recorded outcome.
 * start_send() hands each effect made `sending` (by a mark, mark.c, or a
 * claim, claim.c) to its provider; on_send_done() takes the answer and
 * policy_decide()'s next state; flush_completions() records outcomes in
 * batches (outbox_complete_sending(), on_complete(); outbox_complete_rest() for
 * what it did not apply).
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

/* A provider that queues its sends: outcomes wait at most this long for
 * more of its answers (gather_queued()). */
#ifndef QUEUED_GATHER_MS
#define QUEUED_GATHER_MS 500
#endif

/* ---- logging of one attempt -------------------------------------------- */

static json_t *attempt_fields(struct effect *e, bool applied, const char *resolved)
{
	return json_pack("{s:s,s:s,s:s,s:s,s:s,s:i,s:s,s:s,s:i,s:I,s:i,s:b}",
	                 "run_key", e->run_key, "effect_id", e->id, "type", e->type,
	                 "target_class", e->host_key, "payload_hash", e->payload_hash ? e->payload_hash : "",
	                 "attempt", e->view.attempt, "outcome", outcome_name(e->result.outcome),
	                 "next_state", applied ? next_state_name(e->decision.next) : "lease_lost",
	                 "provider_status", e->result.status,
	                 "duration_ms", (json_int_t)(e->ended_mono_ms - e->started_mono_ms),
	                 "retry_count", e->view.attempt - 1, "lease_held", applied && !resolved);
}

/* resolved: the state change applied to an `unknown` effect the reaper
 * had made of this attempt (outbox_complete), not under the lease. */
static void log_attempt(struct effect *e, bool applied, const char *resolved)
{
	enum outbox_log_level level = !applied ? OLOG_WARN
	                              : e->result.outcome == OUTCOME_ACCEPTED ? OLOG_INFO
	                              : e->result.key_conflict ? OLOG_ERROR : OLOG_WARN;
	json_t *f;

	/* On the hot path: at [log] level = warn, accepted attempts are not
	 * printed, so their line is not built either. */
	if (!log_wants(level))
		return;
	f = attempt_fields(e, applied, resolved);
	if (e->result.provider_id[0])
		json_object_set_new(f, "provider_id", json_string(e->result.provider_id));
	if (e->result.error[0])
		json_object_set_new(f, "error", json_string(e->result.error));
	if (resolved)
		json_object_set_new(f, "resolved", json_string(resolved));
	if (e->metadata)
		json_object_set(f, "metadata", e->metadata);
	if (e->approved_by)
		json_object_set_new(f, "approver", json_string(e->approved_by));
	if (e->decision.next == NEXT_PENDING && applied)
		json_object_set_new(f, "retry_in_ms", json_integer(e->decision.delay_ms));
	if (e->decision.exhausted)
		json_object_set_new(f, "retries_exhausted", json_true());
	log_event(level, "attempt", f);
}

/* This attempt's late outcome resolved the `unknown` effect the reaper had
 * made of it (outbox_complete): counted and logged once, when the database says
 * so. */
static void log_resolved(struct effect *e, const char *how)
{
	metrics_count_unknown_resolved(how);
	log_event(OLOG_INFO, "unknown_resolved",
	          json_pack("{s:s,s:s,s:s,s:s,s:i,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
	                    "type", e->type, "how", how, "attempt", e->view.attempt, "provider_id",
	                    e->result.provider_id, "msg",
	                    strcmp(how, "late_accepted") == 0
	                            ? "the provider's late acceptance completed the unknown effect"
	                            : "the attempt given up on was not sent: back to pending, same key"));
}

/* ---- recording outcomes ------------------------------------------------- */

/* One outcome as an element of a completion's p_results (the keys of
 * its jsonb_to_recordset; status, provider_id and error only when set).
 * Written as text: json_pack + json_dumps per batch cost the worker a
 * noticeable share of its instructions (docs/performance.md, "Where the
 * time goes"). */
static void completion_json(struct strbuf *sb, const struct effect *e)
{
	sb_puts(sb, "{\"effect_id\":");
	sb_json_string(sb, e->id);
	sb_puts(sb, ",\"attempt\":");
	sb_int(sb, e->view.attempt);
	/* How long ago the send started, by the monotonic clock: the
	 * database dates it from its own clock (a worker's wall clock may be
	 * off; outbox_complete), so nothing is decided on this host's time. */
	sb_puts(sb, ",\"started_ms_ago\":");
	sb_int(sb, (long long)(now_mono_ms() - e->started_mono_ms));
	sb_puts(sb, ",\"outcome\":");
	sb_json_string(sb, outcome_name(e->result.outcome));
	sb_puts(sb, ",\"next_state\":");
	sb_json_string(sb, next_state_name(e->decision.next));
	sb_puts(sb, ",\"retry_delay_ms\":");
	sb_int(sb, e->decision.delay_ms);
	if (e->result.status) {
		sb_puts(sb, ",\"status\":");
		sb_int(sb, e->result.status);
	}
	/* Both are valid UTF-8 (on_send_done() sees to it). */
	if (e->result.provider_id[0]) {
		sb_puts(sb, ",\"provider_id\":");
		sb_json_string(sb, e->result.provider_id);
	}
	if (e->result.error[0]) {
		sb_puts(sb, ",\"error\":");
		sb_json_string(sb, e->result.error);
	}
	sb_append(sb, "}", 1);
}

/* The row of effect id in a completion's answer, or -1. */
static int answer_row(PGresult *r, const char *id)
{
	for (int row = 0; row < PQntuples(r); row++)
		if (strcmp(PQgetvalue(r, row, COL_COMPLETE_EFFECT_ID), id) == 0)
			return row;
	return -1;
}

/* One recorded effect: its row in the answer (-1: none) says whether the
 * CAS applied (and whether it resolved an `unknown`). */
static void completed_one(struct worker *w, struct effect *e, PGresult *r, int row)
{
	bool applied = false;
	const char *resolved = NULL;

	if (row >= 0) {
		applied = PQgetvalue(r, row, COL_COMPLETE_APPLIED)[0] == 't';
		if (!PQgetisnull(r, row, COL_COMPLETE_RESOLVED))
			resolved = PQgetvalue(r, row, COL_COMPLETE_RESOLVED);
	}
	log_attempt(e, applied, resolved);
	if (resolved)
		log_resolved(e, resolved);
	if (!applied)
		metrics_inc(M_LEASE_LOST, 1);
	else if (e->decision.exhausted && e->decision.next == NEXT_FAILED)
		metrics_inc(M_RETRIES_EXHAUSTED, 1);
	if (e->late)
		late_resolve_recorded(w, e);
	effect_free(e);
}

/* The database refused a completion: keep the evidence, back to the
 * queue, tried again after a pause (do not spin). */
static void complete_refused(struct worker *w, struct batch *b)
{
	for (size_t i = b->n; i-- > 0;)
		effect_set_phase(w, b->items[i], PH_DONE);
	free(b);
	w->send.complete_busy = false;
	w->send.complete_retry_mono = now_mono_ms() + 1000;
}

/* outbox_complete_rest()'s answer: a row for every element it was given. */
static void on_complete_rest(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;

	(void)db;
	if (!job_ok(w, r, worker_sql[SQL_COMPLETE_REST].name)) {
		complete_refused(w, b);
		return;
	}
	for (size_t i = 0; i < b->n; i++)
		completed_one(w, b->items[i], r, answer_row(r, b->items[i]->id));
	free(b);
	w->send.complete_busy = false;
	worker_kick(w);
}

/* The elements outbox_complete_sending() did not apply (late evidence, a
 * lost lease, a batch delivered twice): on the same connection, still
 * busy, so that no other batch of this worker's runs between the two. */
static void complete_rest(struct worker *w, struct db *db, struct batch *b)
{
	struct strbuf js;
	const char *params[3];

	sb_init(&js, 1024);
	sb_append(&js, "[", 1);
	for (size_t i = 0; i < b->n; i++) {
		if (i > 0)
			sb_append(&js, ",", 1);
		completion_json(&js, b->items[i]);
	}
	sb_append(&js, "]", 1);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = js.s;
	/* Safe to repeat: locked, CAS, evidence once per (attempt, owner). */
	worker_query(db, SQL_COMPLETE_REST, params, on_complete_rest, b, DBQ_RETRY);
	free(js.s);
}

/* outbox_complete_sending()'s answer: a row per element it applied (the
 * usual batch: all of them); the rest, if any, goes to
 * outbox_complete_rest(). */
static void on_complete(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg, *rest = NULL;
	struct worker *w = b->w;

	if (!job_ok(w, r, worker_sql[SQL_COMPLETE].name)) {
		complete_refused(w, b);
		return;
	}
	for (size_t i = 0; i < b->n; i++) {
		int row = answer_row(r, b->items[i]->id);

		if (row >= 0) {
			completed_one(w, b->items[i], r, row);
			continue;
		}
		if (rest == NULL)
			rest = batch_new(w, b->n);
		rest->items[rest->n++] = b->items[i];
	}
	free(b);
	if (rest != NULL) {
		complete_rest(w, db, rest);
		return;
	}
	w->send.complete_busy = false;
	worker_kick(w);
}

/* Where outcomes are recorded.  In a backlog (BACKLOG_FULL_LEASES full
 * leases in a row), on the lease connection, behind the latency path's urgent
 * queries: one busy backend per worker instead of two, which costs the
 * database less CPU and WAL per effect (docs/performance.md, "Where the
 * time goes").  Otherwise
 * on the records connection, so that a lease never waits for an outcome
 * on the wire. */
static struct db *outcomes_db(const struct worker *w)
{
	return decide_outcomes_on_lease_db((int)w->s.busy_connections, w->lease.full_leases,
	                                   db_is_up(w->db))
	               ? w->db : w->rec;
}

/* In a backlog, whether to let outcomes gather into a bigger batch: each
 * outbox_complete() call costs the database a fixed part (planning its
 * statements, the function) besides its rows.  Only while sends or a
 * lease or mark are in flight, for at most BACKLOG_GATHER_MS, and only in
 * a worker whose providers all start their sends at once (w->claimable):
 * beside email's queue, quick chaos runs left more never-sent `unknown`
 * emails with gathering (15 and 30) than without (0-5). */
static bool gather_more(struct worker *w)
{
	const struct effect *e;
	struct gather_view v = {
		.claimable = w->claimable, .full_leases = w->lease.full_leases,
		.in_flight = w->fx.n_sending > 0 || w->lease.busy || w->send.mark_busy,
		.oldest_age_ms = now_mono_ms() - TAILQ_FIRST(&w->fx.done_q)->ended_mono_ms,
		.complete_batch = (size_t)w->s.complete_batch,
	};
	int64_t wait_ms;

	if (w->life.stopping)
		return false;

	TAILQ_FOREACH(e, &w->fx.done_q, link) {     /* as far as it can change the answer */
		v.queued++;
		v.any_not_sent |= e->result.outcome == OUTCOME_NOT_SENT;
		if (v.any_not_sent || v.queued * 2 >= v.complete_batch)
			break;
	}
	wait_ms = decide_gather_ms(&v);
	if (wait_ms > 0)
		worker_kick_in(w, wait_ms);
	return wait_ms > 0;
}

/* The outcomes of a queueing provider with sends still in flight (more
 * answers to come) wait for half its max_in_flight of them, at most
 * QUEUED_GATHER_MS: a relay's answers end one by one, as
 * many round trips apart as a message takes, and one outbox_complete()
 * call per answer costs the database ~1.5 ms each.  An outcome that was
 * not sent (its row is `sending` until recorded: a worker killed meanwhile
 * would leave it `unknown`) is recorded at once, as are all at a stop. */
static bool gather_queued(struct worker *w)
{
	const struct effect *first = TAILQ_FIRST(&w->fx.done_q), *e;
	const struct provider_slot *p = first->prov;
	int64_t age = now_mono_ms() - first->ended_mono_ms;
	long queued = 0;

	if (w->claimable || w->life.stopping || age >= QUEUED_GATHER_MS ||
	    (p->ops->caps & OUTBOX_CAP_STARTS_AT_ONCE) || p->policy.max_in_flight < 8 || p->in_flight == 0)
		return false;
	/* Another provider's outcome (http beside email) is not held for
	 * email's answers. */
	TAILQ_FOREACH(e, &w->fx.done_q, link)
		if (e->result.outcome == OUTCOME_NOT_SENT || e->prov != p ||
		    ++queued * 2 >= p->policy.max_in_flight ||
		    queued >= w->s.complete_batch)
			return false;
	worker_kick_in(w, QUEUED_GATHER_MS - age);
	return true;
}

void flush_completions(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	struct strbuf js;
	const char *params[3];
	size_t n = 0;

	if (w->send.complete_busy || TAILQ_EMPTY(&w->fx.done_q) || !db_is_up(outcomes_db(w)) ||
	    now_mono_ms() < w->send.complete_retry_mono || gather_more(w) || gather_queued(w))
		return;
	b = batch_new(w, (size_t)w->s.complete_batch);
	sb_init(&js, 4096);
	sb_append(&js, "[", 1);
	while ((e = TAILQ_FIRST(&w->fx.done_q)) != NULL && n < (size_t)w->s.complete_batch) {
		effect_set_phase(w, e, PH_RECORDING);
		b->items[n++] = e;
		if (n > 1)
			sb_append(&js, ",", 1);
		completion_json(&js, e);
	}
	sb_append(&js, "]", 1);
	b->n = n;
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = js.s;
	w->send.complete_busy = true;
	/* Safe to repeat after a lost connection: CAS + unique attempt rows. */
	worker_query(outcomes_db(w), SQL_COMPLETE, params, on_complete, b, DBQ_RETRY);
	free(js.s);
}

/* ---- sending ------------------------------------------------------------- */

/* The provider's texts cut to their buffers, without the config's secrets
 * (a peer may echo them) and valid UTF-8 (they go into JSON and the
 * database). */
static void result_sanitize(struct outbox_result *res)
{
	res->provider_id[sizeof(res->provider_id) - 1] = '\0';
	res->error[sizeof(res->error) - 1] = '\0';
	providers_scrub(res->error, sizeof(res->error));
	providers_scrub(res->provider_id, sizeof(res->provider_id));
	if (!utf8_valid(res->error, strlen(res->error)))
		text_copy(res->error, "(provider error text was not UTF-8)", sizeof(res->error));
	if (!utf8_valid(res->provider_id, strlen(res->provider_id)))
		res->provider_id[0] = '\0';
}

/* The provider's answer, on the loop thread. */
static void on_send_done(void *token, const struct outbox_result *res)
{
	struct effect *e = token;
	struct worker *w = e->w;
	struct provider_slot *p = e->prov;
	int64_t now = now_mono_ms();

	e->result = *res;
	result_sanitize(&e->result);
	e->ended_mono_ms = now;
	e->decision = policy_decide(&e->result, e->view.attempt - e->retry_base, &p->policy,
	                            p->honours_keys);
	/* Every completed effect has a provider id (docs/design.md, "Providers"). */
	if (e->result.outcome == OUTCOME_ACCEPTED && e->result.provider_id[0] == '\0')
		snprintf(e->result.provider_id, sizeof(e->result.provider_id), "local:%s:%d:a%d",
		         p->name, e->result.status, e->view.attempt);
	p->in_flight--;
	if (host_send_done(e->host, &e->result, (int)p->policy.breaker_failures,
	                   p->policy.breaker_open_ms, now)) {
		metrics_inc(M_BREAKER_OPENED, 1);
		log_event(OLOG_WARN, "breaker_open",
		          json_pack("{s:s,s:s,s:I}", "provider", p->name, "host", e->host_key,
		                    "probe_in_ms", (json_int_t)(e->host->open_until_ms - now)));
	}
	if (e->result.key_conflict)
		metrics_inc(M_KEY_CONFLICTS, 1);
	metrics_count_send(p->name, outcome_name(e->result.outcome));
	metrics_observe_send(p->name, (double)(now - e->started_mono_ms) / 1000.0);
	effect_set_phase(w, e, PH_DONE);
	worker_kick(w);
}

/* Hand the effect to its provider, now that the statement sent at
 * `confirmed_sent_mono` (a mark or a claim) made it `sending`.  An answer
 * that came so late (a stopped process, a stalled database) that the lease
 * may have lapsed, and the reaper or a kill switch turned off meanwhile
 * moved on, is recorded as not sent instead (the same bookkeeping, no
 * call). */
void start_send(struct worker *w, struct effect *e, int attempt, int64_t confirmed_sent_mono)
{
	char err[OUTBOX_ERROR_MAX] = "";
	const char *refuse = now_mono_ms() - confirmed_sent_mono > w->s.lease_seconds * 1000 * 2 / 3
	                     ? "the sending transition was confirmed too late to act on" : NULL;

	effect_fill_view(e, attempt);
	e->started_mono_ms = now_mono_ms();
	e->prov->in_flight++;
	host_send_started(e->host);
	effect_set_phase(w, e, PH_SENDING);
	if (refuse) {
		struct outbox_result r = { .outcome = OUTCOME_NOT_SENT, .retry_after_ms = -1 };
		snprintf(r.error, sizeof(r.error), "not sent: %.480s", refuse);
		on_send_done(e, &r);
	} else if (!e->prov->ops->send(e->prov->self, &e->view, on_send_done, e, err, sizeof(err))) {
		struct outbox_result r = { .outcome = OUTCOME_NOT_SENT, .retry_after_ms = -1 };
		snprintf(r.error, sizeof(r.error), "could not start: %.480s", err[0] ? err : "provider refused");
		on_send_done(e, &r);
	}
}

/* SPDX-License-Identifier: ISC */
/*
 * effect.c: one effect in a worker: reading it from a row, checking its
 * payload with its provider, the set of ids the worker holds, and
 * effect_set_phase(), the one place that moves an effect between phases
 * (and with it between the worker's lists and counters).  Also the batch
 * that carries effects through one statement.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hosts.h"
#include "json_text.h"
#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

static const char *const phase_names[] = {
	[PH_NEW] = "new", [PH_WAITING] = "waiting", [PH_MARKING] = "marking",
	[PH_SENDING] = "sending", [PH_DONE] = "done", [PH_RECORDING] = "recording",
	[PH_RECONCILING] = "reconciling", [PH_RECONCILED] = "reconciled",
	[PH_RECORDING_VERDICT] = "recording_verdict", [PH_GONE] = "gone",
};

/* ---- the held set -------------------------------------------------------- */

static unsigned held_bucket(const char *id)
{
	unsigned v = 2166136261u;

	for (; *id; id++)
		v = (v ^ (unsigned char)*id) * 16777619u;
	return v % HELD_BUCKETS;
}

struct effect *held_find(struct worker *w, const char *id)
{
	struct effect *e;

	for (e = w->fx.held[held_bucket(id)]; e; e = e->held_next)
		if (strcmp(e->id, id) == 0)
			return e;
	return NULL;
}

static void held_add(struct worker *w, struct effect *e)
{
	unsigned b = held_bucket(e->id);

	e->held_next = w->fx.held[b];
	w->fx.held[b] = e;
}

static void held_remove(struct worker *w, struct effect *e)
{
	struct effect **pp = &w->fx.held[held_bucket(e->id)];

	for (; *pp; pp = &(*pp)->held_next)
		if (*pp == e) {
			*pp = e->held_next;
			return;
		}
}

/* ---- phases -------------------------------------------------------------- */

/* The moves an effect can make (docs/design.md's states, as this worker
 * sees them).  Every phase may end in PH_GONE: a lost lease, a refused
 * statement, a recorded outcome, the worker's end. */
static bool phase_move_allowed(enum effect_phase from, enum effect_phase to)
{
	if (to == PH_GONE)
		return from != PH_GONE;
	switch (from) {
	case PH_NEW:   /* claimed rows (claim.c) go straight to marking */
		return to == PH_WAITING || to == PH_MARKING || to == PH_RECONCILING;
	case PH_WAITING:
		return to == PH_MARKING;
	case PH_MARKING:
		return to == PH_SENDING;
	case PH_SENDING:
		return to == PH_DONE;
	case PH_DONE:
		return to == PH_RECORDING;
	case PH_RECORDING:
		return to == PH_DONE;   /* outbox_complete() refused: kept, tried again */
	case PH_RECONCILING:
		return to == PH_RECONCILED;
	case PH_RECONCILED:
		return to == PH_RECORDING_VERDICT;
	case PH_RECORDING_VERDICT:
	case PH_GONE:
		return false;
	}
	return false;
}

static void phase_leave(struct worker *w, struct effect *e)
{
	switch (e->phase) {
	case PH_WAITING:
		TAILQ_REMOVE(&w->fx.waiting, e, link);
		break;
	case PH_SENDING:
		TAILQ_REMOVE(&w->fx.sending, e, link);
		w->fx.n_sending--;
		metrics_set(G_IN_FLIGHT, w->fx.n_sending);
		break;
	case PH_DONE:
		TAILQ_REMOVE(&w->fx.done_q, e, link);
		break;
	case PH_RECONCILING:
		w->fx.n_reconciling--;
		break;
	case PH_RECONCILED:
		TAILQ_REMOVE(&w->fx.recon_q, e, link);
		break;
	case PH_NEW:
	case PH_MARKING:
	case PH_RECORDING:
	case PH_RECORDING_VERDICT:
	case PH_GONE:
		break;   /* in a batch or on no list */
	}
}

static void phase_enter(struct worker *w, struct effect *e, enum effect_phase from)
{
	switch (e->phase) {
	case PH_WAITING:
		TAILQ_INSERT_TAIL(&w->fx.waiting, e, link);
		break;
	case PH_SENDING:
		TAILQ_INSERT_TAIL(&w->fx.sending, e, link);
		w->fx.n_sending++;
		metrics_set(G_IN_FLIGHT, w->fx.n_sending);
		break;
	case PH_DONE:
		/* Back from a refused outbox_complete(): first in the queue, so
		 * that its caller, walking the batch backwards, keeps the order. */
		if (from == PH_RECORDING)
			TAILQ_INSERT_HEAD(&w->fx.done_q, e, link);
		else
			TAILQ_INSERT_TAIL(&w->fx.done_q, e, link);
		break;
	case PH_RECONCILING:
		w->fx.n_reconciling++;
		break;
	case PH_RECONCILED:
		TAILQ_INSERT_TAIL(&w->fx.recon_q, e, link);
		break;
	case PH_GONE:
		held_remove(w, e);
		w->fx.n_active--;
		break;
	case PH_NEW:
	case PH_MARKING:
	case PH_RECORDING:
	case PH_RECORDING_VERDICT:
		break;   /* in a batch: the batch holds it */
	}
}

/* Move e to phase `to`: off its list, onto the new one, the counters with
 * it.  An impossible move is refused (logged, nothing changed): a bug
 * here must not corrupt the lists or crash the worker. */
bool effect_set_phase(struct worker *w, struct effect *e, enum effect_phase to)
{
	enum effect_phase from = e->phase;

	if (!phase_move_allowed(from, to)) {
		log_msg(OLOG_ERROR, "effect_phase", "effect %s: refused move from %s to %s", e->id,
		        phase_names[from], phase_names[to]);
		return false;
	}
	phase_leave(w, e);
	e->phase = to;
	phase_enter(w, e, from);
	return true;
}

/* ---- one effect ---------------------------------------------------------- */

/* Off its list and out of the held set, then freed.  (The refusal below
 * cannot catch a second free: the memory is gone by then.  It keeps an
 * effect whose phase says it left the lists from being unlinked twice.) */
void effect_free(struct effect *e)
{
	if (!effect_set_phase(e->w, e, PH_GONE))
		return;   /* logged by effect_set_phase() */
	hosts_release(e->w->hosts, e->host);
	free(e->run_key);
	free(e->type);
	free(e->target);
	free(e->payload_text);
	free(e->payload_hash);
	free(e->effect_key);
	free(e->approved_by);
	json_decref(e->payload);
	json_decref(e->metadata);
	free(e->late);
	free(e);
}

/* Every effect still held, at the worker's end. */
void effects_free_all(struct worker *w)
{
	struct effect *e;

	while ((e = TAILQ_FIRST(&w->fx.sending)) != NULL)
		effect_free(e);
	while ((e = TAILQ_FIRST(&w->fx.waiting)) != NULL)
		effect_free(e);
	while ((e = TAILQ_FIRST(&w->fx.done_q)) != NULL)
		effect_free(e);
	while ((e = TAILQ_FIRST(&w->fx.recon_q)) != NULL)
		effect_free(e);
}

static char *dup_field(PGresult *r, int row, int col)
{
	return PQgetisnull(r, row, col) ? NULL : text_strdup(PQgetvalue(r, row, col));
}

/* A row of SQL_LEASE (full) or SQL_RECONCILE_LEASE, as a PH_NEW effect. */
struct effect *effect_from_row(struct worker *w, PGresult *r, int row, bool full)
{
	struct effect *e = text_alloc(sizeof(*e));

	e->w = w;
	e->phase = PH_NEW;
	w->fx.n_active++;
	text_copy(e->id, PQgetvalue(r, row, COL_EFFECT_ID), sizeof(e->id));
	e->run_key = dup_field(r, row, COL_IDEMPOTENCY_KEY);
	e->type = dup_field(r, row, COL_EFFECT_TYPE);
	e->target = dup_field(r, row, COL_TARGET);
	e->payload_text = dup_field(r, row, COL_PAYLOAD);
	e->payload_len = e->payload_text ? (size_t)PQgetlength(r, row, COL_PAYLOAD) : 0;
	e->payload_hash = dup_field(r, row, COL_PAYLOAD_HASH);
	e->effect_key = dup_field(r, row, COL_EFFECT_KEY);
	e->prior_attempts = atoi(PQgetvalue(r, row, COL_ATTEMPTS));
	if (full) {
		if (!PQgetisnull(r, row, COL_LEASE_METADATA))
			e->metadata = json_loads(PQgetvalue(r, row, COL_LEASE_METADATA), 0, NULL);
		else if (!PQgetisnull(r, row, COL_LEASE_METADATA_BYTES))
			e->metadata_withheld_len =
			    strtoul(PQgetvalue(r, row, COL_LEASE_METADATA_BYTES), NULL, 10);
		/* An oversized payload comes as NULL text and its length. */
		if (e->payload_text == NULL && !PQgetisnull(r, row, COL_LEASE_PAYLOAD_BYTES))
			e->payload_len = strtoul(PQgetvalue(r, row, COL_LEASE_PAYLOAD_BYTES), NULL, 10);
		e->approved_by = dup_field(r, row, COL_LEASE_APPROVED_BY);
		e->retry_base = atoi(PQgetvalue(r, row, COL_LEASE_RETRY_BASE));
	}
	e->prov = providers_find(&w->providers, e->type);
	held_add(w, e);
	return e;
}

void effect_fill_view(struct effect *e, int attempt)
{
	e->view = (struct outbox_effect){
		.effect_id = e->id, .run_key = e->run_key, .effect_key = e->effect_key,
		.effect_type = e->type, .target = e->target, .payload = e->payload,
		.payload_hash = e->payload_hash, .attempt = attempt,
		.payload_text = e->payload_text ? e->payload_text : "", .payload_len = e->payload_len,
		.attempt_age_ms = -1,
	};
}

/* The payload as jansson values, for the provider's checks (what leaves is
 * payload_text: provider.h), without the members the provider reads from
 * the text (its text_members: http's body).  An integer beyond 64 bits is
 * valid JSON and jsonb keeps it; jansson refuses it unless integers are
 * read as doubles, so such a payload is read again that way.  NULL with
 * jansson's reason. */
json_t *payload_parse(const struct effect *e, json_error_t *jerr)
{
	const char *text = e->payload_text ? e->payload_text : "";
	const char *const *skip = e->prov ? e->prov->ops->text_members : NULL;
	json_t *p = json_text_parse_except(text, e->payload_len, skip, JSON_DECODE_ANY, jerr);

	if (p == NULL && json_error_code(jerr) == json_error_numeric_overflow)
		p = json_text_parse_except(text, e->payload_len, skip,
		                           JSON_DECODE_ANY | JSON_DECODE_INT_AS_REAL, jerr);
	return p;
}

/* The payload parsed, within the size limit, and an object; false with
 * the reason in err. */
static bool payload_check(struct worker *w, struct effect *e, char *err, size_t errlen)
{
	json_error_t jerr;
	size_t len = e->payload_len;

	if ((long)len > w->s.max_payload_bytes) {
		snprintf(err, errlen, "payload is %zu bytes, over the limit of %ld", len,
		         w->s.max_payload_bytes);
		return false;
	}
	if (e->payload_text == NULL) {  /* withheld under a lower limit, reloaded since */
		snprintf(err, errlen, "payload is %zu bytes, over the limit when it was leased", len);
		return false;
	}
	e->payload = payload_parse(e, &jerr);
	if (e->payload == NULL) {
		/* PostgreSQL accepted it: deeper than jansson's limit is not "invalid". */
		if (json_error_code(&jerr) == json_error_stack_overflow)
			snprintf(err, errlen, "payload is nested too deeply (limit %d)", JSON_PARSER_MAX_DEPTH);
		else
			snprintf(err, errlen, "payload is not valid JSON: %s", jerr.text);
		return false;
	}
	if (!json_is_object(e->payload)) {
		snprintf(err, errlen, "payload must be a JSON object");
		return false;
	}
	return true;
}

/* Parse and check an effect; false with the reason in err. */
bool effect_validate(struct worker *w, struct effect *e, char *err, size_t errlen)
{
	char key[320];

	if (e->prov == NULL) {
		snprintf(err, errlen, "unknown effect type \"%.64s\": no provider loaded", e->type);
		return false;
	}
	if (!payload_check(w, e, err, errlen))
		return false;
	if (e->metadata_withheld_len > 0) {
		snprintf(err, errlen, "metadata is %zu bytes, over the limit of %d",
		         e->metadata_withheld_len, OUTBOX_METADATA_MAX_BYTES);
		return false;
	}
	effect_fill_view(e, e->prior_attempts + 1);
	err[0] = '\0';
	if (!e->prov->ops->validate(e->prov->self, &e->view, e->host_key, sizeof(e->host_key), err,
	                            errlen)) {
		if (err[0] == '\0')
			snprintf(err, errlen, "rejected by provider %s", e->prov->name);
		return false;
	}
	snprintf(key, sizeof(key), "%s|%s", e->prov->name, e->host_key);
	hosts_release(w->hosts, e->host);   /* validated before: let go of the old one */
	e->host = hosts_get(w->hosts, key);
	return true;
}

/* A leased or claimed row that failed effect_validate(): logged, counted,
 * added to *invalid (failed in one outbox_fail_invalid() call, which fails
 * a claimed row only under its claim's call token) and freed. */
void effect_invalid(struct effect *e, const char *err, const char *call, json_t **invalid)
{
	if (*invalid == NULL)
		*invalid = json_array();
	json_array_append_new(*invalid, json_pack("{s:s,s:s,s:s,s:s?}", "effect_id", e->id,
	                                          "error_class", "invalid", "error", err,
	                                          "call", call));
	log_event(OLOG_WARN, "effect_invalid",
	          json_pack("{s:s,s:s,s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
	                    "type", e->type, "payload_hash",
	                    e->payload_hash ? e->payload_hash : "", "error", err));
	metrics_inc(M_INVALID, 1);
	effect_free(e);
}

/* An effect picked to be sent (a mark batch, a claim): a half-open
 * breaker's probe is counted now, so that only one goes through. */
void mark_probe(struct effect *e)
{
	if (e->host->breaker == BREAKER_HALF_OPEN)
		e->host->probe_in_flight = true;
}

/* An effect picked for a mark batch that will not be sent after all: a
 * half-open breaker must not wait forever for its probe. */
void unmark_probe(struct effect *e)
{
	if (e->host && e->host->breaker == BREAKER_HALF_OPEN && e->host->in_flight == 0)
		e->host->probe_in_flight = false;
}

/* ---- batches -------------------------------------------------------------- */

struct batch *batch_new(struct worker *w, size_t cap)
{
	struct batch *b = text_alloc(sizeof(*b) + cap * sizeof(struct effect *));

	b->w = w;
	return b;
}

/* The effects' ids as a PostgreSQL array literal of uuid text. */
char *ids_array(struct effect **items, size_t n)
{
	size_t len = 3 + n * 38;
	char *s = text_alloc(len), *p = s;

	*p++ = '{';
	for (size_t i = 0; i < n; i++) {
		if (i)
			*p++ = ',';
		memcpy(p, items[i]->id, strlen(items[i]->id));
		p += strlen(items[i]->id);
	}
	*p++ = '}';
	*p = '\0';
	return s;
}

/* The hosts the effects' providers connect to (host_key_host()), as a
 * PostgreSQL text[] literal in the order of items: what the sending
 * transition matches host scopes against. */
char *hosts_array(struct effect **items, size_t n)
{
	size_t len = 3, at = 0;
	char host[sizeof(items[0]->host_key)];
	char *s;

	for (size_t i = 0; i < n; i++)
		len += 2 * strlen(items[i]->host_key) + 3;
	s = text_alloc(len);
	s[at++] = '{';
	for (size_t i = 0; i < n; i++) {
		host_key_host(items[i]->host_key, host, sizeof(host));
		if (i)
			s[at++] = ',';
		s[at++] = '"';
		for (const char *c = host; *c; c++) {
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

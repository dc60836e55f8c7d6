/* SPDX-License-Identifier: ISC */
/*
 * acts.c: the acts (POST, checked by main.c first: actions on, a person,
 * the Origin, the CSRF token).  Every act runs in one transaction as the
 * person's own role (set_config('role', person, true), so PostgreSQL
 * checks that the person may, and the operator functions record the
 * person), calling the functions outboxctl calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "pages.h"

/* ---- acts --------------------------------------------------------------------------- */

/* One act: BEGIN, the person's role for this transaction only, the
 * statement, COMMIT.  NULL and *err on failure (rolled back). */
static PGresult *act(const struct req *rq, const char *sql, int n, const char *const *params,
                     const char **err)
{
	static char msg[512];
	const char *role[1] = { rq->identity };
	PGconn *c = console_db();
	PGresult *r, *t;

	*err = NULL;
	if (c == NULL) {
		*err = "the database cannot be reached";
		return NULL;
	}
	PQclear(PQexec(c, "BEGIN"));
	t = PQexecParams(c, "SELECT set_config('role', $1, true)", 1, NULL, role, NULL, NULL, 0);
	if (PQresultStatus(t) != PGRES_TUPLES_OK) {
		snprintf(msg, sizeof(msg), "you (%s) cannot act as yourself in the database: %s",
		         rq->identity, PQresultErrorField(t, PG_DIAG_MESSAGE_PRIMARY)
		                           ? PQresultErrorField(t, PG_DIAG_MESSAGE_PRIMARY) : "?");
		PQclear(t);
		PQclear(PQexec(c, "ROLLBACK"));
		*err = msg;
		return NULL;
	}
	PQclear(t);
	r = PQexecParams(c, sql, n, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(r) != PGRES_TUPLES_OK && PQresultStatus(r) != PGRES_COMMAND_OK) {
		const char *m = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
		snprintf(msg, sizeof(msg), "%s", m ? m : PQerrorMessage(c));
		PQclear(r);
		PQclear(PQexec(c, "ROLLBACK"));
		*err = msg;
		return NULL;
	}
	t = PQexec(c, "COMMIT");
	if (PQresultStatus(t) != PGRES_COMMAND_OK) {
		snprintf(msg, sizeof(msg), "the commit failed: %s", PQerrorMessage(c));
		PQclear(t);
		PQclear(r);
		*err = msg;
		return NULL;
	}
	PQclear(t);
	return r;
}

/* The answer's frame; its banner is drawn once the act is done (pages.c),
 * so that it shows what the act changed. */
static void act_page(const struct req *rq, struct strbuf *b, struct resp *out, const char *title,
                     const char *back)
{
	page_begin(b, rq, title, back);
	out->banner_at = b->len;
}

static void act_failed(struct strbuf *b, struct resp *out, const char *err)
{
	out->status = 403;
	sb_puts(b, "<p class=\"msg err\" id=\"result\">refused: ");
	h(b, err);
	sb_puts(b, "</p>");
}

void do_resolve(const struct req *rq, struct strbuf *b, struct resp *out)
{
	const char *verdict = req_get(rq, "verdict"), *reason = req_get(rq, "reason"), *err;
	const char *pid = req_get(rq, "provider_id");
	int done = 0, refused = 0;

	act_page(rq, b, out, "unknown", "/unknown");
	if (verdict == NULL || reason == NULL ||
	    (strcmp(verdict, "sent") != 0 && strcmp(verdict, "not_sent") != 0)) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">say sent or not sent, and why</p>");
		page_end(b);
		return;
	}
	sb_puts(b, "<ul id=\"result\">");
	for (int i = 0; i < rq->nfields; i++) {
		const char *params[5];
		PGresult *r;
		if (strcmp(rq->keys[i], "id") != 0 || strlen(rq->values[i]) != 36)
			continue;
		params[0] = rq->values[i];
		params[1] = strcmp(verdict, "sent") == 0 ? "true" : "false";
		params[2] = rq->identity;
		params[3] = reason;
		params[4] = strcmp(verdict, "sent") == 0 ? pid : NULL;
		r = act(rq, "SELECT applied, state, idempotency_key, run_state FROM "
		            "outbox_resolve_unknown($1::uuid, $2::boolean, $3, $4, $5)", 5, params, &err);
		sb_puts(b, "<li>");
		h(b, params[0]);
		if (r == NULL) {
			sb_puts(b, ": refused: ");
			h(b, err);
			refused++;
		} else if (PQntuples(r) == 0) {
			sb_puts(b, ": no such effect");
			refused++;
		} else if (PQgetvalue(r, 0, 0)[0] != 't') {
			sb_puts(b, ": it is ");
			h(b, v(r, 0, 1));
			sb_puts(b, ", not unknown: nothing changed");
			refused++;
		} else {
			sb_puts(b, ": now ");
			h(b, v(r, 0, 1));
			sb_puts(b, "; run ");
			h(b, v(r, 0, 2));
			sb_puts(b, " is ");
			h(b, v(r, 0, 3));
			done++;
		}
		sb_puts(b, "</li>");
		PQclear(r);
	}
	sb_printf(b, "</ul><p>%d resolved, %d refused. <a href=\"/unknown\">back to the unknown "
	          "effects</a></p>", done, refused);
	if (done == 0 && refused > 0)
		out->status = 403;
	page_end(b);
}

void do_effect_act(const struct req *rq, struct strbuf *b, struct resp *out)
{
	const char *id = req_get(rq, "id"), *what = req_get(rq, "act"), *reason = req_get(rq, "reason");
	const char *params[4] = { id, rq->identity, reason, NULL }, *err, *sql;
	PGresult *r;

	act_page(rq, b, out, "effect", "/effects");
	if (id == NULL || what == NULL || reason == NULL || strlen(id) != 36) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">an effect, an act and a reason are needed</p>");
		page_end(b);
		return;
	}
	if (strcmp(what, "requeue") == 0) {
		sql = "SELECT applied::text, state FROM outbox_requeue($1::uuid, $2, $3)";
	} else if (strcmp(what, "cancel") == 0) {
		/* outbox_cancel(id, reason, operator), as outboxctl cancel. */
		params[1] = reason;
		params[2] = rq->identity;
		sql = "SELECT outbox_cancel($1::uuid, $2, $3)::text, ''";
	} else if (strcmp(what, "sent") == 0 || strcmp(what, "not_sent") == 0) {
		params[1] = strcmp(what, "sent") == 0 ? "true" : "false";
		params[2] = rq->identity;
		params[3] = reason;
		r = act(rq, "SELECT applied::text, state FROM outbox_resolve_unknown($1::uuid, "
		            "$2::boolean, $3, $4)", 4, params, &err);
		goto answered;
	} else {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">no such act</p>");
		page_end(b);
		return;
	}
	r = act(rq, sql, 3, params, &err);
answered:
	if (r == NULL) {
		act_failed(b, out, err);
	} else {
		bool ok = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "true") == 0;
		sb_printf(b, "<p class=\"msg\" id=\"result\">%s</p>",
		          ok ? "done" : "refused: the effect is not in a state this act takes; nothing changed");
		if (!ok)
			out->status = 409;
		PQclear(r);
	}
	sb_puts(b, "<p><a href=\"/effect?id=");
	hq(b, id);
	sb_puts(b, "\">back to the effect</a></p>");
	page_end(b);
}

/* outbox_replace, as outboxctl replace calls it; its answers worded as
 * outboxctl words them. */
void do_replace(const struct req *rq, struct strbuf *b, struct resp *out)
{
	const char *id = req_get(rq, "id"), *key = req_get(rq, "new_key"), *err;
	const char *reason = req_get(rq, "reason"), *target = req_get(rq, "target");
	const char *payload = req_get(rq, "payload"), *params[6], *status, *state;
	PGresult *r;

	act_page(rq, b, out, "effect", "/effects");
	if (id == NULL || strlen(id) != 36 || key == NULL || reason == NULL) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">an effect, the replacement's own run key "
		           "(issued by the source system, not a suffix of the old one) and a reason are "
		           "needed</p>");
		page_end(b);
		return;
	}
	if (payload) {
		json_error_t jerr;
		json_t *j = json_loads(payload, JSON_DECODE_ANY, &jerr);
		if (j == NULL) {
			out->status = 400;
			sb_puts(b, "<p class=\"msg err\" id=\"result\">the payload is not valid JSON: ");
			h(b, jerr.text);
			sb_printf(b, " (column %d)</p>", jerr.column);
			page_end(b);
			return;
		}
		json_decref(j);
	}
	params[0] = id;
	params[1] = key;
	params[2] = rq->identity;
	params[3] = reason;
	params[4] = target;
	params[5] = payload;
	r = act(rq, "SELECT status, state, coalesce(new_effect_id::text, ''), new_key, original_key "
	            "FROM outbox_replace($1::uuid, $2, $3, $4, $5, $6::jsonb)", 6, params, &err);
	if (r == NULL) {
		act_failed(b, out, err);
	} else if (PQntuples(r) == 0) {
		out->status = 404;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">no such effect</p>");
	} else {
		status = PQgetvalue(r, 0, 0);
		state = PQgetvalue(r, 0, 1);
		sb_puts(b, "<p class=\"msg\" id=\"result\">");
		if (strcmp(status, "created") == 0) {
			sb_puts(b, "replacement created by ");
			h(b, rq->identity);
			sb_puts(b, ": effect <a id=\"replacement\" href=\"/effect?id=");
			hq(b, PQgetvalue(r, 0, 2));
			sb_puts(b, "\">");
			h(b, PQgetvalue(r, 0, 2));
			sb_puts(b, "</a> under the new run ");
			h(b, key);
			sb_puts(b, " (approved, queued), linked to effect ");
			h(b, id);
			sb_puts(b, " of run ");
			h(b, PQgetvalue(r, 0, 4));
			sb_puts(b, ", which is left as it was");
		} else if (strcmp(status, "exists") == 0) {
			sb_puts(b, "effect ");
			h(b, id);
			sb_puts(b, " was already replaced by effect <a id=\"replacement\" href=\"/effect?id=");
			hq(b, PQgetvalue(r, 0, 2));
			sb_puts(b, "\">");
			h(b, PQgetvalue(r, 0, 2));
			sb_puts(b, "</a> under run ");
			h(b, key);
			sb_puts(b, " (now ");
			h(b, state);
			sb_puts(b, "): nothing changed");
		} else if (strcmp(status, "key_taken") == 0) {
			out->status = 409;
			sb_puts(b, "refused: the key ");
			h(b, key);
			sb_puts(b, " already belongs to another run (");
			h(b, state);
			sb_puts(b, "): nothing changed; bring a new key from the source system");
		} else {
			out->status = 409;
			sb_puts(b, "refused: effect ");
			h(b, id);
			sb_puts(b, " is ");
			h(b, state);
			sb_puts(b, ", so it may still be delivered: nothing changed (");
			sb_puts(b, strcmp(state, "pending") == 0   ? "cancel it, then replace it"
			           : strcmp(state, "unknown") == 0 ? "resolve it, then replace it"
			                                           : "wait for its outcome, then replace it");
			sb_puts(b, ")");
		}
		sb_puts(b, "</p>");
	}
	PQclear(r);
	sb_puts(b, "<p><a href=\"/effect?id=");
	hq(b, id);
	sb_puts(b, "\">back to the effect</a></p>");
	page_end(b);
}

/* An act on everything a filter matches, in the state the act takes: a
 * preview (the effects, at most cap), then the act on the same filter. */
struct filter_act {
	const char *path, *state, *verb, *done, *how, *sql;
};

static const struct filter_act requeue_act = {
	"/effects/requeue", "failed", "requeue", "requeued", "same keys, due now",
	"SELECT e.effect_id, q.applied FROM outbox_console_effects(now() - "
	"make_interval(hours => $1::integer), now() + interval '1 minute', $2, $3, $4, $5, "
	"$6, $7, $8::uuid, $9::integer) e, LATERAL outbox_requeue(e.effect_id, $10, $11) q",
};
/* outbox_cancel(id, reason, operator), as outboxctl cancel calls it. */
static const struct filter_act cancel_act = {
	"/effects/cancel", "pending", "cancel", "cancelled", "they will never be sent",
	"SELECT e.effect_id, outbox_cancel(e.effect_id, $11, $10) FROM outbox_console_effects(now() - "
	"make_interval(hours => $1::integer), now() + interval '1 minute', $2, $3, $4, $5, "
	"$6, $7, $8::uuid, $9::integer) e",
};

static void do_filter_act(const struct req *rq, struct strbuf *b, struct resp *out,
                          const struct filter_act *fa)
{
	const char *params[11], *reason = req_get(rq, "reason"), *err;
	char hours[16], cap[16];
	long n = req_get(rq, "cap") ? strtol(req_get(rq, "cap"), NULL, 10) : 100;
	PGresult *r;

	act_page(rq, b, out, "effects", "/effects");
	if (n < 1 || n > 200)
		n = n < 1 ? 1 : 200;
	snprintf(cap, sizeof(cap), "%ld", n);
	effects_params(rq, params, hours, sizeof(hours), fa->state, cap, NULL);
	if (reason == NULL) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">a reason is needed</p>");
		page_end(b);
		return;
	}
	if (req_get(rq, "confirm") == NULL) {
		r = console_query(effects_sql, 10, params, &err);
		if (r == NULL) {
			db_error(b, err);
			page_end(b);
			return;
		}
		sb_printf(b, "<p class=\"msg\" id=\"preview\">%d %s effect%s match%s (at most %s): "
		          "%s them (%s)?</p>", PQntuples(r), fa->state, PQntuples(r) == 1 ? "" : "s",
		          PQntuples(r) == 1 ? "es" : "", cap, fa->verb, fa->how);
		effects_table(b, r);
		sb_printf(b, "<form method=\"post\" action=\"%s\" data-no-refresh>", fa->path);
		csrf_field(b, rq);
		filter_hidden(b, rq, effects_fields, effects_nfields);
		sb_printf(b, "<input type=\"hidden\" name=\"cap\" value=\"%s\">", cap);
		sb_puts(b, "<input type=\"hidden\" name=\"reason\" value=\"");
		h(b, reason);
		sb_printf(b, "\"><button type=\"submit\" name=\"confirm\" value=\"1\" id=\"confirm\">%s "
		          "them</button></form>", fa->verb);
		PQclear(r);
		page_end(b);
		return;
	}
	params[9] = rq->identity;
	params[10] = reason;
	r = act(rq, fa->sql, 11, params, &err);
	if (r == NULL) {
		act_failed(b, out, err);
	} else {
		int done = 0;
		for (int i = 0; i < PQntuples(r); i++)
			done += PQgetvalue(r, i, 1)[0] == 't';
		sb_printf(b, "<p class=\"msg\" id=\"result\">%s %d %s effect%s (%s)</p>", fa->done, done,
		          fa->state, done == 1 ? "" : "s", fa->how);
		PQclear(r);
	}
	sb_puts(b, "<p><a href=\"/effects\">back to the effects</a></p>");
	page_end(b);
}

void do_requeue_filter(const struct req *rq, struct strbuf *b, struct resp *out)
{
	do_filter_act(rq, b, out, &requeue_act);
}

void do_cancel_filter(const struct req *rq, struct strbuf *b, struct resp *out)
{
	do_filter_act(rq, b, out, &cancel_act);
}

static void in_flight(struct strbuf *b, const PGresult *r)
{
	sb_printf(b, "<p>%d effect%s already in flight%s</p>", PQntuples(r),
	          PQntuples(r) == 1 ? " was" : "s were",
	          PQntuples(r) ? " (their outcome will still be recorded):" : ".");
	if (PQntuples(r) == 0)
		return;
	sb_puts(b, "<table id=\"in-flight\"><tr><th>effect</th><th>type</th><th>target</th>"
	           "<th>worker</th><th>since</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		sb_puts(b, "<tr>");
		effect_link(b, v(r, i, 0));
		for (int c = 1; c < 5; c++)
			cell(b, r, i, c);
		sb_puts(b, "</tr>");
	}
	sb_puts(b, "</table>");
}

void do_switch(const struct req *rq, struct strbuf *b, struct resp *out)
{
	const char *to = req_get(rq, "to"), *kind = req_get(rq, "kind"), *value = req_get(rq, "value");
	const char *reason = req_get(rq, "reason"), *err, *params[5];
	PGresult *r;
	bool off;

	act_page(rq, b, out, "controls", "/controls");
	if (to == NULL || reason == NULL || (strcmp(to, "on") != 0 && strcmp(to, "off") != 0) ||
	    (kind && value == NULL)) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">on or off, a scope's value when a scope is "
		           "chosen, and a reason are needed</p>");
		page_end(b);
		return;
	}
	off = strcmp(to, "off") == 0;
	if (kind == NULL) {
		params[0] = off ? "false" : "true";
		params[1] = rq->identity;
		params[2] = reason;
		r = act(rq, "SELECT effect_id, effect_type, target, worker, " T("sending_since")
		            " FROM outbox_kill_switch_set($1::boolean, $2, $3)", 3, params, &err);
	} else {
		params[0] = kind;
		params[1] = value;
		params[2] = off ? "true" : "false";
		params[3] = rq->identity;
		params[4] = reason;
		r = act(rq, "SELECT effect_id, effect_type, target, worker, " T("sending_since")
		            " FROM outbox_scope_pause($1, $2, $3::boolean, $4, $5)", 5, params, &err);
	}
	if (r == NULL) {
		act_failed(b, out, err);
	} else {
		sb_puts(b, "<p class=\"msg\" id=\"result\">");
		if (kind) {
			sb_puts(b, "scope ");
			h(b, kind);
			sb_puts(b, ":");
			h(b, value);
			sb_puts(b, off ? " paused" : " resumed");
		} else {
			sb_puts(b, off ? "kill switch off: no send can start anywhere in the fleet"
			               : "kill switch on: sends allowed");
		}
		sb_puts(b, "</p>");
		if (off)
			in_flight(b, r);
		PQclear(r);
	}
	sb_puts(b, "<p><a href=\"/controls\">back to the controls</a></p>");
	page_end(b);
}

void do_limit(const struct req *rq, struct strbuf *b, struct resp *out)
{
	const char *to = req_get(rq, "to"), *kind = req_get(rq, "kind"), *value = req_get(rq, "value");
	const char *reason = req_get(rq, "reason"), *err, *params[6];
	bool set = to && strcmp(to, "set") == 0;
	PGresult *r;

	act_page(rq, b, out, "controls", "/controls");
	if (to == NULL || kind == NULL || value == NULL || reason == NULL ||
	    (set && req_get(rq, "rate") == NULL)) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">a scope, a rate (to set) and a reason are "
		           "needed</p>");
		page_end(b);
		return;
	}
	params[0] = kind;
	params[1] = value;
	params[2] = set ? req_get(rq, "rate") : NULL;
	params[3] = set ? req_get(rq, "burst") : NULL;
	params[4] = rq->identity;
	params[5] = reason;
	r = act(rq, "SELECT outbox_scope_limit($1, $2, $3::double precision, $4::integer, $5, $6)", 6,
	        params, &err);
	if (r == NULL) {
		act_failed(b, out, err);
	} else {
		sb_puts(b, "<p class=\"msg\" id=\"result\">");
		h(b, kind);
		sb_puts(b, ":");
		h(b, value);
		sb_puts(b, set ? " limited" : " no longer limited");
		sb_puts(b, "</p>");
		PQclear(r);
	}
	sb_puts(b, "<p><a href=\"/controls\">back to the controls</a></p>");
	page_end(b);
}

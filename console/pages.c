/* SPDX-License-Identifier: ISC */
/*
 * pages.c: the console's views and acts.  Every view reads through the
 * functions of sql/functions/45_reads.sql and 46_console.sql as
 * outbox_viewer, with parameters (never text pasted into SQL); every act
 * runs in one transaction as the person's own role (set_config('role',
 * person, true), so PostgreSQL checks that the person may, and the
 * operator functions record the person), calling the functions outboxctl
 * calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "console.h"

#define T(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
#define PAGE 50

/* ---- small helpers ----------------------------------------------------- */

static const char *v(const PGresult *r, int row, int col)
{
	return PQgetisnull(r, row, col) ? NULL : PQgetvalue(r, row, col);
}

static void cell(struct strbuf *b, const PGresult *r, int row, int col)
{
	sb_puts(b, "<td>");
	h(b, v(r, row, col));
	sb_puts(b, "</td>");
}

static void state_cell(struct strbuf *b, const char *state)
{
	sb_puts(b, "<td class=\"state-");
	h(b, state);
	sb_puts(b, "\">");
	h(b, state);
	sb_puts(b, "</td>");
}

static void effect_link(struct strbuf *b, const char *id)
{
	sb_puts(b, "<td class=\"mono\"><a href=\"/effect?id=");
	hq(b, id);
	sb_puts(b, "\">");
	h(b, id);
	sb_puts(b, "</a></td>");
}

static void db_error(struct strbuf *b, const char *err)
{
	sb_puts(b, "<p class=\"msg err\">database: ");
	h(b, err);
	sb_puts(b, "</p>");
}

static void csrf_field(struct strbuf *b, const struct req *r)
{
	sb_printf(b, "<input type=\"hidden\" name=\"csrf\" value=\"%s\">", r->csrf);
}

static bool can_act(const struct req *r)
{
	return console.actions && r->identity != NULL;
}

/* ---- the banner, on every page --------------------------------------- */

static void banner(struct strbuf *b)
{
	const char *err;
	PGresult *sw = console_query("SELECT enabled, changed_by, reason, " T("changed_at")
	                             " FROM outbox_read_switch()", 0, NULL, &err);
	PGresult *sc, *dbr;
	const char *limited[1] = { "false" };

	if (sw == NULL) {
		db_error(b, err);
		return;
	}
	if (PQntuples(sw) == 1) {
		bool on = PQgetvalue(sw, 0, 0)[0] == 't';
		sb_printf(b, "<div class=\"banner%s\" id=\"banner\"><div>kill switch <b id=\"switch\">%s</b> "
		          "(sends %s): set by ", on ? "" : " off", on ? "on" : "off",
		          on ? "allowed" : "stopped fleet-wide");
		h(b, v(sw, 0, 1));
		sb_puts(b, " at ");
		h(b, v(sw, 0, 3));
		sb_puts(b, ": ");
		h(b, v(sw, 0, 2));
		sb_puts(b, "</div>");
	}
	PQclear(sw);
	sc = console_query("SELECT kind, value, paused, paused_by, " T("paused_at") ", paused_reason, "
	                   "rate_per_second, burst, limit_by, " T("limit_at") ", limit_reason, waiting "
	                   "FROM outbox_read_scopes($1::boolean)", 1, limited, &err);
	if (sc && PQntuples(sc) > 0) {
		sb_puts(b, "<ul id=\"scopes\">");
		for (int i = 0; i < PQntuples(sc); i++) {
			sb_puts(b, "<li>scope <b>");
			h(b, v(sc, i, 0));
			sb_puts(b, ":");
			h(b, v(sc, i, 1));
			sb_puts(b, "</b>: ");
			if (PQgetvalue(sc, i, 2)[0] == 't') {
				sb_puts(b, "<span class=\"paused\">paused</span> by ");
				h(b, v(sc, i, 3));
				sb_puts(b, " at ");
				h(b, v(sc, i, 4));
				sb_puts(b, ": ");
				h(b, v(sc, i, 5));
			} else {
				sb_puts(b, "not paused");
			}
			if (v(sc, i, 6)) {
				sb_puts(b, "; limit ");
				h(b, v(sc, i, 6));
				sb_puts(b, "/s burst ");
				h(b, v(sc, i, 7));
				sb_puts(b, " by ");
				h(b, v(sc, i, 8));
				sb_puts(b, " at ");
				h(b, v(sc, i, 9));
				sb_puts(b, ": ");
				h(b, v(sc, i, 10));
			}
			sb_puts(b, "; holding ");
			h(b, v(sc, i, 11));
			sb_puts(b, "</li>");
		}
		sb_puts(b, "</ul>");
	} else if (sc == NULL) {
		db_error(b, err);
	}
	PQclear(sc);
	dbr = console_query("SELECT database, server, schema_version FROM outbox_console_database()",
	                    0, NULL, &err);
	if (dbr && PQntuples(dbr) == 1) {
		sb_puts(b, "<div class=\"db\">database ");
		h(b, v(dbr, 0, 0));
		sb_puts(b, " on ");
		h(b, v(dbr, 0, 1));
		sb_puts(b, ", schema ");
		h(b, v(dbr, 0, 2));
		sb_puts(b, "</div>");
	}
	PQclear(dbr);
	sb_puts(b, "</div>");
}

/* ---- overview ------------------------------------------------------------ */

/* Completions, retries, failures and unknowns per minute, drawn here. */
static void chart(struct strbuf *b)
{
	static const struct {
		const char *name, *color;
	} series[] = { { "completed", "#15803d" }, { "retried", "#d97706" }, { "failed", "#b91c1c" },
		           { "unknown", "#7c3aed" } };
	const int W = 720, H = 160, minutes = 180;
	const char *hours[1] = { "3" }, *err;
	PGresult *r = console_query("SELECT extract(epoch FROM now() - minute)::integer / 60, completed, "
	                            "retried, failed, unknown FROM outbox_console_minutes($1::integer)",
	                            1, hours, &err);
	long max = 1;

	if (r == NULL) {
		db_error(b, err);
		return;
	}
	for (int i = 0; i < PQntuples(r); i++)
		for (int s = 1; s <= 4; s++)
			if (atol(PQgetvalue(r, i, s)) > max)
				max = atol(PQgetvalue(r, i, s));
	sb_printf(b, "<h2>the last 3 hours, per minute</h2><svg id=\"chart\" width=\"%d\" height=\"%d\" "
	          "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"completions, retries, failures and "
	          "unknowns per minute\">", W, H + 20, W, H + 20);
	sb_printf(b, "<line x1=\"0\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#9ca3af\"/>", H, W, H);
	for (int s = 0; s < 4; s++) {
		sb_printf(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"",
		          series[s].color);
		for (int i = 0; i < PQntuples(r); i++) {
			int ago = atoi(PQgetvalue(r, i, 0));
			double x = (double)(minutes - ago) * W / minutes;
			double y = H - (double)atol(PQgetvalue(r, i, s + 1)) * (H - 10) / (double)max;
			sb_printf(b, "%.1f,%.1f ", x, y);
		}
		sb_puts(b, "\"/>");
		sb_printf(b, "<text x=\"%d\" y=\"%d\" fill=\"%s\" font-size=\"11\">%s</text>", 10 + s * 90,
		          H + 15, series[s].color, series[s].name);
	}
	sb_printf(b, "<text x=\"%d\" y=\"12\" font-size=\"11\" text-anchor=\"end\">max %ld/min</text>",
	          W - 4, max);
	sb_puts(b, "</svg>");
	PQclear(r);
}

static void page_overview(const struct req *rq, struct strbuf *b)
{
	const char *err;
	PGresult *r;

	page_begin(b, rq, "overview", "/");
	banner(b);
	r = console_query("SELECT oldest_pending_seconds, oldest_held_seconds FROM outbox_console_ages()",
	                  0, NULL, &err);
	if (r && PQntuples(r) == 1) {
		sb_puts(b, "<p id=\"ages\">oldest due pending: <b>");
		h(b, v(r, 0, 0) ? v(r, 0, 0) : "0");
		sb_puts(b, " s</b>; held by a scope, oldest: ");
		h(b, v(r, 0, 1) ? v(r, 0, 1) : "none");
		sb_puts(b, v(r, 0, 1) ? " s" : "");
		sb_puts(b, "</p>");
	}
	PQclear(r);
	r = console_query("SELECT state, effect_type, n, held FROM outbox_console_counts()", 0, NULL, &err);
	if (r == NULL) {
		db_error(b, err);
	} else {
		sb_puts(b, "<h2>effects by state and type</h2><p>open ones now; completed and failed: "
		           "finished in the last 24 hours</p><table id=\"counts\"><tr><th>state</th>"
		           "<th>type</th><th>effects</th><th>held by a scope</th></tr>");
		for (int i = 0; i < PQntuples(r); i++) {
			sb_puts(b, "<tr>");
			state_cell(b, v(r, i, 0));
			cell(b, r, i, 1);
			sb_puts(b, "<td><a href=\"/effects?state=");
			hq(b, v(r, i, 0));
			sb_puts(b, "&amp;type=");
			hq(b, v(r, i, 1));
			sb_puts(b, "\">");
			h(b, v(r, i, 2));
			sb_puts(b, "</a></td>");
			cell(b, r, i, 3);
			sb_puts(b, "</tr>");
		}
		sb_puts(b, "</table>");
		PQclear(r);
	}
	chart(b);
	page_end(b);
}

/* ---- effects ------------------------------------------------------------ */

static const char *const filter_keys[] = { "state", "type", "host", "run", "key", "error" };
#define NFILTERS (sizeof(filter_keys) / sizeof(filter_keys[0]))

static const char effects_sql[] =
	"SELECT effect_id, idempotency_key, effect_type, target, state, attempts, " T("created_at")
	", " T("updated_at") ", last_error_class, last_error, provider_id "
	"FROM outbox_console_effects(now() - make_interval(hours => $1::integer), now() + interval '1 minute', "
	"$2, $3, $4, $5, $6, $7, $8::uuid, $9::integer)";

/* The filter's parameters ($1..$9 of effects_sql): hours, the six filters,
 * the keyset position, the page size. */
static void effects_params(const struct req *rq, const char *params[9], char *hours,
                           size_t hlen, const char *state, const char *limit)
{
	long hrs = req_get(rq, "hours") ? strtol(req_get(rq, "hours"), NULL, 10) : 24;

	if (hrs < 1 || hrs > 24 * 366)
		hrs = 24;
	snprintf(hours, hlen, "%ld", hrs);
	params[0] = hours;
	for (size_t i = 0; i < NFILTERS; i++)
		params[1 + i] = req_get(rq, filter_keys[i]);
	if (state)
		params[1] = state;
	params[7] = req_get(rq, "before");
	params[8] = limit;
}

static void filter_hidden(struct strbuf *b, const struct req *rq)
{
	for (size_t i = 0; i < NFILTERS; i++) {
		if (req_get(rq, filter_keys[i]) == NULL)
			continue;
		sb_printf(b, "<input type=\"hidden\" name=\"%s\" value=\"", filter_keys[i]);
		h(b, req_get(rq, filter_keys[i]));
		sb_puts(b, "\">");
	}
	if (req_get(rq, "hours")) {
		sb_puts(b, "<input type=\"hidden\" name=\"hours\" value=\"");
		h(b, req_get(rq, "hours"));
		sb_puts(b, "\">");
	}
}

static void effects_table(struct strbuf *b, const PGresult *r)
{
	sb_puts(b, "<table id=\"effects\"><tr><th>effect</th><th>state</th><th>type</th><th>target</th>"
	           "<th>run key</th><th>attempts</th><th>created</th><th>changed</th><th>last error</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		sb_puts(b, "<tr>");
		effect_link(b, v(r, i, 0));
		state_cell(b, v(r, i, 4));
		cell(b, r, i, 2);
		cell(b, r, i, 3);
		cell(b, r, i, 1);
		cell(b, r, i, 5);
		cell(b, r, i, 6);
		cell(b, r, i, 7);
		sb_puts(b, "<td>");
		h(b, v(r, i, 8));
		if (v(r, i, 9)) {
			sb_puts(b, ": ");
			h(b, v(r, i, 9));
		}
		sb_puts(b, "</td></tr>");
	}
	sb_puts(b, "</table>");
}

static void page_effects(const struct req *rq, struct strbuf *b)
{
	static const char *const labels[] = { "state", "type", "host", "run key", "provider key",
		                                  "error text" };
	const char *params[9], *err;
	char hours[16], limit[8];
	PGresult *r;

	snprintf(limit, sizeof(limit), "%d", PAGE);
	effects_params(rq, params, hours, sizeof(hours), NULL, limit);
	page_begin(b, rq, "effects", "/effects");
	banner(b);
	sb_puts(b, "<form method=\"get\" action=\"/effects\" id=\"filters\">");
	for (size_t i = 0; i < NFILTERS; i++) {
		sb_printf(b, "<label>%s <input name=\"%s\" size=\"12\" value=\"", labels[i], filter_keys[i]);
		h(b, req_get(rq, filter_keys[i]));
		sb_puts(b, "\"></label> ");
	}
	sb_printf(b, "<label>hours <input name=\"hours\" size=\"4\" value=\"%s\"></label> "
	          "<button type=\"submit\">filter</button></form>", hours);
	r = console_query(effects_sql, 9, params, &err);
	if (r == NULL) {
		db_error(b, err);
		page_end(b);
		return;
	}
	sb_printf(b, "<p>%d effect%s on this page (newest first, created in the last %s hours)</p>",
	          PQntuples(r), PQntuples(r) == 1 ? "" : "s", hours);
	effects_table(b, r);
	if (PQntuples(r) == PAGE) {
		sb_puts(b, "<p><a id=\"next\" href=\"/effects?before=");
		hq(b, v(r, PAGE - 1, 0));
		for (size_t i = 0; i < NFILTERS; i++) {
			if (req_get(rq, filter_keys[i]) == NULL)
				continue;
			sb_printf(b, "&amp;%s=", filter_keys[i]);
			hq(b, req_get(rq, filter_keys[i]));
		}
		sb_printf(b, "&amp;hours=%s\">older &rarr;</a></p>", hours);
	}
	PQclear(r);
	if (can_act(rq)) {
		sb_puts(b, "<form method=\"post\" action=\"/effects/requeue\" id=\"requeue-filter\">"
		           "<fieldset><legend>requeue the failed effects this filter matches</legend>");
		csrf_field(b, rq);
		filter_hidden(b, rq);
		sb_puts(b, "<label>at most <input name=\"cap\" size=\"5\" value=\"100\"></label> "
		           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" name=\"preview\" value=\"1\">preview</button>"
		           "</fieldset></form>");
		sb_puts(b, "<form method=\"post\" action=\"/effects/cancel\" id=\"cancel-filter\">"
		           "<fieldset><legend>cancel the pending effects this filter matches</legend>");
		csrf_field(b, rq);
		filter_hidden(b, rq);
		sb_puts(b, "<label>at most <input name=\"cap\" size=\"5\" value=\"100\"></label> "
		           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" name=\"preview\" value=\"1\">preview</button>"
		           "</fieldset></form>");
	}
	page_end(b);
}

/* ---- one effect ------------------------------------------------------------ */

static void page_effect(const struct req *rq, struct strbuf *b)
{
	const char *id = req_get(rq, "id"), *err, *params[1] = { id };
	bool payload = req_get(rq, "payload") != NULL;
	PGresult *r, *hi;

	page_begin(b, rq, "effect", "/effects");
	banner(b);
	if (id == NULL || strlen(id) != 36) {
		sb_puts(b, "<p class=\"msg err\">an effect id is needed</p>");
		page_end(b);
		return;
	}
	r = console_query("SELECT effect_id, state, idempotency_key, run_state, effect_type, target, "
	                  "effect_key, attempts, " T("created_at") ", " T("updated_at") ", provider_id, "
	                  "last_error_class, last_error, payload::text FROM outbox_read_effect($1::uuid)",
	                  1, params, &err);
	if (r == NULL || PQntuples(r) == 0) {
		if (r == NULL)
			db_error(b, err);
		else
			sb_puts(b, "<p class=\"msg err\">no such effect</p>");
		PQclear(r);
		page_end(b);
		return;
	}
	{
		static const char *const names[] = { "effect", "state", "run key", "run state", "type",
			                                 "target", "provider key", "attempts", "created",
			                                 "changed", "provider id", "last error class",
			                                 "last error" };
		sb_puts(b, "<table id=\"effect\">");
		for (int c = 0; c < 13; c++) {
			sb_printf(b, "<tr><th>%s</th>", names[c]);
			if (c == 1)
				state_cell(b, v(r, 0, c));
			else
				cell(b, r, 0, c);
			sb_puts(b, "</tr>");
		}
		sb_puts(b, "<tr><th>payload</th><td>");
		if (payload) {
			sb_puts(b, "<pre id=\"payload\">");
			h(b, v(r, 0, 13));
			sb_puts(b, "</pre>");
		} else {
			sb_puts(b, "hidden: <a id=\"show-payload\" href=\"/effect?payload=1&amp;id=");
			hq(b, id);
			sb_puts(b, "\">show it</a> (secrets are never stored)");
		}
		sb_puts(b, "</td></tr></table>");
	}
	hi = console_query("SELECT attempt, worker, " T("started_at") ", " T("ended_at") ", outcome_class, "
	                   "provider_status, provider_id, error_text, state, resolution "
	                   "FROM outbox_read_effect_history($1::uuid)", 1, params, &err);
	if (hi) {
		sb_puts(b, "<h2>attempts and changes</h2><table id=\"history\"><tr><th>attempt</th>"
		           "<th>worker</th><th>started</th><th>ended</th><th>class</th><th>status</th>"
		           "<th>provider id</th><th>reply or error</th><th>state</th><th>resolution</th></tr>");
		for (int i = 0; i < PQntuples(hi); i++) {
			sb_puts(b, "<tr>");
			for (int c = 0; c < 10; c++)
				cell(b, hi, i, c);
			sb_puts(b, "</tr>");
		}
		sb_puts(b, "</table>");
		PQclear(hi);
	}
	if (can_act(rq)) {
		const char *state = v(r, 0, 1);
		sb_puts(b, "<form method=\"post\" action=\"/effect/act\" id=\"effect-act\"><fieldset>"
		           "<legend>act on this effect</legend>");
		csrf_field(b, rq);
		sb_puts(b, "<input type=\"hidden\" name=\"id\" value=\"");
		h(b, id);
		sb_puts(b, "\"><label>reason <input name=\"reason\" size=\"30\" required></label> ");
		if (strcmp(state, "failed") == 0)
			sb_puts(b, "<button type=\"submit\" name=\"act\" value=\"requeue\">requeue</button> ");
		if (strcmp(state, "pending") == 0)
			sb_puts(b, "<button type=\"submit\" name=\"act\" value=\"cancel\">cancel</button> ");
		if (strcmp(state, "unknown") == 0)
			sb_puts(b, "<button type=\"submit\" name=\"act\" value=\"sent\">resolve: sent</button> "
			           "<button type=\"submit\" name=\"act\" value=\"not_sent\">resolve: not sent"
			           "</button>");
		sb_puts(b, "</fieldset></form>");
		/* A replacement only of an effect that can no longer be sent
		 * (outbox_replace refuses pending, sending and unknown). */
		if (strcmp(state, "completed") == 0 || strcmp(state, "failed") == 0) {
			sb_puts(b, "<form method=\"post\" action=\"/effect/replace\" id=\"replace-form\">"
			           "<fieldset><legend>replace: a new run under a key from the source system, "
			           "approved, its effect queued; this one is left as it is</legend>");
			csrf_field(b, rq);
			sb_puts(b, "<input type=\"hidden\" name=\"id\" value=\"");
			h(b, id);
			sb_puts(b, "\"><label>new run key <input name=\"new_key\" size=\"24\" required></label> "
			           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
			           "<label>target (empty: the same) <input name=\"target\" size=\"30\"></label> "
			           "<label>payload JSON (empty: the same) <textarea name=\"payload\" rows=\"3\" "
			           "cols=\"40\"></textarea></label> "
			           "<button type=\"submit\" id=\"replace-submit\">replace</button></fieldset></form>");
		}
	}
	PQclear(r);
	page_end(b);
}

/* ---- unknown ------------------------------------------------------------------ */

static void page_unknown(const struct req *rq, struct strbuf *b)
{
	const char *err;
	PGresult *r;

	page_begin(b, rq, "unknown", "/unknown");
	banner(b);
	r = console_query("SELECT effect_id, idempotency_key, effect_key, effect_type, target, attempts, "
	                  T("unknown_since") ", extract(epoch FROM now() - coalesce(last_attempt_ended, "
	                  "unknown_since))::bigint, last_attempt_worker, last_attempt_outcome, "
	                  "last_attempt_status, last_attempt_error, " T("last_reconciled_at") ", run_state "
	                  "FROM outbox_read_unknown()", 0, NULL, &err);
	if (r == NULL) {
		db_error(b, err);
		page_end(b);
		return;
	}
	sb_printf(b, "<p>%d unknown effect%s, oldest first. Look the provider key up at the provider, "
	          "then record what it says.</p>", PQntuples(r), PQntuples(r) == 1 ? "" : "s");
	if (can_act(rq)) {
		sb_puts(b, "<form method=\"post\" action=\"/unknown/resolve\" id=\"resolve\">");
		csrf_field(b, rq);
	}
	sb_puts(b, "<table id=\"unknown\"><tr><th></th><th>effect</th><th>run key (state)</th>"
	           "<th>provider key</th><th>type, target</th><th>attempts</th><th>unknown since</th>"
	           "<th>since the last call</th><th>last call</th><th>reconciled</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		sb_puts(b, "<tr><td>");
		if (can_act(rq)) {
			sb_puts(b, "<input type=\"checkbox\" name=\"id\" value=\"");
			h(b, v(r, i, 0));
			sb_puts(b, "\">");
		}
		sb_puts(b, "</td>");
		effect_link(b, v(r, i, 0));
		sb_puts(b, "<td>");
		h(b, v(r, i, 1));
		sb_puts(b, " (");
		h(b, v(r, i, 13));
		sb_puts(b, ")</td><td class=\"mono\">");
		h(b, v(r, i, 2));
		sb_puts(b, "</td><td>");
		h(b, v(r, i, 3));
		sb_puts(b, " ");
		h(b, v(r, i, 4));
		sb_puts(b, "</td>");
		cell(b, r, i, 5);
		cell(b, r, i, 6);
		sb_puts(b, "<td>");
		h(b, v(r, i, 7));
		sb_puts(b, " s</td><td>");
		if (v(r, i, 8)) {
			sb_puts(b, "worker ");
			h(b, v(r, i, 8));
			sb_puts(b, ", ");
			h(b, v(r, i, 9));
			if (v(r, i, 10)) {
				sb_puts(b, ", status ");
				h(b, v(r, i, 10));
			}
			if (v(r, i, 11)) {
				sb_puts(b, ": ");
				h(b, v(r, i, 11));
			}
		}
		sb_puts(b, "</td>");
		cell(b, r, i, 12);
		sb_puts(b, "</tr>");
	}
	sb_puts(b, "</table>");
	if (can_act(rq)) {
		sb_puts(b, "<fieldset><legend>resolve the ones ticked</legend>"
		           "<label><input type=\"radio\" name=\"verdict\" value=\"sent\" required> sent (the "
		           "provider has it)</label> <label><input type=\"radio\" name=\"verdict\" "
		           "value=\"not_sent\"> not sent (the provider proves it never got it)</label> "
		           "<label>provider id <input name=\"provider_id\" size=\"16\"></label> "
		           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" id=\"resolve-submit\">resolve</button></fieldset></form>");
	}
	PQclear(r);
	page_end(b);
}

/* ---- approvals, runs, audit ----------------------------------------------------- */

/* The approval's id linked to its page on the n8n kit: [console]
 * approvals_url with {id} replaced (checked at load: http(s), {id} once,
 * after the host), the whole href escaped; the page opens apart from the
 * console and learns nothing of it. */
static void approval_link(struct strbuf *b, const char *id)
{
	const char *t = console.approvals_url, *at = strstr(t, "{id}");
	struct strbuf url;

	sb_init(&url, 256);
	sb_append(&url, t, (size_t)(at - t));
	hq(&url, id);
	sb_puts(&url, at + 4);
	sb_puts(b, "<td class=\"mono\"><a class=\"approval\" rel=\"noopener noreferrer\" "
	           "target=\"_blank\" href=\"");
	h(b, url.s);
	sb_puts(b, "\">");
	h(b, id);
	sb_puts(b, "</a></td>");
	free(url.s);
}

static void page_approvals(const struct req *rq, struct strbuf *b)
{
	const char *err;
	PGresult *r;

	page_begin(b, rq, "approvals", "/approvals");
	banner(b);
	r = console_query("SELECT approval_id, idempotency_key, audience, " T("created_at") ", "
	                  "extract(epoch FROM now() - created_at)::bigint / 60, " T("expires_at") ", "
	                  "proposed, proposed_types FROM outbox_console_approvals()", 0, NULL, &err);
	if (r == NULL) {
		db_error(b, err);
		page_end(b);
		return;
	}
	sb_printf(b, "<p>%d approval%s waiting. The decision is made on the approval page behind "
	          "your SSO proxy (the n8n kit), not here%s.</p>", PQntuples(r),
	          PQntuples(r) == 1 ? "" : "s",
	          console.approvals_url[0] ? ": each approval links to its page" : "");
	sb_puts(b, "<table id=\"approvals\"><tr><th>approval</th><th>run key</th><th>audience</th>"
	           "<th>asked</th><th>waiting (min)</th><th>expires</th><th>effects drafted</th>"
	           "<th>what</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		sb_puts(b, "<tr>");
		if (console.approvals_url[0])
			approval_link(b, v(r, i, 0));
		else
			cell(b, r, i, 0);
		for (int c = 1; c < 8; c++)
			cell(b, r, i, c);
		sb_puts(b, "</tr>");
	}
	sb_puts(b, "</table>");
	PQclear(r);
	page_end(b);
}

/* The runs page's "more": after its last run when it is full, else, for
 * a state (which may be rare), after the 10,000 runs the page walked. */
static void runs_next(struct strbuf *b, const PGresult *r, const char *const params[2])
{
	const char *after = PQntuples(r) == 50 ? v(r, 49, 0) : NULL, *err;
	PGresult *end = NULL;

	if (after == NULL && params[0]) {
		end = console_query("SELECT outbox_console_runs_window_end($1)", 1, &params[1], &err);
		if (end == NULL)
			db_error(b, err);
		else if (PQntuples(end) == 1)
			after = v(end, 0, 0);
	}
	if (after) {
		sb_puts(b, "<p><a id=\"next\" href=\"/runs?after=");
		hq(b, after);
		if (params[0]) {
			sb_puts(b, "&amp;state=");
			hq(b, params[0]);
		}
		sb_puts(b, PQntuples(r) == 50 ? "\">more &rarr;</a></p>"
		                              : "\">the next 10,000 runs &rarr;</a></p>");
	}
	PQclear(end);
}

static void page_runs(const struct req *rq, struct strbuf *b)
{
	const char *params[2] = { req_get(rq, "state"), req_get(rq, "after") }, *err;
	const char *key = req_get(rq, "key");
	PGresult *r;

	page_begin(b, rq, "runs", "/runs");
	banner(b);
	if (key) {
		const char *kp[1] = { key };
		r = console_query("SELECT effect_id, state, effect_type, target, attempts, " T("created_at")
		                  " FROM outbox_console_run_effects($1)", 1, kp, &err);
		sb_puts(b, "<h2>run ");
		h(b, key);
		sb_puts(b, "</h2>");
		if (r == NULL) {
			db_error(b, err);
		} else {
			sb_puts(b, "<table id=\"run-effects\"><tr><th>effect</th><th>state</th><th>type</th>"
			           "<th>target</th><th>attempts</th><th>created</th></tr>");
			for (int i = 0; i < PQntuples(r); i++) {
				sb_puts(b, "<tr>");
				effect_link(b, v(r, i, 0));
				state_cell(b, v(r, i, 1));
				for (int c = 2; c < 6; c++)
					cell(b, r, i, c);
				sb_puts(b, "</tr>");
			}
			sb_puts(b, "</table>");
			PQclear(r);
		}
		page_end(b);
		return;
	}
	sb_puts(b, "<form method=\"get\" action=\"/runs\"><label>state <select name=\"state\">"
	           "<option value=\"\">any</option>");
	{
		static const char *const states[] = { "processing", "awaiting_human", "approved",
			                                  "completed", "failed_retryable", "failed_terminal" };
		for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++)
			sb_printf(b, "<option%s>%s</option>",
			          params[0] && strcmp(params[0], states[i]) == 0 ? " selected" : "", states[i]);
	}
	sb_puts(b, "</select></label> <button type=\"submit\">show</button></form>");
	r = console_query("SELECT idempotency_key, state, effects, open_effects, failure_reason "
	                  "FROM outbox_console_runs($1, $2, 50)", 2, params, &err);
	if (r == NULL) {
		db_error(b, err);
		page_end(b);
		return;
	}
	sb_puts(b, "<table id=\"runs\"><tr><th>run key</th><th>state</th><th>effects</th>"
	           "<th>open</th><th>failure</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		/* Counted up to 101 (outbox_console_runs): 101 is "more than 100". */
		bool many = atol(PQgetvalue(r, i, 2)) > 100;
		sb_puts(b, "<tr><td><a href=\"/runs?key=");
		hq(b, v(r, i, 0));
		sb_puts(b, "\">");
		h(b, v(r, i, 0));
		sb_puts(b, "</a></td>");
		cell(b, r, i, 1);
		if (many) {
			sb_puts(b, "<td>more than 100</td><td>at least ");
			h(b, v(r, i, 3));
			sb_puts(b, "</td>");
		} else {
			cell(b, r, i, 2);
			cell(b, r, i, 3);
		}
		cell(b, r, i, 4);
		sb_puts(b, "</tr>");
	}
	sb_puts(b, "</table>");
	runs_next(b, r, params);
	PQclear(r);
	page_end(b);
}

static void page_audit(const struct req *rq, struct strbuf *b)
{
	const char *params[2] = { req_get(rq, "operator"), req_get(rq, "before") }, *err;
	PGresult *r;

	page_begin(b, rq, "audit", "/audit");
	banner(b);
	sb_puts(b, "<form method=\"get\" action=\"/audit\"><label>operator <input name=\"operator\" "
	           "value=\"");
	h(b, params[0]);
	sb_puts(b, "\"></label> <button type=\"submit\">filter</button></form>");
	r = console_query("SELECT action_id, " T("acted_at") ", operator, action, effect_id, run_key, "
	                  "reason, detail FROM outbox_console_audit($1, $2::bigint, 50)", 2, params, &err);
	if (r == NULL) {
		db_error(b, err);
		page_end(b);
		return;
	}
	sb_puts(b, "<table id=\"audit\"><tr><th>#</th><th>when</th><th>operator</th><th>action</th>"
	           "<th>effect</th><th>run key</th><th>reason</th><th>detail</th></tr>");
	for (int i = 0; i < PQntuples(r); i++) {
		sb_puts(b, "<tr>");
		for (int c = 0; c < 8; c++)
			cell(b, r, i, c);
		sb_puts(b, "</tr>");
	}
	sb_puts(b, "</table>");
	if (PQntuples(r) == 50) {
		sb_puts(b, "<p><a id=\"next\" href=\"/audit?before=");
		hq(b, v(r, 49, 0));
		if (params[0]) {
			sb_puts(b, "&amp;operator=");
			hq(b, params[0]);
		}
		sb_puts(b, "\">older &rarr;</a></p>");
	}
	PQclear(r);
	page_end(b);
}

/* ---- controls -------------------------------------------------------------------- */

static void scope_inputs(struct strbuf *b)
{
	sb_puts(b, "<label>scope <select name=\"kind\"><option value=\"\">everything (the kill "
	           "switch)</option><option value=\"type\">type</option><option value=\"host\">host"
	           "</option><option value=\"crm_object\">crm object</option></select></label> "
	           "<label>value <input name=\"value\" size=\"20\"></label> ");
}

static void page_controls(const struct req *rq, struct strbuf *b)
{
	const char *err, *lim[1] = { "200" };
	PGresult *r;

	page_begin(b, rq, "controls", "/controls");
	banner(b);
	if (can_act(rq)) {
		sb_puts(b, "<form method=\"post\" action=\"/controls/switch\" id=\"switch-form\">"
		           "<fieldset><legend>kill switch: off stops sends, on allows them</legend>");
		csrf_field(b, rq);
		scope_inputs(b);
		sb_puts(b, "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" name=\"to\" value=\"off\" id=\"switch-off\">off</button> "
		           "<button type=\"submit\" name=\"to\" value=\"on\" id=\"switch-on\">on</button>"
		           "</fieldset></form>");
		sb_puts(b, "<form method=\"post\" action=\"/controls/limit\" id=\"limit-form\"><fieldset>"
		           "<legend>rate limit of a type or a host, for the whole fleet</legend>");
		csrf_field(b, rq);
		sb_puts(b, "<label>scope <select name=\"kind\"><option value=\"type\">type</option>"
		           "<option value=\"host\">host</option></select></label> "
		           "<label>value <input name=\"value\" size=\"20\" required></label> "
		           "<label>per second <input name=\"rate\" size=\"6\"></label> "
		           "<label>burst <input name=\"burst\" size=\"4\"></label> "
		           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" name=\"to\" value=\"set\">set</button> "
		           "<button type=\"submit\" name=\"to\" value=\"clear\">clear</button></fieldset></form>");
	}
	r = console_query("SELECT " T("changed_at") ", scope, action, changed_by, reason "
	                  "FROM outbox_console_control_history($1::integer)", 1, lim, &err);
	if (r == NULL) {
		db_error(b, err);
	} else {
		sb_puts(b, "<h2>history of the switch and the scopes</h2><table id=\"control-history\">"
		           "<tr><th>when</th><th>scope</th><th>change</th><th>by</th><th>reason</th></tr>");
		for (int i = 0; i < PQntuples(r); i++) {
			sb_puts(b, "<tr>");
			for (int c = 0; c < 5; c++)
				cell(b, r, i, c);
			sb_puts(b, "</tr>");
		}
		sb_puts(b, "</table>");
		PQclear(r);
	}
	page_end(b);
}

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

static void act_page(const struct req *rq, struct strbuf *b, struct resp *out, const char *title,
                     const char *back)
{
	page_begin(b, rq, title, back);
	banner(b);
	(void)out;
}

static void act_failed(struct strbuf *b, struct resp *out, const char *err)
{
	out->status = 403;
	sb_puts(b, "<p class=\"msg err\" id=\"result\">refused: ");
	h(b, err);
	sb_puts(b, "</p>");
}

static void do_resolve(const struct req *rq, struct strbuf *b, struct resp *out)
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

static void do_effect_act(const struct req *rq, struct strbuf *b, struct resp *out)
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
static void do_replace(const struct req *rq, struct strbuf *b, struct resp *out)
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
	effects_params(rq, params, hours, sizeof(hours), fa->state, cap);
	if (reason == NULL) {
		out->status = 400;
		sb_puts(b, "<p class=\"msg err\" id=\"result\">a reason is needed</p>");
		page_end(b);
		return;
	}
	if (req_get(rq, "confirm") == NULL) {
		r = console_query(effects_sql, 9, params, &err);
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
		filter_hidden(b, rq);
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

static void do_requeue_filter(const struct req *rq, struct strbuf *b, struct resp *out)
{
	do_filter_act(rq, b, out, &requeue_act);
}

static void do_cancel_filter(const struct req *rq, struct strbuf *b, struct resp *out)
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

static void do_switch(const struct req *rq, struct strbuf *b, struct resp *out)
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

static void do_limit(const struct req *rq, struct strbuf *b, struct resp *out)
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

/* ---- routing ------------------------------------------------------------------------ */

void pages_handle(const struct req *rq, struct resp *out)
{
	static const struct {
		const char *path;
		void (*view)(const struct req *, struct strbuf *);
	} views[] = {
		{ "/", page_overview }, { "/effects", page_effects }, { "/effect", page_effect },
		{ "/unknown", page_unknown }, { "/approvals", page_approvals }, { "/runs", page_runs },
		{ "/audit", page_audit }, { "/controls", page_controls },
	};
	static const struct {
		const char *path;
		void (*run)(const struct req *, struct strbuf *, struct resp *);
	} acts[] = {
		{ "/unknown/resolve", do_resolve }, { "/effect/act", do_effect_act },
		{ "/effect/replace", do_replace },
		{ "/effects/requeue", do_requeue_filter }, { "/effects/cancel", do_cancel_filter },
		{ "/controls/switch", do_switch },
		{ "/controls/limit", do_limit },
	};
	bool post = strcmp(rq->method, "POST") == 0;

	if (post) {
		for (size_t i = 0; i < sizeof(acts) / sizeof(acts[0]); i++) {
			if (strcmp(rq->path, acts[i].path) == 0) {
				acts[i].run(rq, &out->body, out);
				return;
			}
		}
	} else {
		for (size_t i = 0; i < sizeof(views) / sizeof(views[0]); i++) {
			if (strcmp(rq->path, views[i].path) == 0) {
				views[i].view(rq, &out->body);
				return;
			}
		}
	}
	out->status = post ? 405 : 404;
	out->content_type = "text/plain; charset=utf-8";
	sb_puts(&out->body, post ? "no such act\n" : "no such page\n");
}

/* SPDX-License-Identifier: ISC */
/*
 * views_queue.c: the views of the queue: the overview (counts, ages, the
 * chart), the effects list with its filters, one effect with its history
 * and the acts it takes, the unknown effects with their evidence.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages.h"

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
	/* Every minute of the window, those with no row at zero, so that a
	 * line falls to the axis where nothing happened. */
	long per[180 + 1][4] = { { 0 } }, max = 1;

	if (r == NULL) {
		db_error(b, err);
		return;
	}
	for (int i = 0; i < PQntuples(r); i++) {
		int ago = atoi(PQgetvalue(r, i, 0));

		if (ago < 0 || ago > minutes)
			continue;
		for (int s = 0; s < 4; s++) {
			per[minutes - ago][s] = atol(PQgetvalue(r, i, s + 1));
			if (per[minutes - ago][s] > max)
				max = per[minutes - ago][s];
		}
	}
	PQclear(r);
	sb_printf(b, "<h2>the last 3 hours, per minute</h2><svg id=\"chart\" width=\"%d\" height=\"%d\" "
	          "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"completions, retries, failures and "
	          "unknowns per minute\">", W, H + 20, W, H + 20);
	sb_printf(b, "<line x1=\"0\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#9ca3af\"/>", H, W, H);
	for (int s = 0; s < 4; s++) {
		sb_printf(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"",
		          series[s].color);
		for (int m = 0; m <= minutes; m++) {
			double x = (double)m * W / minutes;
			double y = H - (double)per[m][s] * (H - 10) / (double)max;
			sb_printf(b, "%.1f,%.1f ", x, y);
		}
		sb_puts(b, "\"/>");
		sb_printf(b, "<text x=\"%d\" y=\"%d\" fill=\"%s\" font-size=\"11\">%s</text>", 10 + s * 90,
		          H + 15, series[s].color, series[s].name);
	}
	sb_printf(b, "<text x=\"%d\" y=\"12\" font-size=\"11\" text-anchor=\"end\">max %ld/min</text>",
	          W - 4, max);
	sb_puts(b, "</svg>");
}

void page_overview(const struct req *rq, struct strbuf *b)
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
	r = console_query("SELECT state, effect_type, host, n, held, capped FROM outbox_console_counts()",
	                  0, NULL, &err);
	if (r == NULL) {
		db_error(b, err);
	} else {
		bool capped = false;

		sb_puts(b, "<h2>effects by state, type and host</h2><p>open ones now; completed and "
		           "failed: finished in the last 24 hours</p><table id=\"counts\"><tr><th>state</th>"
		           "<th>type</th><th>host</th><th>effects</th><th>held by a scope</th></tr>");
		for (int i = 0; i < PQntuples(r); i++) {
			/* A walk that stopped at its cap: its counts are lower bounds. */
			const char *atleast = strcmp(PQgetvalue(r, i, 5), "t") == 0 ? "&ge; " : "";

			capped |= *atleast != '\0';
			sb_puts(b, "<tr>");
			state_cell(b, v(r, i, 0));
			cell(b, r, i, 1);
			cell(b, r, i, 2);
			sb_puts(b, "<td><a href=\"/effects?state=");
			hq(b, v(r, i, 0));
			sb_puts(b, "&amp;type=");
			hq(b, v(r, i, 1));
			if (v(r, i, 2)) {
				sb_puts(b, "&amp;host=");
				hq(b, v(r, i, 2));
			}
			sb_printf(b, "\">%s", atleast);
			h(b, v(r, i, 3));
			sb_puts(b, "</a></td>");
			cell(b, r, i, 4);
			sb_puts(b, "</tr>");
		}
		sb_puts(b, "</table>");
		if (capped)
			sb_puts(b, "<p id=\"counts-capped\">&ge;: more effects than the overview counts "
			           "(20,000 of each: the oldest due, the parked, the day&rsquo;s first "
			           "finished); the effects page lists them all</p>");
		PQclear(r);
	}
	chart(b);
	page_end(b);
}

/* ---- effects ------------------------------------------------------------ */

/* The acts on what a filter matches (acts.c), offered below the list. */
static const struct {
	const char *path, *id, *legend;
} filter_acts[] = {
	{ "/effects/requeue", "requeue-filter", "requeue the failed effects this filter matches" },
	{ "/effects/cancel", "cancel-filter", "cancel the pending effects this filter matches" },
};

void page_effects(const struct req *rq, struct strbuf *b)
{
	const char *params[10], *err, *state = req_get(rq, "state");
	char hours[16], limit[8];
	PGresult *r;

	snprintf(limit, sizeof(limit), "%d", PAGE);
	effects_params(rq, params, hours, sizeof(hours), NULL, limit, WALK);
	page_begin(b, rq, "effects", "/effects");
	banner(b);
	filter_form(b, rq, "/effects", "filters", "filter", effects_fields, effects_nfields);
	r = console_query(effects_sql, 10, params, &err);
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
		filter_query(b, rq, effects_fields, effects_nfields);
		sb_puts(b, "\">older &rarr;</a></p>");
	} else if (req_get(rq, "run") == NULL && (state == NULL || strcmp(state, "failed") != 0)) {
		/* A short page of a bounded walk: where the walk stopped, if it
		 * stopped before the window's start, and the way on from there.
		 * (Read after the page: effects created in between can only move
		 * that point later, so the next page may repeat a row, never skip
		 * one.) */
		const char *fp[3] = { hours, params[7], WALK };
		/* The time an effect id begins with (its creation's Unix ms). */
		PGresult *f = console_query(
			"SELECT w::text, " T("to_timestamp(('x' || lpad(substr(replace(w::text, '-', ''), 1, 12), "
			                     "16, '0'))::bit(64)::bigint / 1000.0)")
			" FROM (SELECT outbox_console_walk_floor(now() - make_interval(hours => $1::integer), "
			"now() + interval '1 minute', $2::uuid, $3::integer) AS w) x",
			3, fp, &err);

		if (f == NULL) {
			db_error(b, err);
		} else if (PQntuples(f) == 1 && v(f, 0, 0)) {
			sb_puts(b, "<p id=\"walk-end\">searched the newest " WALK " effects of the window "
			           "from here, back to ");
			h(b, v(f, 0, 1));
			sb_puts(b, ": <a id=\"next\" href=\"/effects?before=");
			hq(b, v(f, 0, 0));
			filter_query(b, rq, effects_fields, effects_nfields);
			sb_puts(b, "\">search older &rarr;</a></p>");
		}
		PQclear(f);
	}
	PQclear(r);
	for (size_t i = 0; can_act(rq) && i < sizeof(filter_acts) / sizeof(filter_acts[0]); i++) {
		sb_printf(b, "<form method=\"post\" action=\"%s\" id=\"%s\"><fieldset><legend>%s"
		          "</legend>", filter_acts[i].path, filter_acts[i].id, filter_acts[i].legend);
		csrf_field(b, rq);
		filter_hidden(b, rq, effects_fields, effects_nfields);
		sb_puts(b, "<label>at most <input name=\"cap\" size=\"5\" value=\"100\"></label> "
		           "<label>reason <input name=\"reason\" size=\"30\" required></label> "
		           "<button type=\"submit\" name=\"preview\" value=\"1\">preview</button>"
		           "</fieldset></form>");
	}
	page_end(b);
}

/* ---- one effect ------------------------------------------------------------ */

void page_effect(const struct req *rq, struct strbuf *b)
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
	/* The run's state as its effects make it, not as last stored (a run
	 * settles when a worker or outboxctl next touches it). */
	r = console_query("SELECT effect_id, state, idempotency_key, "
	                  "outbox_console_run_state(idempotency_key, run_state), effect_type, target, "
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

void page_unknown(const struct req *rq, struct strbuf *b)
{
	const char *err;
	PGresult *r;

	page_begin(b, rq, "unknown", "/unknown");
	banner(b);
	r = console_query("SELECT u.effect_id, u.idempotency_key, u.effect_key, u.effect_type, u.target, "
	                  "u.attempts, " T("u.unknown_since") ", extract(epoch FROM now() - "
	                  "coalesce(u.last_attempt_ended, u.unknown_since))::bigint, u.last_attempt_worker, "
	                  "u.last_attempt_outcome, u.last_attempt_status, u.last_attempt_error, "
	                  "outbox_console_run_state(u.idempotency_key, u.run_state), e.lookups, "
	                  "e.last_lookup, "
	                  T("e.last_lookup_at") ", e.late_accepted, e.phase, "
	                  "extract(epoch FROM now() - e.sent_at)::bigint "
	                  "FROM outbox_read_unknown() u "
	                  "CROSS JOIN LATERAL outbox_console_unknown_evidence(u.effect_id) e",
	                  0, NULL, &err);
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
	           "<th>since the last call</th><th>phase reached</th><th>since the point of no "
	           "return</th><th>last call</th><th>reconcile lookups</th>"
	           "<th>late acceptances</th></tr>");
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
		h(b, v(r, i, 12));
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
		/* The phase the last send reached, and how long ago it went
		 * `sending` (past that point the provider may have it). */
		sb_puts(b, " s</td><td class=\"phase\">");
		h(b, v(r, i, 17));
		sb_puts(b, "</td><td class=\"no-return\">");
		if (v(r, i, 18)) {
			h(b, v(r, i, 18));
			sb_puts(b, " s");
		}
		sb_puts(b, "</td><td>");
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
		sb_puts(b, "</td><td class=\"lookups\">");
		/* The reconcile lookups: how many, the last one's answer, when. */
		h(b, v(r, i, 13));
		if (v(r, i, 14)) {
			sb_puts(b, "; last ");
			h(b, v(r, i, 15));
			sb_puts(b, ": ");
			h(b, v(r, i, 14));
		}
		sb_puts(b, "</td>");
		cell(b, r, i, 16);
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

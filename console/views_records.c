/* SPDX-License-Identifier: ISC */
/*
 * views_records.c: the views of what was decided and done: the approvals
 * waiting (linked out to the n8n kit's page), the runs and a run's
 * effects, the operators' audit, the controls and their history.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages.h"

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

void page_approvals(const struct req *rq, struct strbuf *b)
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

static const char *const run_states[] = { "processing", "awaiting_human", "approved",
	                                      "completed", "failed_retryable", "failed_terminal", NULL };
static const struct filter_field runs_fields[] = { { "state", "state", 0, run_states, NULL } };
static const struct filter_field audit_fields[] = { { "operator", "operator", 20, NULL, NULL } };

/* The runs page's "more": after its last run when it is full, else, for
 * a state (which may be rare), after the 1,000 runs the page walked. */
static void runs_next(struct strbuf *b, const struct req *rq, const PGresult *r,
                      const char *const params[2])
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
		filter_query(b, rq, runs_fields, 1);
		sb_puts(b, PQntuples(r) == 50 ? "\">more &rarr;</a></p>"
		                              : "\">the next 1,000 runs &rarr;</a></p>");
	}
	PQclear(end);
}

void page_runs(const struct req *rq, struct strbuf *b)
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
	filter_form(b, rq, "/runs", "runs-filter", "show", runs_fields, 1);
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
	runs_next(b, rq, r, params);
	PQclear(r);
	page_end(b);
}

void page_audit(const struct req *rq, struct strbuf *b)
{
	const char *params[2] = { req_get(rq, "operator"), req_get(rq, "before") }, *err;
	PGresult *r;

	page_begin(b, rq, "audit", "/audit");
	banner(b);
	filter_form(b, rq, "/audit", "audit-filter", "filter", audit_fields, 1);
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
		filter_query(b, rq, audit_fields, 1);
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

void page_controls(const struct req *rq, struct strbuf *b)
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

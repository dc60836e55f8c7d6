/* SPDX-License-Identifier: ISC */
/*
 * pages.c: what every page shares (console/pages.h): the cells, the banner
 * on every page, the filter forms drawn from a table of fields, the
 * effects list's query and table (the effects page and the acts on a
 * filter both use them), and the routing of a request to its view or act.
 * The views: views_queue.c (overview, effects, one effect, unknown) and
 * views_records.c (approvals, runs, audit, controls); the acts: acts.c.
 * Every view reads through the functions of sql/functions/45_reads.sql
 * and 46_console.sql as outbox_viewer, with parameters (never text pasted
 * into SQL).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages.h"

/* ---- small helpers ----------------------------------------------------- */

void cell(struct strbuf *b, const PGresult *r, int row, int col)
{
	sb_puts(b, "<td>");
	h(b, v(r, row, col));
	sb_puts(b, "</td>");
}

void state_cell(struct strbuf *b, const char *state)
{
	sb_puts(b, "<td class=\"state-");
	h(b, state);
	sb_puts(b, "\">");
	h(b, state);
	sb_puts(b, "</td>");
}

void effect_link(struct strbuf *b, const char *id)
{
	sb_puts(b, "<td class=\"mono\"><a href=\"/effect?id=");
	hq(b, id);
	sb_puts(b, "\">");
	h(b, id);
	sb_puts(b, "</a></td>");
}

void db_error(struct strbuf *b, const char *err)
{
	sb_puts(b, "<p class=\"msg err\">database: ");
	h(b, err);
	sb_puts(b, "</p>");
}

/* ---- the banner, on every page --------------------------------------- */

void banner(struct strbuf *b)
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

/* ---- effects ------------------------------------------------------------ */

/* ---- filter forms ------------------------------------------------------- */

void filter_form(struct strbuf *b, const struct req *rq, const char *action, const char *id,
                 const char *button, const struct filter_field *f, size_t n)
{
	sb_printf(b, "<form method=\"get\" action=\"%s\" id=\"%s\">", action, id);
	for (size_t i = 0; i < n; i++) {
		const char *now = req_get(rq, f[i].key) ? req_get(rq, f[i].key) : f[i].dflt;
		sb_printf(b, "<label>%s ", f[i].label);
		if (f[i].options) {
			sb_printf(b, "<select name=\"%s\"><option value=\"\">any</option>", f[i].key);
			for (const char *const *o = f[i].options; *o; o++)
				sb_printf(b, "<option%s>%s</option>",
				          now && strcmp(now, *o) == 0 ? " selected" : "", *o);
			sb_puts(b, "</select>");
		} else {
			sb_printf(b, "<input name=\"%s\" size=\"%d\" value=\"", f[i].key, f[i].size);
			h(b, now);
			sb_puts(b, "\">");
		}
		sb_puts(b, "</label> ");
	}
	sb_printf(b, "<button type=\"submit\">%s</button></form>", button);
}

void filter_query(struct strbuf *b, const struct req *rq, const struct filter_field *f, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (req_get(rq, f[i].key) == NULL)
			continue;
		sb_printf(b, "&amp;%s=", f[i].key);
		hq(b, req_get(rq, f[i].key));
	}
}

void filter_hidden(struct strbuf *b, const struct req *rq, const struct filter_field *f, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (req_get(rq, f[i].key) == NULL)
			continue;
		sb_printf(b, "<input type=\"hidden\" name=\"%s\" value=\"", f[i].key);
		h(b, req_get(rq, f[i].key));
		sb_puts(b, "\">");
	}
}

/* ---- the effects list ------------------------------------------------------ */

/* In effects_sql's order ($2..$7), then the window. */
const struct filter_field effects_fields[] = {
	{ "state", "state", 12, NULL, NULL }, { "type", "type", 12, NULL, NULL },
	{ "host", "host", 12, NULL, NULL },   { "run", "run key", 12, NULL, NULL },
	{ "key", "provider key", 12, NULL, NULL }, { "error", "error text", 12, NULL, NULL },
	{ "hours", "hours", 4, NULL, "24" },
};
const size_t effects_nfields = sizeof(effects_fields) / sizeof(effects_fields[0]);

const char effects_sql[] =
	"SELECT effect_id, idempotency_key, effect_type, target, state, attempts, " T("created_at")
	", " T("updated_at") ", last_error_class, last_error, provider_id "
	"FROM outbox_console_effects(now() - make_interval(hours => $1::integer), now() + interval '1 minute', "
	"$2, $3, $4, $5, $6, $7, $8::uuid, $9::integer, $10::integer)";

void effects_params(const struct req *rq, const char *params[10], char *hours, size_t hlen,
                    const char *state, const char *limit, const char *walk)
{
	long hrs = req_get(rq, "hours") ? strtol(req_get(rq, "hours"), NULL, 10) : 24;

	if (hrs < 1 || hrs > 24 * 366)
		hrs = 24;
	snprintf(hours, hlen, "%ld", hrs);
	params[0] = hours;
	for (size_t i = 0; i < 6; i++)
		params[1 + i] = req_get(rq, effects_fields[i].key);
	if (state)
		params[1] = state;
	params[7] = req_get(rq, "before");
	params[8] = limit;
	params[9] = walk;
}

void effects_table(struct strbuf *b, const PGresult *r)
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

/* ---- routing ------------------------------------------------------------------------ */

/* An act's answer gets its banner where act_page left room for it, drawn
 * after the act, so that a switch just turned off reads off. */
static void banner_into(struct resp *out)
{
	struct strbuf page;

	sb_init(&page, out->body.len + 4096);
	sb_append(&page, out->body.s, out->banner_at);
	banner(&page);
	sb_append(&page, out->body.s + out->banner_at, out->body.len - out->banner_at);
	free(out->body.s);
	out->body = page;
}

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
				if (out->banner_at > 0 && out->banner_at <= out->body.len)
					banner_into(out);
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

/* SPDX-License-Identifier: ISC */
/*
 * pages.h: what the console's views (views_queue.c, views_records.c) and
 * acts (acts.c) share, from pages.c: the cells and the banner, the filter
 * forms drawn from a table of fields, the effects list's query and table.
 */
#ifndef OUTBOX_CONSOLE_PAGES_H
#define OUTBOX_CONSOLE_PAGES_H

#include <stdio.h>

#include "console.h"

/* A time as the pages show it, in UTC. */
#define T(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
#define PAGE 50

static inline const char *v(const PGresult *r, int row, int col)
{
	return PQgetisnull(r, row, col) ? NULL : PQgetvalue(r, row, col);
}

static inline void csrf_field(struct strbuf *b, const struct req *r)
{
	sb_printf(b, "<input type=\"hidden\" name=\"csrf\" value=\"%s\">", r->csrf);
}

static inline bool can_act(const struct req *r)
{
	return console.actions && r->identity != NULL;
}

void cell(struct strbuf *b, const PGresult *r, int row, int col);
void state_cell(struct strbuf *b, const char *state);
void effect_link(struct strbuf *b, const char *id);
void db_error(struct strbuf *b, const char *err);
/* The kill switch, the scopes and the database, on every page. */
void banner(struct strbuf *b);

/* One field of a GET filter form: a text input of size, or, with
 * options (NULL-terminated), a select whose first choice is "any"; shown
 * is the request's value, else dflt. */
struct filter_field {
	const char *key, *label;
	int size;
	const char *const *options;
	const char *dflt;
};
/* The form: its fields, then a submit button labelled button. */
void filter_form(struct strbuf *b, const struct req *rq, const char *action, const char *id,
                 const char *button, const struct filter_field *f, size_t n);
/* The fields the request sets, as "&amp;KEY=VALUE" (a link's query). */
void filter_query(struct strbuf *b, const struct req *rq, const struct filter_field *f, size_t n);
/* The fields the request sets, as hidden inputs (an act's form). */
void filter_hidden(struct strbuf *b, const struct req *rq, const struct filter_field *f, size_t n);

/* The effects list: its filters ($2..$7 of effects_sql, then hours). */
extern const struct filter_field effects_fields[];
extern const size_t effects_nfields;
extern const char effects_sql[];
/* effects_sql's parameters ($1..$10): hours, the six filters (state
 * overridden when given), the keyset position, the page size, the walk
 * (WALK for a page, NULL: the whole window, as the acts on a filter). */
void effects_params(const struct req *rq, const char *params[10], char *hours, size_t hlen,
                    const char *state, const char *limit, const char *walk);
/* How many effects of its window a page of the effects list reads at most
 * (outbox_console_effects' p_walk). */
#define WALK "20000"
void effects_table(struct strbuf *b, const PGresult *r);

/* The views (GET) and the acts (POST) the routing in pages.c calls. */
void page_overview(const struct req *rq, struct strbuf *b);
void page_effects(const struct req *rq, struct strbuf *b);
void page_effect(const struct req *rq, struct strbuf *b);
void page_unknown(const struct req *rq, struct strbuf *b);
void page_approvals(const struct req *rq, struct strbuf *b);
void page_runs(const struct req *rq, struct strbuf *b);
void page_audit(const struct req *rq, struct strbuf *b);
void page_controls(const struct req *rq, struct strbuf *b);
void do_resolve(const struct req *rq, struct strbuf *b, struct resp *out);
void do_effect_act(const struct req *rq, struct strbuf *b, struct resp *out);
void do_replace(const struct req *rq, struct strbuf *b, struct resp *out);
void do_requeue_filter(const struct req *rq, struct strbuf *b, struct resp *out);
void do_cancel_filter(const struct req *rq, struct strbuf *b, struct resp *out);
void do_switch(const struct req *rq, struct strbuf *b, struct resp *out);
void do_limit(const struct req *rq, struct strbuf *b, struct resp *out);

#endif

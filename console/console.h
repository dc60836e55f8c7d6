/* SPDX-License-Identifier: ISC */
/*
 * console.h: outbox-console, the operator's web console (docs/console.md).
 * A program of its own beside the workers: it reads through the functions
 * of sql/functions/45_reads.sql and 46_console.sql as outbox_viewer, and
 * acts, when [console] actions = on, as the person's own PostgreSQL role
 * (SET ROLE in the act's transaction) through the functions outboxctl
 * calls.  main.c: the configuration, the HTTP server (libmicrohttpd), the
 * request's checks (proxy identity, Origin, CSRF token) and the headers;
 * pages.c (pages.h): what the pages share and the routing; views_queue.c
 * and views_records.c: the views; acts.c: the acts; html.c: escaping and
 * the page frame.
 */
#ifndef OUTBOX_CONSOLE_H
#define OUTBOX_CONSOLE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

#include "text.h"

#define CONSOLE_MAX_FIELDS 256

struct console_settings {
	const char *conninfo;
	const char *listen;
	bool actions;
	const char *trusted_proxy;
	const char *identity_header;
	const char *origin;
	long refresh_seconds;
	long max_connections;
	const char *approvals_url;   /* a template, {id} the approval's id; "" no link */
};

/* One request as the pages see it. */
struct req {
	const char *method;          /* "GET" or "POST" */
	const char *path;
	const char *identity;        /* the person, from a trusted proxy; NULL: nobody */
	char csrf[65];               /* the token this person's forms carry */
	int nfields;                 /* the query string's or the form's fields */
	char *keys[CONSOLE_MAX_FIELDS];
	char *values[CONSOLE_MAX_FIELDS];
};

struct resp {
	int status;
	const char *content_type;
	struct strbuf body;
	char location[512];          /* a redirect after an act (303) */
	size_t banner_at;            /* an act's answer: where its banner goes, drawn after the act */
};

extern struct console_settings console;

/* The viewer's connection (reconnected when lost); NULL when the database
 * cannot be reached. */
PGconn *console_db(void);
/* A statement as the viewer; NULL (and *err set) on failure. */
PGresult *console_query(const char *sql, int n, const char *const *params, const char **err);

/* The first value of a field, or NULL; empty values count as NULL. */
const char *req_get(const struct req *r, const char *key);

/* Route a request: fills resp (status, body). */
void pages_handle(const struct req *r, struct resp *out);

/* html.c: s HTML-escaped, its control, invisible and bidi characters shown
 * as escapes first (util.c's sb_term_escape, as outboxctl shows them). */
void h(struct strbuf *b, const char *s);
/* s escaped for a URL's query value. */
void hq(struct strbuf *b, const char *s);
void page_begin(struct strbuf *b, const struct req *r, const char *title, const char *current);
void page_end(struct strbuf *b);
extern const char console_css[];
extern const char console_js[];
extern const char console_icon[];

#endif

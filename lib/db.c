/* SPDX-License-Identifier: ISC */
/*
 * db.c: the asynchronous libpq connection (see db.h).
 *
 * Connection states:
 *   DB_WAIT        waiting for the reconnect timer
 *   DB_CONNECTING  PQconnectPoll() in progress
 *   DB_UP          connected; one query at most on the wire
 * The socket changes on every connect, so the event is re-created from
 * PQsocket() each time.
 *
 * Deadlines (db_set_timeouts): a connect, and the answer to the query on
 * the wire, each get response_timeout_ms; past it the connection counts
 * as lost.  A black-holed connection (packets dropped, no reset) would
 * otherwise wait for the kernel: on a real network tcp_user_timeout and
 * the keepalives (set unless the conninfo sets them) notice first, but a
 * peer that takes the data and never answers is noticed only here.
 *
 * Failed connects are logged as they start to repeat: the first, then at
 * attempts 2, 4, 8, ... and at least once a minute, each line with the
 * attempt count and the next delay.
 */
#include "db.h"

#include <event2/event.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/queue.h>

#include "log.h"
#include "util.h"

enum db_state { DB_WAIT, DB_CONNECTING, DB_UP };

struct db_query {
	TAILQ_ENTRY(db_query) link;
	char *sql;
	int nparams;
	char **params;
	db_result_fn cb;
	void *arg;
	unsigned flags;
};
TAILQ_HEAD(db_query_list, db_query);

struct db {
	struct event_base *base;
	char *conninfo;
	char *listen_channel;
	char *app_name;               /* fallback_application_name, or NULL */
	PGconn *conn;
	enum db_state state;
	struct event *sock_ev;        /* connecting: one-shot; up: EV_READ|EV_PERSIST */
	struct event *write_ev;       /* up: added while PQflush() has output left */
	struct event *timer_ev;
	struct event *deadline_ev;    /* the connect's or the wire query's deadline */
	long backoff_min, backoff_max, backoff_cur;
	long statement_timeout_ms;    /* set on the server per session; 0: not */
	long response_timeout_ms;     /* connect / answer deadline; 0: none */
	char tcp_user_timeout[24], keepalives_idle[24], keepalives_interval[24];
	unsigned long failures;       /* failed connects since the last success */
	int64_t failure_logged_mono;  /* when the last of them was logged */
	struct db_query_list queue;   /* head is on the wire when sent */
	bool head_sent;
	int64_t head_sent_mono;       /* when the head query was written */
	int64_t done_sent_mono;       /* the same for the query whose callback runs */
	int64_t cb_end_mono;          /* when the last callback returned */
	PGresult *last_result;
	db_state_fn on_state;
	db_notify_fn on_notify;
	void *cb_arg;
	unsigned long reconnects;
	bool ever_up;
	char last_error[256];
};

static void db_connect_step(struct db *db);
static void db_send_next(struct db *db);
static bool db_send_head(struct db *db);
static void db_lost(struct db *db, const char *why);
static void arm_deadline(struct db *db);

static void query_free(struct db_query *q)
{
	for (int i = 0; i < q->nparams; i++)
		free(q->params[i]);
	free(q->params);
	free(q->sql);
	free(q);
}

/* Copy at most n bytes of src to the output, keeping it terminated. */
static void out_put(char *out, size_t len, size_t *used, const char *src, size_t n)
{
	while (n-- > 0 && *used + 1 < len)
		out[(*used)++] = *src++;
	if (len > 0)
		out[*used < len ? *used : len - 1] = '\0';
}

static bool secret_keyword(const char *k, size_t n)
{
	return (n == 8 && strncasecmp(k, "password", 8) == 0) ||
	       (n == 11 && strncasecmp(k, "sslpassword", 11) == 0);
}

static int hex_digit(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
	     : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A URL query key, percent-escapes decoded (libpq decodes them:
 * pass%77ord is password).  1: a secret key, 0: not, -1: cannot tell (a
 * broken escape, or too long to be a keyword): mask everything after it. */
static int secret_url_key(const char *k, size_t n)
{
	char key[32];
	size_t len = 0;

	for (size_t i = 0; i < n; i++) {
		char c = k[i];
		if (c == '%') {
			int hi = i + 2 < n ? hex_digit(k[i + 1]) : -1;
			int lo = i + 2 < n ? hex_digit(k[i + 2]) : -1;
			if (hi < 0 || lo < 0)
				return -1;
			c = (char)(hi * 16 + lo);
			i += 2;
		}
		if (c == '\0' || len + 1 >= sizeof(key))
			return -1;
		key[len++] = c;
	}
	return secret_keyword(key, len) ? 1 : 0;
}

/* URL form: postgresql://user:secret@host/db?password=x&sslpassword=y */
static void redact_url(const char *s, char *out, size_t len)
{
	const char *p = strstr(s, "://") + 3;
	const char *auth_end = p + strcspn(p, "@/?");
	const char *q;
	size_t used = 0;

	/* The last '@' before the query ends the user info, even past a '/'
	 * that a password may hold: mask too much rather than too little. */
	for (const char *a = p; *a && *a != '?'; a++)
		if (*a == '@')
			auth_end = a;

	out_put(out, len, &used, s, (size_t)(p - s));
	if (*auth_end == '@') {
		const char *colon = memchr(p, ':', (size_t)(auth_end - p));
		if (colon) {
			out_put(out, len, &used, p, (size_t)(colon - p) + 1);
			out_put(out, len, &used, "********", 8);
			p = auth_end;
		}
	}
	q = strchr(p, '?');
	if (q == NULL) {
		out_put(out, len, &used, p, strlen(p));
		return;
	}
	out_put(out, len, &used, p, (size_t)(q - p) + 1);
	for (q++; *q;) {
		size_t plen = strcspn(q, "&"), klen = strcspn(q, "=&");
		int secret = secret_url_key(q, klen);
		if (secret < 0) {           /* when in doubt, mask the rest */
			out_put(out, len, &used, "********", 8);
			return;
		}
		if (klen < plen && secret) {
			out_put(out, len, &used, q, klen + 1);
			out_put(out, len, &used, "********", 8);
		} else {
			out_put(out, len, &used, q, plen);
		}
		q += plen;
		if (*q == '&')
			out_put(out, len, &used, q++, 1);
	}
}

/* keyword = value form, values optionally single-quoted with \ escapes;
 * every password and sslpassword value is masked, the rest kept as is. */
void db_redact_conninfo(const char *conninfo, char *out, size_t len)
{
	const char *p = conninfo;
	size_t used = 0;

	if (len == 0)
		return;
	out[0] = '\0';
	if (conninfo[0] == '\0') {
		text_copy(out, "(libpq environment)", len);
		return;
	}
	if (strncmp(conninfo, "postgresql://", 13) == 0 || strncmp(conninfo, "postgres://", 11) == 0) {
		redact_url(conninfo, out, len);
		return;
	}
	while (*p) {
		const char *k = p, *v;
		size_t klen;
		bool secret;

		while (*p && *p != '=' && *p != ' ' && *p != '\t')
			p++;
		klen = (size_t)(p - k);
		secret = secret_keyword(k, klen);
		while (*p == ' ' || *p == '\t')
			p++;
		if (*p != '=') {           /* not keyword=value: copy and move on */
			out_put(out, len, &used, k, (size_t)(p - k) + (*p ? 1 : 0));
			if (*p)
				p++;
			continue;
		}
		p++;
		while (*p == ' ' || *p == '\t')
			p++;
		out_put(out, len, &used, k, (size_t)(p - k));
		v = p;
		if (*p == '\'') {
			for (p++; *p && *p != '\''; p++)
				if (*p == '\\' && p[1])
					p++;
			if (*p == '\'')
				p++;
		} else {
			while (*p && *p != ' ' && *p != '\t')
				p++;
		}
		if (secret)
			out_put(out, len, &used, "********", 8);
		else
			out_put(out, len, &used, v, (size_t)(p - v));
		while (*p == ' ' || *p == '\t')
			out_put(out, len, &used, p++, 1);
	}
}

struct db *db_new(struct event_base *base, const char *conninfo, long backoff_min_ms,
                  long backoff_max_ms, const char *listen_channel)
{
	struct db *db = text_alloc(sizeof(*db));

	db->base = base;
	db->conninfo = text_strdup(conninfo ? conninfo : "");
	db->listen_channel = listen_channel ? text_strdup(listen_channel) : NULL;
	db->backoff_min = backoff_min_ms;
	db->backoff_max = backoff_max_ms;
	db->backoff_cur = backoff_min_ms;
	db->state = DB_WAIT;
	TAILQ_INIT(&db->queue);
	return db;
}

void db_set_timeouts(struct db *db, long statement_timeout_ms, long response_timeout_ms,
                     long tcp_user_timeout_ms, long keepalive_idle_s, long keepalive_interval_s)
{
	db->statement_timeout_ms = statement_timeout_ms;
	db->response_timeout_ms = response_timeout_ms;
	db->tcp_user_timeout[0] = db->keepalives_idle[0] = db->keepalives_interval[0] = '\0';
	if (tcp_user_timeout_ms > 0)
		snprintf(db->tcp_user_timeout, sizeof(db->tcp_user_timeout), "%ld", tcp_user_timeout_ms);
	if (keepalive_idle_s > 0)
		snprintf(db->keepalives_idle, sizeof(db->keepalives_idle), "%ld", keepalive_idle_s);
	if (keepalive_interval_s > 0)
		snprintf(db->keepalives_interval, sizeof(db->keepalives_interval), "%ld",
		         keepalive_interval_s);
}

void db_set_application_name(struct db *db, const char *name)
{
	free(db->app_name);
	db->app_name = name ? text_strdup(name) : NULL;
}

void db_set_callbacks(struct db *db, db_state_fn on_state, db_notify_fn on_notify, void *arg)
{
	db->on_state = on_state;
	db->on_notify = on_notify;
	db->cb_arg = arg;
}

bool db_is_up(const struct db *db)
{
	return db->state == DB_UP;
}

size_t db_queue_len(const struct db *db)
{
	size_t n = 0;
	const struct db_query *q;

	TAILQ_FOREACH(q, &db->queue, link)
		n++;
	return n;
}

unsigned long db_reconnects(const struct db *db)
{
	return db->reconnects;
}

const char *db_last_error(const struct db *db)
{
	return db->last_error;
}

static void set_error_from_conn(struct db *db)
{
	const char *m = db->conn ? PQerrorMessage(db->conn) : "no connection";

	text_copy(db->last_error, m, sizeof(db->last_error));
	db->last_error[strcspn(db->last_error, "\n")] = '\0';
}

/* Whether the connection's settings come from a service file (the
 * conninfo's service=, or PGSERVICE): libpq fills in a service's keys only
 * where nothing set them, so defaults of ours would override the file's. */
static bool uses_service(const char *conninfo)
{
	PQconninfoOption *opts, *o;
	bool found = getenv("PGSERVICE") != NULL && getenv("PGSERVICE")[0] != '\0';

	if (found || conninfo == NULL || conninfo[0] == '\0')
		return found;
	opts = PQconninfoParse(conninfo, NULL);
	for (o = opts; o && o->keyword; o++)
		if (strcmp(o->keyword, "service") == 0 && o->val && o->val[0])
			found = true;
	PQconninfoFree(opts);
	return found;
}

static void on_timer(evutil_socket_t fd, short what, void *arg)
{
	struct db *db = arg;

	(void)fd;
	(void)what;
	if (db->state == DB_WAIT) {
		db->state = DB_CONNECTING;
		/* The conninfo as dbname (expanded: key=value or a URL);
		 * an empty one is ignored, so libpq's environment applies.
		 * The keys before it are defaults: the expanded conninfo
		 * overrides them (a fallback_application_name, keepalives or
		 * tcp_user_timeout of its own wins), and are left out where a
		 * service file gives the settings.  The application name
		 * shows in pg_stat_activity unless the conninfo or PGAPPNAME
		 * sets one.  libpq ignores the TCP ones on a Unix socket. */
		const char *const keys[] = { "fallback_application_name", "keepalives",
		                             "keepalives_idle", "keepalives_interval",
		                             "keepalives_count", "tcp_user_timeout", "dbname", NULL };
		bool tcp = !uses_service(db->conninfo);
		const char *const vals[] = {
			db->app_name, tcp ? "1" : NULL,
			tcp && db->keepalives_idle[0] ? db->keepalives_idle : NULL,
			tcp && db->keepalives_interval[0] ? db->keepalives_interval : NULL,
			tcp && db->keepalives_interval[0] ? "3" : NULL,
			tcp && db->tcp_user_timeout[0] ? db->tcp_user_timeout : NULL,
			db->conninfo, NULL };
		db->conn = PQconnectStartParams(keys, vals, 1);
		if (db->conn == NULL) {
			db_lost(db, "out of memory");
			return;
		}
		arm_deadline(db);
		db_connect_step(db);
	}
}

/* The next connect: at once the first time, then after a delay with full
 * jitter above a floor (so a fleet that lost its database does not
 * reconnect in lockstep), the ceiling doubling up to backoff_max from
 * the first failure on.  Returns the delay. */
static int64_t schedule_reconnect(struct db *db, bool at_once)
{
	struct timeval tv;
	int64_t delay = 0;

	if (!at_once) {
		delay = db->backoff_min + (int64_t)random_below((uint64_t)db->backoff_cur + 1);
		db->backoff_cur = db->backoff_cur * 2 > db->backoff_max ? db->backoff_max
		                                                        : db->backoff_cur * 2;
	}
	if (db->timer_ev == NULL)
		db->timer_ev = evtimer_new(db->base, on_timer, db);
	tv.tv_sec = delay / 1000;
	tv.tv_usec = (delay % 1000) * 1000;
	evtimer_add(db->timer_ev, &tv);
	return delay;
}

void db_start(struct db *db)
{
	db->state = DB_WAIT;
	(void)schedule_reconnect(db, true);
}

static void on_deadline(evutil_socket_t fd, short what, void *arg);

/* Connecting, or a query on the wire: its deadline from when it started
 * (a query's from when it was written); otherwise none. */
static void arm_deadline(struct db *db)
{
	int64_t left;
	struct timeval tv;

	if (db->response_timeout_ms <= 0)
		return;
	if (db->deadline_ev == NULL)
		db->deadline_ev = evtimer_new(db->base, on_deadline, db);
	if (db->state == DB_CONNECTING) {
		left = db->response_timeout_ms;
	} else if (db->state == DB_UP && db->head_sent) {
		left = db->head_sent_mono + db->response_timeout_ms - now_mono_ms();
		if (left < 0)
			left = 0;
	} else {
		evtimer_del(db->deadline_ev);
		return;
	}
	tv.tv_sec = left / 1000;
	tv.tv_usec = (left % 1000) * 1000;
	evtimer_add(db->deadline_ev, &tv);
}

static void drop_socket_event(struct db *db)
{
	if (db->sock_ev) {
		event_free(db->sock_ev);
		db->sock_ev = NULL;
	}
	if (db->write_ev) {
		event_free(db->write_ev);
		db->write_ev = NULL;
	}
}

static void on_socket(evutil_socket_t fd, short what, void *arg);
static void db_flush(struct db *db);

static void watch_socket(struct db *db, short what)
{
	drop_socket_event(db);
	db->sock_ev = event_new(db->base, PQsocket(db->conn), what, on_socket, db);
	event_add(db->sock_ev, NULL);
}

/* The connection broke (or never came up): fail or requeue the query on
 * the wire, close, and schedule a reconnect. */
static void db_lost(struct db *db, const char *why)
{
	bool was_up = db->state == DB_UP;
	struct db_query *head = TAILQ_FIRST(&db->queue);
	char reason[sizeof(db->last_error)];
	int64_t delay;

	/* why may be last_error, which the next connect overwrites. */
	text_copy(reason, why, sizeof(reason));
	drop_socket_event(db);
	if (db->deadline_ev)
		evtimer_del(db->deadline_ev);
	if (db->last_result) {
		PQclear(db->last_result);
		db->last_result = NULL;
	}
	if (db->conn) {
		PQfinish(db->conn);
		db->conn = NULL;
	}
	db->state = DB_WAIT;
	if (head && db->head_sent) {
		db->head_sent = false;
		if (!(head->flags & DBQ_RETRY)) {
			TAILQ_REMOVE(&db->queue, head, link);
			if (head->cb)
				head->cb(db, NULL, head->arg);
			query_free(head);
		} else if ((head->flags & DBQ_REPEAT_FLAG) && head->nparams > 0) {
			free(head->params[head->nparams - 1]);
			head->params[head->nparams - 1] = text_strdup("true");
		}
	}
	if (db->ever_up)
		db->reconnects++;
	if (was_up) {
		delay = schedule_reconnect(db, false);
		log_msg(OLOG_WARN, "db_disconnected", "database connection lost (reconnecting in %lld ms): %s",
		        (long long)delay, reason);
	} else {
		int64_t now = now_mono_ms();
		bool power_of_two;

		db->failures++;
		power_of_two = (db->failures & (db->failures - 1)) == 0;
		delay = schedule_reconnect(db, false);
		if (power_of_two || now - db->failure_logged_mono >= 60000) {
			db->failure_logged_mono = now;
			log_msg(OLOG_WARN, "db_connect_failed",
			        "cannot connect to the database (attempt %lu, next in %lld ms): %s",
			        db->failures, (long long)delay, reason);
		}
	}
	if (was_up && db->on_state)
		db->on_state(db, false, db->cb_arg);
}

static void on_connected(struct db *db)
{
	PQsetnonblocking(db->conn, 1);
	db->state = DB_UP;
	db->backoff_cur = db->backoff_min;
	db->ever_up = true;
	if (db->deadline_ev)
		evtimer_del(db->deadline_ev);
	log_msg(OLOG_INFO, "db_connected", "connected to PostgreSQL (server %d, attempt %lu)",
	        PQserverVersion(db->conn), db->failures + 1);
	db->failures = 0;
	watch_socket(db, EV_READ | EV_PERSIST);
	if (db->listen_channel) {
		/* LISTEN goes first so no NOTIFY is missed after the reconnect. */
		char sql[128];
		struct db_query *q = text_alloc(sizeof(*q));
		snprintf(sql, sizeof(sql), "LISTEN %s", db->listen_channel);
		q->sql = text_strdup(sql);
		q->cb = NULL;
		q->flags = DBQ_RETRY | DBQ_URGENT;   /* nothing goes ahead of it */
		TAILQ_INSERT_HEAD(&db->queue, q, link);
	}
	if (db->statement_timeout_ms > 0) {
		/* The server's own limit on this session's statements, unless
		 * the role, the database, the conninfo's options or PGOPTIONS set
		 * one (even to 0): only a limit nobody set is replaced. */
		char ms[24];
		struct db_query *q = text_alloc(sizeof(*q));
		snprintf(ms, sizeof(ms), "%ld", db->statement_timeout_ms);
		q->sql = text_strdup("SELECT set_config('statement_timeout', $1, false) "
		                 "FROM pg_settings WHERE name = 'statement_timeout' AND source = 'default'");
		q->nparams = 1;
		q->params = text_alloc(sizeof(char *));
		q->params[0] = text_strdup(ms);
		q->flags = DBQ_RETRY | DBQ_URGENT;
		TAILQ_INSERT_HEAD(&db->queue, q, link);
	}
	if (db->on_state)
		db->on_state(db, true, db->cb_arg);
	db_send_next(db);
}

static void db_connect_step(struct db *db)
{
	switch (PQconnectPoll(db->conn)) {
	case PGRES_POLLING_READING:
		watch_socket(db, EV_READ);
		return;
	case PGRES_POLLING_WRITING:
		watch_socket(db, EV_WRITE);
		return;
	case PGRES_POLLING_OK:
		on_connected(db);
		return;
	case PGRES_POLLING_FAILED:
	default:
		set_error_from_conn(db);
		db_lost(db, db->last_error);
		return;
	}
}

static void deliver_notifies(struct db *db)
{
	PGnotify *n;

	while ((n = PQnotifies(db->conn)) != NULL) {
		if (db->on_notify)
			db->on_notify(db, n->relname, n->extra, db->cb_arg);
		PQfreemem(n);
	}
}

/* Read what the server sent; finish the head query when its results end. */
static void db_read(struct db *db)
{
	if (!PQconsumeInput(db->conn)) {
		set_error_from_conn(db);
		db_lost(db, db->last_error);
		return;
	}
	deliver_notifies(db);
	while (db->head_sent && !PQisBusy(db->conn)) {
		PGresult *r = PQgetResult(db->conn);
		struct db_query *head;
		bool sent_ok;

		if (r != NULL) {
			if (db->last_result)
				PQclear(db->last_result);
			db->last_result = r;
			continue;
		}
		/* End of this query's results. */
		head = TAILQ_FIRST(&db->queue);
		if (PQstatus(db->conn) == CONNECTION_BAD) {
			set_error_from_conn(db);
			db_lost(db, db->last_error);
			return;
		}
		TAILQ_REMOVE(&db->queue, head, link);
		db->head_sent = false;
		if (db->deadline_ev)
			evtimer_del(db->deadline_ev);
		/* Its time on the wire and in the server: from when it was
		 * written, or from the end of the callback before it if it
		 * was written ahead (the answer may have waited for that). */
		db->done_sent_mono = db->head_sent_mono > db->cb_end_mono ? db->head_sent_mono
		                                                          : db->cb_end_mono;
		r = db->last_result;
		db->last_result = NULL;
		/* The next query goes out before this one's callback runs, so
		 * the server works on it while we read this answer (a lease's
		 * rows take the worker ~1 ms to take in). */
		sent_ok = db_send_head(db);
		if (head->cb)
			head->cb(db, r, head->arg);
		else if (r && PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK)
			log_msg(OLOG_WARN, "db_error", "%s: %s", head->sql, PQresultErrorMessage(r));
		PQclear(r);
		query_free(head);
		db->cb_end_mono = now_mono_ms();
		if (db->state != DB_UP)
			return;   /* the callback's query found the connection lost */
		if (!sent_ok) {
			/* The lookahead send failed: the connection is gone
			 * (its callback above still got this query's result). */
			set_error_from_conn(db);
			db_lost(db, db->last_error);
			return;
		}
		deliver_notifies(db);
	}
	db_send_next(db);
}

static void db_flush(struct db *db)
{
	int rc = PQflush(db->conn);

	if (rc < 0) {
		set_error_from_conn(db);
		db_lost(db, db->last_error);
	} else if (rc > 0) {
		event_add(db->write_ev, NULL);
	}
}

static void on_socket(evutil_socket_t fd, short what, void *arg)
{
	struct db *db = arg;

	(void)fd;
	switch (db->state) {
	case DB_CONNECTING:
		db_connect_step(db);
		return;
	case DB_UP:
		if (what & EV_WRITE) {
			db_flush(db);
			if (db->state != DB_UP)
				return;
		}
		if (what & EV_READ)
			db_read(db);
		return;
	case DB_WAIT:
		return;
	}
}

/* Write the head query if there is one and none is on the wire.  False
 * when the connection failed; the caller decides when to call db_lost(). */
static bool db_send_head(struct db *db)
{
	struct db_query *q = TAILQ_FIRST(&db->queue);
	int rc;

	if (db->state != DB_UP || db->head_sent || q == NULL)
		return true;
	if (!PQsendQueryParams(db->conn, q->sql, q->nparams, NULL,
	                       (const char *const *)q->params, NULL, NULL, 0))
		return false;
	db->head_sent = true;
	db->head_sent_mono = now_mono_ms();
	arm_deadline(db);
	rc = PQflush(db->conn);
	if (rc > 0) {
		if (db->write_ev == NULL)
			db->write_ev = event_new(db->base, PQsocket(db->conn), EV_WRITE, on_socket, db);
		event_add(db->write_ev, NULL);
	}
	return rc >= 0;
}

static void db_send_next(struct db *db)
{
	if (!db_send_head(db)) {
		set_error_from_conn(db);
		db_lost(db, db->last_error);
	}
}

/* The statement on a connection given up on is cancelled on the server
 * too: a backend waiting on a lock reads nothing from its socket, so
 * closing the connection alone leaves it waiting, and the retried
 * statement would queue a second backend behind it.  PQcancel() has no
 * timeout (the server may be unreachable), so it runs on a detached
 * thread that owns the request; a server that never answers costs that
 * thread until the kernel gives up the connect. */
static void *cancel_detached(void *arg)
{
	char err[200];

	(void)PQcancel(arg, err, sizeof(err));
	PQfreeCancel(arg);
	return NULL;
}

static void cancel_on_server(struct db *db)
{
	pthread_attr_t attr;
	pthread_t t;
	PGcancel *c = PQgetCancel(db->conn);

	if (c == NULL)
		return;
	if (pthread_attr_init(&attr) != 0) {
		PQfreeCancel(c);
		return;
	}
	(void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&t, &attr, cancel_detached, c) != 0)
		PQfreeCancel(c);
	pthread_attr_destroy(&attr);
}

/* A connect or an answer that took too long: the answer may be waiting
 * in the socket (the loop was busy), so read first. */
static void on_deadline(evutil_socket_t fd, short what, void *arg)
{
	struct db *db = arg;
	char why[160];

	(void)fd;
	(void)what;
	switch (db->state) {
	case DB_CONNECTING:
		snprintf(why, sizeof(why), "no answer from the server within %ld ms while connecting",
		         db->response_timeout_ms);
		text_copy(db->last_error, why, sizeof(db->last_error));
		db_lost(db, why);
		return;
	case DB_UP:
		db_read(db);
		if (db->state != DB_UP || !db->head_sent ||
		    now_mono_ms() - db->head_sent_mono < db->response_timeout_ms) {
			arm_deadline(db);
			return;
		}
		snprintf(why, sizeof(why), "no answer from the server within %ld ms",
		         db->response_timeout_ms);
		text_copy(db->last_error, why, sizeof(db->last_error));
		cancel_on_server(db);
		db_lost(db, why);
		return;
	case DB_WAIT:
		return;
	}
}

int64_t db_head_sent_mono(const struct db *db)
{
	return db->done_sent_mono;
}

void db_query(struct db *db, const char *sql, int nparams, const char *const *params,
              db_result_fn cb, void *arg, unsigned flags)
{
	struct db_query *q = text_alloc(sizeof(*q));

	q->sql = text_strdup(sql);
	q->nparams = nparams;
	q->params = text_array((size_t)(nparams > 0 ? nparams : 1), sizeof(char *));
	for (int i = 0; i < nparams; i++)
		q->params[i] = params[i] ? text_strdup(params[i]) : NULL;
	q->cb = cb;
	q->arg = arg;
	q->flags = flags;
	if (flags & DBQ_URGENT) {
		/* Behind the query on the wire and earlier urgent ones, ahead
		 * of the rest. */
		struct db_query *at = TAILQ_FIRST(&db->queue);
		if (at && db->head_sent)
			at = TAILQ_NEXT(at, link);
		while (at && (at->flags & DBQ_URGENT))
			at = TAILQ_NEXT(at, link);
		if (at)
			TAILQ_INSERT_BEFORE(at, q, link);
		else
			TAILQ_INSERT_TAIL(&db->queue, q, link);
	} else {
		TAILQ_INSERT_TAIL(&db->queue, q, link);
	}
	db_send_next(db);
}

void db_cancel_queued(struct db *db)
{
	struct db_query *q, *next;

	for (q = TAILQ_FIRST(&db->queue); q; q = next) {
		next = TAILQ_NEXT(q, link);
		if (q == TAILQ_FIRST(&db->queue) && db->head_sent)
			continue;
		TAILQ_REMOVE(&db->queue, q, link);
		if (q->cb)
			q->cb(db, NULL, q->arg);
		query_free(q);
	}
}

PGcancel *db_cancel_handle(const struct db *db, const void *arg)
{
	if (db->state != DB_UP || !db->head_sent || TAILQ_FIRST(&db->queue)->arg != arg)
		return NULL;
	return PQgetCancel(db->conn);
}

void db_free(struct db *db)
{
	struct db_query *q;

	if (db == NULL)
		return;
	while ((q = TAILQ_FIRST(&db->queue)) != NULL) {
		TAILQ_REMOVE(&db->queue, q, link);
		query_free(q);
	}
	drop_socket_event(db);
	if (db->timer_ev)
		event_free(db->timer_ev);
	if (db->deadline_ev)
		event_free(db->deadline_ev);
	if (db->last_result)
		PQclear(db->last_result);
	if (db->conn)
		PQfinish(db->conn);
	free(db->conninfo);
	free(db->listen_channel);
	free(db->app_name);
	free(db);
}

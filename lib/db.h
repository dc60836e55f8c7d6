/* SPDX-License-Identifier: ISC */
/*
 * db.h: one asynchronous PostgreSQL connection on the event loop.
 *
 * Queries queue in order and run one at a time (PQsendQueryParams); the
 * next one is written before the previous one's callback runs, so the
 * server works while the caller reads an answer, and an urgent query
 * (DBQ_URGENT) goes ahead of queued ones that are not.  When
 * the connection is lost, or cannot be made, it is (re-)established with
 * exponential backoff and full jitter from the first failure; a query that was on the wire when it broke is either failed
 * back to its caller (res == NULL) or, with DBQ_RETRY, sent again after
 * the reconnect.  Only statements that are safe to repeat get DBQ_RETRY
 * (the dispatcher's functions are written so that all of them are).
 */
#ifndef OUTBOX_DB_H
#define OUTBOX_DB_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct event_base;
struct db;

/* res is NULL when the connection broke with the query in flight.  The
 * callee does not PQclear(): db does after the callback returns. */
typedef void (*db_result_fn)(struct db *db, PGresult *res, void *arg);
typedef void (*db_notify_fn)(struct db *db, const char *channel, const char *payload, void *arg);
typedef void (*db_state_fn)(struct db *db, bool up, void *arg);

#define DBQ_RETRY 0x1u
/* Ahead of queued queries that are not urgent (behind the one on the wire
 * and earlier urgent ones): the latency path (lease, mark) does not wait
 * for recorded outcomes queued before it. */
#define DBQ_URGENT 0x2u
/* With DBQ_RETRY: the statement sent again after a reconnect has its last
 * parameter set to "true" (the statement's own "this is a repeat" flag:
 * outbox_claim's p_repeat), so that a repeat can do less than the first
 * call whose answer was lost. */
#define DBQ_REPEAT_FLAG 0x4u

struct db *db_new(struct event_base *base, const char *conninfo, long backoff_min_ms,
                  long backoff_max_ms, const char *listen_channel);
/* Deadlines and socket settings, for the next connect (a reload's take
 * effect then).  statement_timeout_ms: set on the server for each session
 * unless the role, database or conninfo set one (0: not set; sessions a
 * transaction-mode pooler shares must not carry it).  response_timeout_ms:
 * a connect, or the answer to a query on the wire, taking longer is a lost
 * connection (0: no deadline).  tcp_user_timeout_ms, keepalive_idle_s and
 * keepalive_interval_s (3 probes): defaults the conninfo can override. */
void db_set_timeouts(struct db *db, long statement_timeout_ms, long response_timeout_ms,
                     long tcp_user_timeout_ms, long keepalive_idle_s, long keepalive_interval_s);
/* Shown as application_name in pg_stat_activity (unless the conninfo or
 * PGAPPNAME names one); takes effect at the next connect. */
void db_set_application_name(struct db *db, const char *name);
void db_set_callbacks(struct db *db, db_state_fn on_state, db_notify_fn on_notify, void *arg);
void db_start(struct db *db);
bool db_is_up(const struct db *db);
/* Queries queued or on the wire. */
size_t db_queue_len(const struct db *db);
/* Number of reconnects since start (a metric). */
unsigned long db_reconnects(const struct db *db);
const char *db_last_error(const struct db *db);

void db_query(struct db *db, const char *sql, int nparams, const char *const *params,
              db_result_fn cb, void *arg, unsigned flags);
/* In a result callback: when that query was written to the server, or,
 * if it was written while the callback before it ran, when that callback
 * returned (its time on the wire and in the server, without its wait in
 * the queue or for the worker). */
int64_t db_head_sent_mono(const struct db *db);
/* Drop queued queries (not the one on the wire); their callbacks get NULL.
 * Called from a result callback, the next query is already on the wire.
 * A callback must not db_free() its own db. */
void db_cancel_queued(struct db *db);
/* A cancel request for the statement on the wire if it is the query
 * whose callback argument is `arg` (PQcancel() it, then PQfreeCancel()),
 * else NULL. */
PGcancel *db_cancel_handle(const struct db *db, const void *arg);
void db_free(struct db *db);

/* conninfo with any password replaced by ********, for logs. */
void db_redact_conninfo(const char *conninfo, char *out, size_t len);

#endif

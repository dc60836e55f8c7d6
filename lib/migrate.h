/* SPDX-License-Identifier: ISC */
/*
 * migrate.h: the schema compiled into the binaries (generated from sql/ by
 * gen_migrations.sh) and the code that applies it, all in one transaction
 * under an advisory lock so that any number of hosts may run `outboxctl
 * migrate` at once, with the workers serving (docs/design.md, "Upgrades
 * under a serving fleet"):
 *   - before anything runs, every table of the schema is locked in one
 *     statement, in the order the workers take them, each lock waited for
 *     at most lock_timeout and all of them at most lock_all_ms; an attempt
 *     that does not get them (or meets a deadlock) is rolled back, holding
 *     nothing, and made again after a backoff, for up to wait_ms.  Holding
 *     every lock, the migrations and function files wait for nothing, so a
 *     producer's insert waits at most the pre-lock's bound plus their run
 *     time;
 *   - a migration that rewrites the tables the workers read (105, or one
 *     with the line "-- outbox-migrate: stop-workers") refuses to run while
 *     any worker is connected;
 *   - numbered migrations (sql/NNN_name.sql: tables, indexes, roles) in
 *     order, each once, recorded in schema_migrations with a checksum;
 *   - then the function files (sql/functions/NAME.sql: functions, triggers,
 *     views), each re-applied whenever its text changed, recorded in
 *     schema_functions.
 */
#ifndef OUTBOX_MIGRATE_H
#define OUTBOX_MIGRATE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

struct migration {
	int version;
	const char *name;
	const char *sql;
};

struct function_file {
	const char *name;
	const char *sql;
};

extern const struct migration migrations[];
extern const int migrations_count;
extern const struct function_file function_files[];
extern const int function_files_count;

/* The newest version these binaries know. */
int migrate_latest_version(void);

/* Apply what is pending; print one line per applied migration or function
 * file to out.  Returns the number applied, or -1 with err set (nothing
 * applied then: it is all one transaction). */
int migrate_apply(PGconn *conn, FILE *out, char *err, size_t errlen);

/* The bounds of one attempt and of the retries (migrate_apply's). */
#define MIGRATE_LOCK_TIMEOUT_MS 200    /* one lock (below deadlock_timeout, 1 s) */
#define MIGRATE_LOCK_ALL_MS 500        /* all of them */
#define MIGRATE_WAIT_MS 300000         /* attempts for up to 5 minutes */

struct migrate_opts {
	int lock_timeout_ms;
	int lock_all_ms;
	long wait_ms;
	FILE *notes;          /* a line per attempt rolled back, or NULL */
};

void migrate_default_opts(struct migrate_opts *o);
int migrate_apply_opts(PGconn *conn, FILE *out, const struct migrate_opts *o, char *err,
                       size_t errlen);

/* Whether a migration must run with no worker connected. */
bool migrate_needs_stopped_workers(const struct migration *m);

/* SQL returning the applied version (0 when none): for workers checking
 * that the database was migrated before they start. */
#define MIGRATE_VERSION_SQL \
	"SELECT CASE WHEN to_regclass('public.schema_migrations') IS NULL THEN 0 " \
	"ELSE (SELECT coalesce(max(version), 0) FROM schema_migrations) END"

#endif

/* SPDX-License-Identifier: ISC */
/*
 * migrate.h: the schema compiled into the binaries (generated from sql/ by
 * gen_migrations.sh) and the code that applies it, all in one transaction
 * under an advisory lock so that any number of hosts may run `outboxctl
 * migrate` at once:
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

/* SQL returning the applied version (0 when none): for workers checking
 * that the database was migrated before they start. */
#define MIGRATE_VERSION_SQL \
	"SELECT CASE WHEN to_regclass('public.schema_migrations') IS NULL THEN 0 " \
	"ELSE (SELECT coalesce(max(version), 0) FROM schema_migrations) END"

#endif

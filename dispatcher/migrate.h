/*
 * migrate.h: the schema migrations compiled into the binaries (generated
 * from sql/NNN_name.sql by gen_migrations.sh) and the code that applies
 * them: in order, each once, recorded in schema_migrations with a
 * checksum, under a transaction-level advisory lock so that any number of
 * hosts may run `outboxctl migrate` at once.
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

extern const struct migration migrations[];
extern const int migrations_count;

/* The newest version these binaries know. */
int migrate_latest_version(void);

/* Apply what is pending; print one line per applied migration to out.
 * Returns the number applied, or -1 with err set (nothing applied then:
 * it is all one transaction). */
int migrate_apply(PGconn *conn, FILE *out, char *err, size_t errlen);

/* SQL returning the applied version (0 when none): for workers checking
 * that the database was migrated before they start. */
#define MIGRATE_VERSION_SQL \
	"SELECT CASE WHEN to_regclass('public.schema_migrations') IS NULL THEN 0 " \
	"ELSE (SELECT coalesce(max(version), 0) FROM schema_migrations) END"

#endif

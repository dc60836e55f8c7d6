/* SPDX-License-Identifier: ISC */
/*
 * migrate.c: apply the compiled-in schema (see migrate.h): numbered
 * migrations once each, then the function files whose text changed.
 */
#include "migrate.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

/* Any constant works; it only has to be the same on every host. */
#define MIGRATE_LOCK_KEY "7262935012345678000"

/* The baseline squashed the series the project started with; a database
 * that has all of it holds exactly the baseline's objects. */
#define BASELINE_VERSION 100
static const char *const squashed[] = {
	"001_schema", "002_producer", "003_dispatcher", "004_roles", "005_operator",
	"006_reconcile", "007_lease_cursor", "008_lease_plans", "009_hot_lease",
	"010_sending_index", "011_inflight_list", "012_lease_room",
	"013_sweep_reads_no_table", "014_weekly_this_week",
};
#define SQUASHED_COUNT ((int)(sizeof(squashed) / sizeof(squashed[0])))

int migrate_latest_version(void)
{
	int v = 0;

	for (int i = 0; i < migrations_count; i++)
		if (migrations[i].version > v)
			v = migrations[i].version;
	return v;
}

static bool exec_ok(PGconn *conn, const char *sql, char *err, size_t errlen, const char *what)
{
	PGresult *r = PQexec(conn, sql);
	ExecStatusType st = PQresultStatus(r);
	bool ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;

	if (!ok) {
		snprintf(err, errlen, "%s: %s", what, PQresultErrorMessage(r));
		err[strcspn(err, "\n")] = '\0';
	}
	PQclear(r);
	return ok;
}

static bool exec_params_ok(PGconn *conn, const char *sql, int n, const char *const *params,
                           char *err, size_t errlen, const char *what)
{
	PGresult *r = PQexecParams(conn, sql, n, NULL, params, NULL, NULL, 0);
	bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;

	if (!ok)
		snprintf(err, errlen, "%s: %s", what, PQresultErrorMessage(r));
	PQclear(r);
	return ok;
}

static const struct migration *migration_by_version(int v)
{
	for (int m = 0; m < migrations_count; m++)
		if (migrations[m].version == v)
			return &migrations[m];
	return NULL;
}

static bool is_squashed(int v, const char *name)
{
	return v >= 1 && v <= SQUASHED_COUNT && strcmp(squashed[v - 1], name) == 0;
}

static bool record_migration(PGconn *conn, const struct migration *m, char *err, size_t errlen)
{
	char sum[65], vbuf[16];
	const char *params[3];

	sha256_hex(m->sql, strlen(m->sql), sum);
	snprintf(vbuf, sizeof(vbuf), "%d", m->version);
	params[0] = vbuf;
	params[1] = m->name;
	params[2] = sum;
	return exec_params_ok(conn,
	                      "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
	                      3, params, err, errlen, m->name);
}

/* What the database has: every recorded migration must be one this build
 * knows with the same text, or one of the squashed series.  *squashed_seen
 * counts the latter, *applied marks which of migrations[] are in. */
static bool check_recorded(PGresult *r, bool *applied, int *squashed_seen, char *err,
                           size_t errlen)
{
	*squashed_seen = 0;
	for (int i = 0; i < PQntuples(r); i++) {
		int v = atoi(PQgetvalue(r, i, 0));
		const struct migration *m = migration_by_version(v);
		char sum[65];

		if (!m && is_squashed(v, PQgetvalue(r, i, 1))) {
			(*squashed_seen)++;
			continue;
		}
		if (!m) {
			snprintf(err, errlen,
			         "the database has migration %d (%s) that this build does not know: "
			         "it was migrated by a newer outboxctl",
			         v, PQgetvalue(r, i, 1));
			return false;
		}
		sha256_hex(m->sql, strlen(m->sql), sum);
		if (strcmp(sum, PQgetvalue(r, i, 2)) != 0) {
			snprintf(err, errlen,
			         "migration %s was applied with different contents (checksum %.12s, "
			         "this build has %.12s): refusing to continue",
			         m->name, PQgetvalue(r, i, 2), sum);
			return false;
		}
		applied[m - migrations] = true;
	}
	return true;
}

static int apply_migrations(PGconn *conn, FILE *out, char *err, size_t errlen)
{
	PGresult *r;
	bool *applied;
	int squashed_seen, n = 0;
	const struct migration *base = migration_by_version(BASELINE_VERSION);

	r = PQexec(conn, "SELECT version, name, checksum FROM schema_migrations ORDER BY version");
	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "reading schema_migrations: %s", PQresultErrorMessage(r));
		PQclear(r);
		return -1;
	}
	applied = xcalloc((size_t)migrations_count + 1, sizeof(*applied));
	if (!check_recorded(r, applied, &squashed_seen, err, errlen))
		goto fail;
	if (squashed_seen > 0 && base && !applied[base - migrations]) {
		if (squashed_seen != SQUASHED_COUNT) {
			snprintf(err, errlen,
			         "the database has %d of the %d migrations the baseline replaces: "
			         "finish them with the outboxctl that started them first",
			         squashed_seen, SQUASHED_COUNT);
			goto fail;
		}
		if (!record_migration(conn, base, err, errlen))
			goto fail;
		applied[base - migrations] = true;
		if (out)
			fprintf(out, "recorded %s (the database has 001..014, which it replaces)\n",
			        base->name);
	}
	for (int m = 0; m < migrations_count; m++) {
		if (applied[m])
			continue;
		if (!exec_ok(conn, migrations[m].sql, err, errlen, migrations[m].name) ||
		    !record_migration(conn, &migrations[m], err, errlen))
			goto fail;
		if (out)
			fprintf(out, "applied %s\n", migrations[m].name);
		n++;
	}
	free(applied);
	PQclear(r);
	return n;
fail:
	free(applied);
	PQclear(r);
	return -1;
}

/* Function files after the tables: each re-run whenever its text changed
 * (CREATE OR REPLACE), in name order, and every one of them after any
 * migration ran: a migration may drop or replace what an unchanged file
 * made (a view over a table it rebuilds, a trigger on a table it
 * renames). */
static int apply_function_files(PGconn *conn, FILE *out, char *err, size_t errlen, bool all)
{
	int n = 0;

	for (int f = 0; f < function_files_count; f++) {
		const struct function_file *ff = &function_files[f];
		const char *params[2];
		char sum[65];
		PGresult *r;
		bool same;

		sha256_hex(ff->sql, strlen(ff->sql), sum);
		params[0] = ff->name;
		params[1] = sum;
		r = PQexecParams(conn, "SELECT 1 FROM schema_functions WHERE name = $1 AND checksum = $2",
		                 2, NULL, params, NULL, NULL, 0);
		if (PQresultStatus(r) != PGRES_TUPLES_OK) {
			snprintf(err, errlen, "reading schema_functions: %s", PQresultErrorMessage(r));
			PQclear(r);
			return -1;
		}
		same = PQntuples(r) == 1;
		PQclear(r);
		if (same && !all)
			continue;
		if (!exec_ok(conn, ff->sql, err, errlen, ff->name) ||
		    !exec_params_ok(conn,
		                    "INSERT INTO schema_functions (name, checksum) VALUES ($1, $2) "
		                    "ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, "
		                    "applied_at = now()",
		                    2, params, err, errlen, ff->name))
			return -1;
		if (out)
			fprintf(out, "applied %s\n", ff->name);
		n++;
	}
	return n;
}

int migrate_apply(PGconn *conn, FILE *out, char *err, size_t errlen)
{
	int tables, functions;

	if (!exec_ok(conn, "BEGIN", err, errlen, "begin"))
		return -1;
	if (!exec_ok(conn, "SET LOCAL client_min_messages = warning", err, errlen, "set") ||
	    !exec_ok(conn, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK_KEY ")", err, errlen,
	             "taking the migration lock") ||
	    !exec_ok(conn,
	             "CREATE TABLE IF NOT EXISTS schema_migrations ("
	             " version integer PRIMARY KEY, name text NOT NULL,"
	             " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
	             err, errlen, "creating schema_migrations") ||
	    !exec_ok(conn,
	             "CREATE TABLE IF NOT EXISTS schema_functions ("
	             " name text PRIMARY KEY, checksum text NOT NULL,"
	             " applied_at timestamptz NOT NULL DEFAULT now())",
	             err, errlen, "creating schema_functions"))
		goto fail;
	tables = apply_migrations(conn, out, err, errlen);
	if (tables < 0)
		goto fail;
	functions = apply_function_files(conn, out, err, errlen, tables > 0);
	if (functions < 0)
		goto fail;
	if (!exec_ok(conn, "COMMIT", err, errlen, "commit"))
		return -1;
	return tables + functions;
fail:
	err[strcspn(err, "\n")] = '\0';
	PQclear(PQexec(conn, "ROLLBACK"));
	return -1;
}

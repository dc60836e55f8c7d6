/*
 * migrate.c: apply the compiled-in migrations (see migrate.h).
 */
#include "migrate.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

/* Any constant works; it only has to be the same on every host. */
#define MIGRATE_LOCK_KEY "7262935012345678000"

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

int migrate_apply(PGconn *conn, FILE *out, char *err, size_t errlen)
{
	PGresult *r;
	int applied = 0;

	if (!exec_ok(conn, "BEGIN", err, errlen, "begin"))
		return -1;
	if (!exec_ok(conn, "SET LOCAL client_min_messages = warning", err, errlen, "set") ||
	    !exec_ok(conn, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK_KEY ")", err, errlen,
	             "taking the migration lock") ||
	    !exec_ok(conn,
	             "CREATE TABLE IF NOT EXISTS schema_migrations ("
	             " version integer PRIMARY KEY, name text NOT NULL,"
	             " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
	             err, errlen, "creating schema_migrations"))
		goto fail;

	r = PQexec(conn, "SELECT version, name, checksum FROM schema_migrations ORDER BY version");
	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "reading schema_migrations: %s", PQresultErrorMessage(r));
		PQclear(r);
		goto fail;
	}
	for (int i = 0; i < PQntuples(r); i++) {
		int v = atoi(PQgetvalue(r, i, 0));
		bool known = false;

		for (int m = 0; m < migrations_count; m++) {
			char sum[65];
			if (migrations[m].version != v)
				continue;
			known = true;
			sha256_hex(migrations[m].sql, strlen(migrations[m].sql), sum);
			if (strcmp(sum, PQgetvalue(r, i, 2)) != 0) {
				snprintf(err, errlen,
				         "migration %s was applied with different contents (checksum %.12s, "
				         "this build has %.12s): refusing to continue",
				         migrations[m].name, PQgetvalue(r, i, 2), sum);
				PQclear(r);
				goto fail;
			}
		}
		if (!known) {
			snprintf(err, errlen,
			         "the database has migration %d (%s) that this build does not know: "
			         "it was migrated by a newer outboxctl",
			         v, PQgetvalue(r, i, 1));
			PQclear(r);
			goto fail;
		}
	}

	for (int m = 0; m < migrations_count; m++) {
		bool done = false;
		char sum[65], vbuf[16];
		const char *params[3];
		PGresult *ins;

		for (int i = 0; i < PQntuples(r) && !done; i++)
			done = atoi(PQgetvalue(r, i, 0)) == migrations[m].version;
		if (done)
			continue;
		if (!exec_ok(conn, migrations[m].sql, err, errlen, migrations[m].name)) {
			PQclear(r);
			goto fail;
		}
		sha256_hex(migrations[m].sql, strlen(migrations[m].sql), sum);
		snprintf(vbuf, sizeof(vbuf), "%d", migrations[m].version);
		params[0] = vbuf;
		params[1] = migrations[m].name;
		params[2] = sum;
		ins = PQexecParams(conn,
		                   "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
		                   3, NULL, params, NULL, NULL, 0);
		if (PQresultStatus(ins) != PGRES_COMMAND_OK) {
			snprintf(err, errlen, "recording %s: %s", migrations[m].name,
			         PQresultErrorMessage(ins));
			PQclear(ins);
			PQclear(r);
			goto fail;
		}
		PQclear(ins);
		if (out)
			fprintf(out, "applied %s\n", migrations[m].name);
		applied++;
	}
	PQclear(r);
	if (!exec_ok(conn, "COMMIT", err, errlen, "commit"))
		return -1;
	return applied;
fail:
	err[strcspn(err, "\n")] = '\0';
	PQclear(PQexec(conn, "ROLLBACK"));
	return -1;
}

/* SPDX-License-Identifier: ISC */
/*
 * migrate.c: apply the compiled-in schema (see migrate.h): numbered
 * migrations once each, then the function files whose text changed.
 */
#include "migrate.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* The SQLSTATE of the last failed statement (retryable() reads it). */
static char last_state[6];

static void note_state(PGresult *r)
{
	const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);

	snprintf(last_state, sizeof(last_state), "%s", state ? state : "");
}

static bool exec_ok(PGconn *conn, const char *sql, char *err, size_t errlen, const char *what)
{
	PGresult *r = PQexec(conn, sql);
	ExecStatusType st = PQresultStatus(r);
	bool ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;

	if (!ok) {
		note_state(r);
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

	if (!ok) {
		note_state(r);
		snprintf(err, errlen, "%s: %s", what, PQresultErrorMessage(r));
	}
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

static bool workers_stopped_for(PGconn *conn, const struct migration *m, char *err,
                                size_t errlen);

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
	applied = text_array((size_t)migrations_count + 1, sizeof(*applied));
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
		if (migrate_needs_stopped_workers(&migrations[m]) &&
		    !workers_stopped_for(conn, &migrations[m], err, errlen))
			goto fail;
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

/* ---- pending work ------------------------------------------------------ */

/* How many migrations and function files this build would apply (a
 * baseline to record counts as one).  Read before any table lock is
 * taken: with nothing to do, migrate takes none. */
static int count_pending(PGconn *conn, char *err, size_t errlen)
{
	PGresult *r = PQexec(conn, "SELECT version, name, checksum FROM schema_migrations");
	bool *applied;
	int squashed_seen, n = 0;

	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "reading schema_migrations: %s", PQresultErrorMessage(r));
		PQclear(r);
		return -1;
	}
	applied = text_array((size_t)migrations_count + 1, sizeof(*applied));
	if (!check_recorded(r, applied, &squashed_seen, err, errlen)) {
		free(applied);
		PQclear(r);
		return -1;
	}
	for (int m = 0; m < migrations_count; m++)
		n += !applied[m];
	free(applied);
	PQclear(r);
	r = PQexec(conn, "SELECT name, checksum FROM schema_functions");
	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "reading schema_functions: %s", PQresultErrorMessage(r));
		PQclear(r);
		return -1;
	}
	for (int f = 0; f < function_files_count; f++) {
		char sum[65];
		bool same = false;

		sha256_hex(function_files[f].sql, strlen(function_files[f].sql), sum);
		for (int i = 0; i < PQntuples(r) && !same; i++)
			same = strcmp(PQgetvalue(r, i, 0), function_files[f].name) == 0 &&
			       strcmp(PQgetvalue(r, i, 1), sum) == 0;
		n += !same;
	}
	PQclear(r);
	return n;
}

/* ---- migrations that need the workers stopped -------------------------- */

/* A migration that rewrites the tables the workers read (and so cannot
 * keep the previous release's workers serving, nor hold producers for
 * less than the time of its copy) says so with this line; 105 predates
 * the marker and is named here. */
#define STOP_WORKERS_MARK "-- outbox-migrate: stop-workers"

bool migrate_needs_stopped_workers(const struct migration *m)
{
	return m->version == 105 || strstr(m->sql, STOP_WORKERS_MARK) != NULL;
}

/* Worker connections to this database, by the application name every
 * release's workers give them ("outbox lease NAME", "outbox records
 * NAME"): their count, and their names in names. */
#define WORKER_SESSIONS_SQL \
	"SELECT count(*), coalesce(string_agg(DISTINCT application_name, ', ' " \
	"ORDER BY application_name), '') FROM pg_stat_activity " \
	"WHERE datname = current_database() AND pid <> pg_backend_pid() " \
	"AND (application_name LIKE 'outbox lease %' OR application_name LIKE 'outbox records %')"

static bool workers_stopped_for(PGconn *conn, const struct migration *m, char *err,
                                size_t errlen)
{
	PGresult *r = PQexec(conn, WORKER_SESSIONS_SQL);
	bool ok;

	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "reading pg_stat_activity: %s", PQresultErrorMessage(r));
		PQclear(r);
		return false;
	}
	ok = atoi(PQgetvalue(r, 0, 0)) == 0;
	if (!ok)
		snprintf(err, errlen,
		         "%s rewrites the tables the workers read and cannot run while workers are "
		         "connected: %s worker connection%s open (%.300s). Stop every worker of the "
		         "fleet first (systemctl stop outbox-dispatcher.target on each host), run "
		         "migrate again, then start the new version",
		         m->name, PQgetvalue(r, 0, 0), atoi(PQgetvalue(r, 0, 0)) == 1 ? "" : "s",
		         PQgetvalue(r, 0, 1));
	PQclear(r);
	return ok;
}

/* ---- the locks --------------------------------------------------------- */

/* Every table and view of the schema, one LOCK statement, in the order
 * the workers and producers take them: the runs, the effect tables, the
 * rest, the scopes and the kill switch's row last (the sending transition
 * holds effect rows when it reads outbox_control); views after the
 * tables they read. Partitions come with their parent. */
#define LOCK_LIST_SQL \
	"SELECT 'LOCK TABLE ' || string_agg(format('%I.%I', n.nspname, c.relname), ', ' ORDER BY " \
	"c.relkind IN ('v', 'm'), array_position(ARRAY['workflow_runs', 'effect_outbox', " \
	"'effect_live', 'effect_calls', 'effect_history'], c.relname::text) NULLS LAST, " \
	"c.relname IN ('outbox_scopes', 'outbox_control'), c.relname = 'outbox_control', " \
	"c.relname) || ' IN ACCESS EXCLUSIVE MODE' " \
	"FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace " \
	"WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm') " \
	"AND NOT c.relispartition"

/* SQLSTATEs after which the attempt is rolled back and made again: a lock
 * not granted within lock_timeout, the pre-lock's statement_timeout, a
 * deadlock, a serialization failure. */
static bool retryable(const char *state)
{
	return strcmp(state, "55P03") == 0 || strcmp(state, "57014") == 0 ||
	       strcmp(state, "40P01") == 0 || strcmp(state, "40001") == 0;
}

static bool take_locks(PGconn *conn, const struct migrate_opts *o, char *err, size_t errlen)
{
	char set[96];
	PGresult *r;
	bool ok;

	snprintf(set, sizeof(set), "SET LOCAL lock_timeout = %d", o->lock_timeout_ms);
	if (!exec_ok(conn, set, err, errlen, "set lock_timeout"))
		return false;
	r = PQexec(conn, LOCK_LIST_SQL);
	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "listing the tables: %s", PQresultErrorMessage(r));
		PQclear(r);
		return false;
	}
	if (PQgetisnull(r, 0, 0)) {   /* a fresh database: nothing to lock */
		PQclear(r);
		return true;
	}
	snprintf(set, sizeof(set), "SET LOCAL statement_timeout = %d", o->lock_all_ms);
	ok = exec_ok(conn, set, err, errlen, "set statement_timeout") &&
	     exec_ok(conn, PQgetvalue(r, 0, 0), err, errlen, "taking the tables' locks") &&
	     exec_ok(conn, "SET LOCAL statement_timeout = 0", err, errlen, "set statement_timeout");
	PQclear(r);
	return ok;
}

/* ---- one attempt, and the retries -------------------------------------- */

static int apply_once(PGconn *conn, FILE *out, const struct migrate_opts *o, char *err,
                      size_t errlen)
{
	int pending, tables, functions;

	last_state[0] = '\0';
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
	pending = count_pending(conn, err, errlen);
	if (pending < 0)
		goto fail;
	if (pending == 0)
		return exec_ok(conn, "COMMIT", err, errlen, "commit") ? 0 : -1;
	if (!take_locks(conn, o, err, errlen))
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

/* ---- after the commit ---------------------------------------------------- */

/* Work a migration leaves for after its commit, in short transactions of
 * its own while the fleet serves: the history's source column
 * (sql/112_history_source.sql), a few thousand pages a call, until
 * outbox_history_source_backfill() says none is left.  A schema without
 * the function (one that is not migrated to 112) has nothing to do. */
#define BACKFILL_PAGES "4096"

static int backfill_after_commit(PGconn *conn, FILE *out, char *err, size_t errlen)
{
	PGresult *r = PQexec(conn, "SELECT to_regprocedure('outbox_history_source_backfill(integer)') "
	                           "IS NOT NULL");
	long long steps = 0;
	bool have;

	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "backfill: %s", PQresultErrorMessage(r));
		PQclear(r);
		return -1;
	}
	have = PQgetvalue(r, 0, 0)[0] == 't';
	PQclear(r);
	while (have) {
		r = PQexec(conn, "SELECT outbox_history_source_backfill(" BACKFILL_PAGES ")");
		if (PQresultStatus(r) != PGRES_TUPLES_OK) {
			snprintf(err, errlen, "backfilling effect_history.source: %s",
			         PQresultErrorMessage(r));
			PQclear(r);
			return -1;
		}
		have = strcmp(PQgetvalue(r, 0, 0), "0") != 0;
		PQclear(r);
		steps += have;
	}
	if (out && steps > 0)
		fprintf(out, "backfilled effect_history.source (%lld step%s)\n", steps,
		        steps == 1 ? "" : "s");
	return 0;
}

static void sleep_ms(long ms);
static long long mono_ms(void);

/* The parts of effect_history_failed_idx (sql/114_history_failed_index.sql)
 * the existing partitions lack, each built CONCURRENTLY, outside any
 * transaction (the fleet goes on writing the history), then attached in
 * a transaction of its own; the last attach makes the parent index valid.
 * A build cut short leaves an invalid index, dropped and built again
 * here; one built but not attached is attached.  A partition pruned or
 * an index dropped meanwhile is looked for again.  Nothing here needs a
 * session of its own (no session lock, no SET), so it runs through
 * PgBouncer's transaction mode as the rest of migrate does: a partition
 * another session is building (pg_stat_progress_create_index) is waited
 * for, and a build that meets another's (the same name taken, a deadlock
 * between two builds, a lock not granted, a catalogue row another drop or
 * attach changed) steps back and looks again;
 * one still busy after --wait is left to that session (a line says so).
 * The build waits for the transactions older than it (a held snapshot
 * holds it up, not the workers) under the session's own statement and
 * lock timeouts, the server's defaults unless the owner's role sets them;
 * the attach waits at most a second for its lock, so a worker's insert
 * queued behind it waits no longer. */
static bool steps_back(const char *err)
{
	return strcmp(last_state, "42P07") == 0 ||      /* a name another build took */
	       (strcmp(last_state, "XX000") == 0 &&     /* another's drop or attach */
	        strstr(err, "tuple concurrently updated") != NULL) ||
	       strcmp(last_state, "40P01") == 0 ||      /* deadlock with another build */
	       strcmp(last_state, "55P03") == 0 ||      /* a lock not granted in time */
	       strcmp(last_state, "55006") == 0 ||      /* the index in use by another */
	       strcmp(last_state, "42P01") == 0 ||      /* the partition pruned meanwhile */
	       strcmp(last_state, "42704") == 0 ||      /* the index dropped meanwhile */
	       strcmp(last_state, "2BP01") == 0 ||      /* attached meanwhile: not ours to drop */
	       strcmp(last_state, "42809") == 0;        /* no longer a partition of it */
}

static int build_history_indexes(PGconn *conn, FILE *out, const struct migrate_opts *o,
                                 char *err, size_t errlen)
{
	PGresult *r = PQexec(conn, "SELECT to_regprocedure('outbox_history_index_pending()') IS NOT NULL");
	long long start = mono_ms();
	int built = 0;
	bool have;

	if (PQresultStatus(r) != PGRES_TUPLES_OK) {
		snprintf(err, errlen, "history index: %s", PQresultErrorMessage(r));
		err[strcspn(err, "\n")] = '\0';
		PQclear(r);
		return -1;
	}
	have = PQgetvalue(r, 0, 0)[0] == 't';
	PQclear(r);
	while (have) {
		char part[200], index[100], leftover[200], sql[640];
		bool leftover_valid, busy, ok;

		r = PQexec(conn, "SELECT part, index_name, coalesce(leftover, ''), "
		                 "coalesce(leftover_valid, false), busy "
		                 "FROM outbox_history_index_pending() ORDER BY busy, part LIMIT 1");
		if (PQresultStatus(r) != PGRES_TUPLES_OK) {
			snprintf(err, errlen, "history index: %s", PQresultErrorMessage(r));
			err[strcspn(err, "\n")] = '\0';
			PQclear(r);
			return -1;
		}
		if (PQntuples(r) == 0) {
			PQclear(r);
			break;
		}
		/* Names from the catalogue, quoted by the database (regclass);
		 * the bounds only refuse what cannot be one. */
		if (PQgetlength(r, 0, 0) >= (int)sizeof(part) ||
		    PQgetlength(r, 0, 1) >= (int)sizeof(index) ||
		    PQgetlength(r, 0, 2) >= (int)sizeof(leftover)) {
			snprintf(err, errlen, "history index: a partition name too long: %.100s",
			         PQgetvalue(r, 0, 0));
			PQclear(r);
			return -1;
		}
		snprintf(part, sizeof(part), "%s", PQgetvalue(r, 0, 0));
		snprintf(index, sizeof(index), "%s", PQgetvalue(r, 0, 1));
		snprintf(leftover, sizeof(leftover), "%s", PQgetvalue(r, 0, 2));
		leftover_valid = PQgetvalue(r, 0, 3)[0] == 't';
		busy = PQgetvalue(r, 0, 4)[0] == 't';
		PQclear(r);
		/* A leftover another session dropped after the catalogue was
		 * read prints as its bare oid: gone, look again. */
		if (leftover[0] >= '0' && leftover[0] <= '9')
			busy = true;
		if (busy) {
			/* Another session builds on it (another migrate, most
			 * likely): it finishes there, or the next migrate does. */
			if (mono_ms() - start >= o->wait_ms) {
				if (out)
					fprintf(out, "effect_history_failed_idx: %s is being built by another "
					             "session; it finishes there (or run migrate again)\n", part);
				return 0;
			}
			sleep_ms(200);
			continue;
		}
		if (leftover[0] && !leftover_valid) {
			snprintf(sql, sizeof(sql), "DROP INDEX CONCURRENTLY IF EXISTS %s", leftover);
			ok = exec_ok(conn, sql, err, errlen, "dropping an index build cut short");
		} else if (!leftover[0]) {
			snprintf(sql, sizeof(sql),
			         "CREATE INDEX CONCURRENTLY %s ON %s (effect_id) WHERE state = 'failed'",
			         index, part);
			ok = exec_ok(conn, sql, err, errlen, "building the history's index of failing rows");
		} else {
			snprintf(sql, sizeof(sql), "ALTER INDEX effect_history_failed_idx ATTACH PARTITION %s",
			         leftover);
			ok = exec_ok(conn, "BEGIN", err, errlen, "history index") &&
			     exec_ok(conn, "SET LOCAL lock_timeout = '1s'", err, errlen, "history index") &&
			     exec_ok(conn, sql, err, errlen, "attaching the history's index of failing rows") &&
			     exec_ok(conn, "COMMIT", err, errlen, "history index");
			if (!ok)
				PQclear(PQexec(conn, "ROLLBACK"));
			built += ok;
		}
		if (ok)
			continue;
		if (!steps_back(err))
			return -1;
		if (mono_ms() - start >= o->wait_ms) {
			size_t l = strlen(err);

			snprintf(err + l, errlen - l, " (still so after %lld s)",
			         (mono_ms() - start) / 1000);
			return -1;
		}
		sleep_ms(200);
	}
	if (out && built > 0)
		fprintf(out, "built effect_history_failed_idx on %d partition%s\n", built,
		        built == 1 ? "" : "s");
	return 0;
}

static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) != 0)
		;
}

void migrate_default_opts(struct migrate_opts *o)
{
	o->lock_timeout_ms = MIGRATE_LOCK_TIMEOUT_MS;
	o->lock_all_ms = MIGRATE_LOCK_ALL_MS;
	o->wait_ms = MIGRATE_WAIT_MS;
	o->notes = stderr;
}

int migrate_apply_opts(PGconn *conn, FILE *out, const struct migrate_opts *o, char *err,
                       size_t errlen)
{
	long long start = mono_ms();
	unsigned seed = (unsigned)start ^ (unsigned)PQbackendPID(conn);
	long backoff = 100;

	for (int attempt = 1;; attempt++) {
		int n;
		long wait;

		/* Lines of migrations rolled back are not printed: what one
		 * attempt applied goes to a buffer, out only after its commit. */
		char *buf = NULL;
		size_t len = 0;
		FILE *mem = out ? open_memstream(&buf, &len) : NULL;

		n = apply_once(conn, mem, o, err, errlen);
		if (mem) {
			fclose(mem);
			if (n >= 0)
				fputs(buf, out);
			free(buf);
		}
		if (n >= 0)
			return backfill_after_commit(conn, out, err, errlen) < 0 ||
			               build_history_indexes(conn, out, o, err, errlen) < 0
			           ? -1
			           : n;
		if (!retryable(last_state))
			return n;
		if (mono_ms() - start >= o->wait_ms) {
			size_t l = strlen(err);

			snprintf(err + l, errlen - l,
			         " (gave up after %d attempts in %lld s: a session kept a lock on the "
			         "outbox tables; see pg_locks)",
			         attempt, (mono_ms() - start) / 1000);
			return -1;
		}
		/* Backoff with jitter: 100 ms doubling to 2 s, x0.5..1.5. */
		wait = backoff / 2 + (long)(rand_r(&seed) % (unsigned)(backoff + 1));
		if (o->notes)
			fprintf(o->notes, "migrate: attempt %d rolled back (%s); again in %ld ms\n",
			        attempt, err, wait);
		sleep_ms(wait);
		if (backoff < 2000)
			backoff *= 2;
	}
}

int migrate_apply(PGconn *conn, FILE *out, char *err, size_t errlen)
{
	struct migrate_opts o;

	migrate_default_opts(&o);
	return migrate_apply_opts(conn, out, &o, err, errlen);
}

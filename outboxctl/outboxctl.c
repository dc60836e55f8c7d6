/* SPDX-License-Identifier: ISC */
/*
 * outboxctl.c: the operator's command line.  Global options, the command
 * table, the connection and shared helpers; the commands live in
 * outboxctl_*.c.
 *
 *   outboxctl [--db CONNINFO | --config FILE] COMMAND [ARGS] [--help]
 */
#include "outboxctl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "db.h"
#include "migrate.h"
#include "util.h"
#include "version.h"

static const struct ctl_command commands[] = {
	{ "migrate", cmd_migrate, "migrate [--wait SECONDS]",
	  "Bring the database to this build's schema. Idempotent; safe from many hosts at once,\n"
	  "and with the workers serving: it takes every table's lock at once, waiting at most\n"
	  "200 ms for each and 500 ms for all, and tries again after a backoff for up to\n"
	  "--wait seconds (300). A migration that rewrites the workers' tables refuses to run\n"
	  "while any worker is connected." },
	{ "kill-switch", cmd_kill_switch,
	  "kill-switch off|on [--type T | --host H | --crm-object O] --operator NAME --reason TEXT\n"
	  "      | kill-switch status [--json]",
	  "Stop or allow every send in the fleet. 'off' returns once no send can start anywhere\n"
	  "and lists the sends already in flight.\n"
	  "With a scope, only that part of the fleet, with the same guarantee:\n"
	  "  --type T         effects of type T (email, http, crm, ...)\n"
	  "  --host H         effects sent to host H (an http target's host, the CRM instance's,\n"
	  "                   the relay's): a name or address, no port, IPv6 without brackets\n"
	  "  --crm-object O   crm effects whose target is O/Field (any case)\n"
	  "Paused effects wait, without spending attempts, until 'on' with the same scope; the\n"
	  "global switch still applies to them. 'status' lists the switch and every scope: who,\n"
	  "when, why, its rate limit, the effects it holds now and in all." },
	{ "limit", cmd_limit,
	  "limit set (--type T | --host H) --rate N[/s|/min] [--burst N]\n"
	  "      --operator NAME --reason TEXT\n"
	  "      | limit clear (--type T | --host H) --operator NAME --reason TEXT | limit list [--json]",
	  "A rate limit for the whole fleet: at most N sends start per second across every worker\n"
	  "(3000/min is 50 per second; 0.5/s one every two seconds), up to --burst at once after a\n"
	  "quiet spell (default: one second's worth). Effects over the limit wait for their slot\n"
	  "without spending attempts. --type email limits the relay; --type crm the CRM instance.\n"
	  "A change applies at once, without a restart, and is kept in the scope's history.\n"
	  "  clear   remove the limit; the effects it held are due now\n"
	  "  list    the scopes with a limit" },
	{ "status", cmd_status, "status [--json]",
	  "Counts per state (completed and failed: those that finished in the last 24 hours),\n"
	  "oldest pending age, in flight, unknown, failed in the last hour,\n"
	  "the kill switch, and every paused or rate-limited scope with the effects it holds." },
	{ "unknown", cmd_unknown,
	  "unknown list [--json] | unknown show ID [--json]\n"
	  "      | unknown resolve ID (--sent [--provider-id X] | --not-sent)\n"
	  "      --operator NAME --reason TEXT",
	  "Effects whose outcome nobody knows (a timeout after the request left, a worker that died\n"
	  "mid-send). They are never re-sent automatically.\n"
	  "  list      each with its run key and the provider key to look up at the provider\n"
	  "  show      one effect with its history: every call, its outcome, status and reply\n"
	  "  resolve   record what the provider says: --sent completes the effect (and its run when\n"
	  "            it was the last one), --not-sent puts it back in the queue with the same key.\n"
	  "Both add a row to the attempts log and to operator_actions.\n"
	  "Exit 1: no such effect, or it is no longer unknown (its state is printed)." },
	{ "requeue", cmd_requeue,
	  "requeue (ID | --failed-since T) --operator NAME --reason TEXT",
	  "Put failed effects back in the queue with the same key, due now: one by id, or every\n"
	  "effect that failed since T (a timestamp such as '2026-03-01 02:00+00', or an age such as\n"
	  "2h, 30m, 1d); cancelled effects are left alone. The key makes a second delivery harmless;\n"
	  "a run failed only because of these effects goes back to approved, never to processing.\n"
	  "Exit 1: no such effect, or it is not failed (its state is printed)." },
	{ "replace", cmd_replace,
	  "replace ID --new-key KEY --operator NAME --reason TEXT [--target T] [--payload JSON]",
	  "Create a replacement event: a new run under KEY (issued by the source system, never a\n"
	  "suffix of the old key), approved by you and linked to the original run, with one effect\n"
	  "linked to the original effect: same type, target and payload unless given. The original\n"
	  "is never edited. Refused (exit 1) while the original may still be delivered (pending,\n"
	  "sending, unknown) or when KEY belongs to another run. Repeating it is harmless." },
	{ "prune", cmd_prune,
	  "prune --older-than D [--batch N] [--operator NAME] [--reason TEXT]",
	  "Delete completed and failed effects that ended more than D ago (30d, 12h, 90m, or a\n"
	  "PostgreSQL interval such as '2 weeks'), N rows per transaction (default 1000) so workers\n"
	  "never wait long. Pending, sending and unknown effects and the attempts log are kept." },
	{ "cancel", cmd_cancel, "cancel ID [--reason TEXT] [--operator NAME]",
	  "Stop a pending effect (e.g. one enqueued with a delay) before a worker starts sending it:\n"
	  "it ends failed with reason 'cancelled' and is never sent.\n"
	  "Exit 1: no such effect, or it is already sending or finished (its state is printed)." },
	{ "reconcile", cmd_reconcile, "reconcile [--wait SECONDS]",
	  "Ask the running workers to reconcile unknown effects now (each provider that can looks\n"
	  "the effect up), wait until each was asked (default 60 s) and print the verdicts:\n"
	  "sent -> completed, not sent -> pending with the same key, cannot tell -> stays unknown.\n"
	  "Exit 1: the wait ran out (a worker serving the provider must be running)." },
};
#define N_COMMANDS (sizeof(commands) / sizeof(commands[0]))

static void usage(FILE *out)
{
	fprintf(out,
	        "usage: outboxctl [--db CONNINFO | --config FILE] COMMAND [ARGS]\n"
	        "\n"
	        "  --db CONNINFO   libpq conninfo string or URL (default: libpq's PG* environment)\n"
	        "  --config FILE   take [database] conninfo from a dispatcher config\n"
	        "\ncommands:\n");
	for (size_t i = 0; i < N_COMMANDS; i++)
		fprintf(out, "  %s\n", commands[i].usage);
	fprintf(out,
	        "\n'outboxctl COMMAND --help' describes one command.\n"
	        "exit codes: 0 done, 1 refused or not found, 2 usage, 3 database error\n");
}

PGconn *ctl_connect(struct ctl *ctl)
{
	const char *conninfo = "";
	struct config *cfg = NULL;
	char err[1024], shown[512];

	if (ctl->conn)
		return ctl->conn;
	if (ctl->db) {
		conninfo = ctl->db;
	} else if (ctl->config) {
		struct core_settings s;
		cfg = config_load(ctl->config, err, sizeof(err));
		if (cfg == NULL || !config_core(cfg, &s, err, sizeof(err))) {
			fprintf(stderr, "outboxctl: %s\n", err);
			config_free(cfg);
			return NULL;
		}
		conninfo = s.conninfo;
	}
	ctl->conn = PQconnectdb(conninfo);
	if (PQstatus(ctl->conn) != CONNECTION_OK) {
		db_redact_conninfo(conninfo, shown, sizeof(shown));
		fprintf(stderr, "outboxctl: cannot connect to the database (%s): %s", tv(shown),
		        tv_lines(PQerrorMessage(ctl->conn)));
		PQfinish(ctl->conn);
		ctl->conn = NULL;
	}
	config_free(cfg);
	return ctl->conn;
}

PGresult *ctl_exec(struct ctl *ctl, const char *what, const char *sql, int n,
                   const char *const *params)
{
	PGresult *r;
	ExecStatusType st;

	if (ctl_connect(ctl) == NULL)
		return NULL;
	r = PQexecParams(ctl->conn, sql, n, NULL, params, NULL, NULL, 0);
	st = PQresultStatus(r);
	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK) {
		fprintf(stderr, "outboxctl: %s: %s", what, tv_lines(PQresultErrorMessage(r)));
		PQclear(r);
		return NULL;
	}
	return r;
}

/*
 * Run one statement.  Unlike ctl_exec, this tells the operator's mistakes
 * from the database's failures: SQLSTATE class 22 (a value PostgreSQL
 * cannot take: a bad interval or timestamp, or the functions' own
 * invalid_parameter_value) is a usage error, 2; the rest is 3.
 */
PGresult *ctl_exec_rc(struct ctl *ctl, const char *what, const char *sql, int n,
                      const char *const *params, int *rc)
{
	PGresult *r;
	ExecStatusType st;
	const char *state, *msg;

	if (ctl_connect(ctl) == NULL) {
		*rc = CTL_DB;
		return NULL;
	}
	r = PQexecParams(ctl->conn, sql, n, NULL, params, NULL, NULL, 0);
	st = PQresultStatus(r);
	if (st == PGRES_TUPLES_OK || st == PGRES_COMMAND_OK)
		return r;
	state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
	msg = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
	if (state && strncmp(state, "22", 2) == 0) {
		*rc = CTL_USAGE;
		fprintf(stderr, "outboxctl: %s: %s\n", what, msg ? tv(msg) : "invalid value");
	} else {
		*rc = CTL_DB;
		fprintf(stderr, "outboxctl: %s: %s", what, tv_lines(PQresultErrorMessage(r)));
		if (PQstatus(ctl->conn) == CONNECTION_BAD)
			fprintf(stderr, "outboxctl: %s: the connection to the database was lost; "
			                "the outcome is recorded only if the transaction committed\n", what);
	}
	PQclear(r);
	return NULL;
}

const char *ctl_opt(int argc, char **argv, const char *name)
{
	for (int i = 0; i + 1 < argc; i++)
		if (strcmp(argv[i], name) == 0)
			return argv[i + 1];
	return NULL;
}

bool ctl_flag(int argc, char **argv, const char *name)
{
	for (int i = 0; i < argc; i++)
		if (strcmp(argv[i], name) == 0)
			return true;
	return false;
}

bool ctl_check_opts(int argc, char **argv, const char *const *allowed)
{
	return ctl_check_opts_hint(argc, argv, allowed, NULL);
}

bool ctl_check_opts_hint(int argc, char **argv, const char *const *allowed, const char *hint)
{
	for (int i = 0; i < argc; i++) {
		bool ok = false;
		for (const char *const *a = allowed; *a && !ok; a++) {
			size_t n = strlen(*a);
			if ((*a)[n - 1] == '=') {
				if (strncmp(argv[i], *a, n - 1) == 0 && argv[i][n - 1] == '\0') {
					if (i + 1 >= argc) {
						fprintf(stderr, "outboxctl: %s needs a value\n", tv(argv[i]));
						return false;
					}
					i++;
					ok = true;
				}
			} else if (strcmp(argv[i], *a) == 0) {
				ok = true;
			}
		}
		if (!ok) {
			fprintf(stderr, "outboxctl: unexpected argument '%s'%s%s%s\n", tv(argv[i]),
			        hint ? " (" : "", hint ? hint : "", hint ? ")" : "");
			return false;
		}
	}
	return true;
}

bool ctl_is_uuid(const char *s)
{
	static const char shape[] = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx";

	if (strlen(s) != sizeof(shape) - 1)
		return false;
	for (size_t i = 0; shape[i]; i++) {
		if (shape[i] == '-' ? s[i] != '-' : !strchr("0123456789abcdefABCDEF", s[i]))
			return false;
	}
	return true;
}

/* Human output shows text from the database and the command line; a run
 * key or an operator name may hold terminal escapes (any producer chooses
 * its keys).  tv() returns s, or a copy with every control character made
 * visible (util.c's sb_term_escape); the copies live until exit.  --json
 * output never goes through it: jansson escapes what JSON must. */
static char **tv_pool;
static size_t tv_count;

static void tv_free(void)
{
	for (size_t i = 0; i < tv_count; i++)
		free(tv_pool[i]);
	free(tv_pool);
	tv_pool = NULL;
	tv_count = 0;
}

static const char *tv_keep(const char *s, bool keep_newlines)
{
	struct strbuf b;

	if (s == NULL || !term_needs_escape(s, keep_newlines))
		return s;
	sb_init(&b, strlen(s) + 16);
	sb_term_escape(&b, s, keep_newlines);
	tv_pool = text_realloc(tv_pool, (tv_count + 1) * sizeof(*tv_pool));
	tv_pool[tv_count++] = b.s;
	return b.s;
}

const char *tv(const char *s)
{
	return tv_keep(s, false);
}

const char *tv_lines(const char *s)
{
	return tv_keep(s, true);
}

/* --db may carry a password: keep a copy and overwrite the argument with
 * its redacted form, so `ps` and /proc/PID/cmdline show no secret from
 * here on (PGPASSFILE or --config keep it off the command line entirely). */
static const char *hide_db_argument(char *arg)
{
	static char *copy;
	char shown[1024];
	size_t n = strlen(arg);

	free(copy);
	copy = text_strdup(arg);
	db_redact_conninfo(copy, shown, sizeof(shown));
	memset(arg, 0, n);
	if (strcmp(shown, copy) != 0)
		memcpy(arg, shown, strlen(shown) < n ? strlen(shown) : n);
	else
		memcpy(arg, copy, n);
	return copy;
}

int main(int argc, char **argv)
{
	struct ctl ctl = { 0 };
	int i = 1, rc;

	atexit(tv_free);

	while (i < argc && argv[i][0] == '-') {
		if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
			usage(stdout);
			return CTL_OK;
		} else if (strcmp(argv[i], "--version") == 0) {
			printf("outboxctl %s (schema %d)\n", OUTBOX_VERSION, migrate_latest_version());
			return CTL_OK;
		} else if (strcmp(argv[i], "--db") == 0 && i + 1 < argc) {
			ctl.db = hide_db_argument(argv[i + 1]);
			i += 2;
		} else if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
			ctl.config = argv[i + 1];
			i += 2;
		} else {
			fprintf(stderr, "outboxctl: unknown or incomplete option '%s'\n", tv(argv[i]));
			usage(stderr);
			return CTL_USAGE;
		}
	}
	if (i >= argc) {
		usage(stderr);
		return CTL_USAGE;
	}
	for (size_t c = 0; c < N_COMMANDS; c++) {
		if (strcmp(commands[c].name, argv[i]) != 0)
			continue;
		if (ctl_flag(argc - i - 1, argv + i + 1, "--help")) {
			printf("usage: outboxctl [--db CONNINFO | --config FILE] %s\n\n%s\n",
			       commands[c].usage, commands[c].help);
			return CTL_OK;
		}
		rc = commands[c].run(&ctl, argc - i - 1, argv + i + 1);
		if (ctl.conn)
			PQfinish(ctl.conn);
		return rc;
	}
	fprintf(stderr, "outboxctl: unknown command '%s'\n", tv(argv[i]));
	usage(stderr);
	return CTL_USAGE;
}

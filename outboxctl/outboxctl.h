/* SPDX-License-Identifier: ISC */
/*
 * outboxctl.h: what the outboxctl command files share: the exit codes
 * scripts rely on, the connection, and small query helpers.
 */
#ifndef OUTBOXCTL_H
#define OUTBOXCTL_H

#include <jansson.h>
#include <libpq-fe.h>
#include <stdbool.h>

/* Exit codes (stable: scripts depend on them). */
enum ctl_exit {
	CTL_OK = 0,
	CTL_FAILED = 1,      /* the act was refused or found nothing (bad id, wrong state) */
	CTL_USAGE = 2,       /* bad arguments */
	CTL_DB = 3,          /* database unreachable or a database error */
};

struct ctl {
	const char *db;          /* --db, or NULL */
	const char *config;      /* --config, or NULL */
	bool json;               /* --json where a command supports it */
	PGconn *conn;
};

/* Connect (once) using --db, else --config's [database] conninfo, else
 * libpq's environment.  Prints the error and returns NULL on failure. */
PGconn *ctl_connect(struct ctl *ctl);

/* Run a parameterized statement; on error print "outboxctl: what: msg" and
 * return NULL.  The caller PQclear()s a non-NULL result. */
PGresult *ctl_exec(struct ctl *ctl, const char *what, const char *sql, int n,
                   const char *const *params);

/* The same; SQLSTATE class 22 (a value PostgreSQL cannot take: a bad
 * interval, or an operator function's invalid_parameter_value) is the
 * operator's mistake, *rc = CTL_USAGE with the message alone; any other
 * failure is CTL_DB. */
PGresult *ctl_exec_rc(struct ctl *ctl, const char *what, const char *sql, int n,
                      const char *const *params, int *rc);

/* Option parsing helpers for "--name VALUE" pairs after the command words. */
const char *ctl_opt(int argc, char **argv, const char *name);
bool ctl_flag(int argc, char **argv, const char *name);
/* True when every argument from argv[0] is one of the allowed options
 * (names ending in '=' take a value); prints the offender otherwise. */
bool ctl_check_opts(int argc, char **argv, const char *const *allowed);
/* The same, with a hint after the offender: "unexpected argument 'X' (hint)". */
bool ctl_check_opts_hint(int argc, char **argv, const char *const *allowed, const char *hint);
bool ctl_is_uuid(const char *s);

/* s with control characters made visible, for human-readable output;
 * tv_lines() keeps newlines (multi-line error messages).  The result lives
 * until the process exits. */
const char *tv(const char *s);
const char *tv_lines(const char *s);

typedef int (*ctl_cmd_fn)(struct ctl *ctl, int argc, char **argv);

struct ctl_command {
	const char *name;
	ctl_cmd_fn run;
	const char *usage;
	const char *help;
};

/* Commands, one per file group (outboxctl_*.c). */
int cmd_migrate(struct ctl *ctl, int argc, char **argv);
int cmd_kill_switch(struct ctl *ctl, int argc, char **argv);
int cmd_status(struct ctl *ctl, int argc, char **argv);
int cmd_unknown(struct ctl *ctl, int argc, char **argv);
int cmd_requeue(struct ctl *ctl, int argc, char **argv);
int cmd_replace(struct ctl *ctl, int argc, char **argv);
int cmd_prune(struct ctl *ctl, int argc, char **argv);
int cmd_cancel(struct ctl *ctl, int argc, char **argv);
int cmd_reconcile(struct ctl *ctl, int argc, char **argv);
int cmd_limit(struct ctl *ctl, int argc, char **argv);

/* Shared by the kill switch's two forms (outboxctl_core.c): the sends in
 * flight an outbox_kill_switch_set or outbox_scope_pause returned
 * (effect_id, effect_key, effect_type, target, worker, started). */
void ctl_print_in_flight(const PGresult *r);

/* Scopes (outboxctl_scopes.c).  True when argv holds a scope option
 * (--type, --host, --crm-object). */
bool ctl_scope_given(int argc, char **argv);
/* kill-switch off|on with a scope: argv starts after the verb. */
int ctl_scope_pause(struct ctl *ctl, bool paused, int argc, char **argv);
/* Every scope of outbox_scope_status, after the kill switch in status and
 * kill-switch status: printed, or set as "scopes" in o (--json). */
int ctl_scopes_show(struct ctl *ctl, json_t *o);

#endif

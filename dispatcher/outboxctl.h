/* SPDX-License-Identifier: ISC */
/*
 * outboxctl.h: what the outboxctl command files share: the exit codes
 * scripts rely on, the connection, and small query helpers.
 */
#ifndef OUTBOXCTL_H
#define OUTBOXCTL_H

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

/* Option parsing helpers for "--name VALUE" pairs after the command words. */
const char *ctl_opt(int argc, char **argv, const char *name);
bool ctl_flag(int argc, char **argv, const char *name);
/* True when every argument from argv[0] is one of the allowed options
 * (names ending in '=' take a value); prints the offender otherwise. */
bool ctl_check_opts(int argc, char **argv, const char *const *allowed);
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

#endif

/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_reconcile.c: `outboxctl reconcile [--wait SECONDS]`.
 *
 * Reconciliation itself runs in the workers (they hold the provider
 * plugins and their credentials): this command asks the running fleet for
 * a pass now (outbox_request_reconcile(): a row only operators may write,
 * and a NOTIFY effect_outbox 'reconcile' that wakes the workers to read
 * it), then watches the database
 * until every `unknown` effect of a type whose provider can reconcile has
 * been asked about since the command started, printing each verdict as
 * its attempts-log row appears.
 *
 * Exit: 0 every such effect was asked (whatever the answers), 1 the wait
 * ran out first, 2 usage, 3 database error.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "outboxctl.h"
#include "outboxctl_sql.h"

#define RECONCILE_WAIT_DEFAULT 60
#define RECONCILE_POLL_MS      200

static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms)
{
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

struct verdict_counts {
	int sent, not_sent, unknown;
};

/* Print the verdicts written since the start and not printed yet; *last
 * is the highest history_id printed.  False on a database error. */
static bool print_verdicts(struct ctl *ctl, const char *start, char *last, size_t lastlen,
                           struct verdict_counts *n)
{
	const char *params[2] = { start, last };
	PGresult *r = ctl_run_db(ctl, "reconcile: reading verdicts", CTL_SQL_RECONCILE_VERDICTS,
	                         params);

	if (r == NULL)
		return false;
	for (int i = 0; i < PQntuples(r); i++) {
		const char *cls = PQgetvalue(r, i, VD_OUTCOME), *status = PQgetvalue(r, i, VD_STATUS),
		           *pid = PQgetvalue(r, i, VD_PROVIDER_ID), *error = PQgetvalue(r, i, VD_ERROR);
		bool applied = PQgetvalue(r, i, VD_APPLIED)[0] == 't';
		const char *what;

		if (strcmp(cls, "reconciled_sent") == 0) {
			what = "sent: completed";
			n->sent++;
		} else if (strcmp(cls, "reconciled_not_sent") == 0) {
			what = "not sent: pending again with the same key";
			n->not_sent++;
		} else {
			what = "cannot tell: stays unknown";
			n->unknown++;
		}
		printf("  %s %s %s", tv(PQgetvalue(r, i, VD_EFFECT_ID)), tv(PQgetvalue(r, i, VD_EFFECT_TYPE)),
		       what);
		if (pid[0])
			printf(", provider id %s", tv(pid));
		if (status[0])
			printf(" (status %s)", tv(status));
		if (error[0] && strcmp(cls, "reconciled_sent") != 0)
			printf(": %s", tv(error));
		printf(" [worker %s]%s\n", tv(PQgetvalue(r, i, VD_WORKER)),
		       applied ? "" : " (not applied: the effect changed meanwhile)");
		snprintf(last, lastlen, "%s", PQgetvalue(r, i, VD_HISTORY_ID));
	}
	fflush(stdout);
	PQclear(r);
	return true;
}

/* --wait=SECONDS, 0 to 86400; false (after saying why) otherwise. */
static bool parse_wait(const char *wait_arg, long *wait_s)
{
	char *end;

	if (wait_arg == NULL)
		return true;
	errno = 0;
	*wait_s = strtol(wait_arg, &end, 10);
	if (errno || end == wait_arg || *end || *wait_s < 0 || *wait_s > 86400) {
		fprintf(stderr, "outboxctl: reconcile: --wait takes seconds from 0 to 86400, not '%s'\n",
		        tv(wait_arg));
		return false;
	}
	return true;
}

/* Counts the effects to wait for (unknown now, of a type some worker can
 * reconcile; those of other types need an operator), writes the
 * database's clock to start and asks the fleet to reconcile. */
static bool ask_fleet(struct ctl *ctl, char *start, size_t startlen)
{
	long total, others;
	PGresult *r;

	r = ctl_run_db(ctl, "reconcile", CTL_SQL_RECONCILE_START, NULL);
	if (r == NULL)
		return false;
	snprintf(start, startlen, "%s", PQgetvalue(r, 0, RC_CLOCK));
	total = strtol(PQgetvalue(r, 0, RC_RECONCILABLE), NULL, 10);
	others = strtol(PQgetvalue(r, 0, RC_OTHERS), NULL, 10);
	PQclear(r);

	r = ctl_run_db(ctl, "reconcile: asking the workers", CTL_SQL_RECONCILE_NOTIFY, NULL);
	if (r == NULL)
		return false;
	PQclear(r);
	printf("asked the fleet to reconcile %ld unknown effect%s\n", total, total == 1 ? "" : "s");
	if (others > 0)
		printf("%ld unknown effect%s of types that cannot reconcile need an operator "
		       "(outboxctl unknown list)\n", others, others == 1 ? "" : "s");
	fflush(stdout);
	return true;
}

/* Waits until every effect that was unknown at start, of a reconcilable
 * type, is no longer unknown or has been asked since, printing verdicts as
 * they land; the effects still not asked at the deadline, or -1 when the
 * database failed. */
static long wait_for_fleet(struct ctl *ctl, const char *start, long wait_s,
                           struct verdict_counts *counts)
{
	const char *params[1] = { start };
	long long deadline = mono_ms() + wait_s * 1000;
	char last[32] = "0";
	long remaining;
	PGresult *r;

	for (;;) {
		if (!print_verdicts(ctl, start, last, sizeof(last), counts))
			return -1;
		r = ctl_run_db(ctl, "reconcile: checking progress", CTL_SQL_RECONCILE_LEFT, params);
		if (r == NULL)
			return -1;
		remaining = strtol(PQgetvalue(r, 0, CNT_VALUE), NULL, 10);
		PQclear(r);
		if (remaining == 0 || mono_ms() >= deadline)
			break;
		sleep_ms(RECONCILE_POLL_MS);
	}
	/* Verdicts that landed with the last check. */
	if (!print_verdicts(ctl, start, last, sizeof(last), counts))
		return -1;
	return remaining;
}

int cmd_reconcile(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--wait=", NULL };
	struct verdict_counts counts = { 0 };
	char start[64];
	long wait_s = RECONCILE_WAIT_DEFAULT, remaining;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	if (!parse_wait(ctl_opt(argc, argv, "--wait"), &wait_s))
		return CTL_USAGE;
	if (ctl_connect(ctl) == NULL)
		return CTL_DB;
	if (!ask_fleet(ctl, start, sizeof(start)))
		return CTL_DB;
	remaining = wait_for_fleet(ctl, start, wait_s, &counts);
	if (remaining < 0)
		return CTL_DB;

	printf("%d sent (completed), %d not sent (pending again), %d cannot tell (still unknown)\n",
	       counts.sent, counts.not_sent, counts.unknown);
	if (remaining > 0) {
		fprintf(stderr,
		        "outboxctl: reconcile: %ld unknown effect%s not asked within %ld s: a worker "
		        "serving %s provider must be running (outbox-dispatcher; poll-only workers "
		        "answer on their periodic pass)\n",
		        remaining, remaining == 1 ? " was" : "s were", wait_s,
		        remaining == 1 ? "its" : "their");
		return CTL_FAILED;
	}
	return CTL_OK;
}

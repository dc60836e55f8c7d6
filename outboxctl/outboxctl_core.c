/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_core.c: migrate, kill-switch and status (the global switch;
 * a scope's pause and the scopes' rows are outboxctl_scopes.c's).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "migrate.h"
#include "outboxctl.h"
#include "outboxctl_sql.h"

int cmd_migrate(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--wait=", NULL };
	struct migrate_opts o;
	const char *wait;
	char err[1024], *end;
	int n;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	migrate_default_opts(&o);
	wait = ctl_opt(argc, argv, "--wait");
	if (wait) {
		long s = strtol(wait, &end, 10);

		if (end == wait || *end != '\0' || s < 0 || s > 86400) {
			fprintf(stderr, "outboxctl: migrate --wait takes seconds (0..86400)\n");
			return CTL_USAGE;
		}
		o.wait_ms = s * 1000;
	}
	if (ctl_connect(ctl) == NULL)
		return CTL_DB;
	n = migrate_apply_opts(ctl->conn, stdout, &o, err, sizeof(err));
	if (n < 0) {
		fprintf(stderr, "outboxctl: migrate: %s\n", err);
		return CTL_DB;
	}
	printf("schema at version %d (%d migration%s applied)\n", migrate_latest_version(), n,
	       n == 1 ? "" : "s");
	return CTL_OK;
}

static int kill_switch_status(struct ctl *ctl, bool json)
{
	PGresult *r = ctl_run_db(ctl, "kill-switch status", CTL_SQL_SWITCH, NULL);
	bool on;
	int rc;

	if (r == NULL)
		return CTL_DB;
	on = PQgetvalue(r, 0, SW_ENABLED)[0] == 't';
	if (json) {
		json_t *o = json_pack("{s:s,s:s,s:s,s:s}", "state", on ? "on" : "off",
		                      "changed_by", PQgetvalue(r, 0, SW_CHANGED_BY),
		                      "reason", PQgetvalue(r, 0, SW_REASON),
		                      "changed_at", PQgetvalue(r, 0, SW_CHANGED_AT));
		rc = ctl_scopes_show(ctl, o);
		if (rc == CTL_OK) {
			char *s = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
			puts(s);
			free(s);
		}
		json_decref(o);
	} else {
		printf("kill switch: %s (sends %s)\nset by %s at %s: %s\n", on ? "on" : "off",
		       on ? "allowed where AI_ACTIONS_ENABLED=true" : "stopped fleet-wide",
		       tv(PQgetvalue(r, 0, SW_CHANGED_BY)), tv(PQgetvalue(r, 0, SW_CHANGED_AT)),
		       tv(PQgetvalue(r, 0, SW_REASON)));
		rc = ctl_scopes_show(ctl, NULL);
	}
	PQclear(r);
	return rc;
}

void ctl_print_in_flight(const PGresult *r)
{
	int n = PQntuples(r);

	printf("%d effect%s already in flight%s\n", n, n == 1 ? " was" : "s were",
	       n ? " (their outcome will still be recorded):" : ".");
	for (int i = 0; i < n; i++)
		printf("  %s key=%s type=%s target=%s worker=%s started=%s\n",
		       tv(PQgetvalue(r, i, IF_EFFECT_ID)), tv(PQgetvalue(r, i, IF_EFFECT_KEY)),
		       tv(PQgetvalue(r, i, IF_EFFECT_TYPE)), tv(PQgetvalue(r, i, IF_TARGET)),
		       tv(PQgetvalue(r, i, IF_WORKER)), tv(PQgetvalue(r, i, IF_STARTED)));
}

int cmd_kill_switch(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--operator=", "--reason=", "--json", "--type=",
		                                   "--host=", "--crm-object=", NULL };
	const char *op, *reason, *params[3];
	bool on;
	PGresult *r;

	if (argc < 1) {
		fprintf(stderr, "outboxctl: kill-switch needs off, on or status\n");
		return CTL_USAGE;
	}
	if (!ctl_check_opts_hint(argc - 1, argv + 1, allowed,
	                         "a scope is --type T, --host H or --crm-object O"))
		return CTL_USAGE;
	if (strcmp(argv[0], "status") == 0) {
		if (ctl_scope_given(argc - 1, argv + 1)) {
			fprintf(stderr, "outboxctl: kill-switch status takes no scope: it lists the "
			                "switch and every scope\n");
			return CTL_USAGE;
		}
		return kill_switch_status(ctl, ctl_flag(argc - 1, argv + 1, "--json"));
	}
	if (strcmp(argv[0], "on") != 0 && strcmp(argv[0], "off") != 0) {
		fprintf(stderr, "outboxctl: kill-switch: expected off, on or status, not '%s'\n", tv(argv[0]));
		return CTL_USAGE;
	}
	on = strcmp(argv[0], "on") == 0;
	if (ctl_scope_given(argc - 1, argv + 1))
		return ctl_scope_pause(ctl, !on, argc - 1, argv + 1);
	op = ctl_opt(argc - 1, argv + 1, "--operator");
	reason = ctl_opt(argc - 1, argv + 1, "--reason");
	if (op == NULL || !op[0] || reason == NULL || !reason[0]) {
		fprintf(stderr, "outboxctl: kill-switch %s needs --operator NAME and --reason TEXT "
		                "(they are kept in the control history)\n", argv[0]);
		return CTL_USAGE;
	}
	params[0] = on ? "true" : "false";
	params[1] = op;
	params[2] = reason;
	r = ctl_run_db(ctl, "kill-switch", CTL_SQL_SWITCH_SET, params);
	if (r == NULL)
		return CTL_DB;
	if (on) {
		printf("kill switch on: sends allowed (by %s: %s)\n", tv(op), tv(reason));
	} else {
		printf("kill switch off: no send can start anywhere in the fleet (by %s: %s)\n", tv(op), tv(reason));
		ctl_print_in_flight(r);
	}
	PQclear(r);
	return CTL_OK;
}

int cmd_status(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--json", NULL };
	static const char *const state_names[] = { "pending", "sending", "completed", "unknown", "failed" };
	static const int state_cols[] = { ST_PENDING, ST_SENDING, ST_COMPLETED, ST_UNKNOWN, ST_FAILED };
	PGresult *r;
	bool json;
	int rc;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	json = ctl_flag(argc, argv, "--json");
	r = ctl_run_db(ctl, "status", CTL_SQL_STATUS, NULL);
	if (r == NULL)
		return CTL_DB;
	if (json) {
		json_t *o = json_object(), *counts = json_object(), *ks;
		char *s;
		for (int i = 0; i < 5; i++)
			json_object_set_new(counts, state_names[i],
			                    json_integer(strtoll(PQgetvalue(r, 0, state_cols[i]), NULL, 10)));
		json_object_set_new(o, "counts", counts);
		json_object_set_new(o, "finished_window_hours",
		                    json_integer(strtoll(PQgetvalue(r, 0, ST_WINDOW_HOURS), NULL, 10)));
		json_object_set_new(o, "oldest_pending_age_seconds",
		                    json_real(strtod(PQgetvalue(r, 0, ST_OLDEST_PENDING_AGE), NULL)));
		json_object_set_new(o, "held", json_integer(strtoll(PQgetvalue(r, 0, ST_HELD), NULL, 10)));
		json_object_set_new(o, "oldest_held_age_seconds",
		                    json_real(strtod(PQgetvalue(r, 0, ST_OLDEST_HELD_AGE), NULL)));
		json_object_set_new(o, "in_flight", json_integer(strtoll(PQgetvalue(r, 0, ST_SENDING), NULL, 10)));
		json_object_set_new(o, "unknown", json_integer(strtoll(PQgetvalue(r, 0, ST_UNKNOWN), NULL, 10)));
		json_object_set_new(o, "failed_last_hour",
		                    json_integer(strtoll(PQgetvalue(r, 0, ST_FAILED_LAST_HOUR), NULL, 10)));
		ks = json_pack("{s:s,s:s,s:s,s:s}", "state", PQgetvalue(r, 0, ST_ENABLED)[0] == 't' ? "on" : "off",
		               "changed_by", PQgetvalue(r, 0, ST_CHANGED_BY), "reason", PQgetvalue(r, 0, ST_REASON),
		               "changed_at", PQgetvalue(r, 0, ST_CHANGED_AT));
		json_object_set_new(o, "kill_switch", ks);
		rc = ctl_scopes_show(ctl, o);
		if (rc == CTL_OK) {
			s = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
			puts(s);
			free(s);
		}
		json_decref(o);
	} else {
		for (int i = 0; i < 5; i++)
			printf("%-10s %s\n", state_names[i], tv(PQgetvalue(r, 0, state_cols[i])));
		printf("(completed and failed: effects that finished in the last %s hours)\n",
		       tv(PQgetvalue(r, 0, ST_WINDOW_HOURS)));
		printf("oldest pending age: %ss\n", tv(PQgetvalue(r, 0, ST_OLDEST_PENDING_AGE)));
		if (strcmp(PQgetvalue(r, 0, ST_HELD), "0") != 0)
			printf("held by scopes: %s, the oldest for %ss (not in the pending age)\n",
			       tv(PQgetvalue(r, 0, ST_HELD)), tv(PQgetvalue(r, 0, ST_OLDEST_HELD_AGE)));
		printf("in flight: %s   unknown: %s   failed in the last hour: %s\n",
		       tv(PQgetvalue(r, 0, ST_SENDING)), tv(PQgetvalue(r, 0, ST_UNKNOWN)),
		       tv(PQgetvalue(r, 0, ST_FAILED_LAST_HOUR)));
		printf("kill switch: %s (set by %s at %s: %s)\n",
		       PQgetvalue(r, 0, ST_ENABLED)[0] == 't' ? "on" : "off",
		       tv(PQgetvalue(r, 0, ST_CHANGED_BY)), tv(PQgetvalue(r, 0, ST_CHANGED_AT)),
		       tv(PQgetvalue(r, 0, ST_REASON)));
		rc = ctl_scopes_show(ctl, NULL);
	}
	PQclear(r);
	return rc;
}

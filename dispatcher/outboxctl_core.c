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
	PGresult *r = ctl_exec(ctl, "kill-switch status",
	                       "SELECT enabled, changed_by, reason, "
	                       "to_char(changed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') "
	                       "FROM outbox_control WHERE id = 1",
	                       0, NULL);
	bool on;
	int rc;

	if (r == NULL)
		return CTL_DB;
	on = PQgetvalue(r, 0, 0)[0] == 't';
	if (json) {
		json_t *o = json_pack("{s:s,s:s,s:s,s:s}", "state", on ? "on" : "off",
		                      "changed_by", PQgetvalue(r, 0, 1), "reason", PQgetvalue(r, 0, 2),
		                      "changed_at", PQgetvalue(r, 0, 3));
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
		       tv(PQgetvalue(r, 0, 1)), tv(PQgetvalue(r, 0, 3)), tv(PQgetvalue(r, 0, 2)));
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
		printf("  %s key=%s type=%s target=%s worker=%s started=%s\n", tv(PQgetvalue(r, i, 0)),
		       tv(PQgetvalue(r, i, 1)), tv(PQgetvalue(r, i, 2)), tv(PQgetvalue(r, i, 3)),
		       tv(PQgetvalue(r, i, 4)), tv(PQgetvalue(r, i, 5)));
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
	/* One statement: the function takes the kill-switch lock, so when it
	 * returns (committed) no send can start, and the list is complete. */
	r = ctl_exec(ctl, "kill-switch",
	             "SELECT effect_id, effect_key, effect_type, target, coalesce(worker, ''), "
	             "to_char(sending_since AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') "
	             "FROM outbox_kill_switch_set($1, $2, $3)",
	             3, params);
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
	PGresult *r;
	bool json;
	int rc;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	json = ctl_flag(argc, argv, "--json");
	r = ctl_exec(ctl, "status",
	             /* Open effects from the live queue (one pass over it),
	              * finished ones from the history's finishing rows (those
	              * that are still the effect's last word: an operator's
	              * requeue puts a failed effect back in the live queue, and
	              * it may fail again; a completed effect is never reopened). */
	             "WITH live AS ("
	             "  SELECT count(*) FILTER (WHERE state = 'pending') AS pending,"
	             "         count(*) FILTER (WHERE state = 'sending') AS sending,"
	             "         count(*) FILTER (WHERE state = 'unknown') AS unknown,"
	             "         min(available_at) FILTER (WHERE state = 'pending' AND available_at <= now())"
	             "           AS oldest_due,"
	             "         count(*) FILTER (WHERE state = 'pending' AND held_by IS NOT NULL) AS held,"
	             "         min(created_at) FILTER (WHERE state = 'pending' AND held_by IS NOT NULL)"
	             "           AS oldest_held"
	             "    FROM effect_live),"
	             " failed AS ("
	             "  SELECT h.ended_at FROM effect_history h"
	             "   WHERE h.state = 'failed'"
	             "     AND NOT EXISTS (SELECT 1 FROM effect_live l WHERE l.effect_id = h.effect_id)"
	             "     AND NOT EXISTS (SELECT 1 FROM effect_history n"
	             "                      WHERE n.effect_id = h.effect_id AND n.created_at = h.created_at"
	             "                        AND n.state IS NOT NULL AND n.history_id > h.history_id))"
	             "SELECT l.pending, l.sending,"
	             " (SELECT count(*) FROM effect_history WHERE state = 'completed'),"
	             " l.unknown,"
	             " (SELECT count(*) FROM failed),"
	             " coalesce(extract(epoch FROM now() - l.oldest_due)::numeric(12,3), 0),"
	             " (SELECT count(*) FROM failed WHERE ended_at > now() - interval '1 hour'),"
	             " c.enabled, c.changed_by, c.reason,"
	             " to_char(c.changed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
	             /* Held by a paused or limited scope: not due, so not in the
	              * pending age above; their own age, since creation. */
	             " l.held, coalesce(extract(epoch FROM now() - l.oldest_held)::numeric(12,3), 0)"
	             " FROM live l, outbox_control c WHERE c.id = 1",
	             0, NULL);
	if (r == NULL)
		return CTL_DB;
	if (json) {
		json_t *o = json_object(), *counts = json_object(), *ks;
		char *s;
		for (int i = 0; i < 5; i++)
			json_object_set_new(counts, state_names[i],
			                    json_integer(strtoll(PQgetvalue(r, 0, i), NULL, 10)));
		json_object_set_new(o, "counts", counts);
		json_object_set_new(o, "oldest_pending_age_seconds", json_real(strtod(PQgetvalue(r, 0, 5), NULL)));
		json_object_set_new(o, "held", json_integer(strtoll(PQgetvalue(r, 0, 11), NULL, 10)));
		json_object_set_new(o, "oldest_held_age_seconds", json_real(strtod(PQgetvalue(r, 0, 12), NULL)));
		json_object_set_new(o, "in_flight", json_integer(strtoll(PQgetvalue(r, 0, 1), NULL, 10)));
		json_object_set_new(o, "unknown", json_integer(strtoll(PQgetvalue(r, 0, 3), NULL, 10)));
		json_object_set_new(o, "failed_last_hour", json_integer(strtoll(PQgetvalue(r, 0, 6), NULL, 10)));
		ks = json_pack("{s:s,s:s,s:s,s:s}", "state", PQgetvalue(r, 0, 7)[0] == 't' ? "on" : "off",
		               "changed_by", PQgetvalue(r, 0, 8), "reason", PQgetvalue(r, 0, 9),
		               "changed_at", PQgetvalue(r, 0, 10));
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
			printf("%-10s %s\n", state_names[i], tv(PQgetvalue(r, 0, i)));
		printf("oldest pending age: %ss\n", tv(PQgetvalue(r, 0, 5)));
		if (strcmp(PQgetvalue(r, 0, 11), "0") != 0)
			printf("held by scopes: %s, the oldest for %ss (not in the pending age)\n",
			       tv(PQgetvalue(r, 0, 11)), tv(PQgetvalue(r, 0, 12)));
		printf("in flight: %s   unknown: %s   failed in the last hour: %s\n", tv(PQgetvalue(r, 0, 1)),
		       tv(PQgetvalue(r, 0, 3)), tv(PQgetvalue(r, 0, 6)));
		printf("kill switch: %s (set by %s at %s: %s)\n", PQgetvalue(r, 0, 7)[0] == 't' ? "on" : "off",
		       tv(PQgetvalue(r, 0, 8)), tv(PQgetvalue(r, 0, 10)), tv(PQgetvalue(r, 0, 9)));
		rc = ctl_scopes_show(ctl, NULL);
	}
	PQclear(r);
	return rc;
}

/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_ops.c: the operator's acts on effects: unknown list/show/resolve,
 * requeue, replace, prune and cancel.
 *
 * Each act is one call of a function from sql/functions/40_operator.sql (cancel:
 * outbox_cancel from sql/functions/20_producer.sql), which checks the effect's state under a row
 * lock and records the operator and reason in operator_actions in the
 * same transaction; this file only parses, calls and explains.  Exit
 * codes (outboxctl.h): a malformed argument is 2 before any connection
 * is made; an effect that does not exist or is in the wrong state is 1,
 * naming its current state; a database that is down or fails is 3.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outboxctl.h"
#include "outboxctl_sql.h"

/* Run one named statement (outboxctl_sql.c).  Unlike ctl_exec, this tells
 * the operator's mistakes (SQLSTATE class 22: a usage error, 2) from the
 * database's failures (3). */
static PGresult *ops_exec(struct ctl *ctl, const char *what, enum ctl_stmt stmt,
                          const char *const *params, int *rc)
{
	return ctl_run(ctl, what, stmt, params, rc);
}

/* The effect id every single-effect command takes first. */
static bool ops_effect_id(const char *cmd, int argc, char **argv, const char **id)
{
	if (argc < 1 || strncmp(argv[0], "--", 2) == 0) {
		fprintf(stderr, "outboxctl: %s needs an effect id (see 'outboxctl %s --help')\n",
		        cmd, cmd);
		return false;
	}
	if (!ctl_is_uuid(argv[0])) {
		fprintf(stderr, "outboxctl: %s: '%s' is not a UUID (an effect id looks like "
		                "0b9e6a52-3c41-4f0e-9d7a-5f0c2e8b1a47)\n", cmd, tv(argv[0]));
		return false;
	}
	*id = argv[0];
	return true;
}

/* Who and why: required for every act that changes what gets sent, because
 * operator_actions is the answer to "who did this at 3 a.m.?". */
static bool ops_who(const char *cmd, int argc, char **argv, const char **op, const char **reason)
{
	*op = ctl_opt(argc, argv, "--operator");
	*reason = ctl_opt(argc, argv, "--reason");
	if (*op == NULL || !(*op)[0] || *reason == NULL || !(*reason)[0]) {
		fprintf(stderr, "outboxctl: %s needs --operator NAME and --reason TEXT "
		                "(they are kept in operator_actions)\n", cmd);
		return false;
	}
	return true;
}

static int ops_not_found(const char *cmd, const char *id)
{
	fprintf(stderr, "outboxctl: %s: no effect with id %s\n", cmd, tv(id));
	return CTL_FAILED;
}

/* What to do instead, for an effect found in a state the act refuses. */
static const char *ops_state_hint(const char *state)
{
	if (strcmp(state, "unknown") == 0)
		return "check with the provider, then 'outboxctl unknown resolve'";
	if (strcmp(state, "failed") == 0)
		return "'outboxctl requeue' sends it again with the same key; 'outboxctl replace' "
		       "makes a new event";
	if (strcmp(state, "pending") == 0)
		return "it is queued and will be sent; 'outboxctl cancel' stops it";
	if (strcmp(state, "sending") == 0)
		return "a worker is sending it now; wait for its outcome";
	if (strcmp(state, "completed") == 0)
		return "it was delivered; 'outboxctl replace' makes a new event if a correction is needed";
	return "";
}

static int ops_wrong_state(const char *cmd, const char *id, const char *state, const char *want)
{
	fprintf(stderr, "outboxctl: %s: effect %s is %s, not %s: nothing changed (%s)\n", cmd, tv(id),
	        state, want, ops_state_hint(state));
	return CTL_FAILED;
}

/*
 * "30d", "12h", "90m", "45s", "2w" as a PostgreSQL interval; anything else
 * is returned as given, for PostgreSQL to read ("30 days", "1 mon").
 * Returns true when it was the short form.
 */
static bool ops_interval(const char *in, char *buf, size_t len)
{
	static const struct {
		char unit;
		const char *word;
	} units[] = {
		{ 's', "seconds" }, { 'm', "minutes" }, { 'h', "hours" }, { 'd', "days" }, { 'w', "weeks" },
	};
	size_t n = strlen(in), digits = strspn(in, "0123456789");

	snprintf(buf, len, "%s", in);
	if (n < 2 || digits != n - 1 || digits > 9)
		return false;
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		if (in[n - 1] == units[i].unit) {
			snprintf(buf, len, "%.*s %s", (int)digits, in, units[i].word);
			return true;
		}
	}
	return false;
}

static json_t *ops_json_text(const PGresult *r, int row, int col)
{
	json_t *s;

	if (PQgetisnull(r, row, col))
		return json_null();
	s = json_string(PQgetvalue(r, row, col));
	return s ? s : json_null();
}

static void ops_print_json(json_t *v)
{
	char *s = json_dumps(v, JSON_INDENT(2) | JSON_PRESERVE_ORDER);

	if (s)
		puts(s);
	free(s);
	json_decref(v);
}

/* ---- unknown ----------------------------------------------------------- */

static int unknown_list(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--json", NULL };
	static const char *const keys[UK_COLUMNS] = {
		"effect_id", "idempotency_key", "effect_key", "effect_type", "target", "attempts",
		"unknown_since", "created_at", "last_error_class", "last_error",
		"last_attempt_worker", "last_attempt_outcome", "last_attempt_status", "run_state",
	};
	PGresult *r;
	int rc = CTL_OK, n;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	/* Their runs' states as their effects make them, before the list reads them. */
	r = ops_exec(ctl, "unknown list", CTL_SQL_UNKNOWN_SETTLE, NULL, &rc);
	if (r == NULL)
		return rc;
	PQclear(r);
	r = ops_exec(ctl, "unknown list", CTL_SQL_UNKNOWN_LIST, NULL, &rc);
	if (r == NULL)
		return rc;
	n = PQntuples(r);
	if (ctl_flag(argc, argv, "--json")) {
		json_t *arr = json_array();
		for (int i = 0; i < n; i++) {
			json_t *o = json_object();
			for (int c = 0; c < UK_COLUMNS; c++) {
				json_t *v;
				if ((c == UK_ATTEMPTS || c == UK_LAST_STATUS) && !PQgetisnull(r, i, c))
					v = json_integer(strtoll(PQgetvalue(r, i, c), NULL, 10));
				else
					v = ops_json_text(r, i, c);
				json_object_set_new(o, keys[c], v);
			}
			json_array_append_new(arr, o);
		}
		ops_print_json(arr);
		PQclear(r);
		return CTL_OK;
	}
	if (n == 0) {
		printf("no unknown effects.\n");
		PQclear(r);
		return CTL_OK;
	}
	printf("%d unknown effect%s, oldest first.  Ask the provider whether it has the provider\n"
	       "key, then: outboxctl unknown resolve ID --sent|--not-sent --operator NAME --reason TEXT\n",
	       n, n == 1 ? "" : "s");
	for (int i = 0; i < n; i++) {
		printf("\n%s\n", tv(PQgetvalue(r, i, UK_EFFECT_ID)));
		printf("  run key:       %s (run %s)\n", tv(PQgetvalue(r, i, UK_IDEMPOTENCY_KEY)),
		       tv(PQgetvalue(r, i, UK_RUN_STATE)));
		printf("  provider key:  %s\n", tv(PQgetvalue(r, i, UK_EFFECT_KEY)));
		printf("  type, target:  %s %s\n", tv(PQgetvalue(r, i, UK_EFFECT_TYPE)),
		       tv(PQgetvalue(r, i, UK_TARGET)));
		printf("  attempts:      %s   unknown since %s   created %s\n",
		       tv(PQgetvalue(r, i, UK_ATTEMPTS)), tv(PQgetvalue(r, i, UK_UNKNOWN_SINCE)),
		       tv(PQgetvalue(r, i, UK_CREATED_AT)));
		if (!PQgetisnull(r, i, UK_LAST_WORKER))
			printf("  last attempt:  worker %s, outcome %s%s%s\n", tv(PQgetvalue(r, i, UK_LAST_WORKER)),
			       tv(PQgetvalue(r, i, UK_LAST_OUTCOME)), PQgetisnull(r, i, UK_LAST_STATUS) ? "" : ", status ",
			       tv(PQgetvalue(r, i, UK_LAST_STATUS)));
		if (!PQgetisnull(r, i, UK_LAST_ERROR))
			printf("  last error:    %s%s%s\n", tv(PQgetvalue(r, i, UK_LAST_ERROR_CLASS)),
			       PQgetisnull(r, i, UK_LAST_ERROR_CLASS) ? "" : ": ", tv(PQgetvalue(r, i, UK_LAST_ERROR)));
	}
	PQclear(r);
	return CTL_OK;
}

/* One effect and its history, the evidence to decide an unknown by: every
 * provider call with its outcome, status, provider id and reply. */
static int unknown_show(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--json", NULL };
	static const char *const hkeys[] = { "attempt", "worker", "started_at", "ended_at",
		                                 "outcome_class", "provider_status", "provider_id",
		                                 "error_text", "state" };
	const char *id, *params[1];
	PGresult *e, *h;
	int rc = CTL_OK;

	if (!ops_effect_id("unknown show", argc, argv, &id))
		return CTL_USAGE;
	argc--, argv++;
	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	params[0] = id;
	e = ops_exec(ctl, "unknown show", CTL_SQL_EFFECT, params, &rc);
	if (e == NULL)
		return rc;
	if (PQntuples(e) == 0) {
		PQclear(e);
		return ops_not_found("unknown show", id);
	}
	h = ops_exec(ctl, "unknown show", CTL_SQL_EFFECT_HISTORY, params, &rc);
	if (h == NULL) {
		PQclear(e);
		return rc;
	}
	if (ctl_flag(argc, argv, "--json")) {
		json_t *o = json_object(), *arr = json_array();
		json_object_set_new(o, "effect_id", ops_json_text(e, 0, EF_EFFECT_ID));
		json_object_set_new(o, "state", ops_json_text(e, 0, EF_STATE));
		json_object_set_new(o, "idempotency_key", ops_json_text(e, 0, EF_IDEMPOTENCY_KEY));
		json_object_set_new(o, "run_state", ops_json_text(e, 0, EF_RUN_STATE));
		json_object_set_new(o, "effect_key", ops_json_text(e, 0, EF_EFFECT_KEY));
		json_object_set_new(o, "effect_type", ops_json_text(e, 0, EF_EFFECT_TYPE));
		json_object_set_new(o, "target", ops_json_text(e, 0, EF_TARGET));
		json_object_set_new(o, "attempts", json_integer(strtoll(PQgetvalue(e, 0, EF_ATTEMPTS), NULL, 10)));
		json_object_set_new(o, "created_at", ops_json_text(e, 0, EF_CREATED_AT));
		json_object_set_new(o, "updated_at", ops_json_text(e, 0, EF_UPDATED_AT));
		json_object_set_new(o, "provider_id", ops_json_text(e, 0, EF_PROVIDER_ID));
		json_object_set_new(o, "last_error_class", ops_json_text(e, 0, EF_LAST_ERROR_CLASS));
		json_object_set_new(o, "last_error", ops_json_text(e, 0, EF_LAST_ERROR));
		for (int i = 0; i < PQntuples(h); i++) {
			json_t *a = json_object();
			for (int c = 0; c < (int)(sizeof(hkeys) / sizeof(hkeys[0])); c++) {
				json_t *v;
				if ((c == HI_ATTEMPT || c == HI_STATUS) && !PQgetisnull(h, i, c))
					v = json_integer(strtoll(PQgetvalue(h, i, c), NULL, 10));
				else
					v = ops_json_text(h, i, c);
				json_object_set_new(a, hkeys[c], v);
			}
			json_array_append_new(arr, a);
		}
		json_object_set_new(o, "history", arr);
		ops_print_json(o);
	} else {
		printf("%s: %s\n", tv(PQgetvalue(e, 0, EF_EFFECT_ID)), tv(PQgetvalue(e, 0, EF_STATE)));
		printf("  run key:       %s (run %s)\n", tv(PQgetvalue(e, 0, EF_IDEMPOTENCY_KEY)),
		       tv(PQgetvalue(e, 0, EF_RUN_STATE)));
		printf("  provider key:  %s\n", tv(PQgetvalue(e, 0, EF_EFFECT_KEY)));
		printf("  type, target:  %s %s\n", tv(PQgetvalue(e, 0, EF_EFFECT_TYPE)),
		       tv(PQgetvalue(e, 0, EF_TARGET)));
		printf("  attempts:      %s   created %s   changed %s\n", tv(PQgetvalue(e, 0, EF_ATTEMPTS)),
		       tv(PQgetvalue(e, 0, EF_CREATED_AT)), tv(PQgetvalue(e, 0, EF_UPDATED_AT)));
		if (!PQgetisnull(e, 0, EF_LAST_ERROR))
			printf("  last error:    %s%s%s\n", tv(PQgetvalue(e, 0, EF_LAST_ERROR_CLASS)),
			       PQgetisnull(e, 0, EF_LAST_ERROR_CLASS) ? "" : ": ",
			       tv(PQgetvalue(e, 0, EF_LAST_ERROR)));
		printf("  history (%d row%s):\n", PQntuples(h), PQntuples(h) == 1 ? "" : "s");
		for (int i = 0; i < PQntuples(h); i++) {
			printf("    #%s %s..%s %s", tv(PQgetvalue(h, i, HI_ATTEMPT)),
			       tv(PQgetvalue(h, i, HI_STARTED)), tv(PQgetvalue(h, i, HI_ENDED)),
			       PQgetisnull(h, i, HI_OUTCOME) ? "(state change)" : tv(PQgetvalue(h, i, HI_OUTCOME)));
			if (!PQgetisnull(h, i, HI_WORKER))
				printf(" worker %s", tv(PQgetvalue(h, i, HI_WORKER)));
			if (!PQgetisnull(h, i, HI_STATUS))
				printf(" status %s", tv(PQgetvalue(h, i, HI_STATUS)));
			if (!PQgetisnull(h, i, HI_PROVIDER_ID))
				printf(" provider id %s", tv(PQgetvalue(h, i, HI_PROVIDER_ID)));
			if (!PQgetisnull(h, i, HI_STATE))
				printf(" -> %s", tv(PQgetvalue(h, i, HI_STATE)));
			if (!PQgetisnull(h, i, HI_ERROR))
				printf(": %s", tv(PQgetvalue(h, i, HI_ERROR)));
			printf("\n");
		}
	}
	PQclear(e);
	PQclear(h);
	return CTL_OK;
}

static int unknown_resolve(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--sent", "--not-sent", "--provider-id=",
		                                   "--operator=", "--reason=", NULL };
	const char *id, *op, *reason, *pid, *params[5];
	bool sent, not_sent;
	PGresult *r;
	int rc = CTL_OK;

	if (!ops_effect_id("unknown resolve", argc, argv, &id))
		return CTL_USAGE;
	argc--, argv++;
	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	sent = ctl_flag(argc, argv, "--sent");
	not_sent = ctl_flag(argc, argv, "--not-sent");
	pid = ctl_opt(argc, argv, "--provider-id");
	if (sent == not_sent) {
		fprintf(stderr, "outboxctl: unknown resolve needs exactly one of --sent (the provider "
		                "has it) and --not-sent (the provider proves it never received it)\n");
		return CTL_USAGE;
	}
	if (not_sent && pid) {
		fprintf(stderr, "outboxctl: unknown resolve: --provider-id goes with --sent only\n");
		return CTL_USAGE;
	}
	if (!ops_who("unknown resolve", argc, argv, &op, &reason))
		return CTL_USAGE;

	params[0] = id;
	params[1] = sent ? "true" : "false";
	params[2] = op;
	params[3] = reason;
	params[4] = pid && pid[0] ? pid : NULL;
	r = ops_exec(ctl, "unknown resolve", CTL_SQL_RESOLVE, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0)
		rc = ops_not_found("unknown resolve", id);
	else if (PQgetvalue(r, 0, RS_APPLIED)[0] != 't')
		rc = ops_wrong_state("unknown resolve", id, PQgetvalue(r, 0, RS_STATE), "unknown");
	else if (sent)
		printf("effect %s resolved as sent by %s: completed, provider id %s; run %s is %s\n", tv(id),
		       tv(op), tv(PQgetvalue(r, 0, RS_PROVIDER_ID)), tv(PQgetvalue(r, 0, RS_IDEMPOTENCY_KEY)),
		       tv(PQgetvalue(r, 0, RS_RUN_STATE)));
	else
		printf("effect %s resolved as not sent by %s: pending again with the same key, due now; "
		       "run %s is %s\n", tv(id), tv(op), tv(PQgetvalue(r, 0, RS_IDEMPOTENCY_KEY)),
		       tv(PQgetvalue(r, 0, RS_RUN_STATE)));
	PQclear(r);
	return rc;
}

int cmd_unknown(struct ctl *ctl, int argc, char **argv)
{
	if (argc >= 1 && strcmp(argv[0], "list") == 0)
		return unknown_list(ctl, argc - 1, argv + 1);
	if (argc >= 1 && strcmp(argv[0], "show") == 0)
		return unknown_show(ctl, argc - 1, argv + 1);
	if (argc >= 1 && strcmp(argv[0], "resolve") == 0)
		return unknown_resolve(ctl, argc - 1, argv + 1);
	fprintf(stderr, "outboxctl: unknown: expected 'list', 'show' or 'resolve'%s%s%s\n",
	        argc ? ", not '" : "", argc ? tv(argv[0]) : "", argc ? "'" : "");
	return CTL_USAGE;
}

/* ---- requeue ----------------------------------------------------------- */

static int requeue_since(struct ctl *ctl, const char *since, const char *op, const char *reason)
{
	char ival[64];
	const char *params[3];
	PGresult *r;
	int rc = CTL_OK, n;
	/* An age ("2h") counts back from the database's clock, not this host's. */
	bool age = ops_interval(since, ival, sizeof(ival));

	params[0] = age ? ival : since;
	params[1] = op;
	params[2] = reason;
	r = ops_exec(ctl, "requeue", age ? CTL_SQL_REQUEUE_SINCE_AGO : CTL_SQL_REQUEUE_SINCE_AT,
	             params, &rc);
	if (r == NULL)
		return rc;
	n = PQntuples(r);
	printf("requeued %d failed effect%s (failed since %s; cancelled ones left alone)%s\n", n,
	       n == 1 ? "" : "s", since, n ? ", same keys, due now:" : ".");
	for (int i = 0; i < n; i++)
		printf("  %s key=%s type=%s target=%s was=%s run=%s\n", tv(PQgetvalue(r, i, RQS_EFFECT_ID)),
		       tv(PQgetvalue(r, i, RQS_IDEMPOTENCY_KEY)), tv(PQgetvalue(r, i, RQS_EFFECT_TYPE)),
		       tv(PQgetvalue(r, i, RQS_TARGET)), tv(PQgetvalue(r, i, RQS_LAST_ERROR_CLASS)),
		       tv(PQgetvalue(r, i, RQS_RUN_STATE)));
	PQclear(r);
	return CTL_OK;
}

int cmd_requeue(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--failed-since=", "--operator=", "--reason=", NULL };
	const char *id = NULL, *since, *op, *reason, *params[3];
	PGresult *r;
	int rc = CTL_OK;

	if (argc >= 1 && strncmp(argv[0], "--", 2) != 0) {
		if (!ops_effect_id("requeue", argc, argv, &id))
			return CTL_USAGE;
		argc--, argv++;
	}
	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	since = ctl_opt(argc, argv, "--failed-since");
	if ((id == NULL) == (since == NULL)) {
		fprintf(stderr, "outboxctl: requeue needs either an effect id or --failed-since T "
		                "(a timestamp, or an age such as 2h)\n");
		return CTL_USAGE;
	}
	if (!ops_who("requeue", argc, argv, &op, &reason))
		return CTL_USAGE;
	if (since)
		return requeue_since(ctl, since, op, reason);

	params[0] = id;
	params[1] = op;
	params[2] = reason;
	r = ops_exec(ctl, "requeue", CTL_SQL_REQUEUE, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0)
		rc = ops_not_found("requeue", id);
	else if (PQgetvalue(r, 0, RQ_APPLIED)[0] != 't')
		rc = ops_wrong_state("requeue", id, PQgetvalue(r, 0, RQ_STATE), "failed");
	else
		printf("effect %s requeued by %s: pending with the same key, due now (it had failed: %s); "
		       "run %s is %s\n", tv(id), tv(op),
		       PQgetvalue(r, 0, RQ_LAST_ERROR_CLASS)[0] ? tv(PQgetvalue(r, 0, RQ_LAST_ERROR_CLASS)) : "?",
		       tv(PQgetvalue(r, 0, RQ_IDEMPOTENCY_KEY)), tv(PQgetvalue(r, 0, RQ_RUN_STATE)));
	PQclear(r);
	return rc;
}

/* ---- replace ----------------------------------------------------------- */

int cmd_replace(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--new-key=", "--operator=", "--reason=", "--target=",
		                                   "--payload=", NULL };
	const char *id, *key, *op, *reason, *target, *payload, *params[6];
	const char *status, *state;
	PGresult *r;
	int rc = CTL_OK;

	if (!ops_effect_id("replace", argc, argv, &id))
		return CTL_USAGE;
	argc--, argv++;
	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	key = ctl_opt(argc, argv, "--new-key");
	if (key == NULL || !key[0]) {
		fprintf(stderr, "outboxctl: replace needs --new-key KEY: the replacement's own "
		                "idempotency key, issued by the source system (not a suffix of the old one)\n");
		return CTL_USAGE;
	}
	if (!ops_who("replace", argc, argv, &op, &reason))
		return CTL_USAGE;
	target = ctl_opt(argc, argv, "--target");
	payload = ctl_opt(argc, argv, "--payload");
	if (target && !target[0]) {
		fprintf(stderr, "outboxctl: replace: --target is empty\n");
		return CTL_USAGE;
	}
	if (payload) {
		json_error_t jerr;
		json_t *j = json_loads(payload, JSON_DECODE_ANY, &jerr);
		if (j == NULL) {
			fprintf(stderr, "outboxctl: replace: --payload is not valid JSON: %s (column %d)\n",
			        tv(jerr.text), jerr.column);
			return CTL_USAGE;
		}
		json_decref(j);
	}

	params[0] = id;
	params[1] = key;
	params[2] = op;
	params[3] = reason;
	params[4] = target;
	params[5] = payload;
	r = ops_exec(ctl, "replace", CTL_SQL_REPLACE, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0) {
		PQclear(r);
		return ops_not_found("replace", id);
	}
	status = PQgetvalue(r, 0, RP_STATUS);
	state = PQgetvalue(r, 0, RP_STATE);
	if (strcmp(status, "created") == 0) {
		printf("replacement created by %s: effect %s under the new run %s (approved, queued), "
		       "linked to effect %s of run %s, which is left as it was\n",
		       tv(op), tv(PQgetvalue(r, 0, RP_NEW_EFFECT_ID)), tv(key), tv(id),
		       tv(PQgetvalue(r, 0, RP_ORIGINAL_KEY)));
	} else if (strcmp(status, "exists") == 0) {
		printf("effect %s was already replaced by effect %s under run %s (now %s): nothing "
		       "changed\n", tv(id), tv(PQgetvalue(r, 0, RP_NEW_EFFECT_ID)), tv(key), state);
	} else if (strcmp(status, "key_taken") == 0) {
		fprintf(stderr, "outboxctl: replace: the key %s already belongs to another run (%s): "
		                "nothing changed; bring a new key from the source system\n", tv(key), state);
		rc = CTL_FAILED;
	} else {
		fprintf(stderr, "outboxctl: replace: effect %s is %s, so it may still be delivered: "
		                "nothing changed (%s, then replace it)\n", tv(id), state,
		        strcmp(state, "pending") == 0 ? "cancel it with 'outboxctl cancel'"
		        : strcmp(state, "unknown") == 0 ? "resolve it with 'outboxctl unknown resolve'"
		                                        : "wait for its outcome");
		rc = CTL_FAILED;
	}
	PQclear(r);
	return rc;
}

/* ---- prune ------------------------------------------------------------- */

/* How many months the history has partitions for; -1 on a database error. */
static long prune_months(struct ctl *ctl, int *rc)
{
	PGresult *r = ops_exec(ctl, "prune", CTL_SQL_HISTORY_MONTHS, NULL, rc);
	long n;

	if (r == NULL)
		return -1;
	n = strtol(PQgetvalue(r, 0, CNT_VALUE), NULL, 10);
	PQclear(r);
	return n;
}

int cmd_prune(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--older-than=", "--batch=", "--operator=",
		                                   "--reason=", NULL };
	const char *older, *batch_s, *op, *reason, *params[4];
	char ival[64], batch_buf[16], why[160], *end;
	long batch = 1000, total = 0, batches = 0, months_before, months_after;
	int rc = CTL_OK;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	older = ctl_opt(argc, argv, "--older-than");
	if (older == NULL || !older[0]) {
		fprintf(stderr, "outboxctl: prune needs --older-than D (e.g. 30d, 12h, 90m, or an "
		                "interval such as '2 weeks')\n");
		return CTL_USAGE;
	}
	batch_s = ctl_opt(argc, argv, "--batch");
	if (batch_s) {
		batch = strtol(batch_s, &end, 10);
		if (end == batch_s || *end || batch < 1 || batch > 100000) {
			fprintf(stderr, "outboxctl: prune: --batch must be a number from 1 to 100000, "
			                "not '%s'\n", batch_s);
			return CTL_USAGE;
		}
	}
	ops_interval(older, ival, sizeof(ival));
	snprintf(batch_buf, sizeof(batch_buf), "%ld", batch);
	op = ctl_opt(argc, argv, "--operator");
	reason = ctl_opt(argc, argv, "--reason");
	if (reason == NULL || !reason[0]) {
		snprintf(why, sizeof(why), "retention: older than %s", older);
		reason = why;
	}
	params[0] = ival;
	params[1] = batch_buf;
	params[2] = op && op[0] ? op : NULL;
	params[3] = reason;

	months_before = prune_months(ctl, &rc);
	if (months_before < 0)
		return rc;
	/* One batch per statement, each its own transaction: the workers wait
	 * at most one short delete, and an interrupted prune keeps what it did. */
	for (;;) {
		PGresult *r = ops_exec(ctl, "prune", CTL_SQL_PRUNE, params, &rc);
		long n;

		if (r == NULL) {
			if (batches)
				fprintf(stderr, "outboxctl: prune: stopped after %ld effect%s in %ld batch%s\n",
				        total, total == 1 ? "" : "s", batches, batches == 1 ? "" : "es");
			return rc;
		}
		n = strtol(PQgetvalue(r, 0, CNT_VALUE), NULL, 10);
		PQclear(r);
		total += n;
		batches++;
		if (n < batch)
			break;
	}
	months_after = prune_months(ctl, &rc);
	if (months_after < 0)
		return rc;
	printf("pruned %ld completed or failed effect%s that ended more than %s ago, in %ld "
	       "batch%s of up to %ld; %ld month%s of history dropped whole, attempts log "
	       "included (a month holding a recent effect, or too many open ones, is kept; "
	       "a few open ones are kept apart)\n", total,
	       total == 1 ? "" : "s", older, batches, batches == 1 ? "" : "es", batch,
	       months_before - months_after, months_before - months_after == 1 ? "" : "s");
	return CTL_OK;
}

/* ---- cancel ------------------------------------------------------------ */

int cmd_cancel(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--reason=", "--operator=", NULL };
	const char *id, *reason, *op, *params[3];
	PGresult *r;
	int rc = CTL_OK;
	bool done;

	if (!ops_effect_id("cancel", argc, argv, &id))
		return CTL_USAGE;
	argc--, argv++;
	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	reason = ctl_opt(argc, argv, "--reason");
	op = ctl_opt(argc, argv, "--operator");
	params[0] = id;
	params[1] = reason && reason[0] ? reason : NULL;
	params[2] = op && op[0] ? op : NULL;
	r = ops_exec(ctl, "cancel", CTL_SQL_CANCEL, params, &rc);
	if (r == NULL)
		return rc;
	done = PQgetvalue(r, 0, CNT_VALUE)[0] == 't';
	PQclear(r);

	/* Say what is stored (cancelled: the error it now carries; refused:
	 * why), from the row as it is now. */
	r = ops_exec(ctl, "cancel", CTL_SQL_EFFECT, params, &rc);
	if (r == NULL)
		return rc;
	if (done) {
		printf("effect %s cancelled: %s, with error '%s'; it will never be sent\n", tv(id),
		       PQntuples(r) ? tv(PQgetvalue(r, 0, EF_STATE)) : "failed",
		       PQntuples(r) ? tv(PQgetvalue(r, 0, EF_LAST_ERROR)) : "cancelled");
		rc = CTL_OK;
	} else if (PQntuples(r) == 0) {
		rc = ops_not_found("cancel", id);
	} else if (strcmp(PQgetvalue(r, 0, EF_STATE), "failed") == 0 &&
	           strcmp(PQgetvalue(r, 0, EF_LAST_ERROR_CLASS), "cancelled") == 0) {
		printf("effect %s was already cancelled: nothing changed\n", tv(id));
		rc = CTL_OK;
	} else {
		fprintf(stderr, "outboxctl: cancel: effect %s is %s, not pending: it can no longer be "
		                "cancelled (%s)\n", tv(id), tv(PQgetvalue(r, 0, EF_STATE)),
		        ops_state_hint(tv(PQgetvalue(r, 0, EF_STATE))));
		rc = CTL_FAILED;
	}
	PQclear(r);
	return rc;
}

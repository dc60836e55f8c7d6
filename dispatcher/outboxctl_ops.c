/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_ops.c: the operator's acts on effects: unknown list/resolve,
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

#define OPS_TIME(col) \
	"to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"

/* Run one statement.  Unlike ctl_exec, this tells the operator's mistakes
 * (SQLSTATE class 22: a usage error, 2) from the database's failures (3). */
static PGresult *ops_exec(struct ctl *ctl, const char *what, const char *sql, int n,
                          const char *const *params, int *rc)
{
	return ctl_exec_rc(ctl, what, sql, n, params, rc);
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

/* `unknown` effects sit at available_at = 'infinity' in the live queue's
 * index; the last provider call from the history, by the effect's id. */
static const char unknown_list_sql[] =
	"SELECT l.effect_id, b.idempotency_key, b.effect_key, b.effect_type, b.target, l.attempts, "
	OPS_TIME("l.updated_at") ", " OPS_TIME("l.created_at") ", l.last_error_class, l.last_error, "
	"a.worker, a.outcome_class, a.provider_status, w.state "
	"FROM effect_live l "
	"JOIN effect_outbox b ON b.effect_id = l.effect_id "
	"JOIN workflow_runs w ON w.idempotency_key = b.idempotency_key "
	"LEFT JOIN LATERAL (SELECT x.worker, x.outcome_class, x.provider_status "
	"                     FROM effect_history x WHERE x.effect_id = l.effect_id "
	"                      AND x.created_at = l.created_at AND x.outcome_class IS NOT NULL "
	"                    ORDER BY x.history_id DESC LIMIT 1) a ON true "
	"WHERE l.available_at = 'infinity' AND l.state = 'unknown' "
	"ORDER BY l.updated_at, l.effect_id";

static const char unknown_settle_sql[] =
	"SELECT outbox_settle_runs(ARRAY(SELECT DISTINCT b.idempotency_key "
	"FROM effect_live l JOIN effect_outbox b ON b.effect_id = l.effect_id "
	"WHERE l.available_at = 'infinity' AND l.state = 'unknown'))";

static int unknown_list(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--json", NULL };
	static const char *const keys[] = {
		"effect_id", "idempotency_key", "effect_key", "effect_type", "target", "attempts",
		"unknown_since", "created_at", "last_error_class", "last_error",
		"last_attempt_worker", "last_attempt_outcome", "last_attempt_status", "run_state",
	};
	PGresult *r;
	int rc = CTL_OK, n;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	/* Their runs' states as their effects make them, before the list reads them. */
	r = ops_exec(ctl, "unknown list", unknown_settle_sql, 0, NULL, &rc);
	if (r == NULL)
		return rc;
	PQclear(r);
	r = ops_exec(ctl, "unknown list", unknown_list_sql, 0, NULL, &rc);
	if (r == NULL)
		return rc;
	n = PQntuples(r);
	if (ctl_flag(argc, argv, "--json")) {
		json_t *arr = json_array();
		for (int i = 0; i < n; i++) {
			json_t *o = json_object();
			for (int c = 0; c < (int)(sizeof(keys) / sizeof(keys[0])); c++) {
				json_t *v;
				if ((c == 5 || c == 12) && !PQgetisnull(r, i, c))
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
		printf("\n%s\n", tv(PQgetvalue(r, i, 0)));
		printf("  run key:       %s (run %s)\n", tv(PQgetvalue(r, i, 1)), tv(PQgetvalue(r, i, 13)));
		printf("  provider key:  %s\n", tv(PQgetvalue(r, i, 2)));
		printf("  type, target:  %s %s\n", tv(PQgetvalue(r, i, 3)), tv(PQgetvalue(r, i, 4)));
		printf("  attempts:      %s   unknown since %s   created %s\n", tv(PQgetvalue(r, i, 5)),
		       tv(PQgetvalue(r, i, 6)), tv(PQgetvalue(r, i, 7)));
		if (!PQgetisnull(r, i, 10))
			printf("  last attempt:  worker %s, outcome %s%s%s\n", tv(PQgetvalue(r, i, 10)),
			       tv(PQgetvalue(r, i, 11)), PQgetisnull(r, i, 12) ? "" : ", status ",
			       tv(PQgetvalue(r, i, 12)));
		if (!PQgetisnull(r, i, 9))
			printf("  last error:    %s%s%s\n", tv(PQgetvalue(r, i, 8)),
			       PQgetisnull(r, i, 8) ? "" : ": ", tv(PQgetvalue(r, i, 9)));
	}
	PQclear(r);
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
	r = ops_exec(ctl, "unknown resolve",
	             "SELECT applied, state, idempotency_key, coalesce(provider_id, ''), "
	             "coalesce(run_state, '') "
	             "FROM outbox_resolve_unknown($1::uuid, $2::boolean, $3, $4, $5)",
	             5, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0)
		rc = ops_not_found("unknown resolve", id);
	else if (PQgetvalue(r, 0, 0)[0] != 't')
		rc = ops_wrong_state("unknown resolve", id, PQgetvalue(r, 0, 1), "unknown");
	else if (sent)
		printf("effect %s resolved as sent by %s: completed, provider id %s; run %s is %s\n", tv(id),
		       tv(op), tv(PQgetvalue(r, 0, 3)), tv(PQgetvalue(r, 0, 2)), tv(PQgetvalue(r, 0, 4)));
	else
		printf("effect %s resolved as not sent by %s: pending again with the same key, due now; "
		       "run %s is %s\n", tv(id), tv(op), tv(PQgetvalue(r, 0, 2)), tv(PQgetvalue(r, 0, 4)));
	PQclear(r);
	return rc;
}

int cmd_unknown(struct ctl *ctl, int argc, char **argv)
{
	if (argc >= 1 && strcmp(argv[0], "list") == 0)
		return unknown_list(ctl, argc - 1, argv + 1);
	if (argc >= 1 && strcmp(argv[0], "resolve") == 0)
		return unknown_resolve(ctl, argc - 1, argv + 1);
	fprintf(stderr, "outboxctl: unknown: expected 'list' or 'resolve'%s%s%s\n",
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
	r = ops_exec(ctl, "requeue",
	             age ? "SELECT effect_id, idempotency_key, effect_type, target, "
	                   "coalesce(last_error_class, ''), coalesce(run_state, '') "
	                   "FROM outbox_requeue_failed_since(now() - $1::interval, $2, $3)"
	                 : "SELECT effect_id, idempotency_key, effect_type, target, "
	                   "coalesce(last_error_class, ''), coalesce(run_state, '') "
	                   "FROM outbox_requeue_failed_since($1::timestamptz, $2, $3)",
	             3, params, &rc);
	if (r == NULL)
		return rc;
	n = PQntuples(r);
	printf("requeued %d failed effect%s (failed since %s; cancelled ones left alone)%s\n", n,
	       n == 1 ? "" : "s", since, n ? ", same keys, due now:" : ".");
	for (int i = 0; i < n; i++)
		printf("  %s key=%s type=%s target=%s was=%s run=%s\n", tv(PQgetvalue(r, i, 0)),
		       tv(PQgetvalue(r, i, 1)), tv(PQgetvalue(r, i, 2)), tv(PQgetvalue(r, i, 3)), tv(PQgetvalue(r, i, 4)),
		       tv(PQgetvalue(r, i, 5)));
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
	r = ops_exec(ctl, "requeue",
	             "SELECT applied, state, idempotency_key, coalesce(last_error_class, ''), "
	             "coalesce(run_state, '') FROM outbox_requeue($1::uuid, $2, $3)",
	             3, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0)
		rc = ops_not_found("requeue", id);
	else if (PQgetvalue(r, 0, 0)[0] != 't')
		rc = ops_wrong_state("requeue", id, PQgetvalue(r, 0, 1), "failed");
	else
		printf("effect %s requeued by %s: pending with the same key, due now (it had failed: %s); "
		       "run %s is %s\n", tv(id), tv(op), PQgetvalue(r, 0, 3)[0] ? tv(PQgetvalue(r, 0, 3)) : "?",
		       tv(PQgetvalue(r, 0, 2)), tv(PQgetvalue(r, 0, 4)));
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
	r = ops_exec(ctl, "replace",
	             "SELECT status, state, coalesce(new_effect_id::text, ''), new_key, original_key "
	             "FROM outbox_replace($1::uuid, $2, $3, $4, $5, $6::jsonb)",
	             6, params, &rc);
	if (r == NULL)
		return rc;
	if (PQntuples(r) == 0) {
		PQclear(r);
		return ops_not_found("replace", id);
	}
	status = PQgetvalue(r, 0, 0);
	state = PQgetvalue(r, 0, 1);
	if (strcmp(status, "created") == 0) {
		printf("replacement created by %s: effect %s under the new run %s (approved, queued), "
		       "linked to effect %s of run %s, which is left as it was\n",
		       tv(op), tv(PQgetvalue(r, 0, 2)), tv(key), tv(id), tv(PQgetvalue(r, 0, 4)));
	} else if (strcmp(status, "exists") == 0) {
		printf("effect %s was already replaced by effect %s under run %s (now %s): nothing "
		       "changed\n", tv(id), tv(PQgetvalue(r, 0, 2)), tv(key), state);
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
	PGresult *r = ops_exec(ctl, "prune",
	                       "SELECT count(*) FROM pg_inherits"
	                       " WHERE inhparent = 'effect_history'::regclass",
	                       0, NULL, rc);
	long n;

	if (r == NULL)
		return -1;
	n = strtol(PQgetvalue(r, 0, 0), NULL, 10);
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
		PGresult *r = ops_exec(ctl, "prune",
		                       "SELECT outbox_prune($1::interval, $2::integer, "
		                       "coalesce($3, session_user::text), $4)",
		                       4, params, &rc);
		long n;

		if (r == NULL) {
			if (batches)
				fprintf(stderr, "outboxctl: prune: stopped after %ld effect%s in %ld batch%s\n",
				        total, total == 1 ? "" : "s", batches, batches == 1 ? "" : "es");
			return rc;
		}
		n = strtol(PQgetvalue(r, 0, 0), NULL, 10);
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
	r = ops_exec(ctl, "cancel",
	             "SELECT outbox_cancel($1::uuid, $2, coalesce($3, session_user::text))", 3, params,
	             &rc);
	if (r == NULL)
		return rc;
	done = PQgetvalue(r, 0, 0)[0] == 't';
	PQclear(r);

	/* Say what is stored (cancelled: the error it now carries; refused:
	 * why), from the row as it is now. */
	r = ops_exec(ctl, "cancel",
	             "SELECT state, coalesce(last_error_class, ''), coalesce(last_error, '') "
	             "FROM outbox_effects WHERE effect_id = $1::uuid",
	             1, params, &rc);
	if (r == NULL)
		return rc;
	if (done) {
		printf("effect %s cancelled: %s, with error '%s'; it will never be sent\n", tv(id),
		       PQntuples(r) ? tv(PQgetvalue(r, 0, 0)) : "failed",
		       PQntuples(r) ? tv(PQgetvalue(r, 0, 2)) : "cancelled");
		rc = CTL_OK;
	} else if (PQntuples(r) == 0) {
		rc = ops_not_found("cancel", id);
	} else if (strcmp(PQgetvalue(r, 0, 0), "failed") == 0 &&
	           strcmp(PQgetvalue(r, 0, 1), "cancelled") == 0) {
		printf("effect %s was already cancelled: nothing changed\n", tv(id));
		rc = CTL_OK;
	} else {
		fprintf(stderr, "outboxctl: cancel: effect %s is %s, not pending: it can no longer be "
		                "cancelled (%s)\n", tv(id), tv(PQgetvalue(r, 0, 0)),
		        ops_state_hint(tv(PQgetvalue(r, 0, 0))));
		rc = CTL_FAILED;
	}
	PQclear(r);
	return rc;
}

/* SPDX-License-Identifier: ISC */
/*
 * outboxctl_scopes.c: the parts of the fleet an operator stops or slows on
 * their own, a scope being an effect type, a host or a CRM object:
 * kill-switch off|on with --type, --host or --crm-object
 * (outbox_scope_pause), limit set|clear|list (outbox_scope_limit), and the
 * rows of outbox_scope_status that status and kill-switch status show.
 *
 * Each change is one call of its function, which takes the kill-switch
 * lock exclusively and writes outbox_scope_history in the same
 * transaction: when `off` returns, no send of the scope can start anywhere
 * in the fleet.  This file parses, calls and explains.  A malformed
 * argument is exit 2 before any connection is made; the database checks
 * the values again and its invalid_parameter_value is exit 2 as well.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostname.h"
#include "outboxctl.h"
#include "outboxctl_sql.h"

#define SCOPE_VALUE_MAX 255 /* outbox_scopes.value's bound */
#define SCOPE_LIMIT_MAX 1000000 /* outbox_scope_limit's bound on rate and burst */

enum scope_kind { SCOPE_TYPE, SCOPE_HOST, SCOPE_CRM_OBJECT, SCOPE_KINDS };

static const struct {
	const char *option;   /* on the command line */
	const char *kind;     /* outbox_scopes.kind */
	bool lower_case;      /* stored lower case: hosts and CRM object names */
	bool takes_limit;     /* a destination a rate limit can apply to */
} scope_kinds[SCOPE_KINDS] = {
	[SCOPE_TYPE] = { "--type", "type", false, true },
	[SCOPE_HOST] = { "--host", "host", true, true },
	[SCOPE_CRM_OBJECT] = { "--crm-object", "crm_object", true, false },
};

static const char scope_hint[] = "a scope is --type T, --host H or --crm-object O";

struct scope {
	enum scope_kind kind;
	const char *given;                /* as written: the database checks and stores it */
	char value[SCOPE_VALUE_MAX + 1];  /* as stored, for the messages */
};

static int scope_option(const char *arg)
{
	for (int k = 0; k < SCOPE_KINDS; k++)
		if (strcmp(arg, scope_kinds[k].option) == 0)
			return k;
	return -1;
}

/* After ctl_check_opts has passed, every option but --json takes a value:
 * skip values, so that "--reason --type" is a reason, not a scope. */
static bool skips_value(const char *arg)
{
	return strncmp(arg, "--", 2) == 0 && strcmp(arg, "--json") != 0;
}

bool ctl_scope_given(int argc, char **argv)
{
	for (int i = 0; i < argc; i++) {
		if (scope_option(argv[i]) >= 0)
			return true;
		if (skips_value(argv[i]))
			i++;
	}
	return false;
}

/* Exactly one scope option, with a value that fits. */
static bool scope_parse(const char *cmd, int argc, char **argv, struct scope *out)
{
	int found = -1, first = 0;
	size_t n;

	for (int i = 0; i + 1 < argc; i++) {
		int k = scope_option(argv[i]);
		if (k >= 0 && found >= 0) {
			fprintf(stderr, "outboxctl: %s: one scope at a time, not both %s %s and %s %s\n",
			        cmd, argv[first], tv(argv[first + 1]), argv[i], tv(argv[i + 1]));
			return false;
		}
		if (k >= 0) {
			found = k;
			first = i;
		}
		if (skips_value(argv[i]))
			i++;
	}
	if (found < 0) {
		fprintf(stderr, "outboxctl: %s needs a scope: --type T or --host H\n", cmd);
		return false;
	}
	n = strlen(argv[first + 1]);
	if (n == 0 || n > SCOPE_VALUE_MAX) {
		fprintf(stderr, "outboxctl: %s: %s needs a value of 1 to %d characters\n", cmd,
		        argv[first], SCOPE_VALUE_MAX);
		return false;
	}
	out->kind = (enum scope_kind)found;
	out->given = argv[first + 1];
	for (size_t i = 0; i <= n; i++) {
		char c = argv[first + 1][i];
		out->value[i] = scope_kinds[found].lower_case && c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c;
	}
	/* The stored form, as outbox_scope_value makes it: a CRM object in
	 * lower case, a host in the one spelling the workers match
	 * (lib/hostname.h); a host no connection can be made to is refused
	 * here, not kept as a scope that would never hold anything. */
	if (out->kind == SCOPE_HOST &&
	    host_canon(argv[first + 1], out->value, sizeof(out->value)) == HOST_BAD) {
		fprintf(stderr, "outboxctl: %s: --host %s is not a host name or address (no scheme, "
		        "port or path), e.g. api.example.com, 192.0.2.1, 2001:db8::1\n", cmd,
		        tv(argv[first + 1]));
		return false;
	}
	return true;
}

/* Who and why: kept in outbox_scope_history, the answer to "who paused
 * email at 3 a.m., and why?". */
static bool scope_who(const char *cmd, int argc, char **argv, const char **op, const char **reason)
{
	*op = ctl_opt(argc, argv, "--operator");
	*reason = ctl_opt(argc, argv, "--reason");
	if (*op == NULL || !(*op)[0] || *reason == NULL || !(*reason)[0]) {
		fprintf(stderr, "outboxctl: %s needs --operator NAME and --reason TEXT "
		                "(they are kept in the scope's history)\n", cmd);
		return false;
	}
	return true;
}

/* What the scope's sends are called: "email sends", and what a pause
 * guarantees about them: "no email send can start". */
static void scope_words(const struct scope *s, char *sends, size_t sends_len, char *none,
                        size_t none_len)
{
	const char *v = tv(s->value);

	switch (s->kind) {
	case SCOPE_TYPE:
		snprintf(sends, sends_len, "%s sends", v);
		snprintf(none, none_len, "no %s send can start", v);
		break;
	case SCOPE_HOST:
		snprintf(sends, sends_len, "sends to host %s", v);
		snprintf(none, none_len, "no send to %s can start", v);
		break;
	case SCOPE_CRM_OBJECT:
		snprintf(sends, sends_len, "crm sends to object %s", v);
		snprintf(none, none_len, "no crm send to a %s record can start", v);
		break;
	case SCOPE_KINDS:
		snprintf(sends, sends_len, "sends");
		snprintf(none, none_len, "no send can start");
		break;
	}
}

/* A scope resumed or unlimited while the global switch is off still sends
 * nothing: say so, instead of leaving the operator to wonder. */
static void scope_note_global_switch(struct ctl *ctl)
{
	PGresult *r = ctl_run_db(ctl, "kill-switch status", CTL_SQL_SWITCH, NULL);

	if (r && PQntuples(r) == 1 && PQgetvalue(r, 0, SW_ENABLED)[0] != 't')
		printf("the kill switch is off: nothing is sent until 'outboxctl kill-switch on'\n");
	PQclear(r);
}

/* ---- kill-switch off|on with a scope ---------------------------------- */

int ctl_scope_pause(struct ctl *ctl, bool paused, int argc, char **argv)
{
	const char *cmd = paused ? "kill-switch off" : "kill-switch on";
	const char *op, *reason, *params[5];
	char sends[320], none[320];
	struct scope s;
	PGresult *r;
	int rc = CTL_OK;

	if (!scope_parse(cmd, argc, argv, &s) || !scope_who(cmd, argc, argv, &op, &reason))
		return CTL_USAGE;
	params[0] = scope_kinds[s.kind].kind;
	params[1] = s.given;
	params[2] = paused ? "true" : "false";
	params[3] = op;
	params[4] = reason;
	r = ctl_run(ctl, cmd, CTL_SQL_SCOPE_PAUSE, params, &rc);
	if (r == NULL)
		return rc;
	scope_words(&s, sends, sizeof(sends), none, sizeof(none));
	if (paused) {
		printf("%s paused: %s anywhere in the fleet (by %s: %s)\n", sends, none, tv(op), tv(reason));
		ctl_print_in_flight(r);
	} else {
		printf("%s resumed: the ones it held are due now (by %s: %s)\n", sends, tv(op), tv(reason));
		scope_note_global_switch(ctl);
	}
	PQclear(r);
	return CTL_OK;
}

/* ---- the rows of outbox_scope_status ---------------------------------- */

static PGresult *scope_rows(struct ctl *ctl, const char *what, bool limited_only, int *rc)
{
	const char *params[1] = { limited_only ? "true" : "false" };

	return ctl_run(ctl, what, CTL_SQL_SCOPES, params, rc);
}

static json_t *scope_text(const PGresult *r, int row, int col)
{
	json_t *s;

	if (PQgetisnull(r, row, col))
		return json_null();
	s = json_string(PQgetvalue(r, row, col));
	return s ? s : json_null();
}

static json_t *scope_json(const PGresult *r, int i)
{
	char name[2 * SCOPE_VALUE_MAX];
	json_t *o = json_object();

	snprintf(name, sizeof(name), "%s:%s", PQgetvalue(r, i, SC_KIND), PQgetvalue(r, i, SC_VALUE));
	json_object_set_new(o, "scope", json_string(name));
	json_object_set_new(o, "kind", scope_text(r, i, SC_KIND));
	json_object_set_new(o, "value", scope_text(r, i, SC_VALUE));
	json_object_set_new(o, "paused", json_boolean(PQgetvalue(r, i, SC_PAUSED)[0] == 't'));
	json_object_set_new(o, "paused_by", scope_text(r, i, SC_PAUSED_BY));
	json_object_set_new(o, "paused_at", scope_text(r, i, SC_PAUSED_AT));
	json_object_set_new(o, "paused_reason", scope_text(r, i, SC_PAUSED_REASON));
	json_object_set_new(o, "rate_per_second", PQgetisnull(r, i, SC_RATE) ? json_null()
	                    : json_real(strtod(PQgetvalue(r, i, SC_RATE), NULL)));
	json_object_set_new(o, "burst", PQgetisnull(r, i, SC_BURST) ? json_null()
	                    : json_integer(strtoll(PQgetvalue(r, i, SC_BURST), NULL, 10)));
	json_object_set_new(o, "limit_by", scope_text(r, i, SC_LIMIT_BY));
	json_object_set_new(o, "limit_at", scope_text(r, i, SC_LIMIT_AT));
	json_object_set_new(o, "limit_reason", scope_text(r, i, SC_LIMIT_REASON));
	json_object_set_new(o, "waiting", json_integer(strtoll(PQgetvalue(r, i, SC_WAITING), NULL, 10)));
	json_object_set_new(o, "held_total",
	                    json_integer(strtoll(PQgetvalue(r, i, SC_HELD_TOTAL), NULL, 10)));
	return o;
}

static void scope_print(const PGresult *r, int i)
{
	printf("scope %s:%s: ", tv(PQgetvalue(r, i, SC_KIND)), tv(PQgetvalue(r, i, SC_VALUE)));
	if (PQgetvalue(r, i, SC_PAUSED)[0] == 't')
		printf("paused by %s at %s: %s\n", tv(PQgetvalue(r, i, SC_PAUSED_BY)),
		       tv(PQgetvalue(r, i, SC_PAUSED_AT)), tv(PQgetvalue(r, i, SC_PAUSED_REASON)));
	else
		printf("not paused\n");
	if (PQgetisnull(r, i, SC_RATE))
		printf("  rate: no limit");
	else
		printf("  rate: %.6g per second, burst %s, set by %s at %s: %s",
		       strtod(PQgetvalue(r, i, SC_RATE), NULL), tv(PQgetvalue(r, i, SC_BURST)),
		       tv(PQgetvalue(r, i, SC_LIMIT_BY)), tv(PQgetvalue(r, i, SC_LIMIT_AT)),
		       tv(PQgetvalue(r, i, SC_LIMIT_REASON)));
	printf("   waiting: %s   held back in all: %s\n", tv(PQgetvalue(r, i, SC_WAITING)),
	       tv(PQgetvalue(r, i, SC_HELD_TOTAL)));
}

int ctl_scopes_show(struct ctl *ctl, json_t *o)
{
	int rc = CTL_OK;
	PGresult *r = scope_rows(ctl, "scopes", false, &rc);

	if (r == NULL)
		return rc;
	if (o) {
		json_t *arr = json_array();
		for (int i = 0; i < PQntuples(r); i++)
			json_array_append_new(arr, scope_json(r, i));
		json_object_set_new(o, "scopes", arr);
	} else {
		/* None: the output of the switch alone, as before scopes existed. */
		for (int i = 0; i < PQntuples(r); i++)
			scope_print(r, i);
	}
	PQclear(r);
	return CTL_OK;
}

/* ---- limit set|clear|list ---------------------------------------------- */

/*
 * "50", "50/s", "3000/min", "0.5/s" as sends per second.  Digits and one
 * point only: no sign, exponent, "inf" or "nan" that strtod would take.
 */
static bool scope_rate(const char *in, double *per_second)
{
	static const struct {
		const char *unit;
		double seconds;
	} units[] = { { "", 1.0 }, { "/s", 1.0 }, { "/min", 60.0 } };
	size_t n = strspn(in, "0123456789.");
	const char *dot = memchr(in, '.', n);
	char number[32];
	double v;

	if (n == 0 || n >= sizeof(number) || strspn(in, ".") == n ||
	    (dot && memchr(dot + 1, '.', n - (size_t)(dot - in) - 1)))
		return false;
	memcpy(number, in, n);
	number[n] = '\0';
	v = strtod(number, NULL);
	for (size_t u = 0; u < sizeof(units) / sizeof(units[0]); u++) {
		if (strcmp(in + n, units[u].unit) == 0) {
			*per_second = v / units[u].seconds;
			return isfinite(*per_second) && *per_second > 0 && *per_second <= SCOPE_LIMIT_MAX;
		}
	}
	return false;
}

static bool scope_burst(const char *in, long *burst)
{
	char *end;

	if (in[0] < '0' || in[0] > '9')
		return false;
	*burst = strtol(in, &end, 10);
	return *end == '\0' && *burst >= 1 && *burst <= SCOPE_LIMIT_MAX;
}

/* The limit's scope: --type or --host, not --crm-object. */
static bool limit_scope(const char *cmd, int argc, char **argv, struct scope *s)
{
	if (!scope_parse(cmd, argc, argv, s))
		return false;
	if (!scope_kinds[s->kind].takes_limit) {
		fprintf(stderr, "outboxctl: %s: %s takes no rate limit: a limit applies to a "
		                "destination, --type T or --host H (all crm sends: --type crm, or the "
		                "CRM instance's --host)\n", cmd, scope_kinds[s->kind].option);
		return false;
	}
	return true;
}

static int limit_call(struct ctl *ctl, const char *cmd, const struct scope *s, const char *rate,
                      const char *burst, const char *op, const char *reason)
{
	const char *params[6] = { scope_kinds[s->kind].kind, s->given, rate, burst, op, reason };
	PGresult *r;
	int rc = CTL_OK;

	r = ctl_run(ctl, cmd, CTL_SQL_SCOPE_LIMIT, params, &rc);
	if (r == NULL)
		return rc;
	PQclear(r);
	return CTL_OK;
}

static int limit_set(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--type=", "--host=", "--crm-object=", "--rate=",
		                                   "--burst=", "--operator=", "--reason=", NULL };
	const char *cmd = "limit set", *rate_s, *burst_s, *op, *reason;
	char rate[32], burst[16], sends[320], none[320];
	double per_second;
	long b = 0;
	struct scope s;
	PGresult *r;
	int rc, row = -1;

	if (!ctl_check_opts_hint(argc, argv, allowed, scope_hint) || !limit_scope(cmd, argc, argv, &s))
		return CTL_USAGE;
	rate_s = ctl_opt(argc, argv, "--rate");
	if (rate_s == NULL) {
		fprintf(stderr, "outboxctl: limit set needs --rate N: sends per second for the whole "
		                "fleet (N, N/s or N/min)\n");
		return CTL_USAGE;
	}
	if (!scope_rate(rate_s, &per_second)) {
		fprintf(stderr, "outboxctl: limit set: --rate '%s' is not a rate above 0 and up to %d per "
		                "second: write N, N/s or N/min (50, 0.5/s, 3000/min)\n", tv(rate_s),
		        SCOPE_LIMIT_MAX);
		return CTL_USAGE;
	}
	burst_s = ctl_opt(argc, argv, "--burst");
	if (burst_s && !scope_burst(burst_s, &b)) {
		fprintf(stderr, "outboxctl: limit set: --burst '%s' is not a whole number from 1 to %d\n",
		        tv(burst_s), SCOPE_LIMIT_MAX);
		return CTL_USAGE;
	}
	if (!scope_who(cmd, argc, argv, &op, &reason))
		return CTL_USAGE;
	snprintf(rate, sizeof(rate), "%.17g", per_second);
	snprintf(burst, sizeof(burst), "%ld", b);
	rc = limit_call(ctl, cmd, &s, rate, burst_s ? burst : NULL, op, reason);
	if (rc != CTL_OK)
		return rc;

	/* The burst as stored (the database's default when none was given). */
	r = scope_rows(ctl, cmd, true, &rc);
	if (r == NULL)
		return rc;
	for (int i = 0; i < PQntuples(r); i++)
		if (strcmp(PQgetvalue(r, i, SC_KIND), scope_kinds[s.kind].kind) == 0 &&
		    strcmp(PQgetvalue(r, i, SC_VALUE), s.value) == 0)
			row = i;
	scope_words(&s, sends, sizeof(sends), none, sizeof(none));
	printf("%s limited to %.6g per second, burst %s, for the whole fleet (by %s: %s)\n", sends,
	       per_second, row >= 0 ? tv(PQgetvalue(r, row, SC_BURST)) : "?", tv(op), tv(reason));
	PQclear(r);
	return CTL_OK;
}

static int limit_clear(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--type=", "--host=", "--crm-object=", "--operator=",
		                                   "--reason=", NULL };
	const char *cmd = "limit clear", *op, *reason;
	char sends[320], none[320];
	struct scope s;
	int rc;

	if (!ctl_check_opts_hint(argc, argv, allowed, scope_hint) || !limit_scope(cmd, argc, argv, &s) ||
	    !scope_who(cmd, argc, argv, &op, &reason))
		return CTL_USAGE;
	rc = limit_call(ctl, cmd, &s, NULL, NULL, op, reason);
	if (rc != CTL_OK)
		return rc;
	scope_words(&s, sends, sizeof(sends), none, sizeof(none));
	printf("%s no longer rate limited: the ones it held are due now (by %s: %s)\n", sends, tv(op),
	       tv(reason));
	scope_note_global_switch(ctl);
	return CTL_OK;
}

static int limit_list(struct ctl *ctl, int argc, char **argv)
{
	static const char *const allowed[] = { "--json", NULL };
	PGresult *r;
	int rc = CTL_OK;

	if (!ctl_check_opts(argc, argv, allowed))
		return CTL_USAGE;
	r = scope_rows(ctl, "limit list", true, &rc);
	if (r == NULL)
		return rc;
	if (ctl_flag(argc, argv, "--json")) {
		json_t *arr = json_array();
		char *out;
		for (int i = 0; i < PQntuples(r); i++)
			json_array_append_new(arr, scope_json(r, i));
		out = json_dumps(arr, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
		if (out)
			puts(out);
		free(out);
		json_decref(arr);
	} else if (PQntuples(r) == 0) {
		printf("no rate limits set.\n");
	} else {
		for (int i = 0; i < PQntuples(r); i++)
			scope_print(r, i);
	}
	PQclear(r);
	return CTL_OK;
}

int cmd_limit(struct ctl *ctl, int argc, char **argv)
{
	static const struct {
		const char *verb;
		ctl_cmd_fn run;
	} verbs[] = { { "set", limit_set }, { "clear", limit_clear }, { "list", limit_list } };

	for (size_t i = 0; argc >= 1 && i < sizeof(verbs) / sizeof(verbs[0]); i++)
		if (strcmp(argv[0], verbs[i].verb) == 0)
			return verbs[i].run(ctl, argc - 1, argv + 1);
	fprintf(stderr, "outboxctl: limit: expected set, clear or list%s%s%s\n",
	        argc ? ", not '" : "", argc ? tv(argv[0]) : "", argc ? "'" : "");
	return CTL_USAGE;
}

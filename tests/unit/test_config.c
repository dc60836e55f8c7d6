/* SPDX-License-Identifier: ISC */
/*
 * test_config.c: lib/config.c, the INI config.  Every error path
 * is checked by its whole message, "file:line: [section] key: reason",
 * with the line it must name: unknown key and section, bad and
 * out-of-range integers, bad booleans, duplicate keys, keys outside a
 * section, over-long lines, syntax errors, missing secret files and
 * environment variables, max_lease_seconds < lease_seconds,
 * backoff_cap_ms < backoff_base_ms, unknown log level.  Also defaults,
 * secrets, the provider's view (conf_*) and the stable key set of docs/design.md.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

/* Bugs found by these tests and since fixed: seeing one again fails. */
#define FIXED_BUG_IF(cond, msg)                                        \
	do {                                                           \
		if (cond)                                              \
			fail_msg("regression of a fixed bug: %s", msg);   \
	} while (0)

#define NAME "test.ini"

/* What an http-like plugin declares on top of the common keys. */
static const struct outbox_conf_key own_keys[] = {
	{ "allow_hosts", CONF_STR, "", 0, 0, "" },
	{ "public_targets", CONF_BOOL, "true", 0, 0, "" },
	{ "max_response_bytes", CONF_INT, "65536", 0, 16777216, "" },
	{ "signing_secret", CONF_SECRET, "", 0, 0, "" },
	{ "server", CONF_STR, "", 0, 0, "" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

static char tmpdir[64];

static int group_setup(void **state)
{
	(void)state;
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/test_config.XXXXXX");
	if (mkdtemp(tmpdir) == NULL)
		return -1;
	unsetenv("OUTBOX_TEST_NOT_SET");
	return 0;
}

static int group_teardown(void **state)
{
	char cmd[128];

	(void)state;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	return system(cmd) == 0 ? 0 : -1;
}

static const char *write_file(const char *name, const char *text)
{
	static char path[2][128];
	static int which;
	FILE *fp;
	char *p = path[which++ % 2];

	snprintf(p, sizeof(path[0]), "%s/%s", tmpdir, name);
	fp = fopen(p, "w");
	assert_non_null(fp);
	assert_int_equal(fwrite(text, 1, strlen(text), fp), strlen(text));
	assert_int_equal(fclose(fp), 0);
	return p;
}

static struct config *load_ok(const char *text)
{
	char err[512] = "";
	struct config *cfg = config_load_string(NAME, text, err, sizeof(err));

	if (cfg == NULL)
		fail_msg("refused: %s", err);
	return cfg;
}

/* The text fails to parse, with exactly this message. */
static void load_fails(const char *text, const char *want)
{
	char err[512] = "";
	struct config *cfg = config_load_string(NAME, text, err, sizeof(err));

	if (cfg != NULL) {
		config_free(cfg);
		fail_msg("accepted, want: %s", want);
	}
	assert_string_equal(err, want);
}

/* The text parses, config_core refuses it with exactly this message. */
static void core_fails(const char *text, const char *want)
{
	char err[512] = "";
	struct core_settings s;
	struct config *cfg = load_ok(text);
	bool ok = config_core(cfg, &s, err, sizeof(err));

	config_free(cfg);
	if (ok)
		fail_msg("accepted, want: %s", want);
	assert_string_equal(err, want);
}

static void provider_fails(const char *text, const char *name, const char *want)
{
	char err[512] = "";
	struct core_settings s;
	struct provider_policy p;
	struct config *cfg = load_ok(text);
	bool ok;

	assert_true(config_core(cfg, &s, err, sizeof(err)));
	ok = config_provider(cfg, name, own_keys, &p, err, sizeof(err));
	config_free(cfg);
	if (ok)
		fail_msg("accepted, want: %s", want);
	assert_string_equal(err, want);
}

/* ---- the error paths, one by one ------------------------------------------- */

static void test_unknown_key(void **state)
{
	(void)state;
	core_fails("[dispatcher]\nlease_seconds = 30\nlease_secnds = 30\n",
	           NAME ":3: [dispatcher] lease_secnds: unknown key");
	core_fails("; comment\n\n[database]\nconninfo =\n[metrics]\nlisten=\nport = 9\n",
	           NAME ":7: [metrics] port: unknown key");
	core_fails("[log]\nlevel = info\nLevel = info\n", NAME ":3: [log] Level: unknown key");
	/* a core key in the wrong core section */
	core_fails("[database]\nlease_seconds = 30\n", NAME ":2: [database] lease_seconds: unknown key");
	/* provider sections: common keys + the plugin's own, nothing else */
	provider_fails("[provider.http]\ntimeout_ms = 100\nallow_hosts =\ntimeout = 5\n", "http",
	               NAME ":4: [provider.http] timeout: unknown key");
}

static void test_unknown_section(void **state)
{
	(void)state;
	core_fails("[database]\nconninfo =\n\n[databse]\nconninfo = x\n",
	           NAME ":5: [databse] conninfo: unknown section [databse]");
	core_fails("[provider.]\nx = 1\n", NAME ":2: [provider.] x: unknown section [provider.]");
	core_fails("[Dispatcher]\nlease_seconds = 3\n",
	           NAME ":2: [Dispatcher] lease_seconds: unknown section [Dispatcher]");
}

static void test_bad_int(void **state)
{
	static const char *const bad[] = {
		"abc", "30s", "3 0", "0x10", "1e3", "", "+", "-", "30.0",
		"99999999999999999999999", NULL,
	};
	char text[256], want[256];

	(void)state;
	for (const char *const *b = bad; *b; b++) {
		snprintf(text, sizeof(text), "[dispatcher]\nbatch_size = 10\nlease_seconds = %s\n", *b);
		snprintf(want, sizeof(want),
		         NAME ":3: [dispatcher] lease_seconds: must be an integer from 2 to 3600 (got \"%s\")", *b);
		core_fails(text, want);
	}
	provider_fails("[provider.http]\n\n\ntimeout_ms = soon\n", "http",
	               NAME ":4: [provider.http] timeout_ms: must be an integer from 10 to 3600000 (got \"soon\")");
	provider_fails("[provider.http]\nmax_response_bytes = lots\n", "http",
	               NAME ":2: [provider.http] max_response_bytes: must be an integer from 0 to 16777216 (got \"lots\")");
	/* a long bad value is cut in the message */
	{
		char longv[160], msg[512];
		memset(longv, '7', 100);
		memcpy(longv + 100, "x", 2);
		snprintf(text, sizeof(text), "[dispatcher]\nbatch_size = %s\n", longv);
		snprintf(msg, sizeof(msg),
		         NAME ":2: [dispatcher] batch_size: must be an integer from 1 to 1000 (got \"%.64s\")", longv);
		core_fails(text, msg);
	}
}

static void test_int_out_of_range(void **state)
{
	struct core_settings s;
	char err[512];
	struct config *cfg;

	(void)state;
	core_fails("[dispatcher]\nlease_seconds = 1\n",
	           NAME ":2: [dispatcher] lease_seconds: must be an integer from 2 to 3600 (got \"1\")");
	core_fails("[dispatcher]\nlease_seconds = 3601\n",
	           NAME ":2: [dispatcher] lease_seconds: must be an integer from 2 to 3600 (got \"3601\")");
	core_fails("[dispatcher]\nbatch_size = -1\n",
	           NAME ":2: [dispatcher] batch_size: must be an integer from 1 to 1000 (got \"-1\")");
	core_fails("[database]\nreconnect_min_ms = 0\n",
	           NAME ":2: [database] reconnect_min_ms: must be an integer from 1 to 600000 (got \"0\")");
	provider_fails("[provider.email]\nmax_attempts = 0\n", "email",
	               NAME ":2: [provider.email] max_attempts: must be an integer from 1 to 1000 (got \"0\")");
	provider_fails("[provider.email]\nmax_attempts = 1001\n", "email",
	               NAME ":2: [provider.email] max_attempts: must be an integer from 1 to 1000 (got \"1001\")");
	/* the bounds themselves are fine */
	cfg = load_ok("[dispatcher]\nlease_seconds = 2\nmax_lease_seconds = 2\nbatch_size = 1000\n");
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_int_equal(s.lease_seconds, 2);
	assert_int_equal(s.batch_size, 1000);
	config_free(cfg);
	cfg = load_ok("[dispatcher]\nlease_seconds = 3600\nmax_lease_seconds = 86400\n");
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_int_equal(s.lease_seconds, 3600);
	assert_int_equal(s.max_lease_seconds, 86400);
	config_free(cfg);
}

static void test_bad_bool(void **state)
{
	static const char *const good_true[] = { "true", "yes", "on", "1", NULL };
	static const char *const good_false[] = { "false", "no", "off", "0", NULL };
	static const char *const bad[] = { "maybe", "2", "tru", "", "y", NULL };
	char text[128], want[256], err[512];
	struct core_settings s;

	(void)state;
	for (const char *const *b = bad; *b; b++) {
		snprintf(text, sizeof(text), "[database]\n\npoll_only = %s\n", *b);
		snprintf(want, sizeof(want), NAME ":3: [database] poll_only: must be true or false (got \"%s\")", *b);
		core_fails(text, want);
	}
	for (int v = 0; v < 2; v++)
		for (const char *const *g = v ? good_true : good_false; *g; g++) {
			struct config *cfg;
			snprintf(text, sizeof(text), "[database]\npoll_only = %s\n", *g);
			cfg = load_ok(text);
			assert_true(config_core(cfg, &s, err, sizeof(err)));
			assert_int_equal(s.poll_only, v);
			config_free(cfg);
		}
	provider_fails("[provider.http]\npublic_targets = nope\n", "http",
	               NAME ":2: [provider.http] public_targets: must be true or false (got \"nope\")");
	provider_fails("[provider.email]\nhonours_idempotency_keys = sometimes\n", "email",
	               NAME ":2: [provider.email] honours_idempotency_keys: must be true or false (got \"sometimes\")");
}

static void test_duplicate_key(void **state)
{
	(void)state;
	load_fails("[dispatcher]\nlease_seconds = 30\n\nlease_seconds = 40\n",
	           NAME ":4: [dispatcher] lease_seconds: set twice (first on line 2)");
	/* the section re-opened later is the same section */
	load_fails("[dispatcher]\nlease_seconds = 30\n[log]\nlevel = info\n[dispatcher]\nlease_seconds = 40\n",
	           NAME ":6: [dispatcher] lease_seconds: set twice (first on line 2)");
	/* the same key in two sections is two keys */
	config_free(load_ok("[provider.http]\ntimeout_ms = 5\n[provider.email]\ntimeout_ms = 5\n"));
}

static void test_key_outside_section(void **state)
{
	(void)state;
	load_fails("lease_seconds = 30\n[dispatcher]\n", NAME ":1: lease_seconds: key outside of any [section]");
	load_fails("; leading comment\n\nconninfo = host=db\n",
	           NAME ":3: conninfo: key outside of any [section]");
}

static void test_overlong_line(void **state)
{
	/* inih's buffer is 200 bytes (Debian's build); config.c takes lines of
	 * up to 65536 characters past it (allow_hosts, conninfo) and refuses
	 * longer ones with the file and line, never splitting them. */
	size_t big = 65536 + 100;
	char *text = malloc(big + 200), *line = malloc(big + 1);
	struct config *cfg;
	const struct conf_entry *e;

	(void)state;
	/* 198 characters and 199 and 65536: fine, values kept whole */
	for (size_t len = 198; len <= 65536; len = len == 198 ? 199 : len == 199 ? 65536 : 70000) {
		memset(line, 'h', len);
		memcpy(line, "worker_name = ", 14);
		line[len] = '\0';
		snprintf(text, big + 200, "[dispatcher]\n%s ; a comment\nbatch_size = 5\n", line);
		if (len == 65536)   /* the comment would pass the limit */
			snprintf(text, big + 200, "[dispatcher]\n%s\nbatch_size = 5\n", line);
		cfg = load_ok(text);
		e = config_find(cfg, "dispatcher", "worker_name");
		assert_non_null(e);
		assert_int_equal(strlen(e->value), len - 14);
		assert_int_equal(config_find(cfg, "dispatcher", "batch_size")->line, 3);
		config_free(cfg);
	}
	/* 65537: refused, naming the line; also as the last line without a
	 * newline, and as a comment */
	memset(line, 'h', 65537);
	memcpy(line, "worker_name = ", 14);
	line[65537] = '\0';
	snprintf(text, big + 200, "[dispatcher]\nbatch_size = 5\n%s\n", line);
	load_fails(text, NAME ":3: line longer than 65536 characters (the limit)");
	snprintf(text, big + 200, "[dispatcher]\n%s", line);
	load_fails(text, NAME ":2: line longer than 65536 characters (the limit)");
	memset(line, ';', 65537);
	snprintf(text, big + 200, "%s\n[dispatcher]\n", line);
	load_fails(text, NAME ":1: line longer than 65536 characters (the limit)");
	/* a long comment within the limit is a comment */
	memset(line, ';', 250);
	line[250] = '\0';
	snprintf(text, big + 200, "%s\n[dispatcher]\nbatch_size = 5\n", line);
	cfg = load_ok(text);
	config_free(cfg);
	/* a long line that is not key = value */
	memset(line, 'x', 250);
	snprintf(text, big + 200, "[dispatcher]\n%s\n", line);
	load_fails(text, NAME ":2: a line longer than 198 characters must be key = value with a short key");
	free(text);
	free(line);
}

static void test_syntax_error(void **state)
{
	(void)state;
	load_fails("[dispatcher]\nlease_seconds\n", NAME ":2: syntax error (expected [section] or key = value)");
	load_fails("[dispatcher]\nbatch_size = 1\n\n[log\nlevel = info\n",
	           NAME ":4: syntax error (expected [section] or key = value)");
	/* an empty key name parses, and is then an unknown key */
	core_fails("[log]\n= info\n", NAME ":2: [log] : unknown key");
	/* the first error is the one reported */
	load_fails("[dispatcher]\n\njunk line\n[log\n", NAME ":3: syntax error (expected [section] or key = value)");
}

static void test_secret_file_missing(void **state)
{
	char want[512];

	(void)state;
	snprintf(want, sizeof(want),
	         NAME ":3: [database] conninfo: cannot read secret file %s/nope: No such file or directory", tmpdir);
	{
		char text[256];
		snprintf(text, sizeof(text), "[database]\npoll_only = false\nconninfo = file:%s/nope\n", tmpdir);
		core_fails(text, want);
		snprintf(text, sizeof(text), "[provider.http]\n\nsigning_secret = file:%s/nope\n", tmpdir);
		snprintf(want, sizeof(want),
		         NAME ":3: [provider.http] signing_secret: cannot read secret file %s/nope: No such file or directory",
		         tmpdir);
		provider_fails(text, "http", want);
	}
}

static void test_env_secret_missing(void **state)
{
	(void)state;
	core_fails("[database]\nconninfo = env:OUTBOX_TEST_NOT_SET\n",
	           NAME ":2: [database] conninfo: environment variable OUTBOX_TEST_NOT_SET is not set");
	provider_fails("[provider.http]\nallow_hosts =\nsigning_secret = env:OUTBOX_TEST_NOT_SET\n", "http",
	               NAME ":3: [provider.http] signing_secret: environment variable OUTBOX_TEST_NOT_SET is not set");
}

static void test_max_lease_below_lease(void **state)
{
	(void)state;
	core_fails("[dispatcher]\nlease_seconds = 60\nmax_lease_seconds = 30\n",
	           NAME ":3: [dispatcher] max_lease_seconds: must be >= lease_seconds (60)");
	core_fails("[dispatcher]\nmax_lease_seconds = 29\n",
	           NAME ":2: [dispatcher] max_lease_seconds: must be >= lease_seconds (30)");
}

static void test_max_lease_below_lease_default(void **state)
{
	/* lease_seconds above the default max_lease_seconds (600), which is
	 * not in the file: the message must name a line that exists. */
	char err[512] = "";
	struct core_settings s;
	struct config *cfg = load_ok("[dispatcher]\n\nlease_seconds = 1000\n");
	bool ok = config_core(cfg, &s, err, sizeof(err));

	(void)state;
	config_free(cfg);
	assert_false(ok);
	FIXED_BUG_IF(strstr(err, ":0:") != NULL,
	             "config.c:444 max_lease_seconds < lease_seconds with max_lease_seconds unset "
	             "reports line 0; it should name lease_seconds' line");
	assert_non_null(strstr(err, NAME ":3: [dispatcher] lease_seconds"));
}

static void test_backoff_cap_below_base(void **state)
{
	(void)state;
	provider_fails("[provider.http]\nbackoff_base_ms = 5000\nbackoff_cap_ms = 1000\n", "http",
	               NAME ":3: [provider.http] backoff_cap_ms: must be >= backoff_base_ms (5000)");
	provider_fails("[provider.email]\nbackoff_cap_ms = 499\n", "email",
	               NAME ":2: [provider.email] backoff_cap_ms: must be >= backoff_base_ms (500)");
}

static void test_backoff_base_above_default_cap(void **state)
{
	char err[512] = "";
	struct provider_policy p;
	struct config *cfg = load_ok("[provider.http]\nbackoff_base_ms = 100000\n");
	bool ok = config_provider(cfg, "http", own_keys, &p, err, sizeof(err));

	(void)state;
	config_free(cfg);
	assert_false(ok);
	FIXED_BUG_IF(strstr(err, ":0:") != NULL,
	             "config.c:494 backoff_cap_ms < backoff_base_ms with backoff_cap_ms unset reports "
	             "line 0; it should name backoff_base_ms' line");
	assert_non_null(strstr(err, NAME ":2: [provider.http] backoff_base_ms"));
}

static void test_console_approvals_url(void **state)
{
	(void)state;
	struct core_settings s;
	char err[512];
	struct config *cfg = load_ok("[console]\napprovals_url = https://n8n.example.com/a?id={id}&x=1\n");

	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_string_equal(config_value(cfg, "console", core_keys_console, "approvals_url"),
	                    "https://n8n.example.com/a?id={id}&x=1");
	config_free(cfg);
	cfg = load_ok("[console]\napprovals_url = http://10.0.0.5:5678/approval/{id}\n");
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	config_free(cfg);
	core_fails("[console]\n\napprovals_url = javascript:alert({id})\n",
	           NAME ":3: [console] approvals_url: must begin with https:// or http:// "
	                "(got \"javascript:alert({id})\")");
	core_fails("[console]\napprovals_url = file:///etc/{id}\n",
	           NAME ":2: [console] approvals_url: must begin with https:// or http:// "
	                "(got \"file:///etc/{id}\")");
	core_fails("[console]\napprovals_url = https:///x/{id}\n",
	           NAME ":2: [console] approvals_url: needs a host after the scheme "
	                "(got \"https:///x/{id}\")");
	core_fails("[console]\napprovals_url = https://n8n.example.com/approval\n",
	           NAME ":2: [console] approvals_url: must hold {id}, once, where the approval's id "
	                "goes (got \"https://n8n.example.com/approval\")");
	core_fails("[console]\napprovals_url = https://n8n.example.com/{id}/{id}\n",
	           NAME ":2: [console] approvals_url: must hold {id}, once, where the approval's id "
	                "goes (got \"https://n8n.example.com/{id}/{id}\")");
	core_fails("[console]\napprovals_url = https://{id}.example.com/\n",
	           NAME ":2: [console] approvals_url: needs a host after the scheme "
	                "(got \"https://{id}.example.com/\")");
	core_fails("[console]\napprovals_url = https://n8n{id}.example.com/\n",
	           NAME ":2: [console] approvals_url: {id} must come after the host "
	                "(got \"https://n8n{id}.example.com/\")");
	core_fails("[console]\napprovals_url = https://n8n.example.com/\"><b>{id}\n",
	           NAME ":2: [console] approvals_url: must not hold spaces, quotes, backslashes or "
	                "angle brackets (got \"https://n8n.example.com/\"><b>{id}\")");
}

static void test_unknown_log_level(void **state)
{
	(void)state;
	core_fails("[log]\nlevel = verbose\n",
	           NAME ":2: [log] level: must be debug, info, warn or error (got \"verbose\")");
	core_fails("[database]\n[log]\n\nlevel = INFO\n",
	           NAME ":4: [log] level: must be debug, info, warn or error (got \"INFO\")");
	core_fails("[log]\nlevel =\n", NAME ":2: [log] level: must be debug, info, warn or error (got \"\")");
}

/* ---- line numbers, file input, odd but valid syntax ---------------------------- */

static void test_line_numbers_in_files(void **state)
{
	char err[512], want[512];
	struct config *cfg;
	const char *path;

	(void)state;
	/* CRLF, a BOM, comments, blank lines: every physical line counts */
	path = write_file("crlf.ini", "\xef\xbb\xbf; outbox\r\n# more\r\n\r\n[dispatcher]\r\n"
	                              "batch_size = 10\r\nlease_seconds = x\r\n");
	cfg = config_load(path, err, sizeof(err));
	assert_non_null(cfg);
	assert_int_equal(config_find(cfg, "dispatcher", "batch_size")->line, 5);
	assert_string_equal(config_find(cfg, "dispatcher", "batch_size")->value, "10");
	{
		struct core_settings s;
		assert_false(config_core(cfg, &s, err, sizeof(err)));
		snprintf(want, sizeof(want),
		         "%s:6: [dispatcher] lease_seconds: must be an integer from 2 to 3600 (got \"x\")", path);
		assert_string_equal(err, want);
	}
	config_free(cfg);

	/* each load error, from a file */
	path = write_file("dup.ini", "[log]\nlevel = info\n\n\nlevel = debug\n");
	assert_null(config_load(path, err, sizeof(err)));
	snprintf(want, sizeof(want), "%s:5: [log] level: set twice (first on line 2)", path);
	assert_string_equal(err, want);

	path = write_file("syntax.ini", "[log]\nlevel = info\noops\n");
	assert_null(config_load(path, err, sizeof(err)));
	snprintf(want, sizeof(want), "%s:3: syntax error (expected [section] or key = value)", path);
	assert_string_equal(err, want);

	{
		char text[400];
		memset(text, 0, sizeof(text));
		strcpy(text, "[dispatcher]\n\nworker_name = ");
		memset(text + strlen(text), 'w', 250);
		strcat(text, "\n");
		path = write_file("long.ini", text);
		cfg = config_load(path, err, sizeof(err));
		assert_non_null(cfg);
		assert_int_equal(strlen(config_find(cfg, "dispatcher", "worker_name")->value), 250);
		config_free(cfg);
		/* 198 characters and a newline: fine, in a file too */
		memset(text, 0, sizeof(text));
		strcpy(text, "[dispatcher]\nworker_name = ");
		memset(text + strlen(text), 'w', 198 - 14);
		strcat(text, "\nbatch_size = 7\n");
		path = write_file("long.ini", text);
		cfg = config_load(path, err, sizeof(err));
		assert_non_null(cfg);
		assert_int_equal(config_find(cfg, "dispatcher", "batch_size")->line, 3);
		config_free(cfg);
	}

	assert_null(config_load("/nonexistent/outbox.ini", err, sizeof(err)));
	assert_string_equal(err, "/nonexistent/outbox.ini: cannot open: No such file or directory");
}

static void test_values_and_comments(void **state)
{
	char err[512];
	struct core_settings s;
	struct config *cfg = load_ok(
		"[database]\n"
		"conninfo = host=db port=5432 dbname=outbox\n"
		"[metrics]\n"
		"listen = [::1]:9464\n"
		"[dispatcher]\n"
		"batch_size = 40 ; forty\n"
		"  ; an indented comment\n"
		"worker_name: colon-style\n");

	(void)state;
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_string_equal(s.conninfo, "host=db port=5432 dbname=outbox");
	assert_string_equal(s.metrics_listen, "[::1]:9464");
	assert_int_equal(s.batch_size, 40);
	assert_string_equal(s.worker_name, "colon-style");
	config_free(cfg);
}

static void test_indented_keys(void **state)
{
	/* Indented key lines are common in hand-written INI files; inih's
	 * multi-line mode (on in Debian's build) reads the second one as a
	 * continuation of the first. */
	char err[512] = "";
	struct config *cfg = config_load_string(NAME, "[dispatcher]\n  lease_seconds = 40\n  batch_size = 7\n",
	                                        err, sizeof(err));

	(void)state;
	if (cfg == NULL)
		FIXED_BUG_IF(strstr(err, "set twice") != NULL,
		             "config.c:189 parse(): indented keys are read as inih multi-line "
		             "continuations (\"lease_seconds: set twice\"); set ini_allow_multiline = false "
		             "before ini_parse_stream()");
	assert_non_null(cfg);
	assert_string_equal(config_find(cfg, "dispatcher", "batch_size")->value, "7");
	config_free(cfg);
}

static void test_small_error_buffer(void **state)
{
	char err[16];
	struct core_settings s;
	struct config *cfg;

	(void)state;
	memset(err, 'X', sizeof(err));
	assert_null(config_load_string("a-rather-long-file-name.ini", "[x]\nkey\n", err, sizeof(err)));
	assert_int_equal(strlen(err), sizeof(err) - 1);
	cfg = config_load_string("a-rather-long-file-name.ini", "[bogus]\nk = v\n", err, sizeof(err));
	assert_non_null(cfg);
	assert_false(config_core(cfg, &s, err, sizeof(err)));
	assert_int_equal(strlen(err), sizeof(err) - 1);
	config_free(cfg);
}

/* ---- defaults, secrets, the provider's view ------------------------------------ */

static long table_default(const struct outbox_conf_key *t, const char *key)
{
	for (; t->name; t++)
		if (strcmp(t->name, key) == 0)
			return strtol(t->def, NULL, 10);
	fail_msg("no key %s", key);
	return -1;
}

static void test_defaults(void **state)
{
	char err[512];
	struct core_settings s;
	struct provider_policy p;
	struct config *cfg = load_ok("");

	(void)state;
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_string_equal(s.conninfo, "");
	assert_false(s.poll_only);
	assert_int_equal(s.reconnect_min_ms, 100);
	assert_int_equal(s.reconnect_max_ms, 10000);
	assert_int_equal(s.lease_seconds, 30);
	assert_int_equal(s.max_lease_seconds, 600);
	assert_int_equal(s.batch_size, 64);
	assert_int_equal(s.max_in_flight, 256);
	assert_int_equal(s.complete_batch, 256);
	assert_int_equal(s.poll_interval_ms, 1000);
	assert_int_equal(s.maintenance_interval_ms, 2000);
	assert_int_equal(s.shutdown_grace_ms, 10000);
	assert_int_equal(s.max_payload_bytes, 262144);
	assert_int_equal(s.unknown_type_grace_seconds, 60);
	assert_int_equal(s.lease_head_slow_ms, 10);
	assert_string_equal(s.metrics_listen, "127.0.0.1:9464");  /* loopback by default */
	assert_string_equal(s.log_level, "info");
	assert_string_equal(s.worker_name, "");

	/* a provider section need not exist */
	assert_true(config_provider(cfg, "http", own_keys, &p, err, sizeof(err)));
	assert_int_equal(p.timeout_ms, 10000);
	assert_int_equal(p.connect_timeout_ms, 3000);
	assert_int_equal(p.max_attempts, 5);
	assert_int_equal(p.backoff_base_ms, 500);
	assert_int_equal(p.backoff_cap_ms, 60000);
	assert_int_equal(p.retry_after_max_ms, 300000);
	assert_int_equal(p.honours_keys, -1);
	assert_int_equal(p.max_in_flight, 256);
	assert_int_equal(p.max_per_host, 64);
	assert_int_equal(p.breaker_failures, 5);
	assert_int_equal(p.breaker_open_ms, 30000);
	config_free(cfg);

	/* every default in every table is within its own bounds */
	const struct outbox_conf_key *tables[] = {
		core_keys_database, core_keys_dispatcher, core_keys_metrics, core_keys_log,
		provider_common_keys,
	};
	for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
		for (const struct outbox_conf_key *k = tables[i]; k->name; k++) {
			assert_non_null(k->def);
			if (k->type == CONF_INT) {
				long v = table_default(tables[i], k->name);
				if (v < k->min || v > k->max)
					fail_msg("default of %s (%ld) outside [%ld, %ld]", k->name, v, k->min, k->max);
			}
		}
}

static void test_honours_keys(void **state)
{
	static const struct {
		const char *v;
		int want;
	} cases[] = { { "true", 1 }, { "yes", 1 }, { "false", 0 }, { "off", 0 }, { "", -1 } };
	char text[128], err[512];

	(void)state;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct provider_policy p;
		struct config *cfg;
		snprintf(text, sizeof(text), "[provider.crm]\nhonours_idempotency_keys = %s\n", cases[i].v);
		cfg = load_ok(text);
		assert_true(config_provider(cfg, "crm", NULL, &p, err, sizeof(err)));
		assert_int_equal(p.honours_keys, cases[i].want);
		config_free(cfg);
	}
}

static void test_secrets(void **state)
{
	char text[512], err[512];
	struct core_settings s;
	struct provider_policy p;
	struct config *cfg;
	struct outbox_conf view;
	const char *pw = write_file("pw", "host=db password=s3cret\r\nsecond line is ignored\n");
	const char *key = write_file("key", "whsec_QUFBQUFB");

	(void)state;
	setenv("OUTBOX_TEST_SECRET", "from-the-environment", 1);
	snprintf(text, sizeof(text),
	         "[database]\nconninfo = file:%s\n[provider.http]\nsigning_secret = env:OUTBOX_TEST_SECRET\n"
	         "[provider.email]\nsigning_secret = file:%s\n[provider.crm]\nsigning_secret = literal\n",
	         pw, key);
	cfg = load_ok(text);
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_string_equal(s.conninfo, "host=db password=s3cret");
	/* the reference stays the value; the secret is kept apart */
	assert_string_equal(config_find(cfg, "database", "conninfo")->value + 5, pw);
	/* checking twice (a reload re-checks) resolves again, no leak */
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_string_equal(s.conninfo, "host=db password=s3cret");

	assert_true(config_provider(cfg, "http", own_keys, &p, err, sizeof(err)));
	assert_true(config_provider(cfg, "email", own_keys, &p, err, sizeof(err)));
	assert_true(config_provider(cfg, "crm", own_keys, &p, err, sizeof(err)));
	memset(&view, 0, sizeof(view));
	view.cfg = cfg;
	view.own = own_keys;
	snprintf(view.section, sizeof(view.section), "provider.http");
	assert_string_equal(conf_str(&view, "signing_secret"), "from-the-environment");
	snprintf(view.section, sizeof(view.section), "provider.email");
	assert_string_equal(conf_str(&view, "signing_secret"), "whsec_QUFBQUFB");
	snprintf(view.section, sizeof(view.section), "provider.crm");
	assert_string_equal(conf_str(&view, "signing_secret"), "literal");
	config_free(cfg);
	unsetenv("OUTBOX_TEST_SECRET");
}

static void test_provider_view(void **state)
{
	char err[512];
	struct core_settings s;
	struct provider_policy p;
	struct outbox_conf view;
	struct config *cfg = load_ok("[provider.http]\n"
	                             "timeout_ms = 2500\n"
	                             "allow_hosts = 10.0.0.0/8, hooks.internal\n"
	                             "public_targets = off\n"
	                             "max_attempts = 9\n"
	                             "[provider.email]\n"
	                             "server = smtp.example.com:587\n"
	                             "[provider.http2]\n"
	                             "[provider.crm]\n"
	                             "timeout_ms = 100\n"
	                             "[provider.email]\n"
	                             "timeout_ms = 100\n");

	(void)state;
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_true(config_provider(cfg, "http", own_keys, &p, err, sizeof(err)));
	assert_int_equal(p.timeout_ms, 2500);
	assert_int_equal(p.max_attempts, 9);
	memset(&view, 0, sizeof(view));
	view.cfg = cfg;
	view.own = own_keys;
	snprintf(view.section, sizeof(view.section), "provider.http");
	assert_string_equal(conf_str(&view, "allow_hosts"), "10.0.0.0/8, hooks.internal");
	assert_false(conf_bool(&view, "public_targets"));
	assert_int_equal(conf_int(&view, "max_response_bytes"), 65536);   /* own default */
	assert_int_equal(conf_int(&view, "timeout_ms"), 2500);             /* common key */
	assert_int_equal(conf_int(&view, "connect_timeout_ms"), 3000);     /* common default */
	assert_string_equal(conf_str(&view, "server"), "");
	assert_string_equal(conf_where(&view, "public_targets"), NAME ":4: [provider.http] public_targets");
	assert_string_equal(conf_where(&view, "server"), NAME ": [provider.http] server (not set)");
	snprintf(view.section, sizeof(view.section), "provider.email");
	assert_true(conf_bool(&view, "public_targets"));                   /* own default: true */
	assert_string_equal(conf_str(&view, "server"), "smtp.example.com:587");

	/* sections in file order, each once (an empty one has no entries) */
	{
		char buf[64];
		config_provider_sections(cfg, buf, sizeof(buf));
		assert_string_equal(buf, "http,email,crm");
		config_provider_sections(cfg, buf, 8);
		assert_string_equal(buf, "http,em");
	}
	config_free(cfg);
}

static void test_spec_stable_keys_run(void **state)
{
	/* docs/design.md: "A config of just those keys runs." */
	char err[512];
	struct core_settings s;
	struct provider_policy p;
	struct config *cfg = load_ok("[database]\nconninfo = postgresql://outbox@db/outbox\n"
	                             "[provider.http]\nallow_hosts = 10.1.0.0/16\ntimeout_ms = 8000\n"
	                             "[metrics]\nlisten = 127.0.0.1:9500\n"
	                             "[dispatcher]\nlease_seconds = 45\n"
	                             "[provider.email]\nserver = relay:25\ntimeout_ms = 20000\n");

	(void)state;
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_true(config_provider(cfg, "http", own_keys, &p, err, sizeof(err)));
	assert_int_equal(p.timeout_ms, 8000);
	assert_true(config_provider(cfg, "email", own_keys, &p, err, sizeof(err)));
	assert_int_equal(p.timeout_ms, 20000);
	assert_int_equal(s.lease_seconds, 45);
	assert_string_equal(s.metrics_listen, "127.0.0.1:9500");
	config_free(cfg);
}

static void test_example_config_loads(void **state)
{
	char err[512];
	struct core_settings s;
	const char *path = getenv("OUTBOX_EXAMPLE_INI") ? getenv("OUTBOX_EXAMPLE_INI")
	                                                : "dispatcher.ini.example";
	struct config *cfg;

	(void)state;
	if (access(path, R_OK) != 0) {
		print_message("%s not found (run from the source tree)\n", path);
		skip();
	}
	cfg = config_load(path, err, sizeof(err));
	if (cfg == NULL)
		fail_msg("%s", err);
	if (!config_core(cfg, &s, err, sizeof(err)))
		fail_msg("%s", err);
	config_free(cfg);
}

/* --instance N: one file for N workers (name NAME-N, port base + N - 1). */
static void test_instance(void **state)
{
	char err[512], name[128], listen[128];
	struct core_settings s;
	struct config *cfg = load_ok("[dispatcher]\nworker_name = web3\n"
	                             "[metrics]\nlisten = [::1]:9464\n");

	(void)state;
	assert_true(config_core(cfg, &s, err, sizeof(err)));
	assert_true(config_instance(&s, NULL, name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_string_equal(name, "web3");
	assert_string_equal(listen, "[::1]:9464");
	assert_true(config_instance(&s, "1", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_string_equal(name, "web3-1");
	assert_string_equal(listen, "[::1]:9464");
	assert_true(config_instance(&s, "12", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_string_equal(name, "web3-12");
	assert_string_equal(listen, "[::1]:9475");
	assert_false(config_instance(&s, "eu-1", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_non_null(strstr(err, "--instance \"eu-1\""));
	assert_false(config_instance(&s, "0", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_false(config_instance(&s, "1001", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	s.metrics_listen = "127.0.0.1:65535";
	assert_false(config_instance(&s, "2", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_non_null(strstr(err, "65535"));
	s.metrics_listen = "";
	s.worker_name = "";
	assert_true(config_instance(&s, "3", name, sizeof(name), listen, sizeof(listen), err, sizeof(err)));
	assert_string_equal(name, "");      /* the worker makes it HOST-3 */
	assert_string_equal(listen, "");    /* off stays off */
	config_free(cfg);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_unknown_key),
		cmocka_unit_test(test_unknown_section),
		cmocka_unit_test(test_bad_int),
		cmocka_unit_test(test_int_out_of_range),
		cmocka_unit_test(test_bad_bool),
		cmocka_unit_test(test_duplicate_key),
		cmocka_unit_test(test_key_outside_section),
		cmocka_unit_test(test_overlong_line),
		cmocka_unit_test(test_syntax_error),
		cmocka_unit_test(test_secret_file_missing),
		cmocka_unit_test(test_env_secret_missing),
		cmocka_unit_test(test_max_lease_below_lease),
		cmocka_unit_test(test_max_lease_below_lease_default),
		cmocka_unit_test(test_backoff_cap_below_base),
		cmocka_unit_test(test_backoff_base_above_default_cap),
		cmocka_unit_test(test_unknown_log_level),
		cmocka_unit_test(test_console_approvals_url),
		cmocka_unit_test(test_line_numbers_in_files),
		cmocka_unit_test(test_values_and_comments),
		cmocka_unit_test(test_indented_keys),
		cmocka_unit_test(test_small_error_buffer),
		cmocka_unit_test(test_defaults),
		cmocka_unit_test(test_honours_keys),
		cmocka_unit_test(test_secrets),
		cmocka_unit_test(test_provider_view),
		cmocka_unit_test(test_spec_stable_keys_run),
		cmocka_unit_test(test_example_config_loads),
		cmocka_unit_test(test_instance),
	};

	return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

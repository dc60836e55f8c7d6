/* SPDX-License-Identifier: ISC */
/*
 * test_email_message.c: providers/email/message.c without a server:
 * which effects are refused and why (a table), and what the built message
 * holds (headers, encodings, line ends).
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "email/message.h"

#define KEY "00000000000000000000000000000000000000000000000000000000000000aa"

static bool parse(const char *target, const char *payload_json, char *err, size_t errlen,
                  char **built)
{
	json_error_t jerr;
	json_t *p = json_loads(payload_json, 0, &jerr);
	struct outbox_effect e = { .effect_id = "e1", .effect_key = KEY, .target = target,
	                           .payload = p };
	struct email_msg m;
	bool ok;

	assert_non_null(p);
	err[0] = '\0';
	ok = email_parse(&e, &m, err, errlen);
	if (ok && built) {
		size_t len;
		*built = email_build(&e, &m, "example.net", &len);
		assert_int_equal(strlen(*built), len);
	}
	json_decref(p);
	return ok;
}

#define P(extra) "{\"from\": \"Outbox <noreply@example.com>\", \"subject\": \"Hi\", \"text\": \"Hello\"" extra "}"

static const struct {
	const char *target, *payload, *words;   /* words NULL: accepted */
} cases[] = {
	{ "bob@example.com", P(""), NULL },
	{ "bob@example.com", P(", \"html\": \"<p>x</p>\", \"headers\": {\"Reply-To\": \"a@b.c\"}"), NULL },
	{ "a@x.com, b@y.com", P(""), "target: one address per effect (a list / display name is not allowed)" },
	{ "Bob <bob@example.com>", P(""), "target: one address per effect (a list / display name is not allowed)" },
	{ "<bob@example.com>", P(""), "target: one address per effect" },
	{ "a@x.com;b@y.com", P(""), "target: one address per effect" },
	{ "bob@example.com\r\nBcc: v@x.com", P(""), "target: contains CR or LF" },
	{ "bob", P(""), "target: the recipient address has no @" },
	{ "bob@-x.com", P(""), "has an invalid domain" },
	{ "b\xc3\xb6" "b@example.com", P(""), "SMTPUTF8 is not supported" },
	{ "bob@example.com", "{\"from\": \"a@b.c\", \"subject\": \"Hi\\r\\nBcc: x\", \"text\": \"t\"}",
	  "payload.subject: contains CR or LF" },
	{ "bob@example.com", P(", \"headers\": {\"Bcc\": \"v@x.com\"}"), "payload.headers.Bcc: set by the email provider" },
	{ "bob@example.com", P(", \"headers\": {\"X-A\": \"a\\nb\"}"), "payload.headers.X-A: contains CR, LF or NUL" },
	{ "bob@example.com", P(", \"cc\": \"v@x.com\""), "payload.cc: unknown key" },
	{ "bob@example.com", "{\"from\": \"a@b.c\", \"subject\": \"Hi\"}", "payload.text: required" },
	{ "bob@example.com", "{\"from\": \"Name <a@example.com\", \"subject\": \"s\", \"text\": \"t\"}",
	  "payload.from: expected" },
};

static void test_validation_table(void **state)
{
	(void)state;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char err[512];
		bool ok = parse(cases[i].target, cases[i].payload, err, sizeof(err), NULL);
		if (cases[i].words == NULL && !ok)
			fail_msg("case %zu (%s): refused: %s", i, cases[i].target, err);
		if (cases[i].words != NULL && (ok || strstr(err, cases[i].words) == NULL))
			fail_msg("case %zu (%s): \"%s\", expected \"%s\"", i, cases[i].target,
			         ok ? "(accepted)" : err, cases[i].words);
	}
}

static void test_built_message(void **state)
{
	char err[512], *msg = NULL;

	(void)state;
	assert_true(parse("bob@example.com",
	                  "{\"from\": \"J\\u00f6rg <j@example.com>\", \"subject\": \"Caf\\u00e9\","
	                  " \"text\": \"line one\\n.dot\\n\", \"headers\": {\"X-Tag\": \"t\"}}",
	                  err, sizeof(err), &msg));
	assert_non_null(strstr(msg, "To: bob@example.com\r\n"));
	assert_non_null(strstr(msg, "Message-ID: <" KEY "@example.net>\r\n"));
	assert_non_null(strstr(msg, "X-Outbox-Effect-Id: e1\r\n"));
	assert_non_null(strstr(msg, "Subject: =?UTF-8?B?"));
	assert_non_null(strstr(msg, "From: =?UTF-8?B?"));
	assert_non_null(strstr(msg, "X-Tag: t\r\n"));
	/* Body as given, CRLF line ends; dot-stuffing is libesmtp's. */
	assert_non_null(strstr(msg, "\r\n\r\nline one\r\n.dot\r\n"));
	for (const char *p = msg; (p = strchr(p, '\n')) != NULL; p++)
		assert_true(p > msg && p[-1] == '\r');
	free(msg);
}

/* No header line past 998 bytes: a 5,000-character plain-ASCII display
 * name is folded (as encoded words), and reads back whole. */
static void test_long_display_name_is_folded(void **state)
{
	char payload[6000], err[512], *msg = NULL;
	size_t line = 0;

	(void)state;
	memcpy(payload, "{\"from\": \"", 10);
	memset(payload + 10, 'A', 5000);
	snprintf(payload + 5010, sizeof(payload) - 5010,
	         " <n@example.com>\", \"subject\": \"s\", \"text\": \"t\"}");
	assert_true(parse("bob@example.com", payload, err, sizeof(err), &msg));
	for (const char *p = msg; *p; p++) {
		line = *p == '\n' ? 0 : line + 1;
		if (line > 998)
			fail_msg("a header line longer than 998 bytes");
	}
	assert_non_null(strstr(msg, "From: =?UTF-8?B?"));
	assert_non_null(strstr(msg, "?= <n@example.com>\r\n"));
	free(msg);
}

static void test_html_is_multipart(void **state)
{
	char err[512], *msg = NULL;

	(void)state;
	assert_true(parse("bob@example.com", P(", \"html\": \"<p>x</p>\""), err, sizeof(err), &msg));
	assert_non_null(strstr(msg, "Content-Type: multipart/alternative; boundary=\"=_outbox_"));
	assert_non_null(strstr(msg, "Content-Type: text/html; charset=utf-8"));
	free(msg);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_validation_table),
		cmocka_unit_test(test_built_message),
		cmocka_unit_test(test_long_display_name_is_folded),
		cmocka_unit_test(test_html_is_multipart),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

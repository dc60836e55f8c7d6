/* SPDX-License-Identifier: ISC */
/*
 * test_escape.c: what reaches an operator's terminal or a log line.
 * sb_term_escape() (outboxctl's human output) and db_redact_conninfo()
 * with the encodings an outside review used to slip a password past it.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "util.h"

static char *esc(const char *s, bool keep_newlines)
{
	struct strbuf b;

	sb_init(&b, 16);
	sb_term_escape(&b, s, keep_newlines);
	return b.s;
}

static void expect_escaped(const char *in, const char *want)
{
	char *got = esc(in, false);

	assert_string_equal(got, want);
	assert_true(term_needs_escape(in, false) == (strcmp(in, want) != 0));
	free(got);
}

static void test_term_escape_every_control_class(void **state)
{
	(void)state;
	expect_escaped("plain key-1", "plain key-1");
	expect_escaped("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
	/* The review's run key. */
	expect_escaped("\x1b[2J\x1b[1;31mFAKE: all effects resolved\x1b]0;pwned\x07",
	               "\\e[2J\\e[1;31mFAKE: all effects resolved\\e]0;pwned\\x07");
	expect_escaped("a\nb\rc\td", "a\\nb\\rc\\td");
	expect_escaped("\x01\x1f\x7f", "\\x01\\x1f\\x7f");
	expect_escaped("lone \x1b", "lone \\e");
	/* C1 controls as UTF-8 (CSI U+009B, NEL U+0085, OSC U+009D). */
	expect_escaped("\xc2\x9b" "31m \xc2\x85 \xc2\x9d", "\\u009b31m \\u0085 \\u009d");
	/* Bytes that are not UTF-8 (a raw C1 byte, a truncated sequence). */
	expect_escaped("\x9b" "2J \xe2\x82", "\\x9b2J \\xe2\\x82");
	/* U+00A0 is not a control character. */
	expect_escaped("\xc2\xa0", "\xc2\xa0");
}

static void test_term_escape_bidi_and_invisible_characters(void **state)
{
	(void)state;
	/* ".../<U+202E>exe.txt" would read as ".../txt.exe". */
	expect_escaped("/files/\xe2\x80\xae" "exe.txt", "/files/\\u202eexe.txt");
	/* Embeddings and overrides U+202A-202E. */
	expect_escaped("\xe2\x80\xaa\xe2\x80\xab\xe2\x80\xac\xe2\x80\xad",
	               "\\u202a\\u202b\\u202c\\u202d");
	/* Isolates U+2066-2069. */
	expect_escaped("\xe2\x81\xa6\xe2\x81\xa7\xe2\x81\xa8\xe2\x81\xa9",
	               "\\u2066\\u2067\\u2068\\u2069");
	/* Zero-width space, joiners and marks U+200B-200F. */
	expect_escaped("a\xe2\x80\x8b" "b\xe2\x80\x8c\xe2\x80\x8d\xe2\x80\x8e\xe2\x80\x8f",
	               "a\\u200bb\\u200c\\u200d\\u200e\\u200f");
	/* Line and paragraph separators, byte-order mark, word joiner. */
	expect_escaped("x\xe2\x80\xa8y\xe2\x80\xa9z\xef\xbb\xbf\xe2\x81\xa0",
	               "x\\u2028y\\u2029z\\ufeff\\u2060");
	/* Their neighbours are ordinary text: U+200A hair space, U+2010
	 * hyphen, U+2027 hyphenation point, U+202F narrow no-break space,
	 * U+2065 (unassigned), U+FEFE. */
	expect_escaped("\xe2\x80\x8a\xe2\x80\x90\xe2\x80\xa7\xe2\x80\xaf\xe2\x81\xa5\xef\xbb\xbe",
	               "\xe2\x80\x8a\xe2\x80\x90\xe2\x80\xa7\xe2\x80\xaf\xe2\x81\xa5\xef\xbb\xbe");
}

static void test_term_escape_keeps_newlines_when_asked(void **state)
{
	char *got;

	(void)state;
	got = esc("ERROR: x\nHINT: \x1b[2J\n", true);
	assert_string_equal(got, "ERROR: x\nHINT: \\e[2J\n");
	free(got);
}

static void assert_no_secret(const char *in)
{
	char out[512];

	db_redact_conninfo(in, out, sizeof(out));
	if (strstr(out, "SECRET") != NULL)
		fail_msg("'%s' shown as '%s'", in, out);
}

static void test_redact_encoded_and_upper_case_keys(void **state)
{
	char out[512];

	(void)state;
	assert_no_secret("postgresql://worker@host/db?pass%77ord=SECRET");
	assert_no_secret("postgresql://worker@host/db?sslmode=require&%70assword=SECRET");
	assert_no_secret("postgresql://worker@host/db?%70%61%73%73%77%6F%72%64=SECRET");
	assert_no_secret("postgresql://worker@host/db?PASSWORD=SECRET");
	assert_no_secret("postgresql://worker@host/db?SslPassword=SECRET");
	assert_no_secret("postgres://worker@host/db?pass%7=SECRET");       /* broken escape */
	assert_no_secret("postgresql://worker@host/db?a=1&pass%00word=SECRET");
	assert_no_secret("postgresql://u:pa/SECRET@host/db");
	assert_no_secret("host=h PASSWORD=SECRET");
	assert_no_secret("host=h Password = 'SECRET x'");
	/* What is not secret stays readable. */
	db_redact_conninfo("postgresql://worker@host/db?sslmode=require&application_name=w1", out,
	                   sizeof(out));
	assert_string_equal(out, "postgresql://worker@host/db?sslmode=require&application_name=w1");
	db_redact_conninfo("postgresql://worker@host/db?pass%77ord=SECRET&sslmode=require", out,
	                   sizeof(out));
	assert_string_equal(out, "postgresql://worker@host/db?pass%77ord=********&sslmode=require");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_term_escape_every_control_class),
		cmocka_unit_test(test_term_escape_bidi_and_invisible_characters),
		cmocka_unit_test(test_term_escape_keeps_newlines_when_asked),
		cmocka_unit_test(test_redact_encoded_and_upper_case_keys),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

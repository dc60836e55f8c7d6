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

#include <stdbool.h>
#include <stdio.h>
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
	 * U+FEFC. */
	expect_escaped("\xe2\x80\x8a\xe2\x80\x90\xe2\x80\xa7\xe2\x80\xaf\xef\xbb\xbc",
	               "\xe2\x80\x8a\xe2\x80\x90\xe2\x80\xa7\xe2\x80\xaf\xef\xbb\xbc");
	/* U+2065 and U+FEFE are unassigned: escaped. */
	expect_escaped("\xe2\x81\xa5\xef\xbb\xbe", "\\u2065\\ufefe");
}

/* What the review found printed raw: U+061C, the tag characters, U+00AD,
 * U+034F, U+115F, U+3164, U+FFA0, U+180E, U+2800, U+FE0F, U+FFF9,
 * U+1D173. */
static void test_term_escape_what_the_review_found(void **state)
{
	(void)state;
	expect_escaped("\xd8\x9c", "\\u061c");
	expect_escaped("\xf3\xa0\x80\x80\xf3\xa0\x80\x81\xf3\xa0\x81\xa1\xf3\xa0\x81\xbf",
	               "\\U000e0000\\U000e0001\\U000e0061\\U000e007f");
	expect_escaped("a\xc2\xad" "b", "a\\u00adb");
	expect_escaped("\xcd\x8f", "\\u034f");
	expect_escaped("\xe1\x85\x9f", "\\u115f");
	expect_escaped("\xe3\x85\xa4", "\\u3164");
	expect_escaped("\xef\xbe\xa0", "\\uffa0");
	expect_escaped("\xe1\xa0\x8e", "\\u180e");
	expect_escaped("\xe2\xa0\x80", "\\u2800");
	expect_escaped("\xe2\x9c\x85\xef\xb8\x8f", "\xe2\x9c\x85\\ufe0f");
	expect_escaped("\xef\xbf\xb9", "\\ufff9");
	expect_escaped("\xf0\x9d\x85\xb3", "\\U0001d173");
	/* Malformed UTF-8: overlong, surrogate, past U+10FFFF, cut short. */
	expect_escaped("\xc0\xaf", "\\xc0\\xaf");
	expect_escaped("\xed\xa0\x80", "\\xed\\xa0\\x80");
	expect_escaped("\xf4\x90\x80\x80", "\\xf4\\x90\\x80\\x80");
	expect_escaped("\xf0\x9f\x98", "\\xf0\\x9f\\x98");
}

/* ---- every code point against the Unicode data Debian ships ------------- */

#define UCD "/usr/share/unicode"

static char *ucd_category;     /* two letters per code point, "Cn" by default */
static unsigned char *ucd_ignorable;

static void ucd_load(void)
{
	char line[1024];
	FILE *f = fopen(UCD "/UnicodeData.txt", "r");
	long first = -1;

	if (f == NULL)
		fail_msg("%s/UnicodeData.txt: install Debian's unicode-data (scripts/install-deps.sh)", UCD);
	ucd_category = malloc(0x110000 * 2);
	ucd_ignorable = calloc(0x110000, 1);
	assert_non_null(ucd_category);
	assert_non_null(ucd_ignorable);
	for (long i = 0; i < 0x110000; i++)
		memcpy(ucd_category + 2 * i, "Cn", 2);
	while (fgets(line, sizeof(line), f)) {
		char *name = strchr(line, ';'), *gc;
		long cp = strtol(line, NULL, 16);

		assert_non_null(name);
		gc = strchr(name + 1, ';');
		assert_non_null(gc);
		gc++;
		if (strstr(name, ", First>;")) {
			first = cp;
			continue;
		}
		for (long c = strstr(name, ", Last>;") ? first : cp; c <= cp; c++)
			memcpy(ucd_category + 2 * c, gc, 2);
	}
	fclose(f);
	f = fopen(UCD "/DerivedCoreProperties.txt", "r");
	if (f == NULL)
		fail_msg("%s/DerivedCoreProperties.txt: install Debian's unicode-data", UCD);
	while (fgets(line, sizeof(line), f)) {
		char *end;
		long lo, hi;

		if (line[0] == '#' || strstr(line, "; Default_Ignorable_Code_Point ") == NULL)
			continue;
		lo = strtol(line, &end, 16);
		hi = strncmp(end, "..", 2) == 0 ? strtol(end + 2, NULL, 16) : lo;
		for (long c = lo; c <= hi; c++)
			ucd_ignorable[c] = 1;
	}
	fclose(f);
}

static size_t utf8_encode(uint32_t cp, char *out)
{
	if (cp < 0x80) {
		out[0] = (char)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (char)(0xC0 | (cp >> 6));
		out[1] = (char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (char)(0xE0 | (cp >> 12));
		out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
		out[2] = (char)(0x80 | (cp & 0x3F));
		return 3;
	}
	out[0] = (char)(0xF0 | (cp >> 18));
	out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
	out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
	out[3] = (char)(0x80 | (cp & 0x3F));
	return 4;
}

/* Every code point from U+0001 to U+10FFFF, alone between two letters:
 * printed as it is exactly when it is printable text per the Unicode data
 * (not Cc, Cf, Co, Cs, Cn, Zl, Zp, not Default_Ignorable_Code_Point, not
 * U+2800), else escaped as \uXXXX or \UXXXXXXXX (ASCII controls as \xNN
 * or their names, surrogates, not being UTF-8, byte by byte). */
static void test_term_escape_every_code_point_against_the_unicode_data(void **state)
{
	static const char *const escaped_cats[] = { "Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp" };
	long raw = 0, esc_n = 0;

	(void)state;
	ucd_load();
	for (uint32_t cp = 1; cp < 0x110000; cp++) {
		const char *gc = ucd_category + 2 * cp;
		bool escape = ucd_ignorable[cp] || cp == 0x2800;
		char in[8] = "a", want[32];
		size_t n = utf8_encode(cp, in + 1);
		char *got;

		for (size_t i = 0; i < sizeof(escaped_cats) / sizeof(escaped_cats[0]); i++)
			escape = escape || memcmp(gc, escaped_cats[i], 2) == 0;
		in[1 + n] = 'z';
		in[2 + n] = '\0';
		if (cp < 0x80)
			continue;      /* ASCII: test_term_escape_every_control_class */
		if (cp >= 0xD800 && cp <= 0xDFFF)
			snprintf(want, sizeof(want), "a\\x%02x\\x%02x\\x%02xz", (unsigned char)in[1],
			         (unsigned char)in[2], (unsigned char)in[3]);
		else if (!escape)
			snprintf(want, sizeof(want), "%s", in);
		else if (cp > 0xFFFF)
			snprintf(want, sizeof(want), "a\\U%08xz", (unsigned)cp);
		else
			snprintf(want, sizeof(want), "a\\u%04xz", (unsigned)cp);
		got = esc(in, false);
		if (strcmp(got, want) != 0)
			fail_msg("U+%04X (%.2s): got \"%s\", want \"%s\"", (unsigned)cp, gc, got, want);
		if (term_needs_escape(in, false) != (strcmp(in, want) != 0))
			fail_msg("U+%04X: term_needs_escape disagrees", (unsigned)cp);
		free(got);
		if (strcmp(in, want) == 0)
			raw++;
		else
			esc_n++;
	}
	/* Unicode 15.0: 149,186 assigned characters, most of them printable. */
	assert_true(raw > 140000 && esc_n > 900000);
	free(ucd_category);
	free(ucd_ignorable);
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
		cmocka_unit_test(test_term_escape_what_the_review_found),
		cmocka_unit_test(test_term_escape_every_code_point_against_the_unicode_data),
		cmocka_unit_test(test_redact_encoded_and_upper_case_keys),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

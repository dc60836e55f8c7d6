/* SPDX-License-Identifier: ISC */
/*
 * test_scrub.c: lib/scrub.c, the secret values cut out of what a
 * peer answered, in each spelling it lists.
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

#include "scrub.h"

static void expect(const struct scrub *s, const char *in, const char *want)
{
	size_t n = 0;
	char *got = scrub_dup(s, in, strlen(in), &n);

	if (want == NULL) {
		if (got != NULL)
			fail_msg("\"%s\" scrubbed to \"%s\"", in, got);
		return;
	}
	if (got == NULL)
		fail_msg("\"%s\" not scrubbed", in);
	assert_string_equal(got, want);
	assert_int_equal(n, strlen(want));
	free(got);
}

static void test_every_spelling(void **state)
{
	struct scrub s = { 0 };
	const char *v = "p\"a/s s+k";   /* quote, slash, space, plus */

	(void)state;
	scrub_add(&s, v, strlen(v));
	expect(&s, "x p\"a/s s+k y p\"a/s s+k", "x [secret] y [secret]");
	expect(&s, "{\"e\": \"p\\\"a/s s+k\"}", "{\"e\": \"[secret]\"}");        /* JSON */
	expect(&s, "{\"e\": \"p\\\"a\\/s s+k\"}", "{\"e\": \"[secret]\"}");      /* JSON, \/ */
	expect(&s, "?t=p%22a%2Fs%20s%2Bk&", "?t=[secret]&");                    /* percent */
	expect(&s, "b64 cCJhL3Mgcytr", "b64 [secret]");                         /* base64 */
	expect(&s, "hex 7022612f7320732b6b", "hex [secret]");
	expect(&s, "HEX 7022612F7320732B6B", "HEX [secret]");
	expect(&s, "nothing here", NULL);
	scrub_free(&s);
}

/* A text's end that starts like a secret is left alone (scrubbing it would
 * answer "is this a prefix?" for whoever chose the end); a text cut at a
 * bound loses the same number of bytes whatever they are. */
static void test_no_prefix_oracle(void **state)
{
	struct scrub s = { 0 };
	const char *v = "tok-5e1c2b-echoed";
	const char *texts[] = { "error: Bearer tok-5e1c", "error: Bearer zzz-zzzz" };

	(void)state;
	scrub_add(&s, v, strlen(v));
	expect(&s, texts[0], NULL);
	expect(&s, texts[1], NULL);
	for (int i = 0; i < 2; i++) {
		char *t = strdup(texts[i]);
		size_t n = strlen(t);

		scrub_text(&s, &t, &n, true);
		/* The longest spelling (hex: 34 bytes), each byte of it
		 * written as \u00XX at most (6 bytes), less one: all go. */
		assert_int_equal(n, 0);
		free(t);
		t = malloc(300);
		memset(t, 'x', 250);
		strcpy(t + 250, " Bearer tok-5e1c");
		n = strlen(t);
		scrub_text(&s, &t, &n, true);
		assert_int_equal(n, 266 - (6 * 34 - 1));
		assert_int_equal(strspn(t, "x"), n);
		free(t);
	}
	scrub_free(&s);
}

static void test_basic_credential(void **state)
{
	struct scrub s = { 0 };
	const char *basic = "c3ZjOmh1bnRlcjItcGFzcw==";   /* svc:hunter2-pass */

	(void)state;
	scrub_add(&s, basic, strlen(basic));
	expect(&s, "Basic c3ZjOmh1bnRlcjItcGFzcw==", "Basic [secret]");
	expect(&s, "user svc:hunter2-pass refused", "user [secret] refused");
	expect(&s, "password hunter2-pass refused", "password [secret] refused");
	scrub_free(&s);
}

static void test_longest_first_and_buffers(void **state)
{
	struct scrub s = { 0 };
	char buf[16];
	char *str;

	(void)state;
	scrub_add(&s, "abcd", 4);
	scrub_add(&s, "abcdefgh", 8);
	expect(&s, "abcdefgh abcd", "[secret] [secret]");
	/* In a buffer: cut to fit, never leaving the value. */
	strcpy(buf, "abcd abcd abcd");
	assert_true(scrub_buf(&s, buf, sizeof(buf)));
	assert_string_equal(buf, "[secret] [secre");
	strcpy(buf, "clean");
	assert_false(scrub_buf(&s, buf, sizeof(buf)));
	assert_string_equal(buf, "clean");
	str = strdup("id=abcdefgh");
	scrub_str(&s, &str);
	assert_string_equal(str, "id=[secret]");
	free(str);
	scrub_free(&s);
	/* Empty set: nothing changes. */
	expect(&s, "abcd", NULL);
}

/* Encoders that escape some bytes and leave others, or escape them in a
 * form of their own: Python's quote() keeps '/', form encoding writes a
 * space as '+', lowercase %xx, Go's JSON writes '&' '<' '>' as \u00XX, and
 * a mix of those within one echo. */
static void test_mixed_escapes(void **state)
{
	struct scrub s = { 0 };
	const char *v = "a&b<c>d/e f+g\"h";

	(void)state;
	scrub_add(&s, v, strlen(v));
	expect(&s, "q=a%26b%3Cc%3Ed/e%20f%2Bg%22h;", "q=[secret];");          /* quote() */
	expect(&s, "q=a%26b%3cc%3ed%2fe+f%2bg%22h;", "q=[secret];");          /* form, lower */
	expect(&s, "{\"t\":\"a\\u0026b\\u003cc\\u003ed/e f+g\\\"h\"}",
	       "{\"t\":\"[secret]\"}");                                        /* Go JSON */
	expect(&s, "x a\\u0026b%3Cc>d\\/e+f+g%22h y", "x [secret] y");        /* mixed */
	expect(&s, "x a%26b%3Cc%3Ed/e%20f%2Bg%22 y", NULL);                    /* not whole */
	scrub_free(&s);
}

static char *b64(const char *in)
{
	static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
	size_t len = strlen(in), o = 0;
	char *out = malloc(len / 3 * 4 + 5);

	for (size_t i = 0; i < len; i += 3) {
		unsigned v = (unsigned char)in[i] << 16;
		v |= i + 1 < len ? (unsigned char)in[i + 1] << 8 : 0;
		v |= i + 2 < len ? (unsigned char)in[i + 2] : 0;
		out[o++] = a[(v >> 18) & 63];
		out[o++] = a[(v >> 12) & 63];
		out[o++] = i + 1 < len ? a[(v >> 6) & 63] : '=';
		out[o++] = i + 2 < len ? a[v & 63] : '=';
	}
	out[o] = 0;
	return out;
}

/* A secret inside a longer text that was base64-encoded whole (an echo of
 * the request's header lines), at each of the 3 offsets a prefix of the
 * producer's choosing can give it, and with text after it. */
static void test_base64_inside_longer_text(void **state)
{
	struct scrub s = { 0 };
	const char *v = "s3cr3t-t0ken-value";
	const char *prefixes[] = { "Authorization: Bearer ", "X-Ke: ", "X-Key:  " };

	(void)state;
	scrub_add(&s, v, strlen(v));
	for (int i = 0; i < 3; i++) {
		char line[128], *enc, *got;

		snprintf(line, sizeof(line), "%s%s\r\nAccept: */*\r\n", prefixes[i], v);
		enc = b64(line);
		got = scrub_dup(&s, enc, strlen(enc), NULL);
		if (got == NULL || strstr(got, SCRUB_MARK) == NULL)
			fail_msg("offset %d: \"%s\" not scrubbed", (int)(strlen(prefixes[i]) % 3), enc);
		free(got);
		free(enc);
	}
	scrub_free(&s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_every_spelling),
		cmocka_unit_test(test_no_prefix_oracle),
		cmocka_unit_test(test_basic_credential),
		cmocka_unit_test(test_longest_first_and_buffers),
		cmocka_unit_test(test_mixed_escapes),
		cmocka_unit_test(test_base64_inside_longer_text),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

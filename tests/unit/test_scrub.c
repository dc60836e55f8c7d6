/* SPDX-License-Identifier: ISC */
/*
 * test_scrub.c: providers/lib/scrub.c, the secret values cut out of what a
 * peer answered, in each spelling it lists.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "lib/scrub.h"

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
	/* Cut inside the value: the start of it goes too (4 bytes or more). */
	expect(&s, "error: Bearer p\"a/s", "error: Bearer [secret]");
	expect(&s, "error: p\"a", NULL);            /* 3 bytes: by chance */
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

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_every_spelling),
		cmocka_unit_test(test_basic_credential),
		cmocka_unit_test(test_longest_first_and_buffers),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

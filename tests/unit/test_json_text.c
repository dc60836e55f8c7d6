/* SPDX-License-Identifier: ISC */
/*
 * test_json_text.c: lib/json_text.c, how http's body and crm's
 * fields leave as the producer wrote them: a top-level member found in
 * jsonb's text (nested braces, brackets and quotes inside strings are not
 * structure; the last duplicate wins; malformed or truncated text is "not
 * found", never a read past the end), and compaction that drops only the
 * white space outside strings; the worker's parse without the members a
 * provider reads from the text.  Fuzzed against jansson in
 * tests/fuzz/fuzz_payload.c.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_text.h"

/* The member as a NUL-terminated copy, or NULL when not found. */
static char *member(const char *text, const char *key)
{
	const char *v;
	size_t n;
	char *out;

	if (!json_text_member(text, strlen(text), key, &v, &n))
		return NULL;
	out = malloc(n + 1);
	assert_non_null(out);
	memcpy(out, v, n);
	out[n] = '\0';
	return out;
}

static void assert_member(const char *text, const char *key, const char *want)
{
	char *got = member(text, key);

	if (want == NULL) {
		if (got != NULL)
			fail_msg("%s: found \"%s\" as %s, expected not found", text, key, got);
		return;
	}
	if (got == NULL)
		fail_msg("%s: \"%s\" not found, expected %s", text, key, want);
	assert_string_equal(got, want);
	free(got);
}

static void assert_compact(const char *text, const char *want)
{
	size_t n = 0;
	char *got = json_text_compact(text, strlen(text), &n);

	assert_non_null(got);
	assert_string_equal(got, want);
	assert_int_equal(n, strlen(want));
	free(got);
}

/* What jsonb prints for a webhook payload: the body comes back with its
 * numbers exactly as written. */
static void test_member_of_jsonb_text(void **state)
{
	const char *t = "{\"body\": {\"amount\": 19.99, \"qty\": 1.50, \"id\": 123456789012345678901234567890}, "
	                "\"headers\": {\"X-A\": \"1\"}, \"method\": \"POST\"}";

	(void)state;
	assert_member(t, "body", "{\"amount\": 19.99, \"qty\": 1.50, \"id\": 123456789012345678901234567890}");
	assert_member(t, "method", "\"POST\"");
	assert_member(t, "headers", "{\"X-A\": \"1\"}");
	assert_member(t, "missing", NULL);
	/* a key inside a nested object is not a top-level member */
	assert_member(t, "amount", NULL);
}

static void test_scalars_and_nesting(void **state)
{
	(void)state;
	assert_member("{\"a\": 1, \"b\": -2.5e3, \"c\": true, \"d\": null, \"e\": [1, [2, {\"f\": 3}]]}", "b",
	              "-2.5e3");
	assert_member("{\"a\": 1, \"b\": true}", "b", "true");
	assert_member("{\"a\":[1,[2,{\"f\":3}]],\"z\":0}", "a", "[1,[2,{\"f\":3}]]");
	assert_member("{\"a\":[],\"b\":{}}", "b", "{}");
	assert_member(" \n{ \"a\" :\t\"x\" } ", "a", "\"x\"");
}

/* Braces, brackets, commas and quotes inside strings are not structure. */
static void test_strings_are_opaque(void **state)
{
	const char *t = "{\"a\": \"}, \\\"b\\\": [\", \"b\": \"{\\\\\", \"c\": {\"k\": \"]}\"}}";

	(void)state;
	assert_member(t, "a", "\"}, \\\"b\\\": [\"");
	assert_member(t, "b", "\"{\\\\\"");
	assert_member(t, "c", "{\"k\": \"]}\"}");
}

static void test_last_duplicate_wins(void **state)
{
	(void)state;
	assert_member("{\"a\": 1, \"a\": 2}", "a", "2");
}

/* Keys are compared as written: one spelled with an escape is not found
 * (jsonb prints none; the caller re-encodes with jansson then). */
static void test_escaped_key_not_found(void **state)
{
	(void)state;
	assert_member("{\"bo\\u0064y\": 1}", "body", NULL);
	assert_member("{\"b\": 1}", "body", NULL);
	assert_member("{\"bodyx\": 1}", "body", NULL);
}

static void test_not_an_object_or_malformed(void **state)
{
	static const char *bad[] = {
		"", "   ", "[1]", "\"body\"", "{", "{\"body\"", "{\"body\":", "{\"body\": ",
		"{\"body\": 1", "{\"body\": 1,", "{\"body\": \"open}", "{\"body\": {\"x\": 1}",
		"{\"body\" 1}", "{body: 1}", "{\"body\": 1 \"x\": 2}", "{\"body\": }",
		"{}",
	};

	(void)state;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *v;
		size_t n;

		if (json_text_member(bad[i], strlen(bad[i]), "body", &v, &n))
			fail_msg("found \"body\" in malformed text %s", bad[i]);
	}
}

/* A length shorter than the string: nothing past it is read (ASan). */
static void test_length_is_respected(void **state)
{
	const char *t = "{\"body\": [1, 2]}";
	const char *v;
	size_t n;

	(void)state;
	for (size_t len = 0; len < strlen(t); len++) {
		char *copy = malloc(len ? len : 1);

		assert_non_null(copy);
		memcpy(copy, t, len);
		assert_false(json_text_member(copy, len, "body", &v, &n));
		free(copy);
	}
	assert_true(json_text_member(t, strlen(t), "body", &v, &n));
	assert_int_equal(n, 6);
}

static void test_deep_nesting_is_malformed(void **state)
{
	size_t depth = 3000, len = depth * 2 + 16;
	char *t = malloc(len);
	size_t i = 0;
	const char *v;
	size_t n;

	(void)state;
	assert_non_null(t);
	i += (size_t)sprintf(t, "{\"body\": ");
	for (size_t d = 0; d < depth; d++)
		t[i++] = '[';
	for (size_t d = 0; d < depth; d++)
		t[i++] = ']';
	t[i++] = '}';
	assert_false(json_text_member(t, i, "body", &v, &n));
	free(t);
}

static void test_compact(void **state)
{
	(void)state;
	assert_compact("{\"a\": 19.99, \"b\": [1, 2.50, {\"c\": null}]}", "{\"a\":19.99,\"b\":[1,2.50,{\"c\":null}]}");
	/* white space inside strings and escaped quotes stay */
	assert_compact("{\"k\": \"a b\\\" , c\"}", "{\"k\":\"a b\\\" , c\"}");
	assert_compact(" \t\r\n[ ]\n", "[]");
	assert_compact("", "");
}

static void test_compact_refuses_an_open_string(void **state)
{
	(void)state;
	assert_null(json_text_compact("{\"a\": \"open", 11, NULL));
	assert_null(json_text_compact("\"ends in a backslash\\", 21, NULL));
}

/* The worker's parse for http: everything but the body, which jansson
 * never reads (an integer it cannot hold in the body is no error). */
static void test_parse_except_leaves_out_the_members(void **state)
{
	static const char *const skip[] = { "body", NULL };
	const char *t = "{\"body\": {\"n\": 123456789012345678901234567890, \"s\": \"x\"}, "
	                "\"headers\": {\"X-A\": \"1\"}, \"method\": \"PUT\"}";
	json_error_t err;
	json_t *p = json_text_parse_except(t, strlen(t), skip, 0, &err);

	(void)state;
	assert_non_null(p);
	assert_null(json_object_get(p, "body"));
	assert_string_equal(json_string_value(json_object_get(p, "method")), "PUT");
	assert_string_equal(json_string_value(json_object_get(json_object_get(p, "headers"), "X-A")), "1");
	assert_int_equal(json_object_size(p), 2);
	json_decref(p);
	/* without the skip list jansson refuses that integer */
	assert_null(json_text_parse_except(t, strlen(t), NULL, 0, &err));
}

static void test_parse_except_short_values_and_absent_members(void **state)
{
	static const char *const skip[] = { "a", "b", "missing", NULL };
	const char *t = "{\"a\": 1, \"b\": [], \"c\": true}";
	json_error_t err;
	json_t *p = json_text_parse_except(t, strlen(t), skip, 0, &err);

	(void)state;
	assert_non_null(p);
	assert_int_equal(json_object_size(p), 1);
	assert_true(json_is_true(json_object_get(p, "c")));
	json_decref(p);
}

/* What cannot be found is parsed as usual: malformed text still gets
 * jansson's error, an escaped key stays in the result. */
static void test_parse_except_falls_back_to_jansson(void **state)
{
	static const char *const skip[] = { "body", NULL };
	const char *bad = "{\"body\": {\"x\": }";
	const char *esc = "{\"bo\\u0064y\": 5}";
	json_error_t err;
	json_t *p;

	(void)state;
	assert_null(json_text_parse_except(bad, strlen(bad), skip, 0, &err));
	assert_true(err.text[0] != '\0');
	p = json_text_parse_except(esc, strlen(esc), skip, 0, &err);
	assert_non_null(p);
	assert_int_equal(json_integer_value(json_object_get(p, "body")), 5);
	json_decref(p);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_member_of_jsonb_text),
		cmocka_unit_test(test_scalars_and_nesting),
		cmocka_unit_test(test_strings_are_opaque),
		cmocka_unit_test(test_last_duplicate_wins),
		cmocka_unit_test(test_escaped_key_not_found),
		cmocka_unit_test(test_not_an_object_or_malformed),
		cmocka_unit_test(test_length_is_respected),
		cmocka_unit_test(test_deep_nesting_is_malformed),
		cmocka_unit_test(test_compact),
		cmocka_unit_test(test_compact_refuses_an_open_string),
		cmocka_unit_test(test_parse_except_leaves_out_the_members),
		cmocka_unit_test(test_parse_except_short_values_and_absent_members),
		cmocka_unit_test(test_parse_except_falls_back_to_jansson),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

/* SPDX-License-Identifier: ISC */
/*
 * test_http_lookup.c: providers/lib/http_lookup.c's reading of the
 * provider id from a lookup's answer by JSON pointer (RFC 6901): nested
 * objects and arrays, escaped ~0 and ~1, integers written out; absent,
 * empty, of another type, with a line break, too long or not JSON: no id
 * (the lookup then cannot tell, never "found").
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "lib/http_lookup.h"

static const char *id_of(const char *json, const char *pointer)
{
	static char out[OUTBOX_PROVIDER_ID_MAX];

	if (!http_lookup_pointer_id(json, strlen(json), pointer, out, sizeof(out)))
		return NULL;
	return out;
}

static void test_found_ids(void **state)
{
	(void)state;
	assert_string_equal(id_of("{\"id\":\"ord_1\"}", "/id"), "ord_1");
	assert_string_equal(id_of("{\"data\":{\"id\":42}}", "/data/id"), "42");
	assert_string_equal(id_of("{\"data\":[{\"id\":\"a\"},{\"id\":\"b\"}]}", "/data/1/id"), "b");
	assert_string_equal(id_of("{\"a/b\":{\"c~d\":\"x\"}}", "/a~1b/c~0d"), "x");
	assert_string_equal(id_of("[\"first\"]", "/0"), "first");
}

static void test_no_id(void **state)
{
	(void)state;
	assert_null(id_of("{\"id\":\"\"}", "/id"));
	assert_null(id_of("{\"id\":null}", "/id"));
	assert_null(id_of("{\"id\":true}", "/id"));
	assert_null(id_of("{\"id\":{\"x\":1}}", "/id"));
	assert_null(id_of("{\"id\":\"a\\nb\"}", "/id"));
	assert_null(id_of("{\"other\":\"x\"}", "/id"));
	assert_null(id_of("[]", "/0"));
	assert_null(id_of("{\"data\":[\"a\"]}", "/data/x"));
	assert_null(id_of("{\"data\":[\"a\"]}", "/data/-1"));
	assert_null(id_of("not json", "/id"));
	assert_null(id_of("{\"id\":\"x\"", "/id"));
}

static void test_too_long_is_not_cut(void **state)
{
	char json[OUTBOX_PROVIDER_ID_MAX + 32];

	(void)state;
	memset(json, 'a', sizeof(json));
	memcpy(json, "{\"id\":\"", 7);
	memcpy(json + sizeof(json) - 3, "\"}", 3);
	assert_null(id_of(json, "/id"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_found_ids),
		cmocka_unit_test(test_no_id),
		cmocka_unit_test(test_too_long_is_not_cut),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

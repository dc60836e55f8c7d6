/* SPDX-License-Identifier: ISC */
/*
 * test_http_lookup.c: providers/lib/http_lookup.c's reading of the
 * provider id from a lookup's answer by JSON pointer (RFC 6901): nested
 * objects and arrays, escaped ~0 and ~1, integers written out; absent,
 * empty, of another type, with a line break, too long or not JSON: no id
 * (the lookup then cannot tell, never "found").  And which targets a
 * reconcile_targets entry covers (providers/lib/url.c): parsed scheme,
 * host and port, a path prefix on a segment boundary, a host name alone
 * meaning https on 443; user-info never taken for the host; {origin}
 * built from the parsed parts.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "lib/http_lookup.h"
#include "lib/url.h"

#include <stdlib.h>

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

/* Does the entry cover the target?  -1: the entry is refused. */
static int covers(const char *entry, const char *target)
{
	struct url_prefix p;
	struct url_parts t;
	char err[256], *path = NULL;
	int r;

	if (!url_prefix_parse(entry, &p, err, sizeof(err)))
		return -1;
	assert_true(url_split(target, &t, &path, err, sizeof(err)));
	r = url_prefix_matches(&p, &t, path);
	free(path);
	url_prefix_free(&p);
	return r;
}

static void test_targets_match_on_parsed_parts(void **state)
{
	(void)state;
	/* User-info spelling the allowed origin is not the host. */
	assert_int_equal(covers("http://127.0.0.2:57060", "http://127.0.0.2:57060@127.0.0.3:57061/orders"), 0);
	assert_int_equal(covers("http://127.0.0.2:57060", "http://u:p@127.0.0.2:57060/orders"), 1);
	/* A host name alone: https on 443 only, never http or another port. */
	assert_int_equal(covers("127.0.0.2", "http://127.0.0.2:57061/orders"), 0);
	assert_int_equal(covers("127.0.0.2", "http://127.0.0.2/orders"), 0);
	assert_int_equal(covers("127.0.0.2", "https://127.0.0.2:8443/orders"), 0);
	assert_int_equal(covers("127.0.0.2", "https://127.0.0.2/orders"), 1);
	assert_int_equal(covers("API.Example.com", "https://api.example.COM:443/x"), 1);
	assert_int_equal(covers("::1", "https://[::1]/x"), 1);
	assert_int_equal(covers("api.example.com", "https://api.example.com.evil.test/x"), 0);
	/* Scheme, host and port normalised; the default port filled in. */
	assert_int_equal(covers("HTTPS://API.example.com/", "https://api.example.com:443/v1"), 1);
	assert_int_equal(covers("https://api.example.com:443", "https://api.example.com/v1"), 1);
	assert_int_equal(covers("https://api.example.com", "http://api.example.com/v1"), 0);
	assert_int_equal(covers("https://api.example.com", "https://api.example.com:8443/v1"), 0);
	assert_int_equal(covers("https://api.example.com", "https://api.example.com.evil.test/v1"), 0);
	/* Path prefixes end on a segment boundary; dot segments are resolved. */
	assert_int_equal(covers("https://h.example/api", "https://h.example/api"), 1);
	assert_int_equal(covers("https://h.example/api", "https://h.example/api/v1?x=1"), 1);
	assert_int_equal(covers("https://h.example/api", "https://h.example/apix"), 0);
	assert_int_equal(covers("https://h.example/api/", "https://h.example/api/v1"), 1);
	assert_int_equal(covers("https://h.example/api", "https://h.example/api/../admin"), 0);
	assert_int_equal(covers("https://h.example/api", "https://h.example/other/../api/x"), 1);
	/* Entries that cannot be matched safely are refused. */
	assert_int_equal(covers("127.0.0.2:57060", "https://127.0.0.2/"), -1);
	assert_int_equal(covers("http://u:p@h.example/", "http://h.example/"), -1);
	assert_int_equal(covers("http://h.example/?q=1", "http://h.example/"), -1);
	assert_int_equal(covers("ftp://h.example/", "http://h.example/"), -1);
	assert_int_equal(covers("h.example/api", "https://h.example/api"), -1);
}

/* Encoded dots, slashes and backslashes pass a prefix as written but
 * servers may decode them into another path: never matched, with a reason. */
static void test_ambiguous_paths_never_match(void **state)
{
	(void)state;
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/%2e%2e/admin"), 0);
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/%2E%2E/admin"), 0);
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/..%2fadmin"), 0);
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/..%2Fadmin"), 0);
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/..%5cadmin"), 0);
	assert_int_equal(covers("https://h.example/", "https://h.example/a/%2e%2e/b"), 0);
	assert_int_equal(covers("https://h.example/crm/", "https://h.example/crm/x%41y"), 1);
	assert_non_null(url_path_ambiguous("/crm/..\\admin"));
	assert_non_null(url_path_ambiguous("/crm/%2E%2e/admin"));
	assert_non_null(url_path_ambiguous("/crm/%5C"));
	assert_non_null(strstr(url_path_ambiguous("/a/%2f"), "%2f"));
	assert_null(url_path_ambiguous("/crm/v1.2/x%20y"));
}

static void test_origin_is_built_from_parsed_parts(void **state)
{
	struct url_parts u;
	char err[256], origin[300];

	(void)state;
	assert_true(url_split("http://127.0.0.2:57060@127.0.0.3:57061/orders?x=1", &u, NULL, err,
	                      sizeof(err)));
	assert_true(u.has_userinfo);
	assert_true(url_origin(&u, origin, sizeof(origin)));
	assert_string_equal(origin, "http://127.0.0.3:57061");
	assert_true(url_split("HTTPS://User@Api.Example.com:443/x", &u, NULL, err, sizeof(err)));
	assert_true(url_origin(&u, origin, sizeof(origin)));
	assert_string_equal(origin, "https://api.example.com");
	assert_true(url_split("http://[::1]:8080/x", &u, NULL, err, sizeof(err)));
	assert_true(url_origin(&u, origin, sizeof(origin)));
	assert_string_equal(origin, "http://[::1]:8080");
	assert_false(url_origin(&u, origin, 8));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_found_ids),
		cmocka_unit_test(test_no_id),
		cmocka_unit_test(test_too_long_is_not_cut),
		cmocka_unit_test(test_targets_match_on_parsed_parts),
		cmocka_unit_test(test_ambiguous_paths_never_match),
		cmocka_unit_test(test_origin_is_built_from_parsed_parts),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

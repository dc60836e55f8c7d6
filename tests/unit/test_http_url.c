/* SPDX-License-Identifier: ISC */
/*
 * test_http_url.c: providers/http/target.c's cache of parsed target URLs
 * (http_target_parse): every answer must be http_parse_url()'s for the
 * same text, whatever the cache held before (hits, slots shared by two
 * URLs, URLs too long to keep, failures).  Links the http provider's
 * objects but its glue.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "http/http.h"

struct parsed {
	bool ok;
	char scheme[16], host[256], err[256];
	long port;
};

static void check_same(struct http_provider *hp, const char *url)
{
	struct parsed want = { 0 }, got = { 0 };

	want.ok = http_parse_url(url, want.scheme, sizeof(want.scheme), want.host, sizeof(want.host),
	                         &want.port, want.err, sizeof(want.err));
	got.ok = http_target_parse(hp, url, got.scheme, sizeof(got.scheme), got.host, sizeof(got.host),
	                           &got.port, got.err, sizeof(got.err));
	assert_int_equal(got.ok, want.ok);
	if (want.ok) {
		assert_string_equal(got.scheme, want.scheme);
		assert_string_equal(got.host, want.host);
		assert_int_equal(got.port, want.port);
	} else {
		assert_string_equal(got.err, want.err);
	}
}

static void free_cache(struct http_provider *hp)
{
	for (int i = 0; i < HTTP_URL_CACHE; i++)
		free(hp->urls[i].url);
}

static void test_answers_are_parse_url_s(void **state)
{
	static const char *const urls[] = {
		"http://127.0.0.1:8080/ok", "https://api.example.com/v1/hooks?x=1",
		"HTTPS://API.Example.COM/", "http://[::1]:9/x", "http://[fe80::1%25eth0]/",
		"https://example.com:0/", "ftp://example.com/", "not a url", "http://", "",
		"http://example.com:99999/", "http://user:pw@example.com/", "https://xn--bcher-kva.example/",
	};
	struct http_provider *hp = calloc(1, sizeof(*hp));

	(void)state;
	assert_non_null(hp);
	/* Twice round: the second time every good URL comes from the cache. */
	for (int round = 0; round < 2; round++)
		for (size_t i = 0; i < sizeof(urls) / sizeof(urls[0]); i++)
			check_same(hp, urls[i]);
	/* A failure is not kept. */
	for (int i = 0; i < HTTP_URL_CACHE; i++)
		if (hp->urls[i].url)
			assert_true(http_parse_url(hp->urls[i].url, (char[16]){ 0 }, 16, (char[256]){ 0 }, 256,
			                           &(long){ 0 }, (char[64]){ 0 }, 64));
	free_cache(hp);
	free(hp);
}

static void test_shared_slots_long_urls(void **state)
{
	struct http_provider *hp = calloc(1, sizeof(*hp));
	char url[HTTP_URL_CACHE_MAX + 64];
	int kept = 0;

	(void)state;
	assert_non_null(hp);
	/* Four times as many hosts as slots, in turns: every slot is shared,
	 * and each answer must be for the URL asked, not the slot's last. */
	for (int round = 0; round < 3; round++)
		for (int i = 0; i < 4 * HTTP_URL_CACHE; i++) {
			snprintf(url, sizeof(url), "https://h%d.example.com:%d/p", i, 1000 + i);
			check_same(hp, url);
		}
	for (int i = 0; i < HTTP_URL_CACHE; i++)
		kept += hp->urls[i].url != NULL;
	assert_true(kept > HTTP_URL_CACHE / 2);
	/* Longer than the cache keeps: answered, not kept. */
	memset(url, 'a', sizeof(url));
	memcpy(url, "http://long.example.com/", 24);
	url[HTTP_URL_CACHE_MAX + 10] = '\0';
	check_same(hp, url);
	check_same(hp, url);
	for (int i = 0; i < HTTP_URL_CACHE; i++)
		assert_true(hp->urls[i].url == NULL || strlen(hp->urls[i].url) <= HTTP_URL_CACHE_MAX);
	free_cache(hp);
	free(hp);
}

/* [provider.http] secrets: declarations parsed, and a secret read only for
 * a target under one of its prefixes, with reasons that never show where. */
static void test_secrets_declared_per_prefix(void **state)
{
	static const char *const bad[] = {
		"api", "api=", "api=not-a-url", ".x=https://a.example/", "a/b=https://a.example/",
		"a=https://a.example/; a=https://b.example/", "a=https://u:p@a.example/", NULL,
	};
	struct http_provider *hp = calloc(1, sizeof(*hp));
	char dir[] = "/tmp/secfix-unit-XXXXXX", file[64], out[HTTP_SECRET_MAX + 2], err[256];
	FILE *fp;

	(void)state;
	for (const char *const *b = bad; *b; b++) {
		assert_false(http_secrets_parse(hp, *b, err, sizeof(err)));
		assert_int_equal(hp->n_secrets, 0);
	}
	assert_true(http_secrets_parse(hp, " api = https://a.example/crm/ https://b.example:8443/;;"
	                               "other=http://127.0.0.1:9/x ", err, sizeof(err)));
	assert_int_equal(hp->n_secrets, 2);
	assert_non_null(mkdtemp(dir));
	hp->secrets_dir = dir;
	snprintf(file, sizeof(file), "%s/api", dir);
	fp = fopen(file, "w");
	assert_non_null(fp);
	fputs("tok-1\n", fp);
	fclose(fp);
	assert_true(http_secret_read(hp, "api", "https://a.example/crm/v1", out, sizeof(out), err,
	                             sizeof(err)));
	assert_string_equal(out, "tok-1");
	assert_true(http_secret_read(hp, "api", "https://b.example:8443/any", out, sizeof(out), err,
	                             sizeof(err)));
	assert_false(http_secret_read(hp, "api", "https://b.example/any", out, sizeof(out), err,
	                              sizeof(err)));
	assert_non_null(strstr(err, "may not be sent"));
	assert_false(http_secret_read(hp, "api", "https://a.example/crmx", out, sizeof(out), err,
	                              sizeof(err)));
	assert_false(http_secret_read(hp, "api", "https://a.example/crm/%2e%2e/admin", out,
	                              sizeof(out), err, sizeof(err)));
	assert_false(http_secret_read(hp, "nope", "https://a.example/crm/", out, sizeof(out), err,
	                              sizeof(err)));
	assert_non_null(strstr(err, "secret nope is not declared"));
	/* Declared, allowed, absent: the one reason, no directory in it. */
	assert_false(http_secret_read(hp, "other", "http://127.0.0.1:9/x", out, sizeof(out), err,
	                              sizeof(err)));
	assert_string_equal(err, "secret other is not available");
	unlink(file);
	rmdir(dir);
	hp->secrets_dir = NULL;
	http_secrets_free(hp);
	free(hp);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_answers_are_parse_url_s),
		cmocka_unit_test(test_shared_slots_long_urls),
		cmocka_unit_test(test_secrets_declared_per_prefix),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

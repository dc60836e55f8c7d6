/* SPDX-License-Identifier: ISC */
/*
 * instance.c: the crm provider's org, checked once at init: the instance
 * URL (https, or plain http only for a loopback test server; scheme, host
 * and port only), the REST API version, the sobjects base URL built from
 * them, and the form of the access token that goes into every request's
 * Authorization header.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crm/crm.h"

/* Plain http is for a local test server only: "localhost", 127.0.0.0/8
 * written as an address, or [::1].  ("127.example.com" is a name, not a
 * loopback address.) */
static bool is_loopback_host(const char *h)
{
	struct in_addr a4;

	if (strcmp(h, "localhost") == 0 || strcmp(h, "[::1]") == 0 || strcmp(h, "::1") == 0)
		return true;
	return inet_pton(AF_INET, h, &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127;
}

/* "v59.0": a v, digits and at least one inner dot, 4 to 8 characters. */
static bool api_version_ok(const char *v)
{
	size_t n = strlen(v);

	return n >= 4 && n <= 8 && v[0] == 'v' && isdigit((unsigned char)v[1]) &&
	       strspn(v + 1, "0123456789.") == n - 1 && strchr(v, '.') != NULL && v[n - 1] != '.';
}

bool crm_token_ok(const char *t)
{
	if (t[0] == '\0')
		return false;
	for (; *t; t++)
		if ((unsigned char)*t <= 0x20 || (unsigned char)*t == 0x7f)
			return false;
	return true;
}

/* c->sobjects_url: {instance_url}/services/data/{api_version}/sobjects/,
 * from the parsed URL without its trailing slashes. */
static bool set_sobjects_url(struct crm *c, CURLU *u, const char *api_version, char *err,
                             size_t errlen)
{
	char *base = NULL;
	size_t n;

	if (curl_url_get(u, CURLUPART_URL, &base, 0) != CURLUE_OK) {
		crm_fmt(err, errlen, "%s: cannot rebuild the URL",
		        c->host->conf_where(c->conf, "instance_url"));
		return false;
	}
	n = strlen(base);
	while (n > 0 && base[n - 1] == '/')
		base[--n] = '\0';
	c->sobjects_url = text_alloc(n + strlen(api_version) + 32);
	sprintf(c->sobjects_url, "%s/services/data/%s/sobjects/", base, api_version);
	curl_free(base);
	return true;
}

/* The parts of an instance URL that decide whether it is usable. */
struct url_parts {
	char *scheme, *hostname, *port, *path, *query, *frag, *user;
};

static void url_parts_free(struct url_parts *p)
{
	curl_free(p->scheme);
	curl_free(p->hostname);
	curl_free(p->port);
	curl_free(p->path);
	curl_free(p->query);
	curl_free(p->frag);
	curl_free(p->user);
}

/* Parses url into u and p; false (with err) for an empty, overlong or
 * unparsable URL. */
static bool split_url(struct crm *c, CURLU *u, const char *url, struct url_parts *p, char *err,
                      size_t errlen)
{
	const char *where = c->host->conf_where(c->conf, "instance_url");

	if (strlen(url) > CRM_INSTANCE_URL_MAX) {
		crm_fmt(err, errlen, "%s: longer than %d characters", where, CRM_INSTANCE_URL_MAX);
		return false;
	}
	if (url[0] == '\0') {
		crm_fmt(err, errlen, "%s: required: the org's URL, e.g. https://example.my.salesforce.com",
		        where);
		return false;
	}
	if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_SCHEME, &p->scheme, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_HOST, &p->hostname, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_PORT, &p->port, CURLU_DEFAULT_PORT) != CURLUE_OK) {
		crm_fmt(err, errlen, "%s: not a URL: \"%.200s\"", where, url);
		return false;
	}
	curl_url_get(u, CURLUPART_PATH, &p->path, 0);
	curl_url_get(u, CURLUPART_QUERY, &p->query, 0);
	curl_url_get(u, CURLUPART_FRAGMENT, &p->frag, 0);
	curl_url_get(u, CURLUPART_USER, &p->user, 0);
	return true;
}

/* Sets c->protocols from the scheme; refuses a path, query, fragment or
 * user. */
static bool check_url_parts(struct crm *c, const struct url_parts *p, const char *url, char *err,
                            size_t errlen)
{
	const char *where = c->host->conf_where(c->conf, "instance_url");

	if (strcmp(p->scheme, "https") == 0) {
		c->protocols = "https";
	} else if (strcmp(p->scheme, "http") == 0 && is_loopback_host(p->hostname)) {
		c->protocols = "http";
	} else {
		crm_fmt(err, errlen, "%s: must be https:// (plain http only for a loopback test server), "
		        "got \"%.200s\"", where, url);
		return false;
	}
	if ((p->path && strcmp(p->path, "/") != 0 && p->path[0] != '\0') || p->query || p->frag ||
	    p->user) {
		crm_fmt(err, errlen, "%s: give only scheme, host and port (no path, query or user), "
		        "got \"%.200s\"", where, url);
		return false;
	}
	return true;
}

bool crm_parse_instance_url(struct crm *c, const char *url, const char *api_version,
                            char *err, size_t errlen)
{
	CURLU *u = curl_url();
	struct url_parts p = { 0 };
	bool ok = false;

	if (u == NULL) {
		crm_fmt(err, errlen, "out of memory");
		return false;
	}
	if (!split_url(c, u, url, &p, err, errlen) || !check_url_parts(c, &p, url, err, errlen))
		goto out;
	if (!api_version_ok(api_version)) {
		crm_fmt(err, errlen, "%s: must look like v59.0, got \"%.32s\"",
		        c->host->conf_where(c->conf, "api_version"), api_version);
		goto out;
	}
	if (!set_sobjects_url(c, u, api_version, err, errlen))
		goto out;
	crm_fmt(c->host_key, sizeof(c->host_key), "%s:%s", p.hostname, p.port);
	ok = true;
out:
	url_parts_free(&p);
	curl_url_cleanup(u);
	return ok;
}

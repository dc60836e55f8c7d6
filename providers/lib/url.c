/* SPDX-License-Identifier: ISC */
/*
 * url.c: http(s) URLs split by libcurl's URL API, their origin, and URL
 * prefixes matched on parsed parts (see url.h).
 */
#include "lib/url.h"

#include <ctype.h>
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "text.h"

static void lower(char *s)
{
	for (; *s; s++)
		*s = (char)tolower((unsigned char)*s);
}

static bool has_part(CURLU *u, CURLUPart what)
{
	char *v = NULL;
	bool has = curl_url_get(u, what, &v, 0) == CURLUE_OK && v != NULL;

	curl_free(v);
	return has;
}

bool url_split(const char *url, struct url_parts *u, char **path, char *err, size_t errlen)
{
	CURLU *cu = curl_url();
	char *sch = NULL, *h = NULL, *p = NULL, *pa = NULL;
	bool ok = false;
	CURLUcode rc;

	memset(u, 0, sizeof(*u));
	if (path)
		*path = NULL;
	if (cu == NULL) {
		snprintf(err, errlen, "out of memory");
		return false;
	}
	rc = curl_url_set(cu, CURLUPART_URL, url, 0);
	if (rc != CURLUE_OK) {
		snprintf(err, errlen, "target is not a valid URL: %s", curl_url_strerror(rc));
		goto out;
	}
	if (curl_url_get(cu, CURLUPART_SCHEME, &sch, 0) != CURLUE_OK ||
	    (strcasecmp(sch, "http") != 0 && strcasecmp(sch, "https") != 0)) {
		snprintf(err, errlen, "target URL scheme must be http or https");
		goto out;
	}
	if (curl_url_get(cu, CURLUPART_HOST, &h, 0) != CURLUE_OK || h[0] == '\0') {
		snprintf(err, errlen, "target URL has no host");
		goto out;
	}
	/* IDN and full-width names would be converted (or refused) by the
	 * resolver only at send time, after the allow-list had compared other
	 * bytes: refuse them here; the punycode form (xn--...) is plain ASCII. */
	for (const char *c = h; *c; c++)
		if ((unsigned char)*c >= 0x80 || *c == '%') {
			snprintf(err, errlen, "target URL host is not plain ASCII (internationalized, "
			         "full-width or percent-encoded names are not supported: write the "
			         "punycode form, xn--...)");
			goto out;
		}
	if (h[strlen(h) - 1] == '.') {
		snprintf(err, errlen, "target URL host ends with a dot (write the name without it)");
		goto out;
	}
	if (curl_url_get(cu, CURLUPART_PORT, &p, CURLU_DEFAULT_PORT) != CURLUE_OK) {
		snprintf(err, errlen, "target URL has no usable port");
		goto out;
	}
	if (strlen(h) >= sizeof(u->host)) {
		snprintf(err, errlen, "target URL host is longer than %zu bytes", sizeof(u->host) - 1);
		goto out;
	}
	snprintf(u->scheme, sizeof(u->scheme), "%s", sch);
	lower(u->scheme);
	/* Without IPv6 brackets, so the allow-list compares the address. */
	if (h[0] == '[') {
		size_t n = strlen(h);
		snprintf(u->host, sizeof(u->host), "%.*s", (int)(n > 2 ? n - 2 : 0), h + 1);
	} else {
		snprintf(u->host, sizeof(u->host), "%s", h);
	}
	lower(u->host);
	u->port = strtol(p, NULL, 10);
	u->has_userinfo = has_part(cu, CURLUPART_USER) || has_part(cu, CURLUPART_PASSWORD);
	u->has_query = has_part(cu, CURLUPART_QUERY) || has_part(cu, CURLUPART_FRAGMENT);
	if (path) {
		if (curl_url_get(cu, CURLUPART_PATH, &pa, 0) != CURLUE_OK) {
			snprintf(err, errlen, "target URL has no usable path");
			goto out;
		}
		*path = text_strdup(pa[0] ? pa : "/");
	}
	ok = true;
out:
	curl_free(sch);
	curl_free(h);
	curl_free(p);
	curl_free(pa);
	curl_url_cleanup(cu);
	return ok;
}

bool url_origin(const struct url_parts *u, char *out, size_t len)
{
	long dflt = strcmp(u->scheme, "https") == 0 ? 443 : 80;
	bool v6 = strchr(u->host, ':') != NULL;
	char port[16] = "";
	int n;

	if (u->port != dflt)
		snprintf(port, sizeof(port), ":%ld", u->port);
	n = snprintf(out, len, "%s://%s%s%s%s", u->scheme, v6 ? "[" : "", u->host, v6 ? "]" : "", port);
	return n >= 0 && (size_t)n < len;
}

bool url_prefix_parse(const char *entry, struct url_prefix *p, char *err, size_t errlen)
{
	char *url = NULL;
	bool ok;

	memset(p, 0, sizeof(*p));
	if (strstr(entry, "://") == NULL) {
		/* A host name or address alone: https, port 443, any path. */
		size_t colons = 0;
		for (const char *c = entry; *c; c++) {
			colons += *c == ':';
			if (strchr("/@?#[]", *c) || (unsigned char)*c <= 0x20) {
				snprintf(err, errlen, "\"%.64s\": a host name alone, or a URL prefix "
				         "(https://host[:port]/path)", entry);
				return false;
			}
		}
		if (colons == 1) {
			snprintf(err, errlen, "\"%.64s\": a host name alone means https on port 443; "
			         "for another port write the URL prefix (https://host:port/)", entry);
			return false;
		}
		url = text_alloc(strlen(entry) + 16);
		sprintf(url, colons ? "https://[%s]/" : "https://%s/", entry);
	} else {
		url = text_strdup(entry);
	}
	ok = url_split(url, &p->at, &p->path, err, errlen);
	free(url);
	if (!ok) {
		char why[200];
		snprintf(why, sizeof(why), "%s", err);
		snprintf(err, errlen, "\"%.64s\": %s", entry, why);
		return false;
	}
	if (p->at.has_userinfo || p->at.has_query) {
		snprintf(err, errlen, "\"%.64s\": a URL prefix has no user, password, query or "
		         "fragment", entry);
		url_prefix_free(p);
		return false;
	}
	return true;
}

void url_prefix_free(struct url_prefix *p)
{
	free(p->path);
	p->path = NULL;
}

const char *url_path_ambiguous(const char *path)
{
	static const char *const encoded[] = { "%2e", "%2f", "%5c", NULL };

	if (strchr(path, '\\') != NULL)
		return "the target URL path contains a backslash, which servers may read as '/'";
	for (const char *const *x = encoded; *x; x++)
		if (strcasestr(path, *x) != NULL)
			return "the target URL path contains %2e, %2f or %5c, which servers may decode "
			       "into another path than the one matched";
	return NULL;
}

bool url_prefix_matches(const struct url_prefix *p, const struct url_parts *t, const char *path)
{
	size_t n = strlen(p->path);

	if (url_path_ambiguous(path) != NULL)
		return false;
	if (strcmp(p->at.scheme, t->scheme) != 0 || strcmp(p->at.host, t->host) != 0 ||
	    p->at.port != t->port)
		return false;
	if (strncmp(path, p->path, n) != 0)
		return false;
	return path[n] == '\0' || path[n] == '/' || (n > 0 && p->path[n - 1] == '/');
}

/* SPDX-License-Identifier: ISC */
/*
 * target.c: the http provider's target URL (parsed by libcurl, checked for
 * the SSRF rules' sake: plain-ASCII host, no trailing dot, http/https
 * only), a cache of parsed targets, and the check of an effect's payload
 * (method, headers, body) that validate() runs before any attempt.
 */
#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "http/http.h"
#include "lib/json_text.h"
#include "lib/netrules.h"

static bool has_ctl(const char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || *s == 0x7f)
			return true;
	return false;
}

static bool token_char(char c)
{
	return isalnum((unsigned char)c) || strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static bool reserved_header(const char *name)
{
	static const char *const reserved[] = {
		"idempotency-key", "host", "content-length", "transfer-encoding", "connection",
		"webhook-id", "webhook-timestamp", "webhook-signature", "expect", NULL,
	};

	for (const char *const *r = reserved; *r; r++)
		if (strcasecmp(name, *r) == 0)
			return true;
	return false;
}

bool http_parse_url(const char *url, char *scheme, size_t slen, char *host, size_t hlen,
                    long *port, char *err, size_t errlen)
{
	CURLU *u = curl_url();
	char *sch = NULL, *h = NULL, *p = NULL;
	bool ok = false;
	CURLUcode rc;

	if (u == NULL) {
		snprintf(err, errlen, "out of memory");
		return false;
	}
	rc = curl_url_set(u, CURLUPART_URL, url, 0);
	if (rc != CURLUE_OK) {
		snprintf(err, errlen, "target is not a valid URL: %s", curl_url_strerror(rc));
		goto out;
	}
	if (curl_url_get(u, CURLUPART_SCHEME, &sch, 0) != CURLUE_OK ||
	    (strcasecmp(sch, "http") != 0 && strcasecmp(sch, "https") != 0)) {
		snprintf(err, errlen, "target URL scheme must be http or https");
		goto out;
	}
	if (curl_url_get(u, CURLUPART_HOST, &h, 0) != CURLUE_OK || h[0] == '\0') {
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
	if (curl_url_get(u, CURLUPART_PORT, &p, CURLU_DEFAULT_PORT) != CURLUE_OK) {
		snprintf(err, errlen, "target URL has no usable port");
		goto out;
	}
	snprintf(scheme, slen, "%s", sch);
	for (char *c = scheme; *c; c++)
		*c = (char)tolower((unsigned char)*c);
	/* Strip IPv6 brackets so the allow-list compares the address. */
	if (h[0] == '[') {
		size_t n = strlen(h);
		snprintf(host, hlen, "%.*s", (int)(n > 2 ? n - 2 : 0), h + 1);
	} else {
		snprintf(host, hlen, "%s", h);
	}
	for (char *c = host; *c; c++)
		*c = (char)tolower((unsigned char)*c);
	*port = strtol(p, NULL, 10);
	ok = true;
out:
	curl_free(sch);
	curl_free(h);
	curl_free(p);
	curl_url_cleanup(u);
	return ok;
}

/* http_parse_url(), remembered: the same answer, from the cache when the URL
 * was parsed before (failures are not kept: they are rare, and their
 * message would have to be). */
bool http_target_parse(struct http_provider *hp, const char *url, char *scheme, size_t slen,
                       char *host, size_t hlen, long *port, char *err, size_t errlen)
{
	unsigned h = 2166136261u;
	size_t len = 0;
	struct parsed_url *slot;

	for (const char *c = url; *c; c++, len++)
		h = (h ^ (unsigned char)*c) * 16777619u;
	/* FNV-1a's low bits see only the bytes' low bits: fold the high in. */
	slot = &hp->urls[(h ^ (h >> 16)) % HTTP_URL_CACHE];
	if (slot->url == NULL || strcmp(slot->url, url) != 0) {
		struct parsed_url fresh;

		if (!http_parse_url(url, fresh.scheme, sizeof(fresh.scheme), fresh.host, sizeof(fresh.host),
		                    &fresh.port, err, errlen))
			return false;
		if (len > HTTP_URL_CACHE_MAX || (fresh.url = strdup(url)) == NULL) {
			snprintf(scheme, slen, "%s", fresh.scheme);
			snprintf(host, hlen, "%s", fresh.host);
			*port = fresh.port;
			return true;
		}
		free(slot->url);
		*slot = fresh;
	}
	snprintf(scheme, slen, "%s", slot->scheme);
	snprintf(host, hlen, "%s", slot->host);
	*port = slot->port;
	return true;
}

/* payload.headers: an object of at most HTTP_MAX_HEADERS strings, with
 * token names, no control characters, none the dispatcher sets itself, and
 * no line that would be cut. */
static bool check_headers(const json_t *headers, char *err, size_t errlen)
{
	const char *k;
	json_t *v;

	if (headers == NULL || json_is_null(headers))
		return true;
	if (!json_is_object(headers)) {
		snprintf(err, errlen, "payload.headers must be an object of strings");
		return false;
	}
	if (json_object_size(headers) > HTTP_MAX_HEADERS) {
		snprintf(err, errlen, "payload.headers has more than %d headers", HTTP_MAX_HEADERS);
		return false;
	}
	json_object_foreach((json_t *)headers, k, v) {
		if (k[0] == '\0' || strlen(k) > 256) {
			snprintf(err, errlen, "payload.headers: empty or overlong header name");
			return false;
		}
		for (const char *c = k; *c; c++)
			if (!token_char(*c)) {
				snprintf(err, errlen, "payload.headers: header name \"%.64s\" has invalid characters (CR/LF injection?)", k);
				return false;
			}
		if (!json_is_string(v)) {
			snprintf(err, errlen, "payload.headers.%.64s must be a string", k);
			return false;
		}
		if (has_ctl(json_string_value(v))) {
			snprintf(err, errlen, "payload.headers.%.64s contains CR/LF or control characters", k);
			return false;
		}
		if (reserved_header(k)) {
			snprintf(err, errlen, "payload.headers.%.64s is set by the dispatcher", k);
			return false;
		}
		if (strlen(k) + 2 + strlen(json_string_value(v)) > HTTP_MAX_HEADER_LINE) {
			snprintf(err, errlen, "payload.headers.%.64s: the header line is longer than "
			         "%d bytes (it would be cut)", k, HTTP_MAX_HEADER_LINE);
			return false;
		}
	}
	return true;
}

/* Any JSON value or string is a valid body (and jsonb made it valid
 * JSON): it is read from the text when sent, see body_text() in
 * request.c.  A string body is decoded then; one jansson cannot decode
 * (bytes that are not UTF-8, in a database whose encoding let them in)
 * fails here, before any attempt, rather than at every send. */
static bool check_body(const struct outbox_effect *e, char *err, size_t errlen)
{
	const char *raw;
	size_t raw_len;

	if (e->payload_text && json_text_member(e->payload_text, e->payload_len, "body", &raw, &raw_len) &&
	    raw[0] == '"') {
		json_t *str = json_loadb(raw, raw_len, JSON_DECODE_ANY, NULL);
		bool is_string = json_is_string(str);

		json_decref(str);
		if (!is_string) {
			snprintf(err, errlen, "payload.body is not a valid JSON string (not UTF-8?)");
			return false;
		}
	}
	return true;
}

bool http_validate(void *self, const struct outbox_effect *e, char *host_key,
                   size_t host_keylen, char *err, size_t errlen)
{
	struct http_provider *hp = self;
	const json_t *method;
	char scheme[16], host[256];
	long port;

	if (strlen(e->target) > 8192) {
		snprintf(err, errlen, "target URL longer than 8192 bytes");
		return false;
	}
	if (has_ctl(e->target)) {
		snprintf(err, errlen, "target URL contains control characters (CR/LF injection?)");
		return false;
	}
	if (!http_target_parse(hp, e->target, scheme, sizeof(scheme), host, sizeof(host), &port, err, errlen))
		return false;
	if (!netrules_host_allowed_by_name(hp->rules, host, err, errlen))
		return false;
	method = json_object_get(e->payload, "method");
	if (method && (!json_is_string(method) ||
	               (strcmp(json_string_value(method), "POST") && strcmp(json_string_value(method), "PUT") &&
	                strcmp(json_string_value(method), "PATCH") && strcmp(json_string_value(method), "DELETE")))) {
		snprintf(err, errlen, "payload.method must be one of POST, PUT, PATCH, DELETE");
		return false;
	}
	if (!check_headers(json_object_get(e->payload, "headers"), err, errlen) ||
	    !check_body(e, err, errlen))
		return false;
	snprintf(host_key, host_keylen, "%s://%s:%ld", scheme, host, port);
	return true;
}

void http_target_cache_free(struct http_provider *hp)
{
	for (int i = 0; i < HTTP_URL_CACHE; i++) {
		free(hp->urls[i].url);
		hp->urls[i].url = NULL;
	}
}

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
#include "hostname.h"
#include "json_text.h"
#include "lib/netrules.h"
#include "text.h"
#include "lib/url.h"

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

const char *http_secret_header_refused(const struct http_provider *hp, const char *name)
{
	/* Read from the answer: a peer that echoes the request's header there
	 * (many routers copy X-Request-Id back) would hand the secret to the
	 * provider id, which producers read. */
	static const char *const answer[] = { "x-request-id", "location", "content-location", NULL };
	/* Hop-by-hop, framing, and what intermediaries rewrite, log or echo:
	 * a credential has no business there. */
	static const char *const framing[] = {
		"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
		"transfer-encoding", "upgrade", "content-length", "content-type", "content-encoding",
		"content-range", "range", "host", "expect", "via", "forwarded", "user-agent", "referer",
		"origin", "date", "accept", "accept-encoding", "accept-language", "accept-charset",
		"traceparent", "tracestate", "x-correlation-id", "x-trace-id", "retry-after", NULL,
	};

	if (hp->id_header[0] && strcasecmp(name, hp->id_header) == 0)
		return "it is the header the provider id is read from (provider_id_header)";
	for (const char *const *r = answer; *r; r++)
		if (strcasecmp(name, *r) == 0)
			return "the provider id is read from this header of the answer";
	for (const char *const *r = framing; *r; r++)
		if (strcasecmp(name, *r) == 0)
			return "a hop-by-hop, framing or tracing header never carries a secret";
	if (strncasecmp(name, "x-forwarded-", 12) == 0)
		return "a hop-by-hop, framing or tracing header never carries a secret";
	return NULL;
}

bool http_parse_url(const char *url, char *scheme, size_t slen, char *host, size_t hlen,
                    long *port, char *err, size_t errlen)
{
	struct url_parts u;

	if (!url_split(url, &u, NULL, err, errlen))
		return false;
	snprintf(scheme, slen, "%s", u.scheme);
	snprintf(host, hlen, "%s", u.host);
	*port = u.port;
	return true;
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
		if (len > HTTP_URL_CACHE_MAX) {
			snprintf(scheme, slen, "%s", fresh.scheme);
			snprintf(host, hlen, "%s", fresh.host);
			*port = fresh.port;
			return true;
		}
		fresh.url = text_strdup(url);
		free(slot->url);
		*slot = fresh;
	}
	snprintf(scheme, slen, "%s", slot->scheme);
	snprintf(host, hlen, "%s", slot->host);
	*port = slot->port;
	return true;
}

/* A header value naming a secret: {"secret": NAME} or {"secret": NAME,
 * "prefix": TEXT}; the secret is read now, so an undeclared, missing or
 * unusable one, or one not declared for this target, fails the effect
 * before any attempt (and is read again at send time). */
static bool check_secret_ref(const struct http_provider *hp, const char *target, const char *k,
                             const json_t *v, char *err, size_t errlen)
{
	const json_t *name = json_object_get(v, "secret"), *prefix = json_object_get(v, "prefix");
	char value[HTTP_SECRET_MAX + 2], why[256];
	size_t n = prefix ? 2 : 1;
	const char *refused = http_secret_header_refused(hp, k);
	bool ok;

	if (refused) {
		snprintf(err, errlen, "payload.headers.%.64s may not name a secret: %s", k, refused);
		return false;
	}
	if (name == NULL || json_object_size(v) != n || (prefix && !json_is_string(prefix))) {
		snprintf(err, errlen, "payload.headers.%.64s: a string, or an object with \"secret\" "
		         "and optionally \"prefix\" (a string)", k);
		return false;
	}
	if (!json_is_string(name) || !http_secret_name_ok(json_string_value(name))) {
		snprintf(err, errlen, "payload.headers.%.64s: the secret's name is not a plain file name "
		         "(letters, digits, '_', '-', '.', not starting with '.', at most %d)", k,
		         HTTP_SECRET_NAME_MAX);
		return false;
	}
	if (prefix && has_ctl(json_string_value(prefix))) {
		snprintf(err, errlen, "payload.headers.%.64s.prefix contains CR/LF or control characters", k);
		return false;
	}
	ok = http_secret_read(hp, json_string_value(name), target, value, sizeof(value), why,
	                      sizeof(why));
	if (ok && strlen(k) + 2 + (prefix ? strlen(json_string_value(prefix)) : 0) + strlen(value) >
	              HTTP_MAX_HEADER_LINE) {
		snprintf(why, sizeof(why), "the header line would be longer than %d bytes",
		         HTTP_MAX_HEADER_LINE);
		ok = false;
	}
	explicit_bzero(value, sizeof(value));
	if (!ok)
		snprintf(err, errlen, "payload.headers.%.64s: %s", k, why);
	return ok;
}

/* payload.headers: an object of at most HTTP_MAX_HEADERS strings (or
 * secret references), with token names, no control characters, none the
 * dispatcher sets itself, and no line that would be cut. */
static bool check_headers(const struct http_provider *hp, const char *target, const json_t *headers,
                          char *err, size_t errlen)
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
		if (reserved_header(k)) {
			snprintf(err, errlen, "payload.headers.%.64s is set by the dispatcher", k);
			return false;
		}
		if (json_is_object(v)) {
			if (!check_secret_ref(hp, target, k, v, err, errlen))
				return false;
			continue;
		}
		if (!json_is_string(v)) {
			snprintf(err, errlen, "payload.headers.%.64s must be a string (or {\"secret\": NAME})", k);
			return false;
		}
		if (has_ctl(json_string_value(v))) {
			snprintf(err, errlen, "payload.headers.%.64s contains CR/LF or control characters", k);
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
	char scheme[16], host[256], canon[256];
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
	if (!check_headers(hp, e->target, json_object_get(e->payload, "headers"), err, errlen) ||
	    !check_body(e, err, errlen))
		return false;
	/* One key per address, however the target spells it (an IPv4-mapped
	 * address is the IPv4 one): per-host concurrency, the breaker and the
	 * scopes see one host. */
	host_canon(host, canon, sizeof(canon));
	snprintf(host_key, host_keylen, "%s://%s:%ld", scheme, canon, port);
	return true;
}

void http_target_cache_free(struct http_provider *hp)
{
	for (int i = 0; i < HTTP_URL_CACHE; i++) {
		free(hp->urls[i].url);
		hp->urls[i].url = NULL;
	}
}

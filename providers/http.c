/*
 * http.c: the generic webhook/API provider, on libcurl's multi interface
 * inside the worker's event loop.
 *
 * Target: the URL.  Payload: {"method": "POST", "headers": {...},
 * "body": <JSON value or string>}.  Every request carries
 * `Idempotency-Key: <effect key>`, and Standard Webhooks signature headers
 * when a signing secret is configured.
 *
 * SSRF rules: only http/https; redirects never followed; no proxy unless
 * configured; every address libcurl is about to connect to is checked in
 * CURLOPT_OPENSOCKETFUNCTION (so the checked address is the one used):
 * loopback, private, link-local (cloud metadata), CGNAT, multicast and
 * unspecified addresses are refused unless allow_hosts lists the host name
 * or the address/range; public addresses are allowed unless
 * public_targets = false, in which case they too must be listed.
 *
 * Classification ("did a request byte leave?"): no request byte written
 * (CURLINFO_REQUEST_SIZE == 0: no address, no connection, TLS not up, or a
 * connection that failed before the first write) → not sent; any byte
 * written and no trustworthy status → ambiguous.  The connect time is not
 * used: it is 0 on a reused connection whatever happened after.
 *
 * Keep-alive without ever sending a request twice.  Connections are reused
 * for keepalive_idle_seconds of idleness (0: one connection per call).
 * libcurl, when a *reused* connection dies before any response byte, sends
 * the request again on a new connection by itself (Curl_retry_request; a
 * POST too): a duplicate if the server had taken the first.  Every request
 * libcurl is about to send, first or retried, passes through
 * CURLOPT_PREREQFUNCTION; on_prereq() lets the first through and aborts any
 * later one for the same call, so a request is written at most once.  If
 * bytes of the first were written the call is ambiguous ("connection closed
 * after the request was written, before any answer; not re-sent"), else not
 * sent.  libcurl also drops a pooled connection that the server has closed
 * before reusing it; the short idle age narrows the remaining race (the
 * server closing as our request arrives) to an `unknown`, never a
 * duplicate.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <stdarg.h>
#include <curl/curl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "lib/curl_loop.h"
#include "lib/http_lookup.h"
#include "lib/json_text.h"
#include "lib/netrules.h"
#include "lib/sign.h"
#include "provider.h"

#define HTTP_MAX_HEADERS 64
/* "Name: value" of one payload header, in bytes: what common servers
 * accept in one line (add_header() never cuts a longer one). */
#define HTTP_MAX_HEADER_LINE 8000
/* Idle easy handles kept for reuse (curl_easy_reset, not init/cleanup). */
#define HTTP_EASY_POOL 64
/* libcurl's receive buffer per transfer (default 16 KiB; 1 KiB is its
 * minimum).  The bodies kept are small (max_response_bytes is enforced in
 * on_body); with 1,000 sends in flight 4 KiB saved ~1 MiB of RSS, 1 KiB ~4. */
#define HTTP_RECV_BUFFER 1024L
/* Parsed targets kept (direct-mapped by a hash of the URL), and the longest
 * URL kept: 64 x 1 KiB at most. */
#define HTTP_URL_CACHE 64
#define HTTP_URL_CACHE_MAX 1024

static const struct outbox_conf_key http_keys[] = {
	{ "allow_hosts", CONF_STR, "", 0, 0,
	  "host names, addresses or CIDR ranges that may be reached even if private/loopback" },
	{ "public_targets", CONF_BOOL, "true", 0, 0, "public addresses allowed without being listed" },
	{ "provider_id_header", CONF_STR, "", 0, 0, "response header holding the provider id" },
	{ "provider_id_json", CONF_STR, "id", 0, 0, "top-level JSON field holding the provider id" },
	{ "signing_secret", CONF_SECRET, "", 0, 0, "Standard Webhooks secret (whsec_...); empty: unsigned" },
	{ "user_agent", CONF_STR, "outbox-dispatcher/0.1", 0, 0, "User-Agent header" },
	{ "max_response_bytes", CONF_INT, "65536", 0, 16777216, "response body kept for the provider id" },
	{ "ca_file", CONF_STR, "", 0, 0, "CA bundle for TLS verification; empty: the system's" },
	{ "proxy", CONF_STR, "", 0, 0, "HTTP proxy URL; empty: none (environment proxies ignored)" },
	{ "keepalive_idle_seconds", CONF_INT, "1", 0, 60,
	  "reuse a connection idle at most this long; 0: one connection per call" },
	/* reconciliation by lookup (lib/http_lookup.c); off while reconcile_url is empty */
	{ "reconcile_url", CONF_STR, "", 0, 0,
	  "lookup URL for unknown effects ({key}, {effect_id}, {origin}); empty: no lookup" },
	{ "reconcile_targets", CONF_STR, "", 0, 0,
	  "targets the lookup answers for: URL prefixes or host names, comma or space separated" },
	{ "reconcile_method", CONF_STR, "GET", 0, 0, "lookup request method" },
	{ "reconcile_found_status", CONF_STR, "200", 0, 0, "statuses meaning found (comma separated)" },
	{ "reconcile_not_found_status", CONF_STR, "404", 0, 0,
	  "statuses meaning definitively not found (comma separated)" },
	{ "reconcile_id_json", CONF_STR, "/id", 0, 0,
	  "JSON pointer to the provider id in a found answer; empty: not read" },
	{ "reconcile_id_header", CONF_STR, "", 0, 0,
	  "response header holding the provider id in a found answer (before the JSON)" },
	{ "reconcile_header", CONF_SECRET, "", 0, 0,
	  "one extra lookup request header \"Name: value\" (e.g. Authorization); file: or env: too" },
	{ "reconcile_min_age_seconds", CONF_INT, "300", 1, 604800,
	  "not found counts only this long after the last attempt started" },
	{ "reconcile_timeout_ms", CONF_INT, "5000", 10, 600000, "whole lookup timeout" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

/* A target URL as parse_url() split it. */
struct parsed_url {
	char *url;                 /* the text parsed; NULL: empty slot */
	char scheme[16];
	char host[256];
	long port;
};

struct http_provider {
	const struct outbox_host *host;
	/* validate() and send() of an effect, and every effect to the same
	 * endpoint, need the same parse: libcurl's URL parser was ~7 % of the
	 * worker's instructions.  A parse depends on the text alone. */
	struct parsed_url urls[HTTP_URL_CACHE];
	struct curl_loop *loop;
	struct netrules *rules;
	long timeout_ms, connect_timeout_ms, max_response, keepalive_idle;
	char *id_header, *id_json, *user_agent, *ca_file, *proxy;
	unsigned char secret[256];
	long secret_len;
	CURL *pool[HTTP_EASY_POOL]; /* idle easy handles, reset */
	int pool_len;
	struct http_lookup *lookup; /* reconciliation (lib/http_lookup.c); NULL: off */
};

/* One send in flight (kept small: a worker may hold a thousand). */
struct http_call {
	struct http_provider *hp;
	CURL *easy;
	outbox_done_fn done;
	void *token;
	struct curl_slist *headers;
	char *body;
	const char *target;        /* the effect's: valid until done has returned */
	const char *effect_key;    /* likewise */
	char *resp;
	size_t resp_len;
	char *hdr_id, *request_id, *location; /* response headers, when present */
	long resend_bytes;         /* request bytes written when a resend was refused */
	int attempt;
	int prereq_calls;          /* requests libcurl was about to send */
	bool resend_refused;       /* libcurl wanted to send the request again: refused */
	bool host_listed;          /* allow_hosts names this host: all its addresses pass */
	bool refused;              /* an address was refused by the SSRF rules */
	bool resp_truncated;
	char refused_addr[INET6_ADDRSTRLEN];
};

/* ---- validation --------------------------------------------------------- */

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

static bool parse_url(const char *url, char *scheme, size_t slen, char *host, size_t hlen,
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

/* parse_url(), remembered: the same answer, from the cache when the URL
 * was parsed before (failures are not kept: they are rare, and their
 * message would have to be). */
static bool target_parse(struct http_provider *hp, const char *url, char *scheme, size_t slen,
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

		if (!parse_url(url, fresh.scheme, sizeof(fresh.scheme), fresh.host, sizeof(fresh.host),
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

static bool http_validate(void *self, const struct outbox_effect *e, char *host_key,
                          size_t host_keylen, char *err, size_t errlen)
{
	struct http_provider *hp = self;
	const json_t *method, *headers;
	const char *k, *raw;
	size_t raw_len;
	json_t *v;
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
	if (!target_parse(hp, e->target, scheme, sizeof(scheme), host, sizeof(host), &port, err, errlen))
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
	headers = json_object_get(e->payload, "headers");
	if (headers && !json_is_null(headers)) {
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
	}
	/* Any JSON value or string is a valid body (and jsonb made it valid
	 * JSON): it is read from the text when sent, see body_text().  A
	 * string body is decoded then; one jansson cannot decode (bytes that
	 * are not UTF-8, in a database whose encoding let them in) fails here,
	 * before any attempt, rather than at every send. */
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
	snprintf(host_key, host_keylen, "%s://%s:%ld", scheme, host, port);
	return true;
}

/* ---- the request -------------------------------------------------------- */

static curl_socket_t open_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *a)
{
	struct http_call *c = arg;
	curl_socket_t fd;

	(void)purpose;
	if (!c->host_listed && !netrules_addr_allowed(c->hp->rules, &a->addr)) {
		c->refused = true;
		netrules_format_addr(&a->addr, c->refused_addr, sizeof(c->refused_addr));
		return CURL_SOCKET_BAD;
	}
	fd = socket(a->family, a->socktype, a->protocol);
	return fd < 0 ? CURL_SOCKET_BAD : fd;
}

static size_t on_body(char *ptr, size_t size, size_t nmemb, void *arg)
{
	struct http_call *c = arg;
	size_t n = size * nmemb, room;

	if (c->resp_len >= (size_t)c->hp->max_response) {
		c->resp_truncated = true;
		return n;
	}
	room = (size_t)c->hp->max_response - c->resp_len;
	if (n > room) {
		c->resp_truncated = true;
		n = room;
	}
	char *grown = realloc(c->resp, c->resp_len + n + 1);
	if (grown == NULL)
		return 0;
	c->resp = grown;
	memcpy(c->resp + c->resp_len, ptr, n);
	c->resp_len += n;
	c->resp[c->resp_len] = '\0';
	return size * nmemb;
}

/* *out = the header's value (trimmed, at most OUTBOX_PROVIDER_ID_MAX - 1
 * bytes); a later header of the same name replaces it. */
static void header_value(const char *line, size_t n, size_t namelen, char **out)
{
	const char *v = line + namelen + 1;
	const char *end = line + n;
	size_t len;
	char *copy;

	while (v < end && (*v == ' ' || *v == '\t'))
		v++;
	while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
		end--;
	len = (size_t)(end - v);
	if (len > OUTBOX_PROVIDER_ID_MAX - 1)
		len = OUTBOX_PROVIDER_ID_MAX - 1;
	copy = malloc(len + 1);
	if (copy == NULL)
		return;
	memcpy(copy, v, len);
	copy[len] = '\0';
	free(*out);
	*out = copy;
}

static size_t on_header(char *line, size_t size, size_t nitems, void *arg)
{
	struct http_call *c = arg;
	size_t n = size * nitems;
	const char *colon = memchr(line, ':', n);
	size_t namelen;

	if (colon == NULL)
		return n;
	namelen = (size_t)(colon - line);
	if (c->hp->id_header[0] && namelen == strlen(c->hp->id_header) &&
	    strncasecmp(line, c->hp->id_header, namelen) == 0)
		header_value(line, n, namelen, &c->hdr_id);
	else if (namelen == 12 && strncasecmp(line, "X-Request-Id", 12) == 0)
		header_value(line, n, namelen, &c->request_id);
	else if (namelen == 8 && strncasecmp(line, "Location", 8) == 0)
		header_value(line, n, namelen, &c->location);
	return n;
}

/* Called before libcurl sends a request on a connection (new or reused),
 * including the resend libcurl makes on its own after a reused connection
 * died before any response byte: that one is refused, so a request is
 * written at most once. */
static int on_prereq(void *arg, char *primary_ip, char *local_ip, int primary_port,
                     int local_port)
{
	struct http_call *c = arg;
	long written = 0;

	(void)primary_ip;
	(void)local_ip;
	(void)primary_port;
	(void)local_port;
	if (++c->prereq_calls == 1)
		return CURL_PREREQFUNC_OK;
	/* The request size is not reset by libcurl's retry: it still counts
	 * the bytes of the first request written. */
	if (curl_easy_getinfo(c->easy, CURLINFO_REQUEST_SIZE, &written) != CURLE_OK)
		written = 1; /* unknown: assume the worst */
	if (!c->resend_refused || written > c->resend_bytes)
		c->resend_bytes = written;
	c->resend_refused = true;
	return CURL_PREREQFUNC_ABORT;
}

/* ---- easy handles: a small pool ---------------------------------------- */

static CURL *easy_get(struct http_provider *hp)
{
	if (hp->pool_len > 0)
		return hp->pool[--hp->pool_len];
	return curl_easy_init();
}

/* The easy handle is out of the multi handle; its options (the call's
 * headers, body and callbacks, curl_loop's PRIVATE) are dropped here. */
static void easy_put(struct http_provider *hp, CURL *easy)
{
	if (hp->pool_len < HTTP_EASY_POOL) {
		curl_easy_reset(easy);
		hp->pool[hp->pool_len++] = easy;
	} else {
		curl_easy_cleanup(easy);
	}
}

static void call_free(struct http_call *c)
{
	curl_slist_free_all(c->headers);
	free(c->body);
	free(c->resp);
	free(c->hdr_id);
	free(c->request_id);
	free(c->location);
	free(c);
}

static void pick_provider_id(struct http_call *c, struct outbox_result *r)
{
	if (c->hdr_id && c->hdr_id[0]) {
		snprintf(r->provider_id, sizeof(r->provider_id), "%s", c->hdr_id);
		return;
	}
	if (c->resp && c->hp->id_json[0]) {
		json_t *doc = json_loadb(c->resp, c->resp_len, 0, NULL);
		json_t *v = json_is_object(doc) ? json_object_get(doc, c->hp->id_json) : NULL;
		if (json_is_string(v) && json_string_length(v) > 0)
			snprintf(r->provider_id, sizeof(r->provider_id), "%s", json_string_value(v));
		else if (json_is_integer(v))
			snprintf(r->provider_id, sizeof(r->provider_id), "%" JSON_INTEGER_FORMAT,
			         json_integer_value(v));
		json_decref(doc);
		if (r->provider_id[0])
			return;
	}
	if (c->request_id && c->request_id[0])
		snprintf(r->provider_id, sizeof(r->provider_id), "%s", c->request_id);
	else if (c->location && c->location[0])
		snprintf(r->provider_id, sizeof(r->provider_id), "%s", c->location);
	else
		snprintf(r->provider_id, sizeof(r->provider_id), "local:http-%d:%.16s:a%d", r->status,
		         c->effect_key, c->attempt);
}

static void classify_status(struct http_call *c, long status, CURL *easy, struct outbox_result *r)
{
	curl_off_t retry_after = 0;

	r->status = (int)status;
	if (status >= 200 && status < 300) {
		r->outcome = OUTCOME_ACCEPTED;
		pick_provider_id(c, r);
		return;
	}
	if (status == 429 || status == 503 || status == 409 || status == 408) {
		r->outcome = OUTCOME_RETRY;
		if (curl_easy_getinfo(easy, CURLINFO_RETRY_AFTER, &retry_after) == CURLE_OK && retry_after > 0)
			r->retry_after_ms = (long)retry_after * 1000;
		snprintf(r->error, sizeof(r->error), "HTTP %ld: %s", status,
		         status == 409 ? "key still in flight at the provider" : "provider asked to retry later");
		return;
	}
	if (status == 500 || status == 502 || status == 504 || (status >= 505 && status < 600)) {
		r->outcome = OUTCOME_AMBIGUOUS;
		snprintf(r->error, sizeof(r->error), "HTTP %ld: the request may have been processed", status);
		return;
	}
	r->outcome = OUTCOME_TERMINAL;
	if (status == 422) {
		r->key_conflict = true;
		snprintf(r->error, sizeof(r->error),
		         "HTTP 422: the provider refused the payload (same key, different payload?)");
	} else if (status >= 300 && status < 400) {
		snprintf(r->error, sizeof(r->error), "HTTP %ld: redirects are not followed", status);
	} else {
		snprintf(r->error, sizeof(r->error), "HTTP %ld", status);
	}
	if (c->resp && c->resp_len) {
		size_t used = strlen(r->error);
		snprintf(r->error + used, sizeof(r->error) - used, ": %.200s", c->resp);
		for (char *p = r->error; *p; p++)
			if ((unsigned char)*p < 0x20)
				*p = ' ';
	}
}

static void on_done(CURL *easy, CURLcode rc, void *arg)
{
	struct http_call *c = arg;
	struct outbox_result r = { .retry_after_ms = -1 };
	long status = 0, request_size = 0;

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	if (curl_easy_getinfo(easy, CURLINFO_REQUEST_SIZE, &request_size) != CURLE_OK)
		request_size = 1; /* cannot tell: assume something was written */
	if (c->resend_refused && c->resend_bytes > request_size)
		request_size = c->resend_bytes;

	if (rc == CURLE_OK) {
		classify_status(c, status, easy, &r);
	} else if (request_size > 0) {
		/* Some of the request left this host (possibly on an earlier,
		 * reused connection, even if a later connection was refused). */
		if (status >= 100 && rc == CURLE_PARTIAL_FILE) {
			/* A status arrived, the body was cut: the status still decides. */
			classify_status(c, status, easy, &r);
		} else if (c->resend_refused) {
			r.outcome = OUTCOME_AMBIGUOUS;
			snprintf(r.error, sizeof(r.error),
			         "sent, no answer: connection closed after the request was written, "
			         "before any answer; not re-sent");
		} else {
			r.outcome = OUTCOME_AMBIGUOUS;
			snprintf(r.error, sizeof(r.error), "sent, no answer: %s", curl_easy_strerror(rc));
		}
	} else if (c->refused) {
		char host[256], scheme[16], perr[64];
		long port;

		r.outcome = OUTCOME_TERMINAL;
		if (!target_parse(c->hp, c->target, scheme, sizeof(scheme), host, sizeof(host), &port,
		                  perr, sizeof(perr)))
			snprintf(host, sizeof(host), "the target");
		snprintf(r.error, sizeof(r.error),
		         "address %s of %s is not allowed (SSRF rules: private, loopback, link-local and "
		         "metadata ranges need [provider.http] allow_hosts)",
		         c->refused_addr, host);
	} else if (c->resend_refused) {
		/* A reused connection failed before the first byte was written;
		 * libcurl's resend on a new one was refused all the same. */
		r.outcome = OUTCOME_NOT_SENT;
		snprintf(r.error, sizeof(r.error),
		         "not sent: the reused connection failed before the request was written");
	} else {
		/* Nothing of the request left this host. */
		r.outcome = OUTCOME_NOT_SENT;
		snprintf(r.error, sizeof(r.error), "not sent: %s", curl_easy_strerror(rc));
	}
	easy_put(c->hp, easy);
	c->done(c->token, &r);
	call_free(c);
}

static bool add_header(struct http_call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool add_header(struct http_call *c, const char *fmt, ...)
{
	char line[8192];
	struct curl_slist *l;
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(line))
		return false;           /* never send a cut header */
	l = curl_slist_append(c->headers, line);
	if (l == NULL)
		return false;
	c->headers = l;
	return true;
}

/* Standard Webhooks: v1,<base64 HMAC-SHA256(secret, id.timestamp.body)>. */
static bool sign(struct http_call *c, const char *id, size_t body_len)
{
	char ts[24], sig[128];
	unsigned char mac[32];
	long now = (long)time(NULL);

	snprintf(ts, sizeof(ts), "%ld", now);
	webhook_hmac(c->hp->secret, (size_t)c->hp->secret_len, id, ts, c->body,
	                             body_len, mac);
	if (!b64_encode(mac, sizeof(mac), sig, sizeof(sig)))
		return false;
	return add_header(c, "webhook-id: %s", id) && add_header(c, "webhook-timestamp: %s", ts) &&
	       add_header(c, "webhook-signature: v1,%s", sig);
}

/* The request body: a string body as its characters; any other JSON value
 * as the producer wrote it, compacted (json_text.h: re-encoding through
 * jansson would change numbers, 19.99 into 19.989999999999998); none or
 * null, empty.  Read from the text (the worker leaves "body" out of
 * e->payload: text_members below); from e->payload only when the text does
 * not have it (a key spelled with escapes, which jsonb never prints). */
static char *body_text(const struct outbox_effect *e, size_t *len, bool *is_string)
{
	const json_t *body = NULL;
	json_t *parsed = NULL;
	const char *raw;
	size_t raw_len;
	char *out;

	*is_string = false;
	if (e->payload_text && json_text_member(e->payload_text, e->payload_len, "body", &raw, &raw_len)) {
		if (raw[0] != '"' && !(raw_len == 4 && memcmp(raw, "null", 4) == 0))
			return json_text_compact(raw, raw_len, len);
		if (raw[0] == '"') {
			body = parsed = json_loadb(raw, raw_len, JSON_DECODE_ANY, NULL);
			if (body == NULL)
				return NULL;   /* not a JSON string after all */
		}
	} else {
		body = json_object_get(e->payload, "body");
	}
	if (json_is_string(body)) {
		*is_string = true;
		*len = json_string_length(body);
		out = malloc(*len + 1);
		if (out) {
			memcpy(out, json_string_value(body), *len);
			out[*len] = '\0';
		}
	} else if (body == NULL || json_is_null(body)) {
		*len = 0;
		out = strdup("");
	} else {
		out = json_dumps(body, JSON_COMPACT | JSON_ENCODE_ANY);
		*len = out ? strlen(out) : 0;
	}
	json_decref(parsed);
	return out;
}

static bool http_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
                      char *err, size_t errlen)
{
	struct http_provider *hp = self;
	struct http_call *c = calloc(1, sizeof(*c));
	const json_t *method = json_object_get(e->payload, "method");
	const json_t *headers = json_object_get(e->payload, "headers");
	const char *k;
	json_t *v;
	bool has_ctype = false;
	char scheme[16], url_host[256];
	long port;
	CURL *easy;
	size_t body_len;
	bool body_is_string;

	if (c == NULL) {
		snprintf(err, errlen, "out of memory");
		return false;
	}
	c->hp = hp;
	c->done = done;
	c->token = token;
	c->attempt = e->attempt;
	c->target = e->target;
	c->effect_key = e->effect_key;
	if (!target_parse(hp, e->target, scheme, sizeof(scheme), url_host, sizeof(url_host), &port,
	                  err, errlen)) {
		call_free(c);
		return false;
	}
	c->host_listed = netrules_host_listed(hp->rules, url_host);

	c->body = body_text(e, &body_len, &body_is_string);
	if (c->body == NULL) {
		snprintf(err, errlen, "cannot encode the body");
		call_free(c);
		return false;
	}

	if (headers && json_is_object(headers)) {
		json_object_foreach((json_t *)headers, k, v) {
			if (strcasecmp(k, "content-type") == 0)
				has_ctype = true;
			if (!add_header(c, "%s: %s", k, json_string_value(v)))
				goto oom;
		}
	}
	if (!has_ctype && !add_header(c, "Content-Type: %s",
	                              body_is_string ? "text/plain; charset=utf-8" : "application/json"))
		goto oom;
	if (!add_header(c, "Idempotency-Key: %s", e->effect_key) || !add_header(c, "Expect:"))
		goto oom;
	if (hp->secret_len > 0 && !sign(c, e->effect_key, body_len))
		goto oom;

	easy = easy_get(hp);
	if (easy == NULL)
		goto oom;
	c->easy = easy;
	curl_easy_setopt(easy, CURLOPT_URL, e->target);
	curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, method ? json_string_value(method) : "POST");
	curl_easy_setopt(easy, CURLOPT_POST, 1L);
	curl_easy_setopt(easy, CURLOPT_POSTFIELDS, c->body);
	curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
	curl_easy_setopt(easy, CURLOPT_HTTPHEADER, c->headers);
	curl_easy_setopt(easy, CURLOPT_USERAGENT, hp->user_agent);
	curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, hp->timeout_ms);
	curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, hp->connect_timeout_ms);
	curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(easy, CURLOPT_BUFFERSIZE, HTTP_RECV_BUFFER);
	/* A request is written at most once, even when libcurl would resend it
	 * after a reused connection died (see the top of this file). */
	curl_easy_setopt(easy, CURLOPT_PREREQFUNCTION, on_prereq);
	curl_easy_setopt(easy, CURLOPT_PREREQDATA, c);
	if (hp->keepalive_idle > 0) {
		curl_easy_setopt(easy, CURLOPT_MAXAGE_CONN, hp->keepalive_idle);
	} else {
		curl_easy_setopt(easy, CURLOPT_FORBID_REUSE, 1L);
		curl_easy_setopt(easy, CURLOPT_FRESH_CONNECT, 1L);
	}
	/* HTTP/1.1, one request per connection at a time: with HTTP/2 a pooled
	 * connection would carry up to max_per_host sends at once, and one
	 * reset would make every one of them ambiguous. */
	curl_easy_setopt(easy, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
	curl_loop_safe_options(easy, "http,https", hp->ca_file);
	curl_easy_setopt(easy, CURLOPT_PROXY, hp->proxy);
	curl_easy_setopt(easy, CURLOPT_OPENSOCKETFUNCTION, open_socket);
	curl_easy_setopt(easy, CURLOPT_OPENSOCKETDATA, c);
	curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
	curl_easy_setopt(easy, CURLOPT_WRITEDATA, c);
	curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
	curl_easy_setopt(easy, CURLOPT_HEADERDATA, c);
	if (!curl_loop_add(hp->loop, easy, on_done, c)) {
		easy_put(hp, easy);
		snprintf(err, errlen, "libcurl refused the transfer");
		call_free(c);
		return false;
	}
	return true;
oom:
	snprintf(err, errlen, "out of memory building the request");
	call_free(c);
	return false;
}

/* ---- life cycle ----------------------------------------------------------- */

static void *http_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                       size_t errlen)
{
	struct http_provider *hp = calloc(1, sizeof(*hp));
	const char *secret;
	char rerr[256];

	if (hp == NULL)
		return NULL;
	hp->host = host;
	hp->rules = netrules_parse(host->conf_str(conf, "allow_hosts"),
	                           host->conf_bool(conf, "public_targets"), rerr, sizeof(rerr));
	if (hp->rules == NULL) {
		snprintf(err, errlen, "%s: %s", host->conf_where(conf, "allow_hosts"), rerr);
		free(hp);
		return NULL;
	}
	hp->timeout_ms = host->conf_int(conf, "timeout_ms");
	hp->connect_timeout_ms = host->conf_int(conf, "connect_timeout_ms");
	hp->max_response = host->conf_int(conf, "max_response_bytes");
	hp->keepalive_idle = host->conf_int(conf, "keepalive_idle_seconds");
	hp->id_header = strdup(host->conf_str(conf, "provider_id_header"));
	hp->id_json = strdup(host->conf_str(conf, "provider_id_json"));
	hp->user_agent = strdup(host->conf_str(conf, "user_agent"));
	hp->ca_file = strdup(host->conf_str(conf, "ca_file"));
	hp->proxy = strdup(host->conf_str(conf, "proxy"));
	secret = host->conf_str(conf, "signing_secret");
	if (secret[0]) {
		const char *b64 = strncmp(secret, "whsec_", 6) == 0 ? secret + 6 : secret;
		hp->secret_len = b64_decode(b64, hp->secret, sizeof(hp->secret));
		if (hp->secret_len <= 0) {
			snprintf(err, errlen, "%s: must be whsec_ followed by base64",
			         host->conf_where(conf, "signing_secret"));
			goto fail;
		}
	}
	hp->loop = curl_loop_new(host->base);
	if (hp->loop == NULL || !hp->id_header || !hp->id_json || !hp->user_agent || !hp->ca_file ||
	    !hp->proxy) {
		snprintf(err, errlen, "out of memory");
		goto fail;
	}
	/* Never more connections than sends in flight; idle ones still close
	 * after keepalive_idle_seconds. */
	curl_loop_keep_connections(hp->loop, host->conf_int(conf, "max_in_flight"));
	hp->lookup = http_lookup_new(host, conf, hp->rules, hp->ca_file, hp->proxy, hp->user_agent,
	                             err, errlen);
	if (hp->lookup == NULL && err[0])
		goto fail;
	return hp;
fail:
	if (hp->loop)
		curl_loop_free(hp->loop, NULL);
	netrules_free(hp->rules);
	free(hp->id_header);
	free(hp->id_json);
	free(hp->user_agent);
	free(hp->ca_file);
	free(hp->proxy);
	free(hp);
	return NULL;
}

static void release_call(CURL *easy, void *arg)
{
	curl_easy_cleanup(easy);
	call_free(arg);
}

static void http_shutdown(void *self)
{
	struct http_provider *hp = self;

	http_lookup_free(hp->lookup);
	curl_loop_free(hp->loop, release_call);
	while (hp->pool_len > 0)
		curl_easy_cleanup(hp->pool[--hp->pool_len]);
	netrules_free(hp->rules);
	for (int i = 0; i < HTTP_URL_CACHE; i++)
		free(hp->urls[i].url);
	free(hp->id_header);
	free(hp->id_json);
	free(hp->user_agent);
	free(hp->ca_file);
	free(hp->proxy);
	memset(hp->secret, 0, sizeof(hp->secret));
	free(hp);
}

/* An `unknown` effect: ask the target's API, when a lookup is configured
 * (the worker asks only then: OUTBOX_CAP_RECONCILE_IF_CONFIGURED). */
static bool http_reconcile(void *self, const struct outbox_effect *e, outbox_recon_fn done,
                           void *token, char *err, size_t errlen)
{
	struct http_provider *hp = self;

	if (hp->lookup == NULL) {
		snprintf(err, errlen, "no lookup configured ([provider.http] reconcile_url)");
		return false;
	}
	return http_lookup_ask(hp->lookup, e, done, token, err, errlen);
}

/* The body leaves as written: the worker need not parse it. */
static const char *const http_text_members[] = { "body", NULL };

static const struct outbox_provider http_provider = {
	.abi = OUTBOX_PROVIDER_ABI,
	.name = "http",
	.caps = OUTBOX_CAP_RECONCILE | OUTBOX_CAP_RECONCILE_IF_CONFIGURED,
	.keys = http_keys,
	.init = http_init,
	.validate = http_validate,
	.send = http_send,
	.reconcile = http_reconcile,
	.shutdown = http_shutdown,
	.text_members = http_text_members,
};

const struct outbox_provider *outbox_provider_entry(void)
{
	return &http_provider;
}

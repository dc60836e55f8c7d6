/* SPDX-License-Identifier: ISC */
/*
 * http.h: the http provider's own parts (providers/http/): the generic
 * webhook/API provider, on libcurl's multi interface inside the worker's
 * event loop.
 *
 * http.c: keys, life cycle, reconciliation; target.c: the target URL and
 * the payload, checked (validate); request.c: a call's headers, body and
 * signature; secret.c: header values named by a secret; send.c: the
 * transfer, its callbacks and the outcome.
 *
 * Target: the URL.  Payload: {"method": "POST", "headers": {...},
 * "body": <JSON value or string>}; a header value is a string, or
 * {"secret": NAME, "prefix": "..."}, read from secrets_dir at send time.  Every request carries
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
#ifndef OUTBOX_HTTP_H
#define OUTBOX_HTTP_H

#include <curl/curl.h>
#include <stdbool.h>
#include <stddef.h>

#include "lib/curl_io.h"
#include "scrub.h"
#include "lib/url.h"
#include "provider.h"

#define HTTP_MAX_HEADERS 64
/* "Name: value" of one payload header, in bytes: what common servers
 * accept in one line (add_header() never cuts a longer one). */
#define HTTP_MAX_HEADER_LINE 8000
/* A secret header value ({"secret": NAME}): the name's and the value's
 * longest (secret.c). */
#define HTTP_SECRET_NAME_MAX 128
#define HTTP_SECRET_MAX 4096
/* The longest Retry-After passed on (a week; the dispatcher's
 * retry_after_max_ms bounds it further). */
#define HTTP_RETRY_AFTER_MAX_MS (7L * 86400 * 1000)
/* Idle easy handles kept for reuse (curl_easy_reset, not init/cleanup). */
#define HTTP_EASY_POOL 64
/* libcurl's receive buffer per transfer (default 16 KiB; 1 KiB is its
 * minimum).  The bodies kept are small (max_response_bytes is enforced in
 * curl_body_write); with 1,000 sends in flight 4 KiB saved ~1 MiB of RSS,
 * 1 KiB ~4. */
#define HTTP_RECV_BUFFER 1024L
/* Parsed targets kept (direct-mapped by a hash of the URL), and the longest
 * URL kept: 64 x 1 KiB at most. */
#define HTTP_URL_CACHE 64
#define HTTP_URL_CACHE_MAX 1024

/* A target URL as http_parse_url() split it. */
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
	char *secrets_dir;         /* secret header values' files; NULL: none */
	struct http_secret_decl *secrets; /* the secrets that may be named, and where to */
	int n_secrets;
	unsigned char secret[256];
	long secret_len;
	CURL *pool[HTTP_EASY_POOL]; /* idle easy handles, reset */
	int pool_len;
	struct http_lookup *lookup; /* reconciliation (lib/http_lookup.c); NULL: off */
};

/* One secret a payload header may name ([provider.http] secrets), and the
 * URL prefixes of the targets it may be sent to. */
struct http_secret_decl {
	char *name;
	struct url_prefix *to;
	int n_to;
};

/* One send in flight (kept small: a worker may hold a thousand). */
struct http_call {
	struct http_provider *hp;
	CURL *easy;
	outbox_done_fn done;
	void *token;
	struct curl_slist *headers;
	char *body;
	size_t body_len;
	const char *target;        /* the effect's: valid until done has returned */
	const char *effect_key;    /* likewise */
	struct curl_body resp;     /* up to max_response_bytes */
	char *hdr_id, *request_id, *location; /* response headers, when present */
	long resend_bytes;         /* request bytes written when a resend was refused */
	int attempt;
	int prereq_calls;          /* requests libcurl was about to send */
	bool resend_refused;       /* libcurl wanted to send the request again: refused */
	struct curl_guard guard;   /* the SSRF rules at connect time */
	struct scrub scrub;        /* the secrets this call's headers carry (scrub.h) */
};

/* target.c */
bool http_parse_url(const char *url, char *scheme, size_t slen, char *host, size_t hlen,
                    long *port, char *err, size_t errlen);
bool http_target_parse(struct http_provider *hp, const char *url, char *scheme, size_t slen,
                       char *host, size_t hlen, long *port, char *err, size_t errlen);
void http_target_cache_free(struct http_provider *hp);
bool http_validate(void *self, const struct outbox_effect *e, char *host_key,
                   size_t host_keylen, char *err, size_t errlen);

/* secret.c: a header value named by a secret.  The name: letters, digits,
 * '_', '-', '.', not starting with '.', at most HTTP_SECRET_NAME_MAX. */
bool http_secret_name_ok(const char *name);
/* The secrets key ("NAME=PREFIX PREFIX; NAME=PREFIX") into hp->secrets;
 * false with err (without file and line: the caller adds them). */
bool http_secrets_parse(struct http_provider *hp, const char *spec, char *err, size_t errlen);
void http_secrets_free(struct http_provider *hp);
/* The first line of secrets_dir/NAME into out (at most outlen - 2 bytes,
 * no control characters, not empty), only when NAME is declared for a
 * prefix the target URL is under; false with err, which names the secret
 * but never quotes its value nor shows where it is kept.  The caller
 * wipes out after use. */
bool http_secret_read(const struct http_provider *hp, const char *name, const char *target,
                      char *out, size_t outlen, char *err, size_t errlen);

/* Whether a header may carry a secret ({"secret": NAME}): not one the
 * answer is read from (the provider id: id_header, X-Request-Id,
 * Location), nor one that frames the message or goes to a hop rather
 * than to the API; NULL if it may, else why not. */
const char *http_secret_header_refused(const struct http_provider *hp, const char *name);

/* request.c: a call with its headers, body and signature, not started;
 * NULL with err on failure. */
struct http_call *http_call_new(struct http_provider *hp, const struct outbox_effect *e,
                                outbox_done_fn done, void *token, char *err, size_t errlen);
void http_call_free(struct http_call *c);

/* send.c */
bool http_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
               char *err, size_t errlen);
/* curl_loop_free()'s release: a transfer still running at shutdown. */
void http_release_call(CURL *easy, void *arg);

#endif

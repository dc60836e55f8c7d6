/* SPDX-License-Identifier: ISC */
/*
 * send.c: one http send on libcurl's multi interface: the transfer's
 * options and callbacks (a request written at most once: on_prereq), a
 * small pool of easy handles, and the outcome, classified by whether a
 * request byte left this host (see http.h).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http.h"
#include "lib/curl_loop.h"

/* The provider id may come from a configured header, X-Request-Id or
 * Location (pick_provider_id() says in which order). */
static size_t on_header(char *line, size_t size, size_t nitems, void *arg)
{
	struct http_call *c = arg;
	size_t n = size * nitems;

	if (!(c->hp->id_header[0] && curl_header_take(line, n, c->hp->id_header, &c->hdr_id)) &&
	    !curl_header_take(line, n, "X-Request-Id", &c->request_id))
		curl_header_take(line, n, "Location", &c->location);
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

static void pick_provider_id(struct http_call *c, struct outbox_result *r)
{
	if (c->hdr_id && c->hdr_id[0]) {
		snprintf(r->provider_id, sizeof(r->provider_id), "%s", c->hdr_id);
		return;
	}
	if (c->resp.data && c->hp->id_json[0]) {
		json_t *doc = json_loadb(c->resp.data, c->resp.len, 0, NULL);
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
			r->retry_after_ms = curl_io_retry_after_ms((long long)retry_after,
			                                           HTTP_RETRY_AFTER_MAX_MS);
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
	if (c->resp.data && c->resp.len) {
		size_t used = strlen(r->error);
		snprintf(r->error + used, sizeof(r->error) - used, ": %.200s", c->resp.data);
		for (char *p = r->error; *p; p++)
			if ((unsigned char)*p < 0x20)
				*p = ' ';
	}
}

/* What the answer echoes of the call's secrets is cut out of everything
 * read from it (body, id headers) before anything is made of it, so an
 * excerpt cut from them never keeps half a secret; a body or header cut
 * at its bound loses its possibly partial tail (scrub.h). */
static void scrub_header(const struct scrub *s, char **v)
{
	size_t n = *v ? strlen(*v) : 0;

	/* curl_header_take() keeps OUTBOX_PROVIDER_ID_MAX - 1 bytes at most. */
	scrub_text(s, v, &n, n >= OUTBOX_PROVIDER_ID_MAX - 1);
}

static void scrub_answer(struct http_call *c)
{
	if (c->scrub.n == 0)
		return;
	scrub_text(&c->scrub, &c->resp.data, &c->resp.len, c->resp.truncated);
	scrub_header(&c->scrub, &c->hdr_id);
	scrub_header(&c->scrub, &c->request_id);
	scrub_header(&c->scrub, &c->location);
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
	scrub_answer(c);

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
	} else if (c->guard.refused) {
		char host[256], scheme[16], perr[64];
		long port;

		r.outcome = OUTCOME_TERMINAL;
		if (!http_target_parse(c->hp, c->target, scheme, sizeof(scheme), host, sizeof(host), &port,
		                       perr, sizeof(perr)))
			snprintf(host, sizeof(host), "the target");
		snprintf(r.error, sizeof(r.error),
		         "address %s of %s is not allowed (SSRF rules: private, loopback, link-local and "
		         "metadata ranges need [provider.http] allow_hosts)",
		         c->guard.refused_addr, host);
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
	scrub_buf(&c->scrub, r.error, sizeof(r.error));
	scrub_buf(&c->scrub, r.provider_id, sizeof(r.provider_id));
	easy_put(c->hp, easy);
	c->done(c->token, &r);
	http_call_free(c);
}

/* The transfer's options: the request, timeouts, connection reuse and
 * this file's callbacks (the safety options every request has are
 * curl_loop_add()'s). */
static void set_options(struct http_call *c, CURL *easy, const char *method)
{
	struct http_provider *hp = c->hp;

	curl_easy_setopt(easy, CURLOPT_URL, c->target);
	curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, method ? method : "POST");
	curl_easy_setopt(easy, CURLOPT_POST, 1L);
	curl_easy_setopt(easy, CURLOPT_POSTFIELDS, c->body);
	curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)c->body_len);
	curl_easy_setopt(easy, CURLOPT_HTTPHEADER, c->headers);
	curl_easy_setopt(easy, CURLOPT_USERAGENT, hp->user_agent);
	curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, hp->timeout_ms);
	curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, hp->connect_timeout_ms);
	curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(easy, CURLOPT_BUFFERSIZE, HTTP_RECV_BUFFER);
	/* A request is written at most once, even when libcurl would resend it
	 * after a reused connection died (see http.h). */
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
	curl_io_attach(easy, &c->guard, &c->resp, on_header, c);
}

bool http_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
               char *err, size_t errlen)
{
	struct http_provider *hp = self;
	const json_t *method = json_object_get(e->payload, "method");
	struct http_call *c = http_call_new(hp, e, done, token, err, errlen);
	CURL *easy;

	if (c == NULL)
		return false;
	easy = easy_get(hp);
	if (easy == NULL) {
		snprintf(err, errlen, "out of memory building the request");
		http_call_free(c);
		return false;
	}
	c->easy = easy;
	set_options(c, easy, method ? json_string_value(method) : NULL);
	if (!curl_loop_add(hp->loop, easy, on_done, c)) {
		easy_put(hp, easy);
		snprintf(err, errlen, "libcurl refused the transfer");
		http_call_free(c);
		return false;
	}
	return true;
}

void http_release_call(CURL *easy, void *arg)
{
	curl_easy_cleanup(easy);
	http_call_free(arg);
}

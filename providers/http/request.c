/* SPDX-License-Identifier: ISC */
/*
 * request.c: what the http provider sends for an effect: the payload's
 * headers, Content-Type, Idempotency-Key, the Standard Webhooks signature
 * when a secret is configured, and the body exactly as the producer wrote
 * it.  A header that would be cut is an error, never sent; a header naming
 * a secret gets its value from secret.c, and every line is wiped before
 * it is freed.
 */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "http/http.h"
#include "json_text.h"
#include "lib/netrules.h"
#include "lib/sign.h"
#include "text.h"

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
	explicit_bzero(line, (size_t)n); /* it may hold a secret; memset would be optimised out */
	if (l == NULL)
		return false;
	c->headers = l;
	return true;
}

/* "Name: <prefix><secret>", the secret read from secrets_dir now (secret.c;
 * validate() read it too, but it may have changed or gone since). */
static bool add_secret_header(struct http_call *c, const char *k, const json_t *ref, char *err,
                              size_t errlen)
{
	const json_t *prefix = json_object_get(ref, "prefix");
	char value[HTTP_SECRET_MAX + 2], why[256];
	bool ok = http_secret_read(c->hp, json_string_value(json_object_get(ref, "secret")), c->target,
	                           value, sizeof(value), why, sizeof(why));

	if (!ok) {
		snprintf(err, errlen, "payload.headers.%.64s: %s", k, why);
	} else {
		/* Whatever the answer echoes of it is cut out (send.c). */
		scrub_add(&c->scrub, value, strlen(value));
		if (!(ok = add_header(c, "%s: %s%s", k, prefix ? json_string_value(prefix) : "", value)))
			snprintf(err, errlen, "payload.headers.%.64s: the header line is too long", k);
	}
	explicit_bzero(value, sizeof(value));
	return ok;
}

/* Standard Webhooks: v1,<base64 HMAC-SHA256(secret, id.timestamp.body)>. */
static bool sign(struct http_call *c, const char *id, size_t body_len)
{
	char ts[24], sig[128];
	unsigned char mac[32];
	long now = (long)time(NULL);

	snprintf(ts, sizeof(ts), "%ld", now);
	if (!webhook_hmac(c->hp->secret, (size_t)c->hp->secret_len, id, ts, c->body, body_len, mac) ||
	    !b64_encode(mac, sizeof(mac), sig, sizeof(sig)))
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
		out = text_alloc(*len + 1);
		memcpy(out, json_string_value(body), *len);
	} else if (body == NULL || json_is_null(body)) {
		*len = 0;
		out = text_strdup("");
	} else {
		out = json_dumps(body, JSON_COMPACT | JSON_ENCODE_ANY);
		*len = out ? strlen(out) : 0;
	}
	json_decref(parsed);
	return out;
}

/* A call for e: its headers (the payload's, Content-Type, the key,
 * the signature) and its body, ready to hand to libcurl. */
struct http_call *http_call_new(struct http_provider *hp, const struct outbox_effect *e,
                                outbox_done_fn done, void *token, char *err, size_t errlen)
{
	struct http_call *c = text_alloc(sizeof(*c));
	const json_t *headers = json_object_get(e->payload, "headers");
	const char *k;
	json_t *v;
	bool has_ctype = false;
	char scheme[16], url_host[256];
	long port;
	size_t body_len;
	bool body_is_string;

	c->hp = hp;
	c->done = done;
	c->token = token;
	c->attempt = e->attempt;
	c->target = e->target;
	c->effect_key = e->effect_key;
	c->resp.max = (size_t)hp->max_response;
	if (!http_target_parse(hp, e->target, scheme, sizeof(scheme), url_host, sizeof(url_host), &port,
	                       err, errlen)) {
		http_call_free(c);
		return NULL;
	}
	c->guard.rules = hp->rules;
	c->guard.host_listed = netrules_host_listed(hp->rules, url_host);

	c->body = body_text(e, &body_len, &body_is_string);
	if (c->body == NULL) {
		snprintf(err, errlen, "cannot encode the body");
		http_call_free(c);
		return NULL;
	}
	c->body_len = body_len;

	if (headers && json_is_object(headers)) {
		json_object_foreach((json_t *)headers, k, v) {
			if (strcasecmp(k, "content-type") == 0)
				has_ctype = true;
			if (json_is_object(v)) {
				if (!add_secret_header(c, k, v, err, errlen)) {
					http_call_free(c);
					return NULL;
				}
			} else if (json_string_length(v) == 0) {
				/* libcurl drops "Name:" (its way to remove a header it
				 * would add); "Name;" is its spelling of an empty one. */
				if (!add_header(c, "%s;", k))
					goto oom;
			} else if (!add_header(c, "%s: %s", k, json_string_value(v))) {
				goto oom;
			}
		}
	}
	if (!has_ctype && !add_header(c, "Content-Type: %s",
	                              body_is_string ? "text/plain; charset=utf-8" : "application/json"))
		goto oom;
	if (!add_header(c, "Idempotency-Key: %s", e->effect_key) || !add_header(c, "Expect:"))
		goto oom;
	if (hp->secret_len > 0 && !sign(c, e->effect_key, body_len)) {
		snprintf(err, errlen, "cannot sign the request (HMAC-SHA256 failed): not sent");
		http_call_free(c);
		return NULL;
	}
	return c;
oom:
	snprintf(err, errlen, "out of memory building the request");
	http_call_free(c);
	return NULL;
}

void http_call_free(struct http_call *c)
{
	/* A header line may hold a secret: wipe them before freeing. */
	for (struct curl_slist *l = c->headers; l; l = l->next)
		memset(l->data, 0, strlen(l->data));
	curl_slist_free_all(c->headers);
	free(c->body);
	curl_body_free(&c->resp);
	free(c->hdr_id);
	free(c->request_id);
	free(c->location);
	scrub_free(&c->scrub);
	free(c);
}

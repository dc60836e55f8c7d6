/* SPDX-License-Identifier: ISC */
/*
 * transfer.c: one crm request on libcurl's multi interface: the headers
 * (the Authorization line carries the access token and is wiped before it
 * is freed), the upsert's body exactly as the producer wrote it, the
 * transfer's options (one connection per call), the Retry-After header,
 * and send().  The answers are read in answer.c.
 */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "crm/crm.h"
#include "lib/curl_loop.h"
#include "json_text.h"

#define RETRY_AFTER_MAX_S (86400L * 7)

/* A Retry-After value: delta-seconds or an HTTP-date, capped at a week;
 * false when it is neither. */
static bool retry_after_value(const char *v, long *ms)
{
	char *end;
	long secs;

	errno = 0;
	secs = strtol(v, &end, 10);
	if (end != v && *end == '\0' && secs >= 0) {
		/* Past LONG_MAX (ERANGE) is "later than the cap" too. */
		*ms = curl_io_retry_after_ms(errno == ERANGE ? RETRY_AFTER_MAX_S : secs,
		                             RETRY_AFTER_MAX_S * 1000);
		return true;
	}
	{
		time_t when = curl_getdate(v, NULL);
		time_t now, secs_left;

		if (when == (time_t)-1)
			return false;
		now = time(NULL);
		secs_left = when > now ? when - now : 0;
		if (secs_left > RETRY_AFTER_MAX_S)
			secs_left = RETRY_AFTER_MAX_S;
		*ms = (long)secs_left * 1000;
		return true;
	}
}

/* Retry-After: only the last response's headers count (a status line
 * starts a new response). */
static size_t on_header(char *data, size_t size, size_t nmemb, void *arg)
{
	struct crm_call *k = arg;
	size_t n = size * nmemb, m;
	char line[256], *v = line;
	long ms;

	if (n >= 5 && strncmp(data, "HTTP/", 5) == 0) {
		k->retry_after_ms = -1;
		return n;
	}
	if (n < 12 || strncasecmp(data, "Retry-After:", 12) != 0)
		return n;
	m = n - 12;
	while (m > 0 && (data[12 + m - 1] == '\r' || data[12 + m - 1] == '\n' ||
	                 data[12 + m - 1] == ' '))
		m--;
	crm_copy_printable(line, sizeof(line), data + 12, m);
	while (*v == ' ')
		v++;
	if (retry_after_value(v, &ms))
		k->retry_after_ms = ms;
	return n;
}

/* k->headers, made once per call: the token, JSON both ways, and no
 * "Expect: 100-continue" round trip. */
static bool set_headers(struct crm_call *k, const char *token, char *err, size_t errlen)
{
	char auth[4200];
	struct curl_slist *h;

	if (strlen(token) > sizeof(auth) - 32) {
		crm_fmt(err, errlen, "crm: access_token is too long");
		return false;
	}
	crm_fmt(auth, sizeof(auth), "Authorization: Bearer %s", token);
	h = curl_slist_append(NULL, auth);
	memset(auth, 0, sizeof(auth));
	if (h)
		h = curl_slist_append(h, "Accept: application/json");
	if (h)
		h = curl_slist_append(h, "Content-Type: application/json");
	if (h)
		h = curl_slist_append(h, "Expect:");
	if (h == NULL) {
		crm_fmt(err, errlen, "crm: out of memory");
		return false;
	}
	k->headers = h;
	return true;
}

static CURL *make_easy(struct crm_call *k, const char *url, bool patch, const char *token,
                       char *err, size_t errlen)
{
	struct crm *c = k->crm;
	CURL *easy = curl_easy_init();

	if (easy == NULL) {
		crm_fmt(err, errlen, "crm: cannot create a transfer");
		return NULL;
	}
	if (k->headers == NULL && !set_headers(k, token, err, errlen)) {
		curl_easy_cleanup(easy);
		return NULL;
	}
	k->errbuf[0] = '\0';
	k->retry_after_ms = -1;
	curl_body_free(&k->resp);
	k->resp.max = CRM_RESP_MAX;
	curl_easy_setopt(easy, CURLOPT_URL, url);
	/* One connection per call: on a reused connection that dies before the
	 * answer, libcurl silently sends the request again, and the attempts
	 * log would no longer be one row per call. */
	curl_easy_setopt(easy, CURLOPT_FORBID_REUSE, 1L);
	curl_easy_setopt(easy, CURLOPT_FRESH_CONNECT, 1L);
	curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, c->host->conf_int(c->conf, "timeout_ms"));
	curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS,
	                 c->host->conf_int(c->conf, "connect_timeout_ms"));
	curl_easy_setopt(easy, CURLOPT_USERAGENT, "outbox-dispatcher-crm/1");
	curl_easy_setopt(easy, CURLOPT_HTTPHEADER, k->headers);
	/* The instance URL is the operator's own: no per-address SSRF check. */
	curl_io_attach(easy, NULL, &k->resp, on_header, k);
	curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, k->errbuf);
	if (patch) {
		curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, "PATCH");
		curl_easy_setopt(easy, CURLOPT_POSTFIELDS, k->body);
		curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, (long)strlen(k->body));
	} else {
		curl_easy_setopt(easy, CURLOPT_HTTPGET, 1L);
	}
	return easy;
}

bool crm_call_start(struct crm_call *k, bool patch, char *err, size_t errlen)
{
	struct crm *c = k->crm;
	char url[CRM_URL_MAX];
	CURL *easy;

	crm_fmt(url, sizeof(url), "%s%s", k->record_url, patch ? "" : "?fields=Id");
	easy = make_easy(k, url, patch, c->host->conf_str(c->conf, "access_token"), err, errlen);
	if (easy == NULL)
		return false;
	if (!curl_loop_add(c->loop, easy, crm_on_done, k)) {
		crm_fmt(err, errlen, "crm: libcurl refused the transfer");
		curl_easy_cleanup(easy);
		return false;
	}
	return true;
}

void crm_call_free(struct crm_call *k)
{
	if (k == NULL)
		return;
	/* The Authorization line holds the token: wipe it before freeing. */
	for (struct curl_slist *s = k->headers; s; s = s->next)
		memset(s->data, 0, strlen(s->data));
	curl_slist_free_all(k->headers);
	free(k->record_url);
	free(k->body);
	curl_body_free(&k->resp);
	free(k);
}

void crm_release_transfer(CURL *easy, void *arg)
{
	curl_easy_cleanup(easy);
	crm_call_free(arg);
}

bool crm_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
              char *err, size_t errlen)
{
	struct crm *c = self;
	struct crm_call *k;
	const char *field;
	size_t obj_len;

	if (!crm_parse_target(e->target, &obj_len, &field, err, errlen) ||
	    !crm_check_payload(e->payload, field, err, errlen))
		return false;
	k = crm_call_new(c, e, CALL_UPSERT, err, errlen);
	if (k == NULL)
		return false;
	k->done = done;
	k->token = token;
	/* The fields as the producer wrote them (19.99 stays 19.99: json_text.h);
	 * jansson re-encodes only a payload handed over without its text. */
	if (e->payload_text && e->payload_len > 0)
		k->body = json_text_compact(e->payload_text, e->payload_len, NULL);
	else
		k->body = json_dumps(e->payload, JSON_COMPACT);
	if (k->body == NULL) {
		crm_fmt(err, errlen, "crm: cannot encode the payload");
		crm_call_free(k);
		return false;
	}
	if (!crm_call_start(k, true, err, errlen)) {
		crm_call_free(k);
		return false;
	}
	return true;
}

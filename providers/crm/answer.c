/* SPDX-License-Identifier: ISC */
/*
 * answer.c: what Salesforce answered a crm call, and the outcome: an
 * upsert classified (accepted, retry, ambiguous, terminal; not sent when no
 * request byte left this host), the Id lookup after an upsert that gave
 * none, and the readers every answer shares (the error text, an error
 * code, the record id).  crm_on_done() hands each finished transfer to the
 * reader of its kind.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crm/crm.h"
#include "scrub.h"

/* "ERROR_CODE: message" from Salesforce's [{"errorCode","message"}] error
 * array (or the body's start when it is something else). */
void crm_sf_error_text(const struct crm_call *k, long status, char *dst, size_t len)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	json_t *first = json_is_array(j) ? json_array_get(j, 0) : j;
	const char *code = json_string_value(json_object_get(first, "errorCode"));
	const char *msg = json_string_value(json_object_get(first, "message"));
	char body[200];

	if (code || msg) {
		char tmp[OUTBOX_ERROR_MAX];
		crm_fmt(tmp, sizeof(tmp), "HTTP %ld %s: %s", status, code ? code : "ERROR",
		        msg ? msg : "");
		crm_copy_printable(dst, len, tmp, strlen(tmp));
	} else if (k->resp.len) {
		crm_copy_printable(body, sizeof(body), k->resp.data, k->resp.len);
		crm_fmt(dst, len, "HTTP %ld: %s", status, body);
	} else {
		crm_fmt(dst, len, "HTTP %ld", status);
	}
	json_decref(j);
}

bool crm_sf_error_code_is(const struct crm_call *k, const char *code)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	json_t *first = json_is_array(j) ? json_array_get(j, 0) : j;
	const char *c = json_string_value(json_object_get(first, "errorCode"));
	bool is = c && strcmp(c, code) == 0;

	json_decref(j);
	return is;
}

/* A record id as Salesforce writes them: 15 or 18 alphanumerics.  Anything
 * else is still accepted as an id if it is short and printable. */
static bool id_ok(const char *s)
{
	size_t n = s ? strlen(s) : 0;

	if (n == 0 || n >= OUTBOX_PROVIDER_ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
			return false;
	return true;
}

/* The record id from {"id": ...} (upsert) or {"Id": ...} (lookup). */
bool crm_body_id(const struct crm_call *k, const char *name, char *dst, size_t len)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	const char *id = json_string_value(json_object_get(j, name));
	bool ok = id_ok(id);

	if (ok)
		crm_fmt(dst, len, "%s", id);
	json_decref(j);
	return ok;
}

/* Did any request byte leave the host?  Before the connection (and TLS)
 * was up, nothing did: pretransfer is the moment the request starts. */
static bool request_started(CURL *easy)
{
	curl_off_t pre = 0;
	long sent = 0;

	if (curl_easy_getinfo(easy, CURLINFO_PRETRANSFER_TIME_T, &pre) != CURLE_OK ||
	    curl_easy_getinfo(easy, CURLINFO_REQUEST_SIZE, &sent) != CURLE_OK)
		return true;
	return pre > 0 || sent > 0;
}

void crm_transport_error(CURLcode rc, const struct crm_call *k, char *dst, size_t len)
{
	crm_fmt(dst, len, "%s%s%s", curl_easy_strerror(rc), k->errbuf[0] ? ": " : "", k->errbuf);
	dst[strcspn(dst, "\r\n")] = '\0';
}

static void finish_upsert(CURL *easy, struct crm_call *k, struct outbox_result *r)
{
	curl_easy_cleanup(easy);
	k->done(k->token, r);
	crm_call_free(k);
}

/* A 401: the token expired or was revoked.  Nothing was written, and only
 * an operator can fix it; failing every effect until then would burn
 * them, so they retry later instead (attempts still count). */
static void auth_rejected(struct crm *c, struct outbox_result *r)
{
	r->outcome = OUTCOME_RETRY;
	r->retry_after_ms = c->host->conf_int(c->conf, "auth_retry_ms");
	if (!c->auth_failing) {
		c->auth_failing = true;
		c->host->log(OLOG_WARN, CRM_NAME, "Salesforce rejected the access token (%s): set "
		             "[provider.crm] access_token and reload; effects wait and retry", r->error);
	}
}

/* An upsert answered with anything but success: r's outcome, error text
 * and retry delay. */
static void classify_failure(const struct crm_call *k, long status, struct outbox_result *r)
{
	crm_sf_error_text(k, status, r->error, sizeof(r->error));
	if (status == 300) {
		r->outcome = OUTCOME_TERMINAL;
		crm_fmt(r->error, sizeof(r->error), "HTTP 300: several records have this external id; "
		        "Salesforce updated none (make the field unique)");
	} else if (status == 401) {
		auth_rejected(k->crm, r);
	} else if (status == 409 || status == 429 || status == 503 ||
	           (status == 403 && crm_sf_error_code_is(k, "REQUEST_LIMIT_EXCEEDED")) ||
	           (status == 400 && crm_sf_error_code_is(k, "UNABLE_TO_LOCK_ROW"))) {
		r->outcome = OUTCOME_RETRY;
		r->retry_after_ms = k->retry_after_ms;
	} else if (status >= 500) {
		r->outcome = OUTCOME_AMBIGUOUS;
		r->retry_after_ms = k->retry_after_ms;
	} else {
		r->outcome = OUTCOME_TERMINAL;
	}
}

/* A 2xx: accepted.  The id comes from the body; with none (204 before API
 * v46.0, or a body without an id) one GET asks for the record's real Id,
 * and the local reference stands in if that cannot start. */
static void upsert_accepted(CURL *easy, struct crm_call *k, long status, struct outbox_result *r)
{
	char err[OUTBOX_ERROR_MAX];

	r->outcome = OUTCOME_ACCEPTED;
	if (status != 204 && crm_body_id(k, "id", r->provider_id, sizeof(r->provider_id))) {
		finish_upsert(easy, k, r);
		return;
	}
	curl_easy_cleanup(easy);
	k->kind = CALL_UPSERT_LOOKUP;
	k->upsert_status = (int)status;
	if (crm_call_start(k, false, err, sizeof(err)))
		return;
	crm_fmt(r->provider_id, sizeof(r->provider_id), "%s", k->local_ref);
	k->done(k->token, r);
	crm_call_free(k);
}

static void upsert_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct crm *c = k->crm;
	struct outbox_result r = { .outcome = OUTCOME_TERMINAL, .retry_after_ms = -1 };
	long status = 0;

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	r.status = (int)status;
	if (rc != CURLE_OK) {
		crm_transport_error(rc, k, r.error, sizeof(r.error));
		r.outcome = request_started(easy) ? OUTCOME_AMBIGUOUS : OUTCOME_NOT_SENT;
		r.status = 0;
		finish_upsert(easy, k, &r);
		return;
	}
	if (status != 401 && c->auth_failing) {
		c->auth_failing = false;
		c->host->log(OLOG_INFO, CRM_NAME, "access token accepted again");
	}
	if (status == 200 || status == 201 || status == 204) {
		upsert_accepted(easy, k, status, &r);
		return;
	}
	classify_failure(k, status, &r);
	finish_upsert(easy, k, &r);
}

/* The GET after an upsert that gave no id: the upsert's outcome stands
 * (accepted); only the provider id depends on this answer. */
static void upsert_lookup_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct outbox_result r = { .outcome = OUTCOME_ACCEPTED, .retry_after_ms = -1 };
	long status = 0;

	r.status = k->upsert_status;
	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	if (rc != CURLE_OK || status != 200 ||
	    !crm_body_id(k, "Id", r.provider_id, sizeof(r.provider_id))) {
		crm_fmt(r.provider_id, sizeof(r.provider_id), "%s", k->local_ref);
		k->crm->host->log(OLOG_INFO, CRM_NAME, "upsert accepted (HTTP %d) but the Id lookup "
		                  "answered %ld: provider id is the local reference", r.status,
		                  rc == CURLE_OK ? status : 0L);
	}
	finish_upsert(easy, k, &r);
}

/* The access token a server quotes back (a 401 "... Bearer <token>") is cut
 * out of the answer before any text is made of it: an excerpt cut from it
 * never keeps part of the token (the dispatcher scrubs whole ones from
 * every result and log line as well). */
static void scrub_answer(struct crm_call *k)
{
	const char *token = k->crm->host->conf_str(k->crm->conf, "access_token");
	struct scrub s = { 0 };

	if (k->resp.data == NULL || token[0] == '\0')
		return;
	scrub_add(&s, token, strlen(token));
	scrub_text(&s, &k->resp.data, &k->resp.len, k->resp.truncated);
	scrub_free(&s);
}

void crm_on_done(CURL *easy, CURLcode rc, void *arg)
{
	struct crm_call *k = arg;

	scrub_answer(k);
	switch (k->kind) {
	case CALL_UPSERT:
		upsert_answer(easy, rc, k);
		return;
	case CALL_UPSERT_LOOKUP:
		upsert_lookup_answer(easy, rc, k);
		return;
	case CALL_RECONCILE:
		crm_reconcile_answer(easy, rc, k);
		return;
	}
	abort();
}

/* SPDX-License-Identifier: ISC */
/*
 * crm.h: the crm provider's own parts (providers/crm/): Salesforce REST
 * upsert by External ID, and reconciliation by looking the external id up
 * (docs/crm.md).
 *
 *   target   "Object/ExternalIdField", e.g. "Task/Outbox_Key__c"
 *   payload  a JSON object of the fields to upsert (scalars or null)
 *
 *   send       PATCH {instance_url}/services/data/{api_version}/sobjects/
 *                    {Object}/{ExternalIdField}/{effect key}
 *   reconcile  GET   the same path ?fields=Id
 *
 * The effect key is the record's external id, so an upsert repeated after
 * an ambiguous outcome updates the record the first call created: this
 * provider honours keys.  Every transfer runs on the worker's loop through
 * curl_loop; a call's state lives in one struct crm_call until its done
 * callback has returned.
 *
 * crm.c: keys, life cycle, the provider table and two small text helpers;
 * instance.c: the org's instance URL, API version and access token,
 * checked at init; record.c: the target and payload, checked (validate),
 * and a new call's record URL; transfer.c: a call's request (headers with
 * the token, body) and its transfer, and send; answer.c: the upsert's
 * answer classified, and what the answers share; reconcile.c: the lookup
 * of an `unknown` effect's record and its verdict.
 */
#ifndef OUTBOX_CRM_H
#define OUTBOX_CRM_H

#include <curl/curl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "lib/curl_io.h"
#include "text.h"
#include "provider.h"

#define CRM_NAME          "crm"
#define CRM_NAME_MAX      80        /* Salesforce API names are at most 80 */
#define CRM_RESP_MAX      (1 << 20) /* response bytes kept; the rest is dropped */
#define CRM_INSTANCE_URL_MAX 1024
/* instance URL + "/services/data/vNN.N/sobjects/" + 2 names + key + query */
#define CRM_URL_MAX       (CRM_INSTANCE_URL_MAX + 64 + 2 * CRM_NAME_MAX + 2 + 255 + 16)

struct crm {
	const struct outbox_host *host;
	const struct outbox_conf *conf;
	struct curl_loop *loop;
	char *sobjects_url;        /* {instance_url}/services/data/{v}/sobjects/ */
	char *ca_file;             /* NULL: libcurl's default bundle */
	const char *protocols;     /* "https", or "http" for a loopback server */
	char host_key[300];
	bool auth_failing;         /* last answer was 401: log the change once */
};

enum crm_call_kind {
	CALL_UPSERT,
	CALL_UPSERT_LOOKUP,        /* GET after an upsert that returned no id */
	CALL_RECONCILE,
};

struct crm_call {
	struct crm *crm;
	enum crm_call_kind kind;
	outbox_done_fn done;
	outbox_recon_fn recon_done;
	void *token;
	char *record_url;          /* .../sobjects/Object/Field/key */
	char *body;                /* the upsert's JSON; NULL for GETs */
	struct curl_slist *headers;
	struct curl_body resp;     /* the first CRM_RESP_MAX bytes: a size never fails a call */
	long retry_after_ms;       /* -1: no Retry-After on the last response */
	int upsert_status;         /* CALL_UPSERT_LOOKUP: what the PATCH answered */
	char local_ref[OUTBOX_PROVIDER_ID_MAX];
	char errbuf[CURL_ERROR_SIZE];
};

/* crm.c */
void crm_fmt(char *dst, size_t len, const char *f, ...) __attribute__((format(printf, 3, 4)));
void crm_copy_printable(char *dst, size_t len, const char *src, size_t n);

/* instance.c: c->sobjects_url, c->protocols and c->host_key from the
 * configured instance URL and API version; false with err when they are
 * unusable. */
bool crm_parse_instance_url(struct crm *c, const char *url, const char *api_version,
                            char *err, size_t errlen);
/* The token goes into a header line: no control characters, no spaces. */
bool crm_token_ok(const char *t);

/* record.c */
bool crm_validate(void *self, const struct outbox_effect *e, char *host_key,
                  size_t host_keylen, char *err, size_t errlen);
/* Split "Object/Field" into its two API names. */
bool crm_parse_target(const char *target, size_t *obj_len, const char **field, char *err,
                      size_t errlen);
bool crm_check_payload(const json_t *payload, const char *field, char *err, size_t errlen);
/* A call for e with its record URL and local reference, not started;
 * NULL with err on failure. */
struct crm_call *crm_call_new(struct crm *c, const struct outbox_effect *e,
                              enum crm_call_kind kind, char *err, size_t errlen);

/* transfer.c */
bool crm_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
              char *err, size_t errlen);
/* Starts k's PATCH (patch) or GET ?fields=Id on the loop; crm_on_done()
 * gets the answer. */
bool crm_call_start(struct crm_call *k, bool patch, char *err, size_t errlen);
void crm_call_free(struct crm_call *k);
/* curl_loop_free()'s release: a transfer still running at shutdown. */
void crm_release_transfer(CURL *easy, void *arg);

/* answer.c */
void crm_on_done(CURL *easy, CURLcode rc, void *arg);
void crm_sf_error_text(const struct crm_call *k, long status, char *dst, size_t len);
bool crm_sf_error_code_is(const struct crm_call *k, const char *code);
bool crm_body_id(const struct crm_call *k, const char *name, char *dst, size_t len);
void crm_transport_error(CURLcode rc, const struct crm_call *k, char *dst, size_t len);

/* reconcile.c */
bool crm_reconcile(void *self, const struct outbox_effect *e, outbox_recon_fn done,
                   void *token, char *err, size_t errlen);
void crm_reconcile_answer(CURL *easy, CURLcode rc, struct crm_call *k);

#endif

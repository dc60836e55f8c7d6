/* SPDX-License-Identifier: ISC */
/*
 * reconcile.c: an `unknown` crm effect, asked about by looking its record
 * up by the external id (GET ?fields=Id, never a re-send): found is sent
 * (with the record's Id), Salesforce's NOT_FOUND is not sent, anything
 * else (several records, an error, no answer) cannot tell.
 */
#include <curl/curl.h>
#include <stdio.h>

#include "crm/crm.h"

bool crm_reconcile(void *self, const struct outbox_effect *e, outbox_recon_fn done,
                   void *token, char *err, size_t errlen)
{
	struct crm *c = self;
	struct crm_call *k = crm_call_new(c, e, CALL_RECONCILE, err, errlen);

	if (k == NULL)
		return false;
	k->recon_done = done;
	k->token = token;
	if (!crm_call_start(k, false, err, errlen)) {
		crm_call_free(k);
		return false;
	}
	return true;
}

void crm_reconcile_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct outbox_recon_result r = { .verdict = RECON_CANNOT_TELL };
	long status = 0;

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	if (rc != CURLE_OK) {
		crm_transport_error(rc, k, r.error, sizeof(r.error));
	} else {
		r.status = (int)status;
		if (status == 200) {
			if (crm_body_id(k, "Id", r.provider_id, sizeof(r.provider_id)))
				r.verdict = RECON_SENT;
			else
				crm_fmt(r.error, sizeof(r.error), "HTTP 200 without a record Id");
		} else if (status == 404 && crm_sf_error_code_is(k, "NOT_FOUND")) {
			r.verdict = RECON_NOT_SENT;
			crm_sf_error_text(k, status, r.error, sizeof(r.error));
		} else if (status == 300) {
			crm_fmt(r.error, sizeof(r.error), "HTTP 300: several records have this external id");
		} else {
			crm_sf_error_text(k, status, r.error, sizeof(r.error));
		}
	}
	curl_easy_cleanup(easy);
	k->recon_done(k->token, &r);
	crm_call_free(k);
}

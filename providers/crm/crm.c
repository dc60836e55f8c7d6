/* SPDX-License-Identifier: ISC */
/*
 * crm.c: the crm provider's glue: its configuration keys, life cycle
 * (init, shutdown), the provider table, and the two text helpers its files
 * share.  What it does and why: crm.h.
 */
#include <curl/curl.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crm/crm.h"
#include "lib/curl_loop.h"

static const struct outbox_conf_key crm_keys[] = {
	{ "instance_url", CONF_STR, "", 0, 0,
	  "https://NAME.my.salesforce.com (http only for a loopback test server)" },
	{ "api_version", CONF_STR, "v59.0", 0, 0, "REST API version, vNN.N" },
	{ "access_token", CONF_SECRET, "", 0, 0,
	  "OAuth access token: file:/path or env:NAME; sent as a Bearer token, never logged" },
	{ "ca_file", CONF_STR, "", 0, 0, "PEM bundle to verify the server with; empty: the system's" },
	{ "auth_retry_ms", CONF_INT, "60000", 0, 86400000,
	  "401 (token rejected): retry after this long instead of failing the effect" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

/* ---- text helpers ---------------------------------------------------------- */

void crm_fmt(char *dst, size_t len, const char *f, ...)
{
	va_list ap;

	if (len == 0)
		return;
	va_start(ap, f);
	vsnprintf(dst, len, f, ap);
	va_end(ap);
}

/* Copy text that goes into logs and the database: printable ASCII only,
 * so a hostile response cannot forge log lines.  Not lib/text.c's
 * text_copy_printable(): that one drops CR and LF (an SMTP reply's line
 * breaks) and turns a tab into '?'.  Here a newline or a tab becomes a
 * space, so the words of a multi-line Salesforce message stay apart, and a
 * tab after "Retry-After:" (HTTP's optional whitespace) is skipped like a
 * space when the value is read. */
void crm_copy_printable(char *dst, size_t len, const char *src, size_t n)
{
	size_t o = 0;

	if (len == 0)
		return;
	for (size_t i = 0; i < n && o + 1 < len; i++) {
		unsigned char c = (unsigned char)src[i];
		dst[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : (c == '\n' || c == '\t' ? ' ' : '?');
	}
	dst[o] = '\0';
}

/* ---- life cycle ------------------------------------------------------------ */

static void crm_shutdown(void *self)
{
	struct crm *c = self;

	if (c == NULL)
		return;
	curl_loop_free(c->loop, crm_release_transfer);
	free(c->sobjects_url);
	free(c->ca_file);
	free(c);
	curl_global_cleanup();
}

/* The configured CA bundle, if any, must be readable now. */
static bool set_ca_file(struct crm *c, char *err, size_t errlen)
{
	const char *ca = c->host->conf_str(c->conf, "ca_file");

	if (ca[0] == '\0')
		return true;
	if (access(ca, R_OK) != 0) {
		crm_fmt(err, errlen, "%s: cannot read %s: %s", c->host->conf_where(c->conf, "ca_file"),
		        ca, strerror(errno));
		return false;
	}
	c->ca_file = text_strdup(ca);
	return true;
}

static void *crm_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                      size_t errlen)
{
	struct crm *c = text_alloc(sizeof(*c));

	c->host = host;
	c->conf = conf;
	if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
		crm_fmt(err, errlen, "libcurl failed to initialise");
		free(c);
		return NULL;
	}
	if (!crm_parse_instance_url(c, host->conf_str(conf, "instance_url"),
	                            host->conf_str(conf, "api_version"), err, errlen))
		goto fail;
	if (!crm_token_ok(host->conf_str(conf, "access_token"))) {
		crm_fmt(err, errlen, "%s: required, one line without spaces (file:/path or env:NAME)",
		        host->conf_where(conf, "access_token"));
		goto fail;
	}
	if (!set_ca_file(c, err, errlen))
		goto fail;
	/* No proxy: the instance is the operator's, and a proxy would see the
	 * token. */
	c->loop = curl_loop_new(host->base, &(struct curl_safety){ c->protocols, c->ca_file, NULL });
	if (c->loop == NULL) {
		crm_fmt(err, errlen, "cannot set up libcurl on the event loop");
		goto fail;
	}
	host->log(OLOG_INFO, CRM_NAME, "Salesforce upsert by external id at %s (TLS verification %s)",
	          c->sobjects_url, strcmp(c->protocols, "https") == 0 ? "on" : "n/a: loopback http");
	return c;
fail:
	crm_shutdown(c);
	return NULL;
}

/* Every record goes to the one instance. */
static const char *crm_one_host(void *self)
{
	const struct crm *c = self;

	return c->host_key;
}

/* ---- the provider ---------------------------------------------------------- */

static const struct outbox_provider crm_provider = {
	.abi = OUTBOX_PROVIDER_ABI,
	.name = CRM_NAME,
	.caps = OUTBOX_CAP_HONOURS_KEYS | OUTBOX_CAP_RECONCILE | OUTBOX_CAP_STARTS_AT_ONCE,
	.keys = crm_keys,
	.init = crm_init,
	.validate = crm_validate,
	.send = crm_send,
	.reconcile = crm_reconcile,
	.shutdown = crm_shutdown,
	.one_host = crm_one_host,
};

const struct outbox_provider *outbox_provider_entry(void)
{
	return &crm_provider;
}

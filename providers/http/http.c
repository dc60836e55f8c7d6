/* SPDX-License-Identifier: ISC */
/*
 * http.c: the http provider's glue: its configuration keys, life cycle
 * (init, shutdown), reconciliation through lib/http_lookup.c, and the
 * provider table.  What it does and why: http.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/http.h"
#include "lib/curl_loop.h"
#include "lib/http_lookup.h"
#include "lib/netrules.h"
#include "lib/sign.h"
#include "text.h"

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
	{ "secrets_dir", CONF_STR, "", 0, 0,
	  "directory of the secrets payload headers may name ({\"secret\": NAME}); empty: none "
	  "(never the directory of the worker's own file: secrets)" },
	{ "secrets", CONF_STR, "", 0, 0,
	  "the secrets payload headers may name and where to: NAME=URL-PREFIX [URL-PREFIX...]; "
	  "NAME=..." },
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

/* ---- life cycle ----------------------------------------------------------- */

static void *http_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                       size_t errlen)
{
	struct http_provider *hp = text_alloc(sizeof(*hp));
	const char *secret;
	char rerr[256];

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
	hp->id_header = text_strdup(host->conf_str(conf, "provider_id_header"));
	hp->id_json = text_strdup(host->conf_str(conf, "provider_id_json"));
	hp->user_agent = text_strdup(host->conf_str(conf, "user_agent"));
	hp->ca_file = text_strdup(host->conf_str(conf, "ca_file"));
	hp->proxy = text_strdup(host->conf_str(conf, "proxy"));
	if (host->conf_str(conf, "secrets_dir")[0])
		hp->secrets_dir = text_strdup(host->conf_str(conf, "secrets_dir"));
	if (!http_secrets_parse(hp, host->conf_str(conf, "secrets"), rerr, sizeof(rerr))) {
		snprintf(err, errlen, "%s: %s", host->conf_where(conf, "secrets"), rerr);
		goto fail;
	}
	if (hp->n_secrets > 0 && hp->secrets_dir == NULL) {
		snprintf(err, errlen, "%s: secrets are declared but secrets_dir is not set",
		         host->conf_where(conf, "secrets"));
		goto fail;
	}
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
	hp->loop = curl_loop_new(host->base, &(struct curl_safety){ "http,https", hp->ca_file,
	                                                            hp->proxy });
	if (hp->loop == NULL) {
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
	free(hp->secrets_dir);
	http_secrets_free(hp);
	free(hp);
	return NULL;
}

static void http_shutdown(void *self)
{
	struct http_provider *hp = self;

	http_lookup_free(hp->lookup);
	curl_loop_free(hp->loop, http_release_call);
	while (hp->pool_len > 0)
		curl_easy_cleanup(hp->pool[--hp->pool_len]);
	netrules_free(hp->rules);
	http_target_cache_free(hp);
	free(hp->id_header);
	free(hp->id_json);
	free(hp->user_agent);
	free(hp->ca_file);
	free(hp->proxy);
	free(hp->secrets_dir);
	http_secrets_free(hp);
	explicit_bzero(hp->secret, sizeof(hp->secret));
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
	.caps = OUTBOX_CAP_RECONCILE | OUTBOX_CAP_RECONCILE_IF_CONFIGURED | OUTBOX_CAP_STARTS_AT_ONCE,
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

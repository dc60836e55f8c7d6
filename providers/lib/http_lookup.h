/*
 * http_lookup.h: the http provider's optional reconciliation: ask the
 * target's API whether it holds an effect, by its key, and answer
 * sent / not sent / cannot tell (docs/http.md "Asking the provider").
 *
 * Off unless [provider.http] reconcile_url is set.  The keys below are
 * spliced into http.c's key table.
 */
#ifndef OUTBOX_HTTP_LOOKUP_H
#define OUTBOX_HTTP_LOOKUP_H

#include <stdbool.h>
#include <stddef.h>

#include "provider.h"

struct netrules;
struct http_lookup;

#define HTTP_LOOKUP_KEYS \
	{ "reconcile_url", CONF_STR, "", 0, 0, \
	  "lookup URL for unknown effects ({key}, {effect_id}, {origin}); empty: no lookup" }, \
	{ "reconcile_targets", CONF_STR, "", 0, 0, \
	  "targets the lookup answers for: URL prefixes or host names, comma or space separated" }, \
	{ "reconcile_method", CONF_STR, "GET", 0, 0, "lookup request method" }, \
	{ "reconcile_found_status", CONF_STR, "200", 0, 0, "statuses meaning found (comma separated)" }, \
	{ "reconcile_not_found_status", CONF_STR, "404", 0, 0, \
	  "statuses meaning definitively not found (comma separated)" }, \
	{ "reconcile_id_json", CONF_STR, "/id", 0, 0, \
	  "JSON pointer to the provider id in a found answer; empty: not read" }, \
	{ "reconcile_id_header", CONF_STR, "", 0, 0, \
	  "response header holding the provider id in a found answer (before the JSON)" }, \
	{ "reconcile_header", CONF_SECRET, "", 0, 0, \
	  "one extra request header for the lookup, e.g. env:LOOKUP_AUTH = Authorization: Bearer ..." }, \
	{ "reconcile_min_age_seconds", CONF_INT, "300", 1, 604800, \
	  "not found counts only this long after the last attempt started" }, \
	{ "reconcile_timeout_ms", CONF_INT, "5000", 10, 600000, "whole lookup timeout" }

/* NULL with err[0] == '\0': no lookup configured.  NULL with err set: a
 * bad key (err names it).  rules, ca_file, proxy and user_agent are the
 * provider's and must outlive the lookup. */
struct http_lookup *http_lookup_new(const struct outbox_host *host, const struct outbox_conf *conf,
                                    const struct netrules *rules, const char *ca_file,
                                    const char *proxy, const char *user_agent, char *err,
                                    size_t errlen);

/* provider.h's reconcile() contract. */
bool http_lookup_ask(struct http_lookup *lk, const struct outbox_effect *e, outbox_recon_fn done,
                     void *token, char *err, size_t errlen);

/* Lookups in flight are abandoned (their done is not called). */
void http_lookup_free(struct http_lookup *lk);

/* For the unit test: the value at an RFC 6901 JSON pointer as provider-id
 * text (a string, or an integer written out); false if absent or of
 * another type. */
bool http_lookup_pointer_id(const char *json, size_t len, const char *pointer, char *out,
                            size_t outlen);

#endif

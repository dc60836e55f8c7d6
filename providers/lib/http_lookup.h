/* SPDX-License-Identifier: ISC */
/*
 * http_lookup.h: the http provider's optional reconciliation: ask the
 * target's API whether it holds an effect, by its key, and answer
 * sent / not sent / cannot tell (docs/http.md "Asking the provider").
 *
 * Off unless [provider.http] reconcile_url is set (its reconcile_* keys
 * are in http.c's key table).
 */
#ifndef OUTBOX_HTTP_LOOKUP_H
#define OUTBOX_HTTP_LOOKUP_H

#include <stdbool.h>
#include <stddef.h>

#include "provider.h"

struct netrules;
struct http_lookup;


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

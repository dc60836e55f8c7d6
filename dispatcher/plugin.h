/* SPDX-License-Identifier: ISC */
/*
 * plugin.h: loading provider plugins (dlopen by name from provider_dir),
 * checking their interface version and config, and the per-provider
 * policy (timeouts, retries, limits) the dispatcher applies around them.
 */
#ifndef OUTBOX_PLUGIN_H
#define OUTBOX_PLUGIN_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "provider.h"

struct event_base;

struct provider_slot {
	char name[64];
	void *dl;
	const struct outbox_provider *ops;
	void *self;                   /* the provider's state from init() */
	struct outbox_conf conf;
	struct provider_policy policy;
	bool honours_keys;            /* config, else the capability bit */
	bool can_reconcile;           /* a reconcile hook, and (if optional) configured */
	int in_flight;
	/* The provider's one_host() (ABI 4), as a host: "" when it has none. */
	char one_host[256];
};

struct provider_set {
	struct provider_slot *slots;
	size_t n;
};

/* Load each plugin named in the comma-separated names (empty: every
 * [provider.*] section of cfg, else "http").  One clear error and false
 * when a plugin is missing, has another interface version, has a bad
 * config or fails init; the set is then empty. */
bool providers_load(struct provider_set *set, struct config *cfg, const char *dir,
                    const char *names, struct event_base *base, const char *worker,
                    char *err, size_t errlen);
struct provider_slot *providers_find(struct provider_set *set, const char *name);
/* Re-read the common policy keys from a new config (SIGHUP); nothing
 * changes unless every section checks out. */
bool providers_reload_policy(struct provider_set *set, struct config *cfg, char *err,
                             size_t errlen);
/* Point the providers' config views at a new config object. */
void providers_rebind(struct provider_set *set, struct config *cfg);
void providers_unload(struct provider_set *set);
/* The config's secret values (every CONF_SECRET key, resolved) cut out of
 * buf[size], a provider's text (lib/scrub.h); set by providers_load and
 * providers_rebind. */
void providers_scrub(char *buf, size_t size);

/* Where a provider's late result (host->late_result: an acceptance after
 * the call was reported ambiguous) is handed; NULL fn: dropped. */
typedef void (*providers_late_fn)(void *arg, const char *provider, const char *effect_id,
                                  int attempt, const struct outbox_result *res);
void providers_on_late_result(providers_late_fn fn, void *arg);

/* The default provider_dir: <dir of the executable>/providers when it
 * exists (a build tree), else the installed library folder. */
void providers_default_dir(char *buf, size_t len);

#endif

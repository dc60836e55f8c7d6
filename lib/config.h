/* SPDX-License-Identifier: ISC */
/*
 * config.h: the INI config, as tables of keys (name, type, default,
 * bounds).  Parsing (inih) and checking happen before anything uses a
 * value, and every error names the file, the line and the key.  A failed
 * reload keeps the old config.
 */
#ifndef OUTBOX_CONFIG_H
#define OUTBOX_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "provider.h"
#include "util.h"

struct conf_entry {
	char *section;
	char *key;
	char *value;
	char *resolved;    /* CONF_SECRET: the secret itself; never logged */
	int line;
	bool known;        /* matched a key table */
};

struct config {
	char *path;
	struct conf_entry *entries;
	size_t n, cap;
	bool others_can_read;      /* the file's mode has o+r (config_load) */
};

/* The [database], [dispatcher], [metrics] and [log] settings. */
struct core_settings {
	const char *conninfo;
	bool poll_only;
	long reconnect_min_ms, reconnect_max_ms;
	long busy_connections;

	const char *worker_name;
	const char *provider_dir;
	const char *providers;
	long lease_seconds, max_lease_seconds;
	long batch_size, max_in_flight, complete_batch;
	long poll_interval_ms, maintenance_interval_ms;
	long shutdown_grace_ms, max_payload_bytes;
	long unknown_type_grace_seconds;
	long lease_head_slow_ms;
	bool claim;                 /* outbox_claim for rows that can go at once */

	const char *metrics_listen;
	const char *log_level;
};

/* The keys every [provider.NAME] section has, whatever the provider. */
struct provider_policy {
	long timeout_ms, connect_timeout_ms;
	long max_attempts, backoff_base_ms, backoff_cap_ms, retry_after_max_ms;
	int honours_keys;          /* -1: the provider's capability decides */
	long max_in_flight, max_per_host;
	long breaker_failures, breaker_open_ms;
};

extern const struct outbox_conf_key core_keys_database[];
extern const struct outbox_conf_key core_keys_dispatcher[];
extern const struct outbox_conf_key core_keys_metrics[];
extern const struct outbox_conf_key core_keys_log[];
extern const struct outbox_conf_key core_keys_console[];
extern const struct outbox_conf_key provider_common_keys[];

/* Parse path.  On error returns NULL and writes "file:line: [section] key:
 * reason" to err. */
struct config *config_load(const char *path, char *err, size_t errlen) WARN_UNUSED;
/* Same, from a string (tests and fuzzing); name is used in messages. */
struct config *config_load_string(const char *name, const char *text,
                                  char *err, size_t errlen) WARN_UNUSED;
void config_free(struct config *cfg);

/* Check the core sections against their tables and fill *out (pointers
 * into cfg).  Also refuses unknown sections other than [provider.*]. */
bool config_core(struct config *cfg, struct core_settings *out, char *err, size_t errlen) WARN_UNUSED;

/* One config file for N instances: `outbox-dispatcher --instance N` (the
 * systemd template passes %i) runs as worker "<worker_name>-N" (empty
 * worker_name: "<host>-N") with its metrics on [metrics] listen's port
 * + N - 1.  N is a number from 1 to CONFIG_MAX_INSTANCE; NULL: no
 * instance, both as written.  Writes the results to name and listen
 * (name "" when worker_name is empty and there is no instance); false
 * with err for a bad instance or a port past 65535. */
#define CONFIG_MAX_INSTANCE 1000
bool config_instance(const struct core_settings *s, const char *instance, char *name,
                     size_t namelen, char *listen, size_t listenlen, char *err,
                     size_t errlen) WARN_UNUSED;

/* Check [provider.NAME] against the common keys plus the provider's own
 * (NULL for none), resolve secrets, fill *policy. */
bool config_provider(struct config *cfg, const char *name,
                     const struct outbox_conf_key *own_keys,
                     struct provider_policy *policy, char *err, size_t errlen) WARN_UNUSED;

/* Names of the [provider.NAME] sections present, in file order, as a
 * comma-separated list written to buf. */
void config_provider_sections(const struct config *cfg, char *buf, size_t len);

/* A value or NULL when the key is absent. */
const struct conf_entry *config_find(const struct config *cfg, const char *section,
                                     const char *key);

/* A key of a section checked by config_core(), or its default. */
const char *config_value(const struct config *cfg, const char *section,
                         const struct outbox_conf_key *table, const char *key);
long config_int(const struct config *cfg, const char *section,
                const struct outbox_conf_key *table, const char *key);
bool config_bool(const struct config *cfg, const char *section,
                 const struct outbox_conf_key *table, const char *key);

/* The view a provider gets (opaque in provider.h). */
struct outbox_conf {
	struct config *cfg;
	char section[128];
	const struct outbox_conf_key *own;
};
const char *conf_str(const struct outbox_conf *c, const char *key);
long conf_int(const struct outbox_conf *c, const char *key);
bool conf_bool(const struct outbox_conf *c, const char *key);
const char *conf_where(const struct outbox_conf *c, const char *key);

#endif

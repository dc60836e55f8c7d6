/* SPDX-License-Identifier: ISC */
/*
 * config.c: the configuration's key tables (every key with its type,
 * default and bounds; dispatcher.ini.example documents the same), the
 * checks of the values read against them (secrets resolved), and the
 * settings the worker and the providers read.  Reading the file itself:
 * config_read.c.
 */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "log.h"
#include "util.h"

/* Every key with its default; dispatcher.ini.example documents the same. */
const struct outbox_conf_key core_keys_database[] = {
	{ "conninfo", CONF_SECRET, "", 0, 0, "libpq conninfo or URL; empty: libpq's environment" },
	{ "poll_only", CONF_BOOL, "false", 0, 0, "no LISTEN (PgBouncer transaction pooling)" },
	{ "reconnect_min_ms", CONF_INT, "100", 1, 600000, "first reconnect delay" },
	{ "reconnect_max_ms", CONF_INT, "10000", 1, 3600000, "reconnect delay cap" },
	{ "busy_connections", CONF_INT, "1", 1, 2,
	  "connections busy in a backlog: 1 records outcomes on the lease connection; 2 on the second" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

const struct outbox_conf_key core_keys_dispatcher[] = {
	{ "worker_name", CONF_STR, "", 0, 0, "name in logs and the database; empty: host-pid" },
	{ "provider_dir", CONF_STR, "", 0, 0, "where outbox_NAME.so plugins are" },
	{ "providers", CONF_STR, "", 0, 0, "plugins to load; empty: the [provider.*] sections, else http" },
	{ "lease_seconds", CONF_INT, "30", 2, 3600, "lease length, renewed while sending" },
	{ "max_lease_seconds", CONF_INT, "600", 2, 86400, "cap on the total lease of one send" },
	{ "batch_size", CONF_INT, "64", 1, 1000, "rows leased per round trip" },
	{ "max_in_flight", CONF_INT, "256", 1, 100000, "sends in flight per worker" },
	{ "complete_batch", CONF_INT, "256", 1, 5000, "outcomes recorded per round trip" },
	{ "poll_interval_ms", CONF_INT, "1000", 10, 600000, "poll when no NOTIFY arrives" },
	{ "maintenance_interval_ms", CONF_INT, "2000", 100, 10000, "reaper and housekeeping period" },
	{ "shutdown_grace_ms", CONF_INT, "10000", 0, 600000, "SIGTERM: wait this long for sends" },
	{ "max_payload_bytes", CONF_INT, "262144", 64, 67108864, "larger payloads fail as invalid" },
	{ "unknown_type_grace_seconds", CONF_INT, "60", 0, 86400, "fail rows of a type nobody serves after this" },
	/* Ignored: a lease while the switch is off returns nothing and the
	 * worker polls (poll_interval_ms) or wakes on the NOTIFY of "on".
	 * Accepted so that files written for earlier versions still load. */
	{ "kill_switch_recheck_ms", CONF_INT, "1000", 50, 60000, "ignored (kept so older files load)" },
	{ "claim", CONF_BOOL, "true", 0, 0,
	  "lease and mark rows in one statement while they can all be sent at once" },
	{ "lease_head_slow_ms", CONF_INT, "10", 0, 60000,
	  "a lease from the due index's head slower than this: lease from the last position; 0: always" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

const struct outbox_conf_key core_keys_metrics[] = {
	{ "listen", CONF_STR, "127.0.0.1:9464", 0, 0, "host:port for /metrics and /healthz; empty: off" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

const struct outbox_conf_key core_keys_log[] = {
	{ "level", CONF_STR, "info", 0, 0, "debug, info, warn or error" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

/* outbox-console's section (console/); the workers check it and ignore it. */
const struct outbox_conf_key core_keys_console[] = {
	{ "listen", CONF_STR, "127.0.0.1:8470", 0, 0, "HOST:PORT on loopback, or unix:/PATH" },
	{ "conninfo", CONF_STR, "", 0, 0, "the viewer's login; empty: [database] conninfo" },
	{ "actions", CONF_BOOL, "false", 0, 0, "on: operators may act (as their own role)" },
	{ "trusted_proxy", CONF_STR, "", 0, 0, "the proxy's address whose identity header is read" },
	{ "identity_header", CONF_STR, "X-Remote-User", 0, 0, "the header naming the person" },
	{ "origin", CONF_STR, "", 0, 0, "the origin pages are served from (https://host)" },
	{ "refresh_seconds", CONF_INT, "5", 0, 3600, "pages refresh this often while visible; 0 never" },
	{ "max_connections", CONF_INT, "64", 1, 10000, "connections at once" },
	{ "approvals_url", CONF_STR, "", 0, 0,
	  "the n8n kit's approval page, {id} the approval's id (http or https); empty: no link" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

const struct outbox_conf_key provider_common_keys[] = {
	{ "timeout_ms", CONF_INT, "10000", 10, 3600000, "whole-call timeout" },
	{ "connect_timeout_ms", CONF_INT, "3000", 10, 600000, "connect timeout" },
	{ "max_attempts", CONF_INT, "5", 1, 1000, "attempts before failed (retries exhausted)" },
	{ "backoff_base_ms", CONF_INT, "500", 1, 3600000, "first backoff ceiling" },
	{ "backoff_cap_ms", CONF_INT, "60000", 1, 86400000, "largest backoff ceiling" },
	{ "retry_after_max_ms", CONF_INT, "300000", 0, 86400000, "Retry-After is honoured up to this" },
	{ "honours_idempotency_keys", CONF_STR, "", 0, 0, "true/false; empty: the provider's default" },
	{ "max_in_flight", CONF_INT, "256", 1, 100000, "sends in flight for this provider" },
	{ "max_per_host", CONF_INT, "64", 1, 100000, "sends in flight per target host" },
	{ "breaker_failures", CONF_INT, "5", 1, 100000, "consecutive failures that open a host's breaker" },
	{ "breaker_open_ms", CONF_INT, "30000", 10, 3600000,
	  "longest wait between an open breaker's probes (the first goes after 1 s, doubling)" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

static const struct outbox_conf_key *key_lookup(const struct outbox_conf_key *table,
                                                const char *name)
{
	for (; table && table->name; table++)
		if (strcmp(table->name, name) == 0)
			return table;
	return NULL;
}

static bool parse_bool(const char *v, bool *out)
{
	if (!strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "on") || !strcmp(v, "1")) {
		*out = true;
		return true;
	}
	if (!strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "off") || !strcmp(v, "0")) {
		*out = false;
		return true;
	}
	return false;
}

static bool parse_long(const char *v, long *out)
{
	char *end;
	long n;

	errno = 0;
	n = strtol(v, &end, 10);
	if (errno != 0 || end == v || *end != '\0')
		return false;
	*out = n;
	return true;
}

/* The file a "file:" value names; false when it names
 * ${CREDENTIALS_DIRECTORY} and that is not set.  systemd's per-unit
 * credentials directory differs per instance
 * (/run/credentials/outbox-dispatcher@N.service): one config for N
 * instances names it this way. */
static bool secret_file_path(const char *v, char *file, size_t len)
{
	static const char cred_var[] = "${CREDENTIALS_DIRECTORY}";

	if (strncmp(v + 5, cred_var, sizeof(cred_var) - 1) == 0) {
		const char *dir = getenv("CREDENTIALS_DIRECTORY");
		if (dir == NULL || dir[0] == '\0')
			return false;
		snprintf(file, len, "%s%s", dir, v + 5 + sizeof(cred_var) - 1);
	} else {
		snprintf(file, len, "%s", v + 5);
	}
	return true;
}

/* A secret is "file:/path" (first line of the file), "env:NAME", or the
 * value itself. */
static bool resolve_secret(struct conf_entry *e, const char *path, char *err, size_t errlen)
{
	const char *v = e->value;

	if (strncmp(v, "file:", 5) == 0) {
		char file[4096];
		FILE *fp;
		char buf[4096];
		size_t n;
		struct stat st;

		if (!secret_file_path(v, file, sizeof(file))) {
			snprintf(err, errlen, "%s:%d: [%s] %s: ${CREDENTIALS_DIRECTORY} is not set (it is "
			         "inside a unit with LoadCredential=)", path, e->line, e->section, e->key);
			return false;
		}
		fp = fopen(file, "r");
		if (fp == NULL) {
			snprintf(err, errlen, "%s:%d: [%s] %s: cannot read secret file %s: %s", path,
			         e->line, e->section, e->key, file, strerror(errno));
			return false;
		}
		if (fstat(fileno(fp), &st) == 0 && (st.st_mode & S_IROTH))
			log_msg(OLOG_WARN, "secret_file_readable",
			        "%s:%d: [%s] %s: secret file %s is readable by every user (mode %03o): "
			        "chmod o-r it, or pass it with systemd's LoadCredential=", path, e->line,
			        e->section, e->key, file, (unsigned)(st.st_mode & 0777));
		n = fread(buf, 1, sizeof(buf) - 1, fp);
		fclose(fp);
		buf[n] = '\0';
		buf[strcspn(buf, "\r\n")] = '\0';
		e->resolved = text_strdup(buf);
		memset(buf, 0, sizeof(buf));
	} else if (strncmp(v, "env:", 4) == 0) {
		const char *s = getenv(v + 4);
		if (s == NULL) {
			snprintf(err, errlen, "%s:%d: [%s] %s: environment variable %s is not set", path,
			         e->line, e->section, e->key, v + 4);
			return false;
		}
		e->resolved = text_strdup(s);
	} else {
		e->resolved = text_strdup(v);
	}
	return true;
}

/* A config file every user may read that holds a secret in clear. */
static void warn_readable_config(const struct config *cfg, int line, const char *section,
                                 const char *key)
{
	log_msg(OLOG_WARN, "config_readable",
	        "%s:%d: [%s] %s: a secret in a config file every user may read: chmod o-r the "
	        "file, or name the secret with file: or env:", cfg->path, line, section, key);
}

/* Whether a conninfo carries a password (key=value or URI user:pw@). */
static bool conninfo_has_password(const char *ci)
{
	const char *auth, *at, *slash;

	if (strcasestr(ci, "password") != NULL)
		return true;
	if (strncmp(ci, "postgresql://", 13) == 0)
		auth = ci + 13;
	else if (strncmp(ci, "postgres://", 11) == 0)
		auth = ci + 11;
	else
		return false;
	slash = strchr(auth, '/');
	at = strchr(auth, '@');
	if (at == NULL || (slash != NULL && slash < at))
		return false;
	return memchr(auth, ':', (size_t)(at - auth)) != NULL;
}

/* A relative provider_dir names a directory beside the config file, not
 * one under whatever directory the worker was started from. */
static void resolve_provider_dir(struct config *cfg)
{
	struct conf_entry *e = (struct conf_entry *)config_find(cfg, "dispatcher", "provider_dir");
	const char *slash = strrchr(cfg->path, '/');
	struct strbuf b;

	if (e == NULL || e->value[0] == '\0' || e->value[0] == '/' || slash == NULL)
		return;
	sb_init(&b, strlen(cfg->path) + strlen(e->value) + 2);
	sb_append(&b, cfg->path, (size_t)(slash - cfg->path) + 1);
	sb_puts(&b, e->value);
	free(e->value);
	e->value = b.s;
}

static bool check_entry(struct config *cfg, struct conf_entry *e,
                        const struct outbox_conf_key *k, char *err, size_t errlen)
{
	long n;
	bool b;

	e->known = true;
	switch (k->type) {
	case CONF_INT:
		if (!parse_long(e->value, &n) || n < k->min || n > k->max) {
			snprintf(err, errlen, "%s:%d: [%s] %s: must be an integer from %ld to %ld (got \"%.64s\")",
			         cfg->path, e->line, e->section, e->key, k->min, k->max, e->value);
			return false;
		}
		return true;
	case CONF_BOOL:
		if (!parse_bool(e->value, &b)) {
			snprintf(err, errlen, "%s:%d: [%s] %s: must be true or false (got \"%.64s\")",
			         cfg->path, e->line, e->section, e->key, e->value);
			return false;
		}
		return true;
	case CONF_SECRET:
		free(e->resolved);
		e->resolved = NULL;
		/* A conninfo is a secret only when it carries a password. */
		if (cfg->others_can_read && strncmp(e->value, "file:", 5) != 0 &&
		    strncmp(e->value, "env:", 4) != 0 &&
		    (strcmp(e->key, "conninfo") != 0 || conninfo_has_password(e->value)))
			warn_readable_config(cfg, e->line, e->section, e->key);
		return resolve_secret(e, cfg->path, err, errlen);
	case CONF_STR:
		return true;
	}
	return true;
}

/* Check every entry of one section against up to two tables. */
static bool check_section(struct config *cfg, const char *section,
                          const struct outbox_conf_key *t1, const struct outbox_conf_key *t2,
                          char *err, size_t errlen)
{
	for (size_t i = 0; i < cfg->n; i++) {
		struct conf_entry *e = &cfg->entries[i];
		const struct outbox_conf_key *k;

		if (strcmp(e->section, section) != 0)
			continue;
		k = key_lookup(t1, e->key);
		if (k == NULL)
			k = key_lookup(t2, e->key);
		if (k == NULL) {
			snprintf(err, errlen, "%s:%d: [%s] %s: unknown key", cfg->path, e->line,
			         e->section, e->key);
			return false;
		}
		if (!check_entry(cfg, e, k, err, errlen))
			return false;
	}
	return true;
}

static const char *value_or_default(const struct config *cfg, const char *section,
                                    const struct outbox_conf_key *table, const char *key)
{
	const struct conf_entry *e = config_find(cfg, section, key);
	const struct outbox_conf_key *k = key_lookup(table, key);

	if (e)
		return e->resolved ? e->resolved : e->value;
	return k && k->def ? k->def : "";
}

static long int_of(const struct config *cfg, const char *section,
                   const struct outbox_conf_key *table, const char *key)
{
	long n = 0;

	if (!parse_long(value_or_default(cfg, section, table, key), &n))
		n = 0;
	return n;
}

static bool bool_of(const struct config *cfg, const char *section,
                    const struct outbox_conf_key *table, const char *key)
{
	bool b = false;

	if (!parse_bool(value_or_default(cfg, section, table, key), &b))
		b = false;
	return b;
}

/* [console] approvals_url: empty, or http(s)://HOST... holding {id} once,
 * where the approval's id goes; no spaces, quotes or angle brackets (the
 * console puts it in an href).  Checked here, for the workers too, so a
 * mistake is found by whichever program loads the file first. */
static bool console_approvals_url_ok(const struct config *cfg, char *err, size_t errlen)
{
	const struct conf_entry *e = config_find(cfg, "console", "approvals_url");
	const char *u = e ? e->value : "", *rest, *id;
	const char *why = NULL;

	if (!u[0])
		return true;
	if (strncmp(u, "https://", 8) == 0)
		rest = u + 8;
	else if (strncmp(u, "http://", 7) == 0)
		rest = u + 7;
	else
		rest = NULL;
	id = strstr(u, "{id}");
	if (rest == NULL)
		why = "must begin with https:// or http://";
	else if (!rest[0] || rest[0] == '/' || rest[0] == '{')
		why = "needs a host after the scheme";
	else if (u[strcspn(u, " \t\"'<>\\`")] != '\0')
		why = "must not hold spaces, quotes, backslashes or angle brackets";
	else if (id == NULL || strstr(id + 4, "{id}") != NULL)
		why = "must hold {id}, once, where the approval's id goes";
	else if (id < rest + strcspn(rest, "/?#"))
		why = "{id} must come after the host";
	if (why == NULL)
		return true;
	snprintf(err, errlen, "%s:%d: [console] approvals_url: %s (got \"%.64s\")", cfg->path,
	         e->line, why, u);
	return false;
}

bool config_core(struct config *cfg, struct core_settings *s, char *err, size_t errlen)
{
	static const struct {
		const char *name;
		const struct outbox_conf_key *keys;
	} sections[] = {
		{ "database", core_keys_database },
		{ "dispatcher", core_keys_dispatcher },
		{ "metrics", core_keys_metrics },
		{ "log", core_keys_log },
		{ "console", core_keys_console },
	};

	for (size_t i = 0; i < cfg->n; i++) {
		const char *sec = cfg->entries[i].section;
		bool ok = strncmp(sec, "provider.", 9) == 0 && sec[9] != '\0';

		for (size_t j = 0; !ok && j < sizeof(sections) / sizeof(sections[0]); j++)
			ok = strcmp(sec, sections[j].name) == 0;
		if (!ok) {
			snprintf(err, errlen, "%s:%d: [%s] %s: unknown section [%s]", cfg->path,
			         cfg->entries[i].line, sec, cfg->entries[i].key, sec);
			return false;
		}
	}
	for (size_t j = 0; j < sizeof(sections) / sizeof(sections[0]); j++)
		if (!check_section(cfg, sections[j].name, sections[j].keys, NULL, err, errlen))
			return false;

#define S(sec, tbl, k) value_or_default(cfg, sec, tbl, k)
#define I(sec, tbl, k) int_of(cfg, sec, tbl, k)
	s->conninfo = S("database", core_keys_database, "conninfo");
	s->poll_only = bool_of(cfg, "database", core_keys_database, "poll_only");
	s->reconnect_min_ms = I("database", core_keys_database, "reconnect_min_ms");
	s->reconnect_max_ms = I("database", core_keys_database, "reconnect_max_ms");
	s->busy_connections = I("database", core_keys_database, "busy_connections");
	s->worker_name = S("dispatcher", core_keys_dispatcher, "worker_name");
	resolve_provider_dir(cfg);
	s->provider_dir = S("dispatcher", core_keys_dispatcher, "provider_dir");
	s->providers = S("dispatcher", core_keys_dispatcher, "providers");
	s->lease_seconds = I("dispatcher", core_keys_dispatcher, "lease_seconds");
	s->max_lease_seconds = I("dispatcher", core_keys_dispatcher, "max_lease_seconds");
	s->batch_size = I("dispatcher", core_keys_dispatcher, "batch_size");
	s->max_in_flight = I("dispatcher", core_keys_dispatcher, "max_in_flight");
	s->complete_batch = I("dispatcher", core_keys_dispatcher, "complete_batch");
	s->poll_interval_ms = I("dispatcher", core_keys_dispatcher, "poll_interval_ms");
	s->lease_head_slow_ms = I("dispatcher", core_keys_dispatcher, "lease_head_slow_ms");
	s->claim = bool_of(cfg, "dispatcher", core_keys_dispatcher, "claim");
	s->maintenance_interval_ms = I("dispatcher", core_keys_dispatcher, "maintenance_interval_ms");
	s->shutdown_grace_ms = I("dispatcher", core_keys_dispatcher, "shutdown_grace_ms");
	s->max_payload_bytes = I("dispatcher", core_keys_dispatcher, "max_payload_bytes");
	s->unknown_type_grace_seconds = I("dispatcher", core_keys_dispatcher, "unknown_type_grace_seconds");
	s->metrics_listen = S("metrics", core_keys_metrics, "listen");
	s->log_level = S("log", core_keys_log, "level");
#undef S
#undef I

	if (s->max_lease_seconds < s->lease_seconds) {
		/* Blame whichever of the two the file sets (the other is a default). */
		const struct conf_entry *e = config_find(cfg, "dispatcher", "max_lease_seconds");
		if (e)
			snprintf(err, errlen, "%s:%d: [dispatcher] max_lease_seconds: must be >= lease_seconds (%ld)",
			         cfg->path, e->line, s->lease_seconds);
		else if ((e = config_find(cfg, "dispatcher", "lease_seconds")) != NULL)
			snprintf(err, errlen, "%s:%d: [dispatcher] lease_seconds: must be <= max_lease_seconds (%ld)",
			         cfg->path, e->line, s->max_lease_seconds);
		return false;
	}
	if (strcmp(s->log_level, "debug") && strcmp(s->log_level, "info") &&
	    strcmp(s->log_level, "warn") && strcmp(s->log_level, "error")) {
		const struct conf_entry *e = config_find(cfg, "log", "level");
		snprintf(err, errlen, "%s:%d: [log] level: must be debug, info, warn or error (got \"%.32s\")",
		         cfg->path, e ? e->line : 0, s->log_level);
		return false;
	}
	return console_approvals_url_ok(cfg, err, errlen);
}

/* Whether dir (resolved) is the directory holding file. */
static bool same_dir_as_file(const char *dir, const char *file)
{
	char copy[4096], real[PATH_MAX];
	char *slash;

	snprintf(copy, sizeof(copy), "%s", file);
	slash = strrchr(copy, '/');
	if (slash == NULL)
		snprintf(copy, sizeof(copy), ".");
	else if (slash == copy)
		slash[1] = '\0';
	else
		*slash = '\0';
	return realpath(copy, real) != NULL && strcmp(real, dir) == 0;
}

/* Whether dir (resolved) holds libpq's password file: the conninfo's
 * passfile= or $PGPASSFILE. */
static bool passfile_dir_is(const struct config *cfg, const char *dir)
{
	const struct conf_entry *ci = config_find(cfg, "database", "conninfo");
	const char *env = getenv("PGPASSFILE"), *v, *pf;
	char file[4096];

	if (env && env[0] && same_dir_as_file(dir, env))
		return true;
	if (ci == NULL)
		return false;
	v = ci->resolved ? ci->resolved : ci->value;
	if ((pf = strcasestr(v, "passfile=")) == NULL)
		return false;
	pf += 9;
	pf += *pf == '\'';
	snprintf(file, sizeof(file), "%.*s", (int)strcspn(pf, " \t'&"), pf);
	return file[0] && same_dir_as_file(dir, file);
}

/* A provider's secrets_dir (files a payload may name) is never where the
 * worker's own secrets are: the directory of any file: value in the config
 * (the database conninfo, SMTP passwords), of libpq's password file, or
 * $CREDENTIALS_DIRECTORY, so no
 * payload can name them. */
static bool check_secrets_dir(const struct config *cfg, const char *section, char *err,
                              size_t errlen)
{
	const struct conf_entry *e = config_find(cfg, section, "secrets_dir");
	const char *cred = getenv("CREDENTIALS_DIRECTORY");
	char real[PATH_MAX], cred_real[PATH_MAX], file[4096];

	if (e == NULL || e->value[0] == '\0')
		return true;
	if (realpath(e->value, real) == NULL) {
		snprintf(err, errlen, "%s:%d: [%s] secrets_dir: %s: %s", cfg->path, e->line, section,
		         e->value, strerror(errno));
		return false;
	}
	if (cred && cred[0] && realpath(cred, cred_real) != NULL && strcmp(real, cred_real) == 0) {
		snprintf(err, errlen, "%s:%d: [%s] secrets_dir: is $CREDENTIALS_DIRECTORY, which holds "
		         "the worker's own credentials: use a directory of its own", cfg->path, e->line,
		         section);
		return false;
	}
	if (passfile_dir_is(cfg, real)) {
		snprintf(err, errlen, "%s:%d: [%s] secrets_dir: is the directory of the database "
		         "password file (passfile, PGPASSFILE), which a payload must never name: use a "
		         "directory of its own", cfg->path, e->line, section);
		return false;
	}
	for (size_t i = 0; i < cfg->n; i++) {
		const struct conf_entry *o = &cfg->entries[i];

		if (strncmp(o->value, "file:", 5) == 0 && secret_file_path(o->value, file, sizeof(file)) &&
		    same_dir_as_file(real, file)) {
			snprintf(err, errlen, "%s:%d: [%s] secrets_dir: is the directory of [%s] %s's "
			         "file (line %d), which a payload must never name: use a directory of "
			         "its own", cfg->path, e->line, section, o->section, o->key, o->line);
			return false;
		}
	}
	return true;
}

bool config_provider(struct config *cfg, const char *name, const struct outbox_conf_key *own,
                     struct provider_policy *p, char *err, size_t errlen)
{
	char section[128];
	const char *hk;
	const struct conf_entry *e;

	snprintf(section, sizeof(section), "provider.%s", name);
	if (!check_section(cfg, section, provider_common_keys, own, err, errlen) ||
	    !check_secrets_dir(cfg, section, err, errlen))
		return false;
	/* A provider may redeclare a common key to give it its own default
	 * (email: max_in_flight); type and bounds stay the common table's. */
#define I(k) int_of(cfg, section, key_lookup(own, k) ? own : provider_common_keys, k)
	p->timeout_ms = I("timeout_ms");
	p->connect_timeout_ms = I("connect_timeout_ms");
	p->max_attempts = I("max_attempts");
	p->backoff_base_ms = I("backoff_base_ms");
	p->backoff_cap_ms = I("backoff_cap_ms");
	p->retry_after_max_ms = I("retry_after_max_ms");
	p->max_in_flight = I("max_in_flight");
	p->max_per_host = I("max_per_host");
	p->breaker_failures = I("breaker_failures");
	p->breaker_open_ms = I("breaker_open_ms");
#undef I
	hk = value_or_default(cfg, section, provider_common_keys, "honours_idempotency_keys");
	p->honours_keys = -1;
	if (hk[0] != '\0') {
		bool b;
		if (!parse_bool(hk, &b)) {
			e = config_find(cfg, section, "honours_idempotency_keys");
			snprintf(err, errlen, "%s:%d: [%s] honours_idempotency_keys: must be true or false (got \"%.32s\")",
			         cfg->path, e ? e->line : 0, section, hk);
			return false;
		}
		p->honours_keys = b;
	}
	if (p->backoff_cap_ms < p->backoff_base_ms) {
		e = config_find(cfg, section, "backoff_cap_ms");
		if (e)
			snprintf(err, errlen, "%s:%d: [%s] backoff_cap_ms: must be >= backoff_base_ms (%ld)",
			         cfg->path, e->line, section, p->backoff_base_ms);
		else if ((e = config_find(cfg, section, "backoff_base_ms")) != NULL)
			snprintf(err, errlen, "%s:%d: [%s] backoff_base_ms: must be <= backoff_cap_ms (%ld)",
			         cfg->path, e->line, section, p->backoff_cap_ms);
		return false;
	}
	return true;
}

bool config_instance(const struct core_settings *s, const char *instance, char *name,
                     size_t namelen, char *listen, size_t listenlen, char *err, size_t errlen)
{
	long n = 0, port;
	const char *colon;
	char *end;

	if (instance == NULL) {
		snprintf(name, namelen, "%s", s->worker_name);
		snprintf(listen, listenlen, "%s", s->metrics_listen);
		return true;
	}
	if (instance[0] < '1' || instance[0] > '9' || !parse_long(instance, &n) ||
	    n > CONFIG_MAX_INSTANCE) {
		snprintf(err, errlen, "--instance \"%.64s\": must be a number from 1 to %d (the metrics "
		         "port is [metrics] listen's + N - 1); give a named instance a config file of "
		         "its own and no --instance", instance, CONFIG_MAX_INSTANCE);
		return false;
	}
	if (s->worker_name[0])
		snprintf(name, namelen, "%s-%ld", s->worker_name, n);
	else
		name[0] = '\0';
	if (s->metrics_listen[0] == '\0') {
		listen[0] = '\0';
		return true;
	}
	colon = strrchr(s->metrics_listen, ':');
	errno = 0;
	port = colon ? strtol(colon + 1, &end, 10) : -1;
	if (colon == NULL || errno || end == colon + 1 || *end != '\0' || port < 1 ||
	    port + n - 1 > 65535) {
		snprintf(err, errlen, "[metrics] listen: instance %ld needs host:port with port + %ld "
		         "at most 65535 (got \"%.64s\")", n, n - 1, s->metrics_listen);
		return false;
	}
	snprintf(listen, listenlen, "%.*s:%ld", (int)(colon - s->metrics_listen), s->metrics_listen,
	         port + n - 1);
	return true;
}

void config_provider_sections(const struct config *cfg, char *buf, size_t len)
{
	size_t used = 0;

	buf[0] = '\0';
	for (size_t i = 0; i < cfg->n; i++) {
		const char *sec = cfg->entries[i].section;
		bool seen = false;

		if (strncmp(sec, "provider.", 9) != 0)
			continue;
		for (size_t j = 0; j < i && !seen; j++)
			seen = strcmp(cfg->entries[j].section, sec) == 0;
		if (seen)
			continue;
		used += (size_t)snprintf(buf + used, used < len ? len - used : 0, "%s%s",
		                         used ? "," : "", sec + 9);
		if (used >= len) {
			buf[len - 1] = '\0';
			return;
		}
	}
}

/* The provider's view. */
static const struct outbox_conf_key *conf_table_for(const struct outbox_conf *c, const char *key)
{
	return key_lookup(c->own, key) ? c->own : provider_common_keys;
}

const char *conf_str(const struct outbox_conf *c, const char *key)
{
	return value_or_default(c->cfg, c->section, conf_table_for(c, key), key);
}

long conf_int(const struct outbox_conf *c, const char *key)
{
	return int_of(c->cfg, c->section, conf_table_for(c, key), key);
}

bool conf_bool(const struct outbox_conf *c, const char *key)
{
	return bool_of(c->cfg, c->section, conf_table_for(c, key), key);
}

const char *conf_where(const struct outbox_conf *c, const char *key)
{
	static char buf[512];
	const struct conf_entry *e = config_find(c->cfg, c->section, key);

	if (e)
		snprintf(buf, sizeof(buf), "%s:%d: [%s] %s", c->cfg->path, e->line, c->section, key);
	else
		snprintf(buf, sizeof(buf), "%s: [%s] %s (not set)", c->cfg->path, c->section, key);
	return buf;
}

const char *config_value(const struct config *cfg, const char *section,
                         const struct outbox_conf_key *table, const char *key)
{
	return value_or_default(cfg, section, table, key);
}

long config_int(const struct config *cfg, const char *section,
                const struct outbox_conf_key *table, const char *key)
{
	return int_of(cfg, section, table, key);
}

bool config_bool(const struct config *cfg, const char *section,
                 const struct outbox_conf_key *table, const char *key)
{
	return bool_of(cfg, section, table, key);
}

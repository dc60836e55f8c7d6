/* SPDX-License-Identifier: ISC */
/*
 * plugin.c: provider plugins (see plugin.h).
 */
#include "plugin.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hosts.h"
#include "scrub.h"
#include "log.h"
#include "util.h"

#ifndef OUTBOX_LIBDIR
#define OUTBOX_LIBDIR "/usr/local/lib/outbox-dispatcher/providers"
#endif

/* The secret values of the config the providers were given (every
 * CONF_SECRET key, resolved), cut out of whatever a provider reports: its
 * results (providers_scrub, from send.c, reconcile.c and late.c) and its
 * log lines.  A peer may echo the credential a provider sent it. */
static struct scrub config_scrub;

static void scrub_from_config(const struct config *cfg)
{
	scrub_free(&config_scrub);
	for (size_t i = 0; i < cfg->n; i++) {
		const char *v = cfg->entries[i].resolved, *sp;

		if (v == NULL || v[0] == '\0')
			continue;
		scrub_add(&config_scrub, v, strlen(v));
		/* "Name: Scheme credential" (reconcile_header): its credential
		 * alone, as an answer would quote it. */
		if ((sp = strrchr(v, ' ')) != NULL && strlen(sp + 1) >= SCRUB_MIN_DERIVED)
			scrub_add(&config_scrub, sp + 1, strlen(sp + 1));
		if ((sp = strstr(v, ": ")) != NULL && strlen(sp + 2) >= SCRUB_MIN_DERIVED)
			scrub_add(&config_scrub, sp + 2, strlen(sp + 2));
	}
}

void providers_scrub(char *buf, size_t size)
{
	scrub_buf(&config_scrub, buf, size);
}

static void host_log(enum outbox_log_level level, const char *provider, const char *fmt, ...)
{
	char buf[2048];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	providers_scrub(buf, sizeof(buf));
	if (!utf8_valid(buf, strlen(buf)))
		for (char *p = buf; *p; p++)
			if ((unsigned char)*p >= 0x80)
				*p = '?';
	log_event(level, "provider", json_pack("{s:s,s:s}", "provider", provider, "msg", buf));
}

/* Late results go to whoever registered (the worker; one per process). */
static providers_late_fn late_fn;
static void *late_arg;

void providers_on_late_result(providers_late_fn fn, void *arg)
{
	late_fn = fn;
	late_arg = arg;
}

static void host_late_result(const char *provider, const char *effect_id, int attempt,
                             const struct outbox_result *res)
{
	if (late_fn && provider && effect_id && res)
		late_fn(late_arg, provider, effect_id, attempt, res);
}

static struct outbox_host host_template = {
	.abi = OUTBOX_PROVIDER_ABI,
	.log = host_log,
	.conf_str = conf_str,
	.conf_int = conf_int,
	.conf_bool = conf_bool,
	.conf_where = conf_where,
	.late_result = host_late_result,
};
static struct outbox_host provider_host;

void providers_default_dir(char *buf, size_t len)
{
	char exe[PATH_MAX], cand[PATH_MAX + 16];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	struct stat st;

	if (n > 0) {
		exe[n] = '\0';
		char *slash = strrchr(exe, '/');
		if (slash) {
			*slash = '\0';
			snprintf(cand, sizeof(cand), "%s/providers", exe);
			if (stat(cand, &st) == 0 && S_ISDIR(st.st_mode)) {
				text_copy(buf, cand, len);
				return;
			}
		}
	}
	text_copy(buf, OUTBOX_LIBDIR, len);
}

/*
 * Whether path (the provider directory or a plugin in it) may be trusted
 * to hold code: the file itself and every directory above it up to /, both
 * as written and as resolved (a symlink's target and the directories
 * above it), owned by root or by the user the worker runs as, and
 * writable by neither group nor others.  Anyone who can write any of them
 * could replace the file, or a directory on its way, and make the worker
 * run their code, with its database login and secrets.  OpenSSH's
 * StrictModes checks a key file's path the same way.  One exception: a
 * sticky directory above (/tmp) may be writable by others when the entry
 * of the path inside it (child) is root's or the worker's user's, as the
 * sticky bit lets no one else rename or remove that entry.  The node
 * itself never gets the exception, so provider_dir (checked as a node of
 * its own) is never a directory where others may add a plugin.
 */
static bool trusted_node(const char *what, const char *path, const char *node, bool self,
                         const char *child, char *err, size_t errlen)
{
	struct stat st, cst;
	char where[PATH_MAX + 64] = "";

	if (stat(node, &st) != 0) {
		snprintf(err, errlen, "%s %s: %s: %s", what, path, node, strerror(errno));
		return false;
	}
	if (!self)
		snprintf(where, sizeof(where), ": %s %s", S_ISDIR(st.st_mode) ? "the directory" : "its target",
		         node);
	if (st.st_uid != 0 && st.st_uid != geteuid()) {
		snprintf(err, errlen, "%s %s%s is owned by uid %u, neither root nor the worker's user "
		         "(uid %u): refusing to load code from it", what, path, where,
		         (unsigned)st.st_uid, (unsigned)geteuid());
		return false;
	}
	if ((st.st_mode & (S_IWGRP | S_IWOTH)) && child != NULL && S_ISDIR(st.st_mode) &&
	    (st.st_mode & S_ISVTX) && lstat(child, &cst) == 0 &&
	    (cst.st_uid == 0 || cst.st_uid == geteuid()))
		return true;
	if (st.st_mode & (S_IWGRP | S_IWOTH)) {
		snprintf(err, errlen, "%s %s%s is writable by %s (mode %03o): refusing to load code "
		         "from it; chmod go-w it%s", what, path, where,
		         (st.st_mode & S_IWOTH) ? "every user" : "its group",
		         (unsigned)(st.st_mode & 07777),
		         where[0] ? ", or keep the plugins elsewhere" : "");
		return false;
	}
	return true;
}

/* The node and every directory above it, up to /: abs is absolute, path
 * as written, resolved whether abs is its target rather than path. */
static bool trusted_chain(const char *what, const char *path, const char *abs, bool resolved,
                          char *err, size_t errlen)
{
	char buf[PATH_MAX], child[PATH_MAX];
	char *slash;
	struct stat lst;

	text_copy(buf, abs, sizeof(buf));
	/* A symlink itself: its target is judged on the resolved chain. */
	if (!(lstat(buf, &lst) == 0 && S_ISLNK(lst.st_mode)) &&
	    !trusted_node(what, path, buf, !resolved, NULL, err, errlen))
		return false;
	while ((slash = strrchr(buf, '/')) != NULL) {
		text_copy(child, buf, sizeof(child));
		if (slash == buf) {
			if (buf[1] == '\0')
				break;
			buf[1] = '\0';
		} else {
			*slash = '\0';
		}
		if (!trusted_node(what, path, buf, false, child, err, errlen))
			return false;
	}
	return true;
}

static bool trusted_path(const char *what, const char *path, char *err, size_t errlen)
{
	char abs[PATH_MAX], real[PATH_MAX], cwd[PATH_MAX];

	if (path[0] == '/') {
		text_copy(abs, path, sizeof(abs));
	} else if (getcwd(cwd, sizeof(cwd)) != NULL &&
	           (size_t)snprintf(abs, sizeof(abs), "%s/%s", cwd, path) < sizeof(abs)) {
		;
	} else {
		snprintf(err, errlen, "%s %s: cannot tell its directory", what, path);
		return false;
	}
	if (realpath(path, real) == NULL) {
		snprintf(err, errlen, "%s %s: %s", what, path, strerror(errno));
		return false;
	}
	/* As written (the directories holding each link), then as resolved. */
	return trusted_chain(what, path, abs, false, err, errlen) &&
	       (strcmp(real, abs) == 0 || trusted_chain(what, path, real, true, err, errlen));
}

static bool load_one(struct provider_slot *slot, struct config *cfg, const char *dir,
                     const char *name, char *err, size_t errlen)
{
	char path[PATH_MAX], perr[OUTBOX_ERROR_MAX] = "";
	outbox_provider_entry_fn entry;
	const struct outbox_provider *ops;

	if (strlen(name) == 0 || strlen(name) >= sizeof(slot->name) || strchr(name, '/') ||
	    strchr(name, '.')) {
		snprintf(err, errlen, "provider \"%s\": not a valid provider name", name);
		return false;
	}
	text_copy(slot->name, name, sizeof(slot->name));
	snprintf(path, sizeof(path), "%s/outbox_%s.so", dir, name);
	if (access(path, F_OK) == 0 && !trusted_path("provider plugin", path, err, errlen))
		return false;
	slot->dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (slot->dl == NULL) {
		snprintf(err, errlen, "provider \"%s\": cannot load %s: %s", name, path, dlerror());
		return false;
	}
	*(void **)&entry = dlsym(slot->dl, "outbox_provider_entry");
	if (entry == NULL) {
		snprintf(err, errlen, "provider \"%s\": %s has no outbox_provider_entry(): not a provider plugin",
		         name, path);
		return false;
	}
	ops = entry();
	if (ops == NULL || ops->abi < OUTBOX_PROVIDER_ABI_OLDEST || ops->abi > OUTBOX_PROVIDER_ABI) {
		snprintf(err, errlen,
		         "provider \"%s\": %s was built for provider interface %u, this dispatcher "
		         "speaks %u (and loads %u): rebuild the plugin against this providers/provider.h",
		         name, path, ops ? ops->abi : 0u, (unsigned)OUTBOX_PROVIDER_ABI,
		         (unsigned)OUTBOX_PROVIDER_ABI_OLDEST);
		return false;
	}
	if (ops->name == NULL || strcmp(ops->name, name) != 0 || ops->init == NULL ||
	    ops->validate == NULL || ops->send == NULL || ops->shutdown == NULL) {
		snprintf(err, errlen, "provider \"%s\": %s is incomplete (name \"%s\", missing callbacks)",
		         name, path, ops->name ? ops->name : "");
		return false;
	}
	slot->ops = ops;
	if (!config_provider(cfg, name, ops->keys, &slot->policy, err, errlen))
		return false;
	scrub_from_config(cfg);        /* its secrets are resolved now */
	slot->conf.cfg = cfg;
	snprintf(slot->conf.section, sizeof(slot->conf.section), "provider.%s", name);
	slot->conf.own = ops->keys;
	slot->honours_keys = slot->policy.honours_keys >= 0 ? slot->policy.honours_keys != 0
	                                                    : (ops->caps & OUTBOX_CAP_HONOURS_KEYS) != 0;
	slot->can_reconcile = (ops->caps & OUTBOX_CAP_RECONCILE) && ops->reconcile;
	if (slot->can_reconcile && (ops->caps & OUTBOX_CAP_RECONCILE_IF_CONFIGURED)) {
		const struct conf_entry *ce = config_find(cfg, slot->conf.section, "reconcile_url");
		slot->can_reconcile = ce != NULL && ce->value[0] != '\0';
	}
	slot->self = ops->init(&provider_host, &slot->conf, perr, sizeof(perr));
	if (slot->self == NULL) {
		snprintf(err, errlen, "provider \"%s\": init failed: %s", name,
		         perr[0] ? perr : "no reason given");
		return false;
	}
	/* One host for every effect (read from plugins built for ABI 4 on):
	 * the claim records it for the rows it moves to `sending`. */
	if (ops->abi >= 4 && ops->one_host != NULL) {
		const char *key = ops->one_host(slot->self);

		if (key != NULL && key[0] != '\0')
			host_key_host(key, slot->one_host, sizeof(slot->one_host));
	}
	log_event(OLOG_INFO, "provider_loaded",
	          json_pack("{s:s,s:s,s:b,s:b,s:I,s:I}", "provider", name, "path", path,
	                    "honours_idempotency_keys", slot->honours_keys, "can_reconcile",
	                    slot->can_reconcile,
	                    "timeout_ms", (json_int_t)slot->policy.timeout_ms, "max_attempts",
	                    (json_int_t)slot->policy.max_attempts));
	return true;
}

bool providers_load(struct provider_set *set, struct config *cfg, const char *dir,
                    const char *names, struct event_base *base, const char *worker,
                    char *err, size_t errlen)
{
	char list[1024], *save = NULL, *tok;

	scrub_from_config(cfg);
	provider_host = host_template;
	provider_host.base = base;
	provider_host.worker = worker;
	if (names && names[0])
		text_copy(list, names, sizeof(list));
	else
		config_provider_sections(cfg, list, sizeof(list));
	if (list[0] == '\0')
		text_copy(list, "http", sizeof(list));

	set->n = 0;
	set->slots = text_array(32, sizeof(*set->slots));
	if (access(dir, F_OK) == 0 && !trusted_path("provider_dir", dir, err, errlen)) {
		providers_unload(set);
		return false;
	}
	for (tok = strtok_r(list, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
		if (providers_find(set, tok))
			continue;
		if (set->n == 32) {
			snprintf(err, errlen, "too many providers (at most 32)");
			providers_unload(set);
			return false;
		}
		set->n++;
		if (!load_one(&set->slots[set->n - 1], cfg, dir, tok, err, errlen)) {
			providers_unload(set);
			return false;
		}
	}
	/* A [provider.X] section nothing loads is a typo worth refusing. */
	for (size_t i = 0; i < cfg->n; i++) {
		const char *sec = cfg->entries[i].section;
		if (strncmp(sec, "provider.", 9) == 0 && !providers_find(set, sec + 9)) {
			snprintf(err, errlen, "%s:%d: [%s]: no such provider is loaded (providers = %s)",
			         cfg->path, cfg->entries[i].line, sec, names && names[0] ? names : "(sections)");
			providers_unload(set);
			return false;
		}
	}
	return true;
}

struct provider_slot *providers_find(struct provider_set *set, const char *name)
{
	for (size_t i = 0; i < set->n; i++)
		if (strcmp(set->slots[i].name, name) == 0)
			return &set->slots[i];
	return NULL;
}

bool providers_reload_policy(struct provider_set *set, struct config *cfg, char *err,
                             size_t errlen)
{
	struct provider_policy fresh[32];

	for (size_t i = 0; i < set->n; i++)
		if (!config_provider(cfg, set->slots[i].name, set->slots[i].ops->keys, &fresh[i], err,
		                     errlen))
			return false;
	for (size_t i = 0; i < set->n; i++) {
		struct provider_slot *s = &set->slots[i];
		s->policy = fresh[i];
		s->honours_keys = fresh[i].honours_keys >= 0 ? fresh[i].honours_keys != 0
		                                             : (s->ops->caps & OUTBOX_CAP_HONOURS_KEYS) != 0;
	}
	return true;
}

void providers_rebind(struct provider_set *set, struct config *cfg)
{
	for (size_t i = 0; i < set->n; i++)
		set->slots[i].conf.cfg = cfg;
	scrub_from_config(cfg);
}

void providers_unload(struct provider_set *set)
{
	for (size_t i = 0; i < set->n; i++) {
		struct provider_slot *s = &set->slots[i];
		if (s->self && s->ops)
			s->ops->shutdown(s->self);
		/* Sanitizer builds keep the code mapped so leak reports can
		 * still name the plugin's frames. */
#if !defined(__SANITIZE_ADDRESS__)
		if (s->dl)
			dlclose(s->dl);
#endif
	}
	free(set->slots);
	set->slots = NULL;
	set->n = 0;
	scrub_free(&config_scrub);
}

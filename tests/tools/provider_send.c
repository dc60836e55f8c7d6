/* SPDX-License-Identifier: ISC */
/*
 * provider_send: drive one provider plugin without the dispatcher.
 *
 *   provider_send [--exit-after-ms N] PLUGIN.so CONFIG.ini NAME EFFECTS.json
 *
 * Loads PLUGIN.so the way the dispatcher does (abi check, the real config
 * checker from lib/config.c for [provider.NAME]), then, on a fresh
 * event_base, runs validate() and send() for each effect of EFFECTS.json
 * (one object or an array; each {"effect_id", "effect_key", "target",
 * "payload", "payload_text"?, "run_key"?, "attempt"?, "target_hex"?}; target_hex gives the
 * target as raw bytes, for input JSON cannot carry) and prints one JSON line per effect
 * on stdout:
 *
 *   {"effect_id": ..., "stage": "validate"|"send"|"done", "outcome": ...,
 *    "status": N, "provider_id": ..., "error": ..., "host_key": ...,
 *    "elapsed_ms": N}
 *
 * Exit 0 when every effect got an answer, 2 when the plugin or its config
 * was refused (one line {"stage": "init", "error": ...}).  With
 * --exit-after-ms the provider is shut down after N ms even with sends in
 * flight (they are abandoned, as at a dispatcher's stop).  Provider log
 * lines go to stderr as the dispatcher's JSON logs.
 *
 * Built by the tests: cc provider_send.c
 * build/obj/dispatcher/{config,config_read,util,log}.o
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>
#include <event2/thread.h>
#include <jansson.h>

#include "config.h"
#include "log.h"
#include "provider.h"
#include "util.h"

struct pending {
	size_t slot;
	char *target;             /* from target_hex */
	char *payload_text;       /* the payload as the worker passes it */
	json_t *effect;           /* keeps the strings alive until done */
	struct outbox_effect view;
	char host_key[256];
	int64_t started;
};

static struct event_base *base;
static int outstanding;
static struct pending **slots;   /* sends not answered yet */

static void host_log(enum outbox_log_level level, const char *provider, const char *fmt, ...)
{
	char buf[2048];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	log_event(level, "provider", json_pack("{s:s,s:s}", "provider", provider, "msg", buf));
}

static void print_line(json_t *o)
{
	char *s = json_dumps(o, JSON_COMPACT);

	printf("%s\n", s);
	fflush(stdout);
	free(s);
	json_decref(o);
}

static const char *outcome_text(enum outbox_outcome o)
{
	switch (o) {
	case OUTCOME_ACCEPTED:
		return "accepted";
	case OUTCOME_NOT_SENT:
		return "not_sent";
	case OUTCOME_RETRY:
		return "retry";
	case OUTCOME_TERMINAL:
		return "terminal";
	case OUTCOME_AMBIGUOUS:
		return "ambiguous";
	}
	return "?";
}

static void on_done(void *token, const struct outbox_result *r)
{
	struct pending *p = token;

	print_line(json_pack("{s:s,s:s,s:s,s:i,s:s,s:s,s:s,s:I,s:I}", "effect_id", p->view.effect_id,
	                     "stage", "done", "outcome", outcome_text(r->outcome), "status", r->status,
	                     "provider_id", r->provider_id, "error", r->error, "host_key", p->host_key,
	                     "retry_after_ms", (json_int_t)r->retry_after_ms, "elapsed_ms",
	                     (json_int_t)(now_mono_ms() - p->started)));
	slots[p->slot] = NULL;
	json_decref(p->effect);
	free(p->target);
	free(p->payload_text);
	free(p);
	if (--outstanding == 0)
		event_base_loopbreak(base);
}

static const char *str_of(json_t *o, const char *key, const char *def)
{
	const char *s = json_string_value(json_object_get(o, key));

	return s ? s : def;
}

static void on_exit_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	event_base_loopbreak(base);
}

int main(int argc, char **argv)
{
	const struct outbox_provider *ops;
	outbox_provider_entry_fn entry;
	struct outbox_host host = { 0 };
	struct outbox_conf conf = { 0 };
	struct provider_policy policy;
	struct config *cfg;
	json_t *effects;
	json_error_t jerr;
	char err[OUTBOX_ERROR_MAX] = "";
	void *dl, *self;
	long exit_after = -1;
	size_t n_effects;
	int ai = 1;

	if (argc > 2 && strcmp(argv[1], "--exit-after-ms") == 0) {
		exit_after = atol(argv[2]);
		ai = 3;
	}
	if (argc - ai != 4) {
		fprintf(stderr, "usage: provider_send [--exit-after-ms N] PLUGIN.so CONFIG.ini NAME EFFECTS.json\n");
		return 64;
	}
	signal(SIGPIPE, SIG_IGN);
	evthread_use_pthreads();
	log_init("provider_send", "t1");
	base = event_base_new();

	dl = dlopen(argv[ai], RTLD_NOW | RTLD_LOCAL);
	if (dl == NULL) {
		print_line(json_pack("{s:s,s:s}", "stage", "init", "error", dlerror()));
		return 2;
	}
	*(void **)&entry = dlsym(dl, "outbox_provider_entry");
	ops = entry ? entry() : NULL;
	if (ops == NULL || ops->abi != OUTBOX_PROVIDER_ABI || strcmp(ops->name, argv[ai + 2]) != 0) {
		print_line(json_pack("{s:s,s:s}", "stage", "init", "error", "not a provider of this ABI/name"));
		return 2;
	}
	cfg = config_load(argv[ai + 1], err, sizeof(err));
	if (cfg == NULL || !config_provider(cfg, ops->name, ops->keys, &policy, err, sizeof(err))) {
		print_line(json_pack("{s:s,s:s}", "stage", "init", "error", err));
		config_free(cfg);
		return 2;
	}
	conf.cfg = cfg;
	snprintf(conf.section, sizeof(conf.section), "provider.%s", ops->name);
	conf.own = ops->keys;
	host.abi = OUTBOX_PROVIDER_ABI;
	host.base = base;
	host.worker = "t1";
	host.log = host_log;
	host.conf_str = conf_str;
	host.conf_int = conf_int;
	host.conf_bool = conf_bool;
	host.conf_where = conf_where;
	self = ops->init(&host, &conf, err, sizeof(err));
	if (self == NULL) {
		print_line(json_pack("{s:s,s:s}", "stage", "init", "error", err));
		config_free(cfg);
		event_base_free(base);
		return 2;
	}

	effects = json_load_file(argv[ai + 3], JSON_ALLOW_NUL, &jerr);
	if (effects == NULL) {
		fprintf(stderr, "%s: %s\n", argv[ai + 3], jerr.text);
		return 64;
	}
	if (!json_is_array(effects)) {
		json_t *a = json_array();
		json_array_append_new(a, effects);
		effects = a;
	}
	n_effects = json_array_size(effects);
	slots = text_array(n_effects + 1, sizeof(*slots));
	for (size_t i = 0; i < json_array_size(effects); i++) {
		json_t *e = json_array_get(effects, i);
		struct pending *p = text_alloc(sizeof(*p));

		p->slot = i;
		p->effect = json_incref(e);
		p->view.effect_id = str_of(e, "effect_id", "00000000-0000-4000-8000-000000000000");
		p->view.run_key = str_of(e, "run_key", "run");
		p->view.effect_key = str_of(e, "effect_key", "");
		p->view.effect_type = ops->name;
		p->view.target = str_of(e, "target", "");
		if (json_is_string(json_object_get(e, "target_hex"))) {
			const char *h = str_of(e, "target_hex", "");
			size_t n = strlen(h) / 2;
			p->target = text_array(n + 1, 1);
			for (size_t k = 0; k < n; k++)
				sscanf(h + 2 * k, "%2hhx", (unsigned char *)&p->target[k]);
			p->view.target = p->target;
		}
		p->view.payload = json_object_get(e, "payload");
		/* The text: "payload_text" as given (to test numbers jansson
		 * cannot hold), else the payload compacted. */
		if (json_is_string(json_object_get(e, "payload_text")))
			p->payload_text = text_strdup(str_of(e, "payload_text", ""));
		else
			p->payload_text = json_dumps(p->view.payload, JSON_COMPACT | JSON_ENCODE_ANY);
		p->view.payload_text = p->payload_text;
		p->view.payload_len = p->payload_text ? strlen(p->payload_text) : 0;
		p->view.payload_hash = "";
		p->view.attempt = json_is_integer(json_object_get(e, "attempt"))
		                      ? (int)json_integer_value(json_object_get(e, "attempt"))
		                      : 1;
		p->started = now_mono_ms();
		err[0] = '\0';
		if (!ops->validate(self, &p->view, p->host_key, sizeof(p->host_key), err, sizeof(err))) {
			print_line(json_pack("{s:s,s:s,s:s}", "effect_id", p->view.effect_id, "stage",
			                     "validate", "error", err));
			json_decref(p->effect);
			free(p->target);
			free(p->payload_text);
			free(p);
			continue;
		}
		outstanding++;
		slots[i] = p;
		if (!ops->send(self, &p->view, on_done, p, err, sizeof(err))) {
			outstanding--;
			slots[i] = NULL;
			print_line(json_pack("{s:s,s:s,s:s}", "effect_id", p->view.effect_id, "stage", "send",
			                     "error", err));
			json_decref(p->effect);
			free(p->target);
			free(p->payload_text);
			free(p);
		}
	}
	json_decref(effects);
	if (outstanding > 0) {
		struct event *t = NULL;
		if (exit_after >= 0) {
			struct timeval tv = { exit_after / 1000, (exit_after % 1000) * 1000 };
			t = evtimer_new(base, on_exit_timer, NULL);
			evtimer_add(t, &tv);
		}
		event_base_dispatch(base);
		if (t)
			event_free(t);
	}
	ops->shutdown(self);
	/* Sends abandoned by the shutdown: done will never be called. */
	if (outstanding > 0)
		print_line(json_pack("{s:s,s:i}", "stage", "shutdown", "abandoned", outstanding));
	for (size_t i = 0; i < n_effects; i++)
		if (slots[i]) {
			json_decref(slots[i]->effect);
			free(slots[i]->target);
			free(slots[i]);
		}
	free(slots);
	config_free(cfg);
	event_base_free(base);
	return outstanding > 0 && exit_after < 0 ? 1 : 0;
}

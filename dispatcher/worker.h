/*
 * worker.h: one dispatcher worker: leasing, the kill-switch-checked
 * `sending` transition, provider calls, outcome recording, lease renewal,
 * the reaper, reconciliation and graceful shutdown, all on one libevent
 * loop.
 */
#ifndef OUTBOX_WORKER_H
#define OUTBOX_WORKER_H

#include <stdbool.h>

struct worker;
struct event_base;

struct worker_options {
	const char *config_path;
	const char *instance;      /* --instance N, or NULL (config_instance()) */
	/* --check-config: load the config and the plugins, then stop: no
	 * metrics listener, no database connection (so it works beside a
	 * running instance and without a database). */
	bool check_only;
};

/* Load config and plugins and connect.  Returns NULL after logging one
 * clear error (bad config, missing plugin...). */
struct worker *worker_new(struct event_base *base, const struct worker_options *opt);
/* Run the loop until a signal has stopped the worker; returns its exit
 * code, 0 (errors before the loop are worker_new's). */
int worker_run(struct worker *w);
void worker_free(struct worker *w);

#endif

/* SPDX-License-Identifier: ISC */
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
};

/* Load the config and the plugins, nothing more: no metrics listener, no
 * database connection (all --check-config does, so it works beside a
 * running instance and without a database).  Returns NULL after logging
 * one clear error (bad config, missing plugin...). */
struct worker *worker_load(struct event_base *base, const struct worker_options *opt);
/* Listen for metrics, connect and start the timers; false after logging
 * why (the caller still frees w). */
bool worker_start(struct worker *w);
/* Run the loop until a signal has stopped the worker; returns its exit
 * code, 0 (errors before the loop are worker_load's and worker_start's). */
int worker_run(struct worker *w);
void worker_free(struct worker *w);

#endif

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

/* Load config and plugins and connect.  Returns NULL after logging one
 * clear error (bad config, missing plugin...). */
struct worker *worker_new(struct event_base *base, const char *config_path);
/* Run the loop until the worker has stopped; returns the exit code. */
int worker_run(struct worker *w);
void worker_free(struct worker *w);

#endif

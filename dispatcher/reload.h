/* SPDX-License-Identifier: ISC */
/* reload.h: the reload's verdict, from the worker to ExecReload= (reload.c). */
#ifndef OUTBOX_RELOAD_H
#define OUTBOX_RELOAD_H

#include <stdbool.h>

/* The worker: its verdict on reload number seq (0: the start). */
void reload_report(unsigned seq, bool ok, const char *msg);

/* `outbox-dispatcher --reload PID`: SIGHUP, then wait for the verdict;
 * the exit status. */
int reload_request(const char *pid_text, int timeout_ms);

#endif

/* SPDX-License-Identifier: ISC */
/*
 * sdnotify.h: systemd notifications (READY, RELOADING, STOPPING, STATUS,
 * WATCHDOG) through libsystemd's sd_notify; no-ops outside systemd.
 */
#ifndef OUTBOX_SDNOTIFY_H
#define OUTBOX_SDNOTIFY_H

#include <stdbool.h>
#include <stdint.h>

struct event_base;

/* Arms a watchdog timer on the loop when WATCHDOG_USEC is set. */
void sdnotify_init(struct event_base *base);
void sdnotify_ready(const char *status);
void sdnotify_reloading(void);
void sdnotify_stopping(void);
void sdnotify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void sdnotify_shutdown(void);
/* What sdnotify_init() found: NOTIFY_SOCKET set, and the watchdog interval
 * its timer pings at (0: no timer armed).  For logs and tests. */
bool sdnotify_enabled(void);
uint64_t sdnotify_watchdog_usec(void);

#endif

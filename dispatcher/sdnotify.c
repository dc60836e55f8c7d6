/* SPDX-License-Identifier: ISC */
/*
 * sdnotify.c: systemd notifications through libsystemd's sd_notify.
 *
 *   STATUS                while starting: why the worker cannot serve yet
 *                         (database unreachable, permission denied, schema
 *                         too old), so that `systemctl status` says it
 *   READY=1 + STATUS      once the worker serves: both database connections
 *                         up and the schema checked (and again after a
 *                         reload); until then TimeoutStartSec= applies
 *   RELOADING=1           on SIGHUP, with MONOTONIC_USEC (systemd >= 253
 *                         wants it for Type=notify-reload; older ignore it)
 *   STOPPING=1            on SIGTERM
 *   WATCHDOG=1            from a timer on the worker's own loop at half of
 *                         WatchdogSec: a stuck loop stops the pings and
 *                         systemd restarts the unit.
 *
 * Outside systemd (NOTIFY_SOCKET unset) every call is a no-op.
 */
#include "sdnotify.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>
#include <systemd/sd-daemon.h>

#include "log.h"

static struct {
	bool enabled;            /* NOTIFY_SOCKET is set */
	bool warned;             /* one warning per process for a failed notify */
	struct event *watchdog;
	uint64_t watchdog_usec;
} S;

/* Sends one notification; a failure is logged once (systemd may be gone
 * during shutdown, and a log line per ping would flood the journal). */
static void notify(const char *state)
{
	int rc;

	if (!S.enabled)
		return;
	rc = sd_notify(0, state);
	if (rc < 0 && !S.warned) {
		S.warned = true;
		log_msg(OLOG_WARN, "sd_notify_failed", "sd_notify failed: %s", strerror(-rc));
	}
}

/* STATUS= text must stay on one line: a newline would start another
 * assignment in the notification datagram. */
static void status_clean(char *s)
{
	for (; *s; s++)
		if (*s == '\n' || *s == '\r')
			*s = ' ';
}

static void watchdog_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	notify("WATCHDOG=1");
}

void sdnotify_init(struct event_base *base)
{
	uint64_t usec = 0;
	const char *sock = getenv("NOTIFY_SOCKET");

	sdnotify_shutdown();
	S.enabled = sock && sock[0];
	if (!S.enabled || !base)
		return;
	/* > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID (if any) is us. */
	if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0)
		return;
	S.watchdog_usec = usec;
	S.watchdog = event_new(base, -1, EV_PERSIST, watchdog_cb, NULL);
	if (!S.watchdog) {
		log_msg(OLOG_ERROR, "sd_watchdog", "cannot create the watchdog timer");
		return;
	}
	{
		uint64_t half = usec / 2;
		struct timeval tv = { (time_t)(half / 1000000), (suseconds_t)(half % 1000000) };
		if (half == 0)
			tv.tv_usec = 1;
		event_add(S.watchdog, &tv);
	}
	log_msg(OLOG_INFO, "sd_watchdog", "systemd watchdog every %.3f s (WatchdogSec=%.3f s)",
	        (double)usec / 2e6, (double)usec / 1e6);
	notify("WATCHDOG=1");
}

void sdnotify_ready(const char *status)
{
	char buf[512];

	if (!S.enabled)
		return;
	snprintf(buf, sizeof(buf), "READY=1\nSTATUS=%s", status ? status : "ready");
	status_clean(buf + strlen("READY=1\n"));
	notify(buf);
}

void sdnotify_reloading(void)
{
	char buf[128];
	struct timespec ts;

	if (!S.enabled)
		return;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	snprintf(buf, sizeof(buf), "RELOADING=1\nSTATUS=reloading configuration\nMONOTONIC_USEC=%llu",
	         (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL);
	notify(buf);
}

void sdnotify_stopping(void)
{
	notify("STOPPING=1\nSTATUS=stopping: finishing in-flight sends");
}

void sdnotify_status(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	int n;

	if (!S.enabled)
		return;
	memcpy(buf, "STATUS=", 7);
	va_start(ap, fmt);
	n = vsnprintf(buf + 7, sizeof(buf) - 7, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	status_clean(buf + 7);
	notify(buf);
}

void sdnotify_shutdown(void)
{
	if (S.watchdog) {
		event_free(S.watchdog);
		S.watchdog = NULL;
	}
	S.watchdog_usec = 0;
}

bool sdnotify_enabled(void)
{
	return S.enabled;
}

uint64_t sdnotify_watchdog_usec(void)
{
	return S.watchdog ? S.watchdog_usec : 0;
}

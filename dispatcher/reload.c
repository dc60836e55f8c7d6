/* SPDX-License-Identifier: ISC */
/*
 * reload.c: `systemctl reload` as the worker itself answers it.
 *
 * The unit's ExecReload= runs `outbox-dispatcher --reload $MAINPID`: it
 * sends SIGHUP and waits for the worker's verdict on the new config, which
 * the worker (on SIGHUP, with its own credentials: systemd 252 does not
 * show the unit's credentials to ExecReload= processes) writes to
 * $RUNTIME_DIRECTORY/reload as one line "SEQ ok|failed MESSAGE", SEQ
 * counting the reloads since the start (0: started).  The helper exits 0
 * for ok, 1 for failed (systemd then says "Reload failed" and the worker
 * keeps its old config), 1 when no verdict comes within the timeout.
 */
#include "reload.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define STATUS_FILE "reload"

/* The first of $RUNTIME_DIRECTORY's paths (':'-separated) + "/reload". */
static bool status_path(char *path, size_t len)
{
	const char *dir = getenv("RUNTIME_DIRECTORY");
	size_t n;

	if (dir == NULL || dir[0] == '\0')
		return false;
	n = strcspn(dir, ":");
	return snprintf(path, len, "%.*s/%s", (int)n, dir, STATUS_FILE) < (int)len;
}

void reload_report(unsigned seq, bool ok, const char *msg)
{
	char path[4096], tmp[4200];
	FILE *f;

	if (!status_path(path, sizeof(path)))
		return;
	snprintf(tmp, sizeof(tmp), "%s.%ld", path, (long)getpid());
	f = fopen(tmp, "w");
	if (f == NULL)
		return;
	fprintf(f, "%u %s %s\n", seq, ok ? "ok" : "failed", msg);
	if (fclose(f) != 0 || rename(tmp, path) != 0)
		(void)unlink(tmp);
}

/* The status line's sequence number (-1: none yet) and the rest. */
static long read_status(const char *path, char *rest, size_t len)
{
	char line[2048];
	FILE *f = fopen(path, "r");
	long seq = -1;
	char *end;

	rest[0] = '\0';
	if (f == NULL)
		return -1;
	if (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = '\0';
		seq = strtol(line, &end, 10);
		if (end == line)
			seq = -1;
		else
			snprintf(rest, len, "%s", *end == ' ' ? end + 1 : end);
	}
	fclose(f);
	return seq;
}

int reload_request(const char *pid_text, int timeout_ms)
{
	char path[4096], rest[2048];
	long pid, before, now;
	char *end;
	struct timespec step = { 0, 50 * 1000000L };

	pid = strtol(pid_text, &end, 10);
	if (end == pid_text || *end != '\0' || pid <= 1) {
		fprintf(stderr, "outbox-dispatcher: --reload needs the worker's PID (ExecReload=... "
		                "--reload $MAINPID)\n");
		return 2;
	}
	if (!status_path(path, sizeof(path))) {
		fprintf(stderr, "outbox-dispatcher: --reload needs RUNTIME_DIRECTORY (the unit's "
		                "RuntimeDirectory=), where the worker writes its verdict\n");
		return 2;
	}
	before = read_status(path, rest, sizeof(rest));
	if (kill((pid_t)pid, SIGHUP) != 0) {
		fprintf(stderr, "outbox-dispatcher: cannot signal %ld: %s\n", pid, strerror(errno));
		return 1;
	}
	for (int waited = 0; waited < timeout_ms; waited += 50) {
		nanosleep(&step, NULL);
		now = read_status(path, rest, sizeof(rest));
		if (now > before) {
			bool ok = strncmp(rest, "ok", 2) == 0;

			fprintf(stderr, "outbox-dispatcher: %s\n", rest[0] ? rest : "reloaded");
			return ok ? 0 : 1;
		}
	}
	fprintf(stderr, "outbox-dispatcher: no answer from %ld to the reload within %d ms\n", pid,
	        timeout_ms);
	return 1;
}

/* SPDX-License-Identifier: ISC */
/*
 * log.c: the JSON line logger.  One write(2) per line so lines from
 * several threads never interleave.
 */
#include "log.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

static char log_program[32] = "outbox";
static char log_worker[128] = "";
static enum outbox_log_level log_min = OLOG_INFO;

void log_init(const char *program, const char *worker)
{
	text_copy(log_program, program, sizeof(log_program));
	if (worker)
		text_copy(log_worker, worker, sizeof(log_worker));
}

void log_set_worker(const char *worker)
{
	text_copy(log_worker, worker, sizeof(log_worker));
}

void log_set_min_level(enum outbox_log_level level)
{
	log_min = level;
}

bool log_wants(enum outbox_log_level level)
{
	return level >= log_min;
}

const char *log_level_name(enum outbox_log_level level)
{
	switch (level) {
	case OLOG_DEBUG:
		return "debug";
	case OLOG_INFO:
		return "info";
	case OLOG_WARN:
		return "warn";
	case OLOG_ERROR:
		return "error";
	}
	return "info";
}

void log_event(enum outbox_log_level level, const char *event, json_t *fields)
{
	char ts[40];
	char *line;
	json_t *o;

	if (level < log_min) {
		json_decref(fields);
		return;
	}
	format_iso8601(now_wall_ms(), ts, sizeof(ts));
	o = json_object();
	json_object_set_new(o, "ts", json_string(ts));
	json_object_set_new(o, "level", json_string(log_level_name(level)));
	json_object_set_new(o, "program", json_string(log_program));
	if (log_worker[0])
		json_object_set_new(o, "worker", json_string(log_worker));
	json_object_set_new(o, "event", json_string(event));
	if (fields) {
		json_object_update(o, fields);
		json_decref(fields);
	}
	line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_ENSURE_ASCII);
	json_decref(o);
	if (line) {
		size_t n = strlen(line);
		line[n] = '\n';   /* json_dumps leaves room: replace NUL, write n+1 */
		ssize_t w = write(STDERR_FILENO, line, n + 1);
		(void)w;
		free(line);
	}
}

void log_vmsg(enum outbox_log_level level, const char *event, const char *fmt, va_list ap)
{
	char buf[2048];

	if (level < log_min)
		return;
	vsnprintf(buf, sizeof(buf), fmt, ap);
	/* jansson refuses invalid UTF-8; keep the line rather than lose it. */
	if (!utf8_valid(buf, strlen(buf))) {
		for (char *p = buf; *p; p++)
			if ((unsigned char)*p >= 0x80)
				*p = '?';
	}
	log_event(level, event, json_pack("{s:s}", "msg", buf));
}

void log_msg(enum outbox_log_level level, const char *event, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	log_vmsg(level, event, fmt, ap);
	va_end(ap);
}

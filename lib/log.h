/* SPDX-License-Identifier: ISC */
/*
 * log.h: structured logs, one JSON object per line on stderr (journald
 * keeps it as is).  Every line has ts, level, program, worker and event.
 * Payloads are logged as their hash, secrets never: callers pass neither.
 */
#ifndef OUTBOX_LOG_H
#define OUTBOX_LOG_H

#include <jansson.h>
#include <stdbool.h>
#include <stdarg.h>

#include "provider.h"   /* enum outbox_log_level */

void log_init(const char *program, const char *worker);
void log_set_worker(const char *worker);
void log_set_min_level(enum outbox_log_level level);
/* Whether a line at this level would be printed (skip building it if not). */
bool log_wants(enum outbox_log_level level);
const char *log_level_name(enum outbox_log_level level);

/* {"event": event, "msg": formatted} */
void log_msg(enum outbox_log_level level, const char *event, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
void log_vmsg(enum outbox_log_level level, const char *event, const char *fmt, va_list ap);

/* Emit an event with the given fields; takes ownership of fields. */
void log_event(enum outbox_log_level level, const char *event, json_t *fields);

#endif

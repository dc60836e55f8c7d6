/* SPDX-License-Identifier: ISC */
/*
 * util.h: small helpers every part uses: clocks, randomness, UUIDs,
 * SHA-256, jittered backoff, and JSON-string and
 * terminal escaping onto the growing string (struct strbuf, which the
 * dispatcher shares with the providers: lib/text.h).  Allocations and
 * bounded copies are lib/text.h's: one out-of-memory policy, abort.
 */
#ifndef OUTBOX_UTIL_H
#define OUTBOX_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "text.h"

#define WARN_UNUSED __attribute__((warn_unused_result))

/* Milliseconds on the monotonic clock (intervals, deadlines). */
/* Raise the soft RLIMIT_NOFILE to the hard limit (every descriptor use is
 * poll()-based, so numbers past 1024 are fine): the database connections,
 * the sends and the metrics port then share the larger limit.  Returns the
 * soft limit now in force, -1 when it cannot be read. */
long fd_limit_raise(void);
int64_t now_mono_ms(void);
/* Milliseconds since the epoch (timestamps written to the database). */
int64_t now_wall_ms(void);
/* ISO 8601 UTC with milliseconds, e.g. 2026-11-30T01:02:03.456Z. */
void format_iso8601(int64_t wall_ms, char *buf, size_t len);

/* Cryptographic randomness (getrandom); aborts if the kernel cannot give it. */
void random_bytes(void *buf, size_t len);
/* Uniform in [0, bound) without modulo bias; bound > 0. */
uint64_t random_below(uint64_t bound);
/* A random (version 4) UUID in text form: 36 characters + NUL. */
void uuid_v4(char out[37]);

/* Lower-case hex SHA-256 of data: 64 characters + NUL. */
void sha256_hex(const void *data, size_t len, char out[65]);
/* Exponential backoff with full jitter: uniform in [0, min(cap, base*2^(attempt-1))]. */
int64_t backoff_full_jitter_ms(int64_t base_ms, int64_t cap_ms, int attempt);

/* True when s is valid UTF-8 (no overlongs, no surrogates). */
bool utf8_valid(const char *s, size_t len);

/* s as a JSON string, quotes included: ", \ and control characters
 * escaped the way jansson's json_dumps() escapes them (s is UTF-8). */
void sb_json_string(struct strbuf *b, const char *s);

/* s for a terminal: every control character visible instead of acted on.
 * C0 (except \n when keep_newlines), DEL and bytes that are not valid
 * UTF-8 become \xNN, C1 (U+0080..U+009F) becomes \u00NN; \t \r \n
 * (when escaped) and ESC keep their short names (\t \r \n \e).  A
 * lone ESC or an ANSI sequence is shown, never interpreted.  Invisible
 * and bidi characters (U+200B-200F, U+2028-202E, U+2060-2064,
 * U+2066-2069, U+FEFF) become \uNNNN: they reorder or hide text. */
void sb_term_escape(struct strbuf *b, const char *s, bool keep_newlines);
/* Whether s needs sb_term_escape() at all. */
bool term_needs_escape(const char *s, bool keep_newlines);

#endif

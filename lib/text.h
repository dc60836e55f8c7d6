/* SPDX-License-Identifier: ISC */
/*
 * text.h: small text helpers every provider needs: bounded copies,
 * printable copies of peer text, the growing string the programs and the
 * providers share, and the one out-of-memory policy of the whole tree
 * (abort: a worker that cannot allocate a few bytes cannot record outcomes
 * either, and the lease reaper recovers its rows).
 *
 * text.c is in lib/, linked into every program (the Makefile's LIB_SRC)
 * and into each plugin (from lib/'s archive): the providers build against
 * provider.h, lib/ and providers/lib/, never against a program's files,
 * and a plugin exports nothing but its entry point (providers/plugin.map),
 * so its calls here bind to its own copy, whatever the loading daemon was
 * built from.
 */
#ifndef OUTBOX_TEXT_H
#define OUTBOX_TEXT_H

#include <stdbool.h>
#include <stddef.h>

/* Every allocation of lib/, the programs and the providers
 * (tests/static/test_oom_policy.py checks): they
 * abort when memory is exhausted and never return NULL, so no caller has
 * an out-of-memory path to get wrong (a cut header, an all-zero HMAC).
 * text_alloc zeroes like calloc; text_array(n, size) checks n * size for
 * overflow; text_strndup copies at most n bytes. */
void *text_alloc(size_t n);
void *text_array(size_t n, size_t size);
void *text_realloc(void *p, size_t n);
char *text_strdup(const char *s);
char *text_strndup(const char *s, size_t n);

/* Copies src into dst[size], cut to fit, always NUL-terminated. */
void text_copy(char *dst, const char *src, size_t size);

/* Peer text (a server's reply, a response body) made printable ASCII for
 * the database and JSON logs: CR and LF dropped, other bytes outside
 * 0x20..0x7e become '?'.  Reads src[0..srclen). */
void text_copy_printable(char *dst, const char *src, size_t srclen, size_t size);

/* A growing string: text built by appending (an email message, the
 * completion batch's JSON, the metrics page, a config path), the one the
 * dispatcher and the providers share.  After sb_init, s is always a
 * NUL-terminated string of len bytes (it may hold NULs of its own), owned
 * by whoever holds the struct: free(b.s).
 *
 * Why this shape: sb_init makes s a valid (empty) string before anything
 * is appended, so a caller may read b.s at once and never meets a NULL; a
 * zeroed struct still works, as an empty buffer with no allocation yet.
 * Growth checks len + n for overflow and, like every allocation here,
 * aborts when memory runs out, so no caller has a half-built text to
 * handle.  Why here: the plugins and every program link this file; the
 * programs' formatters over it (JSON strings, terminal escapes) are in
 * lib/util.c. */
struct strbuf {
	char *s;
	size_t len, cap;
};

/* cap: the first allocation (0 for a small default). */
void sb_init(struct strbuf *b, size_t cap);
void sb_append(struct strbuf *b, const char *s, size_t n);
void sb_puts(struct strbuf *b, const char *s);
void sb_int(struct strbuf *b, long long v);
void sb_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif

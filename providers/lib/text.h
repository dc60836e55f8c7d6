/* SPDX-License-Identifier: ISC */
/*
 * text.h: small text helpers every provider needs: bounded copies,
 * printable copies of peer text, a growing byte buffer, and the providers'
 * out-of-memory policy (abort: a worker that cannot allocate a few bytes
 * cannot record outcomes either, and the lease reaper recovers its rows).
 */
#ifndef OUTBOX_TEXT_H
#define OUTBOX_TEXT_H

#include <stdbool.h>
#include <stddef.h>

/* calloc() that aborts when memory is exhausted (never returns NULL). */
void *text_alloc(size_t n);
char *text_strdup(const char *s);

/* Copies src into dst[size], cut to fit, always NUL-terminated. */
void text_copy(char *dst, const char *src, size_t size);

/* Peer text (a server's reply, a response body) made printable ASCII for
 * the database and JSON logs: CR and LF dropped, other bytes outside
 * 0x20..0x7e become '?'.  Reads src[0..srclen). */
void text_copy_printable(char *dst, const char *src, size_t srclen, size_t size);

/* A growing byte buffer, always NUL-terminated once written to. */
struct strbuf {
	char *p;
	size_t len, cap;
};

void strbuf_add(struct strbuf *b, const char *s, size_t n);
void strbuf_puts(struct strbuf *b, const char *s);
void strbuf_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif

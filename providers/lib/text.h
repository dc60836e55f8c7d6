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

/* The providers' allocations, all of them (providers/email/ aside): they
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

/* A growing byte buffer, always NUL-terminated once written to. */
struct strbuf {
	char *p;
	size_t len, cap;
};

void strbuf_add(struct strbuf *b, const char *s, size_t n);
void strbuf_puts(struct strbuf *b, const char *s);
void strbuf_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif

/* SPDX-License-Identifier: ISC */
/*
 * text.c: bounded and printable copies, the growing string and the
 * out-of-memory policy shared by the providers and the dispatcher (text.h).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text.h"

/* Said once on stderr (the journal) so that the abort has a cause. */
static void text_out_of_memory(void)
{
	fputs("outbox: out of memory\n", stderr);
	abort();
}

void *text_alloc(size_t n)
{
	void *p = calloc(1, n ? n : 1);

	if (p == NULL)
		text_out_of_memory();
	return p;
}

void *text_array(size_t n, size_t size)
{
	if (size != 0 && n > SIZE_MAX / size)
		text_out_of_memory();
	return text_alloc(n * size);
}

void *text_realloc(void *p, size_t n)
{
	void *q = realloc(p, n ? n : 1);

	if (q == NULL)
		text_out_of_memory();
	return q;
}

char *text_strdup(const char *s)
{
	size_t n = strlen(s) + 1;
	char *p = text_alloc(n);

	memcpy(p, s, n);
	return p;
}

char *text_strndup(const char *s, size_t n)
{
	size_t len = strnlen(s, n);
	char *p = text_alloc(len + 1);

	memcpy(p, s, len);
	return p;
}

void text_copy(char *dst, const char *src, size_t size)
{
	size_t n = strlen(src);

	if (size == 0)
		return;
	if (n >= size)
		n = size - 1;
	memcpy(dst, src, n);
	dst[n] = '\0';
}

void text_copy_printable(char *dst, const char *src, size_t srclen, size_t size)
{
	size_t o = 0;

	if (size == 0)
		return;
	for (size_t i = 0; i < srclen && o + 1 < size; i++) {
		unsigned char c = (unsigned char)src[i];
		if (c == '\r' || c == '\n')
			continue;
		dst[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
	}
	dst[o] = '\0';
}

/* ---- the growing string ------------------------------------------------- */

void sb_init(struct strbuf *b, size_t cap)
{
	b->cap = cap ? cap : 64;
	b->s = text_alloc(b->cap);
	b->len = 0;
}

/* Room for n more bytes and the NUL. */
static void sb_reserve(struct strbuf *b, size_t n)
{
	size_t need, cap;

	if (n >= SIZE_MAX - b->len)
		text_out_of_memory();
	need = b->len + n + 1;
	if (need <= b->cap)
		return;
	cap = b->cap ? b->cap : 64;
	while (cap < need)
		cap = cap > SIZE_MAX / 2 ? need : cap * 2;
	b->s = text_realloc(b->s, cap);
	b->cap = cap;
}

void sb_append(struct strbuf *b, const char *s, size_t n)
{
	sb_reserve(b, n);
	if (n)
		memcpy(b->s + b->len, s, n);
	b->len += n;
	b->s[b->len] = '\0';
}

void sb_puts(struct strbuf *b, const char *s)
{
	sb_append(b, s, strlen(s));
}

void sb_int(struct strbuf *b, long long v)
{
	char digits[24], *p = digits + sizeof(digits);
	/* Unsigned, so that the most negative value negates without overflow. */
	unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;

	do {
		*--p = (char)('0' + u % 10);
		u /= 10;
	} while (u);
	if (v < 0)
		*--p = '-';
	sb_append(b, p, (size_t)(digits + sizeof(digits) - p));
}

void sb_printf(struct strbuf *b, const char *fmt, ...)
{
	va_list ap;
	int n;

	/* Straight into the buffer: measure, make room, write. */
	va_start(ap, fmt);
	n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	if (n < 0)
		abort();        /* a bad format, or text past INT_MAX: inputs are capped far below */
	sb_reserve(b, (size_t)n);
	va_start(ap, fmt);
	vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
	va_end(ap);
	b->len += (size_t)n;
}

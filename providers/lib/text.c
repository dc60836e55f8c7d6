/* SPDX-License-Identifier: ISC */
/*
 * text.c: bounded and printable copies, the growing buffer and the
 * out-of-memory policy shared by the providers (text.h).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text.h"

void *text_alloc(size_t n)
{
	void *p = calloc(1, n ? n : 1);

	if (p == NULL)
		abort();
	return p;
}

void *text_array(size_t n, size_t size)
{
	if (size != 0 && n > SIZE_MAX / size)
		abort();
	return text_alloc(n * size);
}

void *text_realloc(void *p, size_t n)
{
	void *q = realloc(p, n ? n : 1);

	if (q == NULL)
		abort();
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

void strbuf_add(struct strbuf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 1024;
		while (cap < b->len + n + 1)
			cap *= 2;
		b->p = text_realloc(b->p, cap);
		b->cap = cap;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

void strbuf_puts(struct strbuf *b, const char *s)
{
	strbuf_add(b, s, strlen(s));
}

void strbuf_printf(struct strbuf *b, const char *fmt, ...)
{
	va_list ap;
	char small[512];
	int n;

	va_start(ap, fmt);
	n = vsnprintf(small, sizeof(small), fmt, ap);
	va_end(ap);
	if (n < 0)
		abort();
	if ((size_t)n < sizeof(small)) {
		strbuf_add(b, small, (size_t)n);
		return;
	}
	char *big = text_alloc((size_t)n + 1);
	va_start(ap, fmt);
	vsnprintf(big, (size_t)n + 1, fmt, ap);
	va_end(ap);
	strbuf_add(b, big, (size_t)n);
	free(big);
}

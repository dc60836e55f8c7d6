/* SPDX-License-Identifier: ISC */
/*
 * hostname.c: hosts in one spelling (see hostname.h).
 */
#include "hostname.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define HOST_MAX 253

/* One part of a numeric IPv4 spelling as libcurl's URL parser reads it
 * (strtoul with base 0: 0x hex, 0 octal, else decimal; a digit first,
 * no sign): false when it is not one. */
static bool ipv4_part(const char *s, size_t n, uint64_t *v)
{
	unsigned base = 10;
	size_t i = 0;

	*v = 0;
	if (n == 0 || !isdigit((unsigned char)s[0]))
		return false;
	if (s[0] == '0' && n > 1 && s[1] == 'x') {
		base = 16;
		i = 2;
		if (n == 2)
			return false;
	} else if (s[0] == '0') {
		base = 8;
	}
	for (; i < n; i++) {
		unsigned d;
		if (isdigit((unsigned char)s[i]))
			d = (unsigned)(s[i] - '0');
		else if (base == 16 && s[i] >= 'a' && s[i] <= 'f')
			d = (unsigned)(s[i] - 'a' + 10);
		else
			return false;
		if (d >= base)
			return false;
		*v = *v * base + d;
		if (*v > 0xffffffffu)
			return false;
	}
	return true;
}

/* s (lower case) as an IPv4 address in any of the spellings libcurl
 * normalises: one to four parts, the last filling the bytes left. */
static bool ipv4_parse(const char *s, unsigned char a[4])
{
	uint64_t part[4];
	int n = 0;
	uint32_t addr;

	for (const char *p = s;; n++) {
		const char *dot = strchr(p, '.');
		size_t len = dot ? (size_t)(dot - p) : strlen(p);

		if (n == 4 || !ipv4_part(p, len, &part[n]))
			return false;
		if (dot == NULL)
			break;
		p = dot + 1;
	}
	for (int i = 0; i < n; i++)
		if (part[i] > 0xff)
			return false;
	if (part[n] > (n == 0 ? 0xffffffffu : 0xffffffffu >> (8 * n)))
		return false;
	addr = (uint32_t)part[n];
	for (int i = 0; i < n; i++)
		addr |= (uint32_t)part[i] << (24 - 8 * i);
	a[0] = (unsigned char)(addr >> 24);
	a[1] = (unsigned char)(addr >> 16);
	a[2] = (unsigned char)(addr >> 8);
	a[3] = (unsigned char)addr;
	return true;
}

static bool valid_name(const char *s)
{
	const char *label = s, *last = s;
	bool numeric = true;

	if (strlen(s) > HOST_MAX)
		return false;
	for (const char *c = s;; c++) {
		if (*c == '.' || *c == '\0') {
			size_t n = (size_t)(c - label);
			if (n == 0 || n > 63 || label[0] == '-' || c[-1] == '-')
				return false;
			if (*c == '\0')
				break;
			label = c + 1;
			last = label;
			continue;
		}
		if (!isalnum((unsigned char)*c) && *c != '-' && *c != '_')
			return false;
	}
	/* A name's last label is never all digits (RFC 3696, 2): "1.2.3.4.5"
	 * is no address and names nothing. */
	for (const char *c = last; *c; c++)
		numeric = numeric && isdigit((unsigned char)*c);
	return !numeric;
}

enum host_form host_canon(const char *in, char *out, size_t len)
{
	const char *given = in;
	char h[HOST_MAX + 2];
	size_t n = strlen(in);
	bool bracketed = n >= 2 && in[0] == '[' && in[n - 1] == ']';
	unsigned char a6[16], a4[4];
	enum host_form form = HOST_BAD;

	if (bracketed) {
		in++;
		n -= 2;
	}
	if (n > HOST_MAX || len == 0)
		goto bad;
	for (size_t i = 0; i < n; i++)
		h[i] = (char)tolower((unsigned char)in[i]);
	h[n] = '\0';
	if (strchr(h, ':') != NULL) {
		if (inet_pton(AF_INET6, h, a6) != 1)
			goto bad;
		if (memcmp(a6, "\0\0\0\0\0\0\0\0\0\0\xff\xff", 12) == 0) {
			memcpy(a4, a6 + 12, 4);
			goto v4;
		}
		if (inet_ntop(AF_INET6, a6, h, sizeof(h)) == NULL)
			goto bad;
		snprintf(out, len, "%s", h);
		return HOST_IPV6;
	}
	if (bracketed)
		goto bad;
	if (n > 0 && h[n - 1] == '.')
		h[--n] = '\0';
	if (n == 0)
		goto bad;
	if (ipv4_parse(h, a4))
		goto v4;
	if (!valid_name(h))
		goto bad;
	snprintf(out, len, "%s", h);
	return HOST_NAME;
v4:
	snprintf(out, len, "%u.%u.%u.%u", a4[0], a4[1], a4[2], a4[3]);
	return HOST_IPV4;
bad:
	n = strlen(given);
	if (len > 0) {
		size_t k = n < len - 1 ? n : len - 1;
		for (size_t i = 0; i < k; i++)
			out[i] = (char)tolower((unsigned char)given[i]);
		out[k] = '\0';
	}
	return form;
}

/* SPDX-License-Identifier: ISC */
/*
 * util.c: clocks, randomness, UUIDs, digests, backoff, UTF-8 checks, JSON
 * and terminal escaping onto the growing string, the descriptor limit.
 * Allocation and bounded copies are lib/text.c's (one out-of-memory policy).
 */
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>

#include "term_table.h"

long fd_limit_raise(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
		return -1;
	if (rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) != 0 && getrlimit(RLIMIT_NOFILE, &rl) != 0)
			return -1;
	}
	return rl.rlim_cur == RLIM_INFINITY ? LONG_MAX : (long)rl.rlim_cur;
}

int64_t now_mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t now_wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void format_iso8601(int64_t wall_ms, char *buf, size_t len)
{
	time_t secs = (time_t)(wall_ms / 1000);
	struct tm tm;
	char base[32];

	gmtime_r(&secs, &tm);
	strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
	snprintf(buf, len, "%s.%03dZ", base, (int)(wall_ms % 1000));
}

void random_bytes(void *buf, size_t len)
{
	unsigned char *p = buf;

	while (len > 0) {
		ssize_t n = getrandom(p, len, 0);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			abort();
		}
		p += n;
		len -= (size_t)n;
	}
}

uint64_t random_below(uint64_t bound)
{
	uint64_t r, limit;

	if (bound <= 1)
		return 0;
	limit = UINT64_MAX - (UINT64_MAX % bound);
	do {
		random_bytes(&r, sizeof(r));
	} while (r >= limit);
	return r % bound;
}

void uuid_v4(char out[37])
{
	unsigned char b[16];

	random_bytes(b, sizeof(b));
	b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
	b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
	snprintf(out, 37,
	         "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
	         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
	         b[12], b[13], b[14], b[15]);
}

void sha256_hex(const void *data, size_t len, char out[65])
{
	unsigned char md[SHA256_DIGEST_LENGTH];
	unsigned int mdlen = 0;
	static const char hex[] = "0123456789abcdef";

	EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL);
	for (unsigned int i = 0; i < SHA256_DIGEST_LENGTH; i++) {
		out[2 * i] = hex[md[i] >> 4];
		out[2 * i + 1] = hex[md[i] & 0xf];
	}
	out[64] = '\0';
}

int64_t backoff_full_jitter_ms(int64_t base_ms, int64_t cap_ms, int attempt)
{
	int64_t ceiling = base_ms;

	if (base_ms <= 0)
		return 0;
	for (int i = 1; i < attempt && ceiling < cap_ms; i++)
		ceiling *= 2;
	if (ceiling > cap_ms)
		ceiling = cap_ms;
	return (int64_t)random_below((uint64_t)ceiling + 1);
}

bool utf8_valid(const char *s, size_t len)
{
	const unsigned char *p = (const unsigned char *)s;
	size_t i = 0;

	while (i < len) {
		unsigned char c = p[i];
		size_t n;
		uint32_t cp;

		if (c < 0x80) {
			i++;
			continue;
		} else if ((c & 0xe0) == 0xc0) {
			n = 1;
			cp = c & 0x1f;
		} else if ((c & 0xf0) == 0xe0) {
			n = 2;
			cp = c & 0x0f;
		} else if ((c & 0xf8) == 0xf0) {
			n = 3;
			cp = c & 0x07;
		} else {
			return false;
		}
		if (i + n >= len)
			return false;
		for (size_t k = 1; k <= n; k++) {
			if ((p[i + k] & 0xc0) != 0x80)
				return false;
			cp = (cp << 6) | (p[i + k] & 0x3f);
		}
		if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
		    cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return false;
		i += n + 1;
	}
	return true;
}

/* ---- escaping onto a growing string (lib/text.h) ---------------------- */

void sb_json_string(struct strbuf *b, const char *s)
{
	static const char hex[] = "0123456789ABCDEF";   /* jansson's \u00XX */
	const char *run = s;

	sb_append(b, "\"", 1);
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		char esc[6] = { '\\', 0 };
		size_t n = 2;

		if (c >= 0x20 && c != '"' && c != '\\')
			continue;
		sb_append(b, run, (size_t)(s - run));
		run = s + 1;
		switch (c) {
		case '"': esc[1] = '"'; break;
		case '\\': esc[1] = '\\'; break;
		case '\b': esc[1] = 'b'; break;
		case '\f': esc[1] = 'f'; break;
		case '\n': esc[1] = 'n'; break;
		case '\r': esc[1] = 'r'; break;
		case '\t': esc[1] = 't'; break;
		default:
			memcpy(esc + 1, "u00", 3);
			esc[4] = hex[c >> 4];
			esc[5] = hex[c & 0xf];
			n = 6;
		}
		sb_append(b, esc, n);
	}
	sb_append(b, run, (size_t)(s - run));
	sb_append(b, "\"", 1);
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid. */
static size_t utf8_seq_len(const unsigned char *s)
{
	size_t n = s[0] < 0xC2 ? 0 : s[0] < 0xE0 ? 2 : s[0] < 0xF0 ? 3 : s[0] < 0xF5 ? 4 : 0;

	if (n == 0)
		return 0;
	for (size_t i = 1; i < n; i++)
		if (s[i] == 0)
			return 0;
	return utf8_valid((const char *)s, n) ? n : 0;
}

/* The code point of the valid UTF-8 sequence s[0..n). */
static uint32_t utf8_decode(const unsigned char *s, size_t n)
{
	uint32_t cp = n == 2 ? s[0] & 0x1F : n == 3 ? s[0] & 0x0F : s[0] & 0x07;

	for (size_t i = 1; i < n; i++)
		cp = (cp << 6) | (s[i] & 0x3F);
	return cp;
}

/*
 * Whether a code point above U+007F is not printable text: a control, a
 * format character (bidi embeddings, overrides and isolates, zero-width
 * characters, the tag block, U+00AD, U+061C ...), private use, a
 * surrogate, unassigned, a line or paragraph separator, a default
 * ignorable (U+034F, the Hangul fillers, variation selectors ...) or
 * U+2800 (term_table.h, generated from the Unicode data by
 * scripts/gen_term_table.py).  Printed raw they make ".../<U+202E>exe.txt"
 * read as ".../txt.exe", or hide text altogether.
 */
static bool not_printable(uint32_t cp)
{
	size_t lo = 0, hi = sizeof(term_escaped) / sizeof(term_escaped[0]);

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (cp < term_escaped[mid].lo)
			hi = mid;
		else if (cp > term_escaped[mid].hi)
			lo = mid + 1;
		else
			return true;
	}
	return false;
}

/* How many bytes at s are replaced, and by what (esc: at least 12
 * bytes): 0 when s starts a character printed as it is. */
static size_t term_char(const unsigned char *s, bool keep_newlines, char *esc)
{
	static const char hex[] = "0123456789abcdef";
	size_t n;
	uint32_t cp;

	if (s[0] >= 0x20 && s[0] < 0x7F)
		return 0;
	if (s[0] == '\n' && keep_newlines)
		return 0;
	if (s[0] < 0x80) {
		const char *named = s[0] == '\n' ? "\\n" : s[0] == '\r' ? "\\r" : s[0] == '\t' ? "\\t"
		                  : s[0] == 0x1B ? "\\e" : NULL;
		if (named) {
			strcpy(esc, named);
		} else {
			esc[0] = '\\'; esc[1] = 'x'; esc[2] = hex[s[0] >> 4]; esc[3] = hex[s[0] & 0xF];
			esc[4] = 0;
		}
		return 1;
	}
	n = utf8_seq_len(s);
	if (n == 0) {
		/* Not UTF-8: the byte, in hex. */
		esc[0] = '\\'; esc[1] = 'x'; esc[2] = hex[s[0] >> 4]; esc[3] = hex[s[0] & 0xF];
		esc[4] = 0;
		return 1;
	}
	cp = utf8_decode(s, n);
	if (!not_printable(cp))
		return 0;
	/* \uXXXX, or \UXXXXXXXX above the BMP. */
	{
		int digits = cp > 0xFFFF ? 8 : 4;
		esc[0] = '\\';
		esc[1] = digits == 8 ? 'U' : 'u';
		for (int i = 0; i < digits; i++)
			esc[2 + i] = hex[(cp >> (4 * (digits - 1 - i))) & 0xF];
		esc[2 + digits] = 0;
	}
	return n;
}

bool term_needs_escape(const char *s, bool keep_newlines)
{
	const unsigned char *p = (const unsigned char *)s;
	char esc[16];

	while (*p) {
		size_t n = utf8_seq_len(p);
		if (term_char(p, keep_newlines, esc) > 0)
			return true;
		p += n > 0 ? n : 1;
	}
	return false;
}

void sb_term_escape(struct strbuf *b, const char *s, bool keep_newlines)
{
	const unsigned char *p = (const unsigned char *)s;
	const unsigned char *run = p;
	char esc[16];

	while (*p) {
		size_t skip = term_char(p, keep_newlines, esc);
		if (skip == 0) {
			size_t n = p[0] < 0x80 ? 1 : utf8_seq_len(p);
			p += n > 0 ? n : 1;
			continue;
		}
		sb_append(b, (const char *)run, (size_t)(p - run));
		sb_puts(b, esc);
		p += skip;
		run = p;
	}
	sb_append(b, (const char *)run, (size_t)(p - run));
}

/* SPDX-License-Identifier: ISC */
/*
 * scrub.c: secret values cut out of peer text (scrub.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scrub.h"
#include "text.h"

static const char b64_alphabet[] =
	"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *b64_of(const unsigned char *in, size_t len, size_t *outlen)
{
	char *out = text_alloc((len + 2) / 3 * 4 + 1), *o = out;

	for (size_t i = 0; i < len; i += 3) {
		uint32_t v = (uint32_t)in[i] << 16;
		if (i + 1 < len)
			v |= (uint32_t)in[i + 1] << 8;
		if (i + 2 < len)
			v |= in[i + 2];
		*o++ = b64_alphabet[(v >> 18) & 63];
		*o++ = b64_alphabet[(v >> 12) & 63];
		*o++ = i + 1 < len ? b64_alphabet[(v >> 6) & 63] : '=';
		*o++ = i + 2 < len ? b64_alphabet[v & 63] : '=';
	}
	*o = '\0';
	*outlen = (size_t)(o - out);
	return out;
}

/* The bytes a whole, padded base64 text stands for; NULL if it is not one. */
static unsigned char *b64_from(const char *in, size_t len, size_t *outlen)
{
	unsigned char *out, *o;
	uint32_t acc = 0;
	int bits = 0;
	size_t pad = 0;

	if (len == 0 || len % 4 != 0)
		return NULL;
	while (pad < 2 && in[len - 1 - pad] == '=')
		pad++;
	o = out = text_alloc(len / 4 * 3 + 1);
	for (size_t i = 0; i < len - pad; i++) {
		const char *p = in[i] ? strchr(b64_alphabet, in[i]) : NULL;
		if (p == NULL) {
			free(out);
			return NULL;
		}
		acc = (acc << 6) | (uint32_t)(p - b64_alphabet);
		bits += 6;
		if (bits >= 8) {
			bits -= 8;
			*o++ = (unsigned char)(acc >> bits);
		}
	}
	*o = '\0';
	*outlen = (size_t)(o - out);
	return out;
}

/* One spelling, kept unless it is already there (or too short). */
static void add_one(struct scrub *s, const char *v, size_t len, size_t min)
{
	int at;

	if (len == 0 || len < min)
		return;
	for (int i = 0; i < s->n; i++)
		if (s->len[i] == len && memcmp(s->v[i], v, len) == 0)
			return;
	s->v = text_realloc(s->v, (size_t)(s->n + 1) * sizeof(*s->v));
	s->len = text_realloc(s->len, (size_t)(s->n + 1) * sizeof(*s->len));
	/* Longest first: a longer spelling is replaced whole, never a part. */
	for (at = s->n; at > 0 && s->len[at - 1] < len; at--) {
		s->v[at] = s->v[at - 1];
		s->len[at] = s->len[at - 1];
	}
	s->v[at] = text_strndup(v, len);
	s->len[at] = len;
	s->n++;
}

static void add_owned(struct scrub *s, char *v, size_t len)
{
	add_one(s, v, len, SCRUB_MIN_DERIVED);
	explicit_bzero(v, len);
	free(v);
}

/* JSON-escaped: '"' and '\' always, '/' as "\/" too when slash is set. */
static char *json_escaped(const char *v, size_t len, bool slash, size_t *outlen)
{
	char *out = text_alloc(len * 2 + 1), *o = out;

	for (size_t i = 0; i < len; i++) {
		if (v[i] == '"' || v[i] == '\\' || (slash && v[i] == '/'))
			*o++ = '\\';
		*o++ = v[i];
	}
	*o = '\0';
	*outlen = (size_t)(o - out);
	return out;
}

static char *percent_encoded(const char *v, size_t len, size_t *outlen)
{
	static const char hex[] = "0123456789ABCDEF";
	char *out = text_alloc(len * 3 + 1), *o = out;

	for (size_t i = 0; i < len; i++) {
		unsigned char c = (unsigned char)v[i];
		if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
		    c == '-' || c == '.' || c == '_' || c == '~') {
			*o++ = (char)c;
		} else {
			*o++ = '%';
			*o++ = hex[c >> 4];
			*o++ = hex[c & 15];
		}
	}
	*o = '\0';
	*outlen = (size_t)(o - out);
	return out;
}

static char *hex_of(const char *v, size_t len, bool upper, size_t *outlen)
{
	const char *hex = upper ? "0123456789ABCDEF" : "0123456789abcdef";
	char *out = text_alloc(len * 2 + 1), *o = out;

	for (size_t i = 0; i < len; i++) {
		*o++ = hex[(unsigned char)v[i] >> 4];
		*o++ = hex[(unsigned char)v[i] & 15];
	}
	*o = '\0';
	*outlen = (size_t)(o - out);
	return out;
}

void scrub_add(struct scrub *s, const char *value, size_t len)
{
	unsigned char *dec;
	size_t n;
	char *t;

	if (len == 0)
		return;
	add_one(s, value, len, 1);
	t = json_escaped(value, len, false, &n);
	add_owned(s, t, n);
	t = json_escaped(value, len, true, &n);
	add_owned(s, t, n);
	t = percent_encoded(value, len, &n);
	add_owned(s, t, n);
	t = b64_of((const unsigned char *)value, len, &n);
	while (n > 0 && t[n - 1] == '=')
		n--;
	add_one(s, t, n, SCRUB_MIN_DERIVED);          /* unpadded */
	for (size_t i = 0; i < n; i++)               /* base64url */
		t[i] = t[i] == '+' ? '-' : t[i] == '/' ? '_' : t[i];
	add_one(s, t, n, SCRUB_MIN_DERIVED);
	explicit_bzero(t, n);
	free(t);
	t = b64_of((const unsigned char *)value, len, &n);
	add_owned(s, t, n);                          /* padded */
	/* Inside a longer base64 text (a whole header line or request
	 * encoded) the value starts at any of 3 offsets: the characters that
	 * stand for its bytes alone, none of those before or after it. */
	for (size_t k = 0; k < 3; k++) {
		unsigned char *pre = text_alloc(len + k + 1);
		size_t lead = k == 0 ? 0 : k + 1, end;

		memset(pre, 0, k);
		memcpy(pre + k, value, len);
		t = b64_of(pre, len + k, &n);
		explicit_bzero(pre, len + k);
		free(pre);
		end = (len + k) * 8 / 6;         /* characters made of whole bits */
		if (end > lead) {
			add_one(s, t + lead, end - lead, SCRUB_MIN_DERIVED);
			for (size_t i = lead; i < end; i++)
				t[i] = t[i] == '+' ? '-' : t[i] == '/' ? '_' : t[i];
			add_one(s, t + lead, end - lead, SCRUB_MIN_DERIVED);
		}
		explicit_bzero(t, n);
		free(t);
	}
	t = hex_of(value, len, false, &n);
	add_owned(s, t, n);
	t = hex_of(value, len, true, &n);
	add_owned(s, t, n);
	dec = b64_from(value, len, &n);
	if (dec) {
		bool printable = n > 0;
		for (size_t i = 0; i < n; i++)
			printable = printable && dec[i] >= 0x20 && dec[i] < 0x7f;
		if (printable) {
			const char *colon = memchr(dec, ':', n);
			add_one(s, (const char *)dec, n, SCRUB_MIN_DERIVED);
			if (colon)
				add_one(s, colon + 1, n - (size_t)(colon + 1 - (const char *)dec),
				        SCRUB_MIN_DERIVED);
		}
		explicit_bzero(dec, n);
		free(dec);
	}
}

void scrub_free(struct scrub *s)
{
	for (int i = 0; i < s->n; i++) {
		explicit_bzero(s->v[i], s->len[i]);
		free(s->v[i]);
	}
	free(s->v);
	free(s->len);
	s->v = NULL;
	s->len = NULL;
	s->n = 0;
}

static int hex_digit(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10 : -1;
}

static int hex_pair(const char *p)
{
	int a = hex_digit(p[0]), b = a < 0 ? -1 : hex_digit(p[1]);

	return b < 0 ? -1 : a * 16 + b;
}

/* How many bytes of src[i..len) spell v[0..vlen) byte by byte, each byte
 * as itself or in the escapes an echo mixes: %XX (either case, only some
 * bytes encoded, as Python's quote() leaves '/'), '+' for a space (form
 * encoding), \uXXXX below U+0100 (Go's JSON writes '&' '<' '>' so) and a
 * backslash before a punctuation byte (JSON's \" \/ \\); 0 when they do
 * not.  An escape that decodes to the byte wanted is taken before the
 * byte itself: no backtracking, so the time stays linear. */
static size_t match_mixed(const char *v, size_t vlen, const char *src, size_t len, size_t i)
{
	size_t p = i;

	for (size_t j = 0; j < vlen; j++) {
		unsigned char want = (unsigned char)v[j];

		if (p >= len)
			return 0;
		if (src[p] == '%' && len - p >= 3 && hex_pair(src + p + 1) == want) {
			p += 3;
		} else if (src[p] == '\\' && len - p >= 6 && src[p + 1] == 'u' && src[p + 2] == '0' &&
		           src[p + 3] == '0' && hex_pair(src + p + 4) == want) {
			p += 6;
		} else if (src[p] == '\\' && len - p >= 2 && (unsigned char)src[p + 1] == want &&
		           want > 0x20 && want < 0x7f && !((want | 0x20) >= 'a' && (want | 0x20) <= 'z') &&
		           !(want >= '0' && want <= '9')) {
			p += 2;
		} else if ((unsigned char)src[p] == want || (src[p] == '+' && want == ' ')) {
			p++;
		} else {
			return 0;
		}
	}
	return p - i;
}

/* Which spelling starts at src[i], and how many bytes it covers.  Whole
 * spellings only: scrubbing a text's end because it starts like a secret
 * would tell whoever chose that end (a producer, through an echo) that
 * their guess is a prefix of it, byte after byte. */
static size_t match_at(const struct scrub *s, const char *src, size_t len, size_t i)
{
	size_t rest = len - i, m;

	for (int k = 0; k < s->n; k++)
		if (s->v[k][0] == src[i] && s->len[k] <= rest &&
		    memcmp(src + i, s->v[k], s->len[k]) == 0)
			return s->len[k];
	for (int k = 0; k < s->n; k++)
		if ((m = match_mixed(s->v[k], s->len[k], src, len, i)) > 0)
			return m;
	return 0;
}

void scrub_text(const struct scrub *s, char **data, size_t *len, bool cut)
{
	size_t n;
	char *t;

	if (s == NULL || s->n == 0 || *data == NULL)
		return;
	if (cut) {
		/* s->len[0] is the longest spelling, and a byte of it is
		 * written in 6 bytes at most (\u00XX: match_mixed). */
		size_t most = SCRUB_MAX_WIDTH * s->len[0] - 1;
		size_t drop = most < *len ? most : *len;
		explicit_bzero(*data + *len - drop, drop);
		*len -= drop;
		(*data)[*len] = '\0';
	}
	t = scrub_dup(s, *data, *len, &n);
	if (t == NULL)
		return;
	explicit_bzero(*data, *len);
	free(*data);
	*data = t;
	*len = n;
}

char *scrub_dup(const struct scrub *s, const char *src, size_t len, size_t *outlen)
{
	struct strbuf b;
	size_t i = 0, from = 0;
	bool hit = false;

	if (s == NULL || s->n == 0 || src == NULL)
		return NULL;
	sb_init(&b, 0);
	while (i < len) {
		size_t m = match_at(s, src, len, i);
		if (m == 0) {
			i++;
			continue;
		}
		sb_append(&b, src + from, i - from);
		sb_puts(&b, SCRUB_MARK);
		i += m;
		from = i;
		hit = true;
	}
	if (!hit) {
		free(b.s);
		return NULL;
	}
	sb_append(&b, src + from, len - from);
	if (outlen)
		*outlen = b.len;
	return b.s;
}

bool scrub_buf(const struct scrub *s, char *buf, size_t size)
{
	char *t;

	if (size == 0)
		return false;
	buf[size - 1] = '\0';
	t = scrub_dup(s, buf, strlen(buf), NULL);
	if (t == NULL)
		return false;
	explicit_bzero(buf, size);
	text_copy(buf, t, size);
	free(t);
	return true;
}

void scrub_str(const struct scrub *s, char **p)
{
	size_t n;
	char *t;

	if (*p == NULL)
		return;
	t = scrub_dup(s, *p, strlen(*p), &n);
	if (t == NULL)
		return;
	explicit_bzero(*p, strlen(*p));
	free(*p);
	*p = t;
}

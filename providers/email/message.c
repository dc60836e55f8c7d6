/* SPDX-License-Identifier: ISC */
/*
 * message.c: the email effect as a message, with no network and no state:
 * validation of the target and payload (header injection, addresses,
 * reserved headers) and the RFC 5322 / MIME text built from them.  Pure
 * functions of their input, unit-tested in tests/unit/test_email_message.c.
 */
#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "text.h"
#include "message.h"

/* Longest header line we write unencoded (RFC 5322 allows 998). */
#define EMAIL_HDR_LINE 900

/* Base64 of data (OpenSSL), lines of 76 characters ending in CRLF. */
static void sb_base64_lines(struct strbuf *b, const unsigned char *data, size_t len)
{
	unsigned char out[80];

	for (size_t off = 0; off < len; off += 57) {
		size_t n = len - off < 57 ? len - off : 57;
		int w = EVP_EncodeBlock(out, data + off, (int)n);
		sb_append(b, (const char *)out, (size_t)w);
		sb_append(b, "\r\n", 2);
	}
}

/* One RFC 2047 encoded-word per chunk of at most 45 bytes, cut at UTF-8
 * character boundaries, folded with CRLF SP. */
static void sb_encoded_words(struct strbuf *b, const char *s)
{
	size_t len = strlen(s), off = 0;
	unsigned char out[80];
	bool first = true;

	if (len == 0)
		return;
	while (off < len) {
		size_t n = len - off < 45 ? len - off : 45;
		/* Do not split a multi-byte character. */
		while (off + n < len && n > 0 && ((unsigned char)s[off + n] & 0xC0) == 0x80)
			n--;
		if (n == 0)
			n = len - off < 45 ? len - off : 45;
		int w = EVP_EncodeBlock(out, (const unsigned char *)s + off, (int)n);
		if (!first)
			sb_append(b, "\r\n ", 3);
		sb_puts(b, "=?UTF-8?B?");
		sb_append(b, (const char *)out, (size_t)w);
		sb_puts(b, "?=");
		first = false;
		off += n;
	}
}

static bool is_ascii_printable(const char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f)
			return false;
	return true;
}

/* An unstructured header value: as is when short printable ASCII that
 * cannot be mistaken for an encoded word, else RFC 2047. */
static void sb_unstructured(struct strbuf *b, const char *value, size_t room)
{
	if (is_ascii_printable(value) && strlen(value) <= room && strstr(value, "=?") == NULL)
		sb_puts(b, value);
	else
		sb_encoded_words(b, value);
}

/* ---- validation ----------------------------------------------------------- */


static bool valid_utf8(const char *s, size_t len)
{
	/* jansson refuses to build a string from invalid UTF-8. */
	json_t *j = json_stringn(s, len);

	if (j == NULL)
		return false;
	json_decref(j);
	return true;
}

/* CR, LF or NUL: the characters that split or cut a header. */
bool email_has_injection(const char *s, size_t len)
{
	for (size_t i = 0; i < len; i++)
		if (s[i] == '\r' || s[i] == '\n' || s[i] == '\0')
			return true;
	return false;
}

bool email_has_control(const char *s)
{
	for (; *s; s++)
		if (((unsigned char)*s < 0x20 && *s != '\t') || *s == 0x7f)
			return true;
	return false;
}

static bool atext_char(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
	       strchr("!#$%&'*+-/=?^_`{|}~", c) != NULL;
}

bool email_valid_domain(const char *d, size_t len)
{
	size_t label = 0;

	if (len == 0 || len > 253)
		return false;
	if (d[0] == '[') {
		char lit[64];
		struct in_addr a4;
		if (len < 3 || d[len - 1] != ']' || len - 2 >= sizeof(lit))
			return false;
		memcpy(lit, d + 1, len - 2);
		lit[len - 2] = '\0';
		return inet_pton(AF_INET, lit, &a4) == 1;
	}
	for (size_t i = 0; i < len; i++) {
		char c = d[i];
		if (c == '.') {
			if (label == 0 || d[i - 1] == '-')
				return false;
			label = 0;
			continue;
		}
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '-'))
			return false;
		if (c == '-' && label == 0)
			return false;
		if (++label > 63)
			return false;
	}
	return label > 0 && d[len - 1] != '-';
}

/* An addr-spec without quoted local parts or comments: what an outbox
 * producer should ever hand over.  NULL when fine, else why not. */
static const char *address_problem(const char *a, size_t len)
{
	const char *at;
	size_t local;

	if (len == 0)
		return "is empty";
	if (len > EMAIL_ADDR_MAX)
		return "is longer than 254 characters";
	if (!is_ascii_printable(a))
		return "contains non-ASCII or control characters (SMTPUTF8 is not supported)";
	at = strrchr(a, '@');
	if (at == NULL)
		return "has no @";
	local = (size_t)(at - a);
	if (local == 0 || local > 64)
		return "has an empty or over-long local part";
	for (size_t i = 0; i < local; i++)
		if (!(atext_char(a[i]) || (a[i] == '.' && i > 0 && i + 1 < local && a[i + 1] != '.')))
			return "has a local part with characters outside RFC 5322 atext";
	if (!email_valid_domain(at + 1, len - local - 1))
		return "has an invalid domain";
	return NULL;
}

/* Header names a producer may not set: the provider writes these itself,
 * or they make no sense in a message being submitted. */
static bool reserved_header(const char *name)
{
	static const char *const reserved[] = {
		"From", "To", "Cc", "Bcc", "Subject", "Message-ID", "Date", "MIME-Version",
		"X-Outbox-Effect-Id", "Return-Path", "Received", "Original-Recipient", "Sender",
		NULL,
	};

	for (size_t i = 0; reserved[i]; i++)
		if (strcasecmp(name, reserved[i]) == 0)
			return true;
	return strncasecmp(name, "Content-", 8) == 0 || strncasecmp(name, "Resent-", 7) == 0;
}

static bool valid_header_name(const char *n)
{
	size_t len = strlen(n);

	if (len == 0 || len > 64)
		return false;
	for (; *n; n++)
		if ((unsigned char)*n <= 32 || (unsigned char)*n >= 127 || *n == ':')
			return false;
	return true;
}

bool email_fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return false;
}

/* A string member: present (if required), a string, no NUL. */
static bool get_string(const json_t *payload, const char *key, bool required, const char **out,
                       size_t *outlen, char *err, size_t errlen)
{
	const json_t *v = json_object_get(payload, key);

	*out = NULL;
	if (v == NULL || json_is_null(v)) {
		if (required)
			return email_fail(err, errlen, "payload.%s: required (a string)", key);
		return true;
	}
	if (!json_is_string(v))
		return email_fail(err, errlen, "payload.%s: must be a string", key);
	*out = json_string_value(v);
	*outlen = json_string_length(v);
	if (memchr(*out, '\0', *outlen) != NULL)
		return email_fail(err, errlen, "payload.%s: contains a NUL character (refused)", key);
	if (!valid_utf8(*out, *outlen))
		return email_fail(err, errlen, "payload.%s: not valid UTF-8", key);
	return true;
}

/* "addr@example.com" or "Display Name <addr@example.com>". */
static bool parse_from(const char *from, size_t len, struct email_msg *m, char *err, size_t errlen)
{
	const char *lt = memchr(from, '<', len);
	const char *why;

	if (email_has_injection(from, len))
		return email_fail(err, errlen, "payload.from: contains CR or LF (header injection refused)");
	if (email_has_control(from))
		return email_fail(err, errlen, "payload.from: contains control characters");
	m->from_name = NULL;
	if (lt != NULL) {
		const char *gt = from + len - 1;
		const char *name = from, *name_end = lt;
		size_t alen;

		if (*gt != '>' || gt < lt)
			return email_fail(err, errlen, "payload.from: expected \"Name <address>\"");
		alen = (size_t)(gt - lt - 1);
		if (memchr(lt + 1, '<', alen) || memchr(lt + 1, '>', alen))
			return email_fail(err, errlen, "payload.from: expected \"Name <address>\"");
		while (name < name_end && (*name == ' ' || *name == '\t'))
			name++;
		while (name_end > name && (name_end[-1] == ' ' || name_end[-1] == '\t'))
			name_end--;
		if (name_end - name >= 2 && name[0] == '"' && name_end[-1] == '"') {
			name++;
			name_end--;
		}
		if (name_end > name) {
			m->from_name = name;
			m->from_name_len = (size_t)(name_end - name);
		}
		if (alen > EMAIL_ADDR_MAX)
			return email_fail(err, errlen, "payload.from: the address is longer than 254 characters");
		memcpy(m->from_addr, lt + 1, alen);
		m->from_addr[alen] = '\0';
	} else {
		if (len > EMAIL_ADDR_MAX)
			return email_fail(err, errlen, "payload.from: the address is longer than 254 characters");
		memcpy(m->from_addr, from, len);
		m->from_addr[len] = '\0';
	}
	why = address_problem(m->from_addr, strlen(m->from_addr));
	if (why)
		return email_fail(err, errlen, "payload.from: the address %s", why);
	return true;
}

static bool key_chars(const char *s, size_t max)
{
	size_t n = 0;

	for (; *s; s++, n++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      *s == '-' || *s == '_' || *s == '.'))
			return false;
	return n > 0 && n <= max;
}

/* The recipient (one bare address), and the key and id that go into the
 * Message-ID and X-Outbox-Effect-Id headers. */
static bool check_target(const struct outbox_effect *e, char *err, size_t errlen)
{
	const char *why;
	size_t tlen;

	if (e->target == NULL)
		return email_fail(err, errlen, "target: missing (the recipient address)");
	tlen = strlen(e->target);
	if (email_has_injection(e->target, tlen))
		return email_fail(err, errlen, "target: contains CR or LF (header injection refused)");
	if (!valid_utf8(e->target, tlen))
		return email_fail(err, errlen, "target: not valid UTF-8");
	if (strpbrk(e->target, ",;<>\" ") != NULL)
		return email_fail(err, errlen, "target: one address per effect (a list / display name is "
		                  "not allowed): give the bare address, one effect per recipient");
	why = address_problem(e->target, tlen);
	if (why)
		return email_fail(err, errlen, "target: the recipient address %s", why);
	if (e->effect_key == NULL || !key_chars(e->effect_key, 128))
		return email_fail(err, errlen, "effect key: not usable in a Message-ID");
	if (e->effect_id == NULL || !key_chars(e->effect_id, 64))
		return email_fail(err, errlen, "effect id: not usable in a header");
	return true;
}

/* A payload key outside the known ones is refused (a "to" or "cc" would
 * otherwise be silently ignored). */
static bool check_known_keys(const json_t *payload, char *err, size_t errlen)
{
	static const char *const known[] = { "from", "subject", "text", "html", "headers", NULL };
	const char *key;
	const json_t *v;

	json_object_foreach((json_t *)payload, key, v) {
		size_t i;
		for (i = 0; known[i] && strcmp(known[i], key) != 0; i++)
			;
		if (known[i] == NULL)
			return email_fail(err, errlen,
			            "payload.%.64s: unknown key (an email effect has one recipient, its "
			            "target; known keys: from, subject, text, html, headers)",
			            email_has_control(key) || !valid_utf8(key, strlen(key)) ? "?" : key);
	}
	return true;
}

/* One of payload.headers: a valid name the provider does not set itself,
 * and a one-line UTF-8 string value. */
static bool check_header(const char *name, const json_t *hv, char *err, size_t errlen)
{
	const char *val;
	size_t vlen;

	if (email_has_injection(name, strlen(name)))
		return email_fail(err, errlen,
		            "payload.headers: a header name contains CR or LF (header injection refused)");
	if (!valid_header_name(name))
		return email_fail(err, errlen,
		            "payload.headers: \"%.64s\" is not a valid header name",
		            is_ascii_printable(name) ? name : "?");
	if (reserved_header(name))
		return email_fail(err, errlen,
		            "payload.headers.%s: set by the email provider, cannot be overridden",
		            name);
	if (!json_is_string(hv))
		return email_fail(err, errlen, "payload.headers.%s: must be a string", name);
	val = json_string_value(hv);
	vlen = json_string_length(hv);
	if (email_has_injection(val, vlen))
		return email_fail(err, errlen,
		            "payload.headers.%s: contains CR, LF or NUL (header injection refused)",
		            name);
	if (!valid_utf8(val, vlen))
		return email_fail(err, errlen, "payload.headers.%s: not valid UTF-8", name);
	if (email_has_control(val))
		return email_fail(err, errlen, "payload.headers.%s: contains control characters", name);
	return true;
}

/* payload.headers, optional: m->headers when every one is usable. */
static bool parse_headers(const json_t *payload, struct email_msg *m, char *err, size_t errlen)
{
	const json_t *v = json_object_get(payload, "headers");
	const json_t *hv;
	const char *name;

	if (v == NULL || json_is_null(v))
		return true;
	if (!json_is_object(v))
		return email_fail(err, errlen, "payload.headers: must be an object of strings");
	json_object_foreach((json_t *)v, name, hv) {
		if (!check_header(name, hv, err, errlen))
			return false;
	}
	m->headers = v;
	return true;
}

/* Everything validate() checks; send() runs it again (cheap) so that it
 * never builds a message from an effect it has not checked itself. */
bool email_parse(const struct outbox_effect *e, struct email_msg *m, char *err, size_t errlen)
{
	const char *from;
	size_t from_len = 0, subj_len = 0;

	memset(m, 0, sizeof(*m));
	if (!check_target(e, err, errlen))
		return false;
	if (!json_is_object(e->payload))
		return email_fail(err, errlen, "payload: must be a JSON object");
	if (!check_known_keys(e->payload, err, errlen))
		return false;
	if (!get_string(e->payload, "from", true, &from, &from_len, err, errlen) ||
	    !get_string(e->payload, "subject", true, &m->subject, &subj_len, err, errlen) ||
	    !get_string(e->payload, "text", true, &m->text, &m->text_len, err, errlen) ||
	    !get_string(e->payload, "html", false, &m->html, &m->html_len, err, errlen))
		return false;
	if (email_has_injection(m->subject, subj_len))
		return email_fail(err, errlen, "payload.subject: contains CR or LF (header injection refused)");
	if (email_has_control(m->subject))
		return email_fail(err, errlen, "payload.subject: contains control characters");
	if (!parse_from(from, from_len, m, err, errlen))
		return false;
	return parse_headers(e->payload, m, err, errlen);
}

/* ---- building the message ------------------------------------------------ */

/* Normalise line ends to CRLF; true when the result can go as 7bit. */
static bool body_normalise(const char *s, size_t len, struct strbuf *out)
{
	bool seven = true;
	size_t line = 0;

	for (size_t i = 0; i < len; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '\r' || c == '\n') {
			if (c == '\r' && i + 1 < len && s[i + 1] == '\n')
				i++;
			sb_append(out, "\r\n", 2);
			line = 0;
			continue;
		}
		if (c >= 0x80 || (c < 0x20 && c != '\t') || c == 0x7f)
			seven = false;
		if (++line > 998)
			seven = false;
		sb_append(out, (const char *)&c, 1);
	}
	if (out->len < 2 || memcmp(out->s + out->len - 2, "\r\n", 2) != 0)
		sb_append(out, "\r\n", 2);
	return seven;
}

static void sb_part(struct strbuf *b, const char *subtype, const char *body, size_t len, bool force_b64)
{
	struct strbuf norm;
	bool seven;

	sb_init(&norm, len + 3);        /* the body, most often unchanged, and a CRLF */
	seven = body_normalise(body, len, &norm);

	sb_printf(b, "Content-Type: text/%s; charset=utf-8\r\n", subtype);
	if (seven && !force_b64) {
		sb_puts(b, "Content-Transfer-Encoding: 7bit\r\n\r\n");
		sb_append(b, norm.s, norm.len);
	} else {
		sb_puts(b, "Content-Transfer-Encoding: base64\r\n\r\n");
		sb_base64_lines(b, (const unsigned char *)norm.s, norm.len);
	}
	free(norm.s);
}

char *email_build(const struct outbox_effect *e, const struct email_msg *m,
                         const char *msgid_domain, size_t *lenp)
{
	struct strbuf b;

	sb_init(&b, 1024);
	sb_puts(&b, "From: ");
	if (m->from_name) {
		char *name = text_alloc(m->from_name_len + 1);
		memcpy(name, m->from_name, m->from_name_len);
		/* Quoted only if "From: "NAME" <addr>" fits one line; a longer
		 * name is folded as encoded words. */
		if (is_ascii_printable(name) && strstr(name, "=?") == NULL &&
		    2 * m->from_name_len + strlen(m->from_addr) + 12 <= EMAIL_HDR_LINE) {
			sb_append(&b, "\"", 1);
			for (const char *p = name; *p; p++) {
				if (*p == '"' || *p == '\\')
					sb_append(&b, "\\", 1);
				sb_append(&b, p, 1);
			}
			sb_append(&b, "\" ", 2);
		} else {
			sb_encoded_words(&b, name);
			sb_append(&b, " ", 1);
		}
		free(name);
		sb_printf(&b, "<%s>\r\n", m->from_addr);
	} else {
		sb_printf(&b, "%s\r\n", m->from_addr);
	}
	sb_printf(&b, "To: %s\r\n", e->target);
	sb_puts(&b, "Subject: ");
	sb_unstructured(&b, m->subject, EMAIL_HDR_LINE - 9);
	sb_puts(&b, "\r\n");
	sb_printf(&b, "Message-ID: <%s@%s>\r\n", e->effect_key, msgid_domain);
	sb_printf(&b, "X-Outbox-Effect-Id: %s\r\n", e->effect_id);
	if (m->headers) {
		const char *name;
		const json_t *hv;
		json_object_foreach((json_t *)m->headers, name, hv) {
			sb_printf(&b, "%s: ", name);
			sb_unstructured(&b, json_string_value(hv), EMAIL_HDR_LINE - strlen(name) - 2);
			sb_puts(&b, "\r\n");
		}
	}
	sb_puts(&b, "MIME-Version: 1.0\r\n");
	if (m->html == NULL) {
		sb_part(&b, "plain", m->text, m->text_len, false);
	} else {
		/* Base64 parts cannot contain the boundary ("=_" is not base64). */
		char boundary[64];
		snprintf(boundary, sizeof(boundary), "=_outbox_%.32s", e->effect_key);
		sb_printf(&b, "Content-Type: multipart/alternative; boundary=\"%s\"\r\n\r\n", boundary);
		sb_puts(&b, "This is a multi-part message in MIME format.\r\n");
		sb_printf(&b, "\r\n--%s\r\n", boundary);
		sb_part(&b, "plain", m->text, m->text_len, true);
		sb_printf(&b, "\r\n--%s\r\n", boundary);
		sb_part(&b, "html", m->html, m->html_len, true);
		sb_printf(&b, "\r\n--%s--\r\n", boundary);
	}
	*lenp = b.len;
	return b.s;
}


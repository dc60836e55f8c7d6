/*
 * email.c: the `email` provider: one message per effect over SMTP with
 * libesmtp.
 *
 * libesmtp's smtp_start_session() runs a whole SMTP session and blocks, so
 * sessions run on a small pool of threads of our own.  send() builds the
 * complete RFC 5322 message on the loop thread, queues a job and returns;
 * a pool thread runs the session and classifies it; the result comes back
 * to the loop through a pipe and `done` is called there.
 *
 * The one question that matters for an outbox is "could the relay have
 * taken responsibility for the message?".  It can only do so after it has
 * seen the end-of-data terminator ("\r\n.\r\n").  So every job records,
 * under the pool mutex, how far the session got:
 *
 *   STARTED     picked up by a thread: resolving, connecting
 *   CONNECTED   TCP connection up (libesmtp's SMTP_EV_CONNECT)
 *   ENVELOPE    MAIL FROM written
 *   DATA        354 received, the message is being copied
 *   END         our message callback said "end of message": the
 *               terminator follows.  This is the commit point; it is
 *               taken under the mutex, and a job the loop has already
 *               given up on is aborted instead (no terminator is written,
 *               libesmtp drops the connection and the relay discards it)
 *   REPLIED     the relay answered the end of data
 *
 * A failure before END proves nothing was committed (not sent / retry);
 * a missing answer after END is ambiguous.  A loop-side timer per job
 * enforces timeout_ms over the whole call (queue wait included) and
 * connect_timeout_ms from the moment a thread starts the job, because
 * libesmtp has no connect timeout and only per-read timeouts.  A job the
 * timer gives up on is reported at once; its thread finishes in the
 * background and its late answer is logged for the operator.
 *
 * Classification (SPEC.md), per recipient; an effect has one recipient,
 * its target:
 *
 *   connect refused, DNS, TLS handshake/verification failure  not sent
 *   greeting/EHLO/AUTH 4xx, MAIL/RCPT/DATA 4xx, 4xx after data  retry
 *   no answer before the end of data (timeout, closed)          retry
 *   5xx anywhere; STARTTLS required but not offered           terminal
 *   no answer after the end of data (timeout, closed)        ambiguous
 *   250 after the end of data                                 accepted
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/queue.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <event2/event.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>   /* before libesmtp.h: declares smtp_starttls_set_ctx */
#include <openssl/x509.h>

#include <auth-client.h>
#include <libesmtp.h>

#include "provider.h"

#define EMAIL_NAME        "email"
#define EMAIL_MAX_THREADS 256
#define EMAIL_REPLY_MAX   200
#define EMAIL_ADDR_MAX    254
/* Longest header line we write unencoded (RFC 5322 allows 998). */
#define EMAIL_HDR_LINE    900
/* Join a stuck thread this long at shutdown before leaving it behind. */
#define EMAIL_JOIN_MS     1000

static const struct outbox_conf_key email_keys[] = {
	{ "server", CONF_STR, "127.0.0.1:25", 0, 0, "SMTP relay as host:port" },
	{ "starttls", CONF_STR, "optional", 0, 0, "required, optional or off" },
	{ "username", CONF_STR, "", 0, 0, "AUTH user name; empty: no AUTH" },
	{ "password", CONF_SECRET, "", 0, 0, "AUTH password (file:/path or env:NAME)" },
	{ "helo_name", CONF_STR, "", 0, 0, "name sent in EHLO; empty: the host name" },
	{ "ca_file", CONF_STR, "", 0, 0, "PEM CA bundle the relay's certificate must chain to; "
	  "empty: the system's CAs" },
	{ "threads", CONF_INT, "4", 1, EMAIL_MAX_THREADS, "SMTP sessions at once" },
	{ "message_id_domain", CONF_STR, "outbox-dispatcher.invalid", 0, 0,
	  "right-hand side of Message-ID: <effect key@domain>" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

/* ---- small helpers ------------------------------------------------------ */

static int64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void *email_alloc(size_t n)
{
	void *p = calloc(1, n ? n : 1);

	if (p == NULL)
		abort();
	return p;
}

static char *email_strdup(const char *s)
{
	size_t n = strlen(s) + 1;
	char *p = email_alloc(n);

	memcpy(p, s, n);
	return p;
}

static void copy_str(char *dst, const char *src, size_t size)
{
	size_t n = strlen(src);

	if (n >= size)
		n = size - 1;
	memcpy(dst, src, n);
	dst[n] = '\0';
}

/* Text from the relay, made printable ASCII (it ends up in the database
 * and in JSON logs). */
static void copy_printable(char *dst, const char *src, size_t srclen, size_t size)
{
	size_t o = 0;

	for (size_t i = 0; i < srclen && o + 1 < size; i++) {
		unsigned char c = (unsigned char)src[i];
		if (c == '\r' || c == '\n')
			continue;
		dst[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
	}
	dst[o] = '\0';
}

/* A growing byte buffer for building the message. */
struct sbuf {
	char *p;
	size_t len, cap;
};

static void sb_add(struct sbuf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 1024;
		while (cap < b->len + n + 1)
			cap *= 2;
		char *p = realloc(b->p, cap);
		if (p == NULL)
			abort();
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void sb_puts(struct sbuf *b, const char *s)
{
	sb_add(b, s, strlen(s));
}

static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct sbuf *b, const char *fmt, ...)
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
		sb_add(b, small, (size_t)n);
		return;
	}
	char *big = email_alloc((size_t)n + 1);
	va_start(ap, fmt);
	vsnprintf(big, (size_t)n + 1, fmt, ap);
	va_end(ap);
	sb_add(b, big, (size_t)n);
	free(big);
}

/* Base64 of data (OpenSSL), lines of 76 characters ending in CRLF. */
static void sb_base64_lines(struct sbuf *b, const unsigned char *data, size_t len)
{
	unsigned char out[80];

	for (size_t off = 0; off < len; off += 57) {
		size_t n = len - off < 57 ? len - off : 57;
		int w = EVP_EncodeBlock(out, data + off, (int)n);
		sb_add(b, (const char *)out, (size_t)w);
		sb_add(b, "\r\n", 2);
	}
}

/* One RFC 2047 encoded-word per chunk of at most 45 bytes, cut at UTF-8
 * character boundaries, folded with CRLF SP. */
static void sb_encoded_words(struct sbuf *b, const char *s)
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
			sb_add(b, "\r\n ", 3);
		sb_puts(b, "=?UTF-8?B?");
		sb_add(b, (const char *)out, (size_t)w);
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
static void sb_unstructured(struct sbuf *b, const char *value, size_t room)
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
static bool has_injection(const char *s, size_t len)
{
	for (size_t i = 0; i < len; i++)
		if (s[i] == '\r' || s[i] == '\n' || s[i] == '\0')
			return true;
	return false;
}

static bool has_control(const char *s)
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

static bool valid_domain(const char *d, size_t len)
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
	if (!valid_domain(at + 1, len - local - 1))
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

/* Everything the message is built from, pointing into the effect. */
struct email_msg {
	const char *from_name;    /* NULL: no display name */
	size_t from_name_len;
	char from_addr[EMAIL_ADDR_MAX + 1];
	const char *subject, *text, *html;
	size_t text_len, html_len;
	const json_t *headers;    /* object or NULL */
};

static bool fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(char *err, size_t errlen, const char *fmt, ...)
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
			return fail(err, errlen, "payload.%s: required (a string)", key);
		return true;
	}
	if (!json_is_string(v))
		return fail(err, errlen, "payload.%s: must be a string", key);
	*out = json_string_value(v);
	*outlen = json_string_length(v);
	if (memchr(*out, '\0', *outlen) != NULL)
		return fail(err, errlen, "payload.%s: contains a NUL character (refused)", key);
	if (!valid_utf8(*out, *outlen))
		return fail(err, errlen, "payload.%s: not valid UTF-8", key);
	return true;
}

/* "addr@example.com" or "Display Name <addr@example.com>". */
static bool parse_from(const char *from, size_t len, struct email_msg *m, char *err, size_t errlen)
{
	const char *lt = memchr(from, '<', len);
	const char *why;

	if (has_injection(from, len))
		return fail(err, errlen, "payload.from: contains CR or LF (header injection refused)");
	if (has_control(from))
		return fail(err, errlen, "payload.from: contains control characters");
	m->from_name = NULL;
	if (lt != NULL) {
		const char *gt = from + len - 1;
		const char *name = from, *name_end = lt;
		size_t alen;

		if (*gt != '>' || gt < lt)
			return fail(err, errlen, "payload.from: expected \"Name <address>\"");
		alen = (size_t)(gt - lt - 1);
		if (memchr(lt + 1, '<', alen) || memchr(lt + 1, '>', alen))
			return fail(err, errlen, "payload.from: expected \"Name <address>\"");
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
			return fail(err, errlen, "payload.from: the address is longer than 254 characters");
		memcpy(m->from_addr, lt + 1, alen);
		m->from_addr[alen] = '\0';
	} else {
		if (len > EMAIL_ADDR_MAX)
			return fail(err, errlen, "payload.from: the address is longer than 254 characters");
		memcpy(m->from_addr, from, len);
		m->from_addr[len] = '\0';
	}
	why = address_problem(m->from_addr, strlen(m->from_addr));
	if (why)
		return fail(err, errlen, "payload.from: the address %s", why);
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

/* Everything validate() checks; send() runs it again (cheap) so that it
 * never builds a message from an effect it has not checked itself. */
static bool email_parse(const struct outbox_effect *e, struct email_msg *m, char *err, size_t errlen)
{
	static const char *const known[] = { "from", "subject", "text", "html", "headers", NULL };
	const char *key, *from, *why;
	const json_t *v;
	size_t from_len = 0, subj_len = 0, tlen;

	memset(m, 0, sizeof(*m));
	if (e->target == NULL)
		return fail(err, errlen, "target: missing (the recipient address)");
	tlen = strlen(e->target);
	if (has_injection(e->target, tlen))
		return fail(err, errlen, "target: contains CR or LF (header injection refused)");
	if (!valid_utf8(e->target, tlen))
		return fail(err, errlen, "target: not valid UTF-8");
	why = address_problem(e->target, tlen);
	if (why)
		return fail(err, errlen, "target: the recipient address %s", why);
	if (e->effect_key == NULL || !key_chars(e->effect_key, 128))
		return fail(err, errlen, "effect key: not usable in a Message-ID");
	if (e->effect_id == NULL || !key_chars(e->effect_id, 64))
		return fail(err, errlen, "effect id: not usable in a header");
	if (!json_is_object(e->payload))
		return fail(err, errlen, "payload: must be a JSON object");
	json_object_foreach((json_t *)e->payload, key, v) {
		size_t i;
		for (i = 0; known[i] && strcmp(known[i], key) != 0; i++)
			;
		if (known[i] == NULL)
			return fail(err, errlen,
			            "payload.%.64s: unknown key (an email effect has one recipient, its "
			            "target; known keys: from, subject, text, html, headers)",
			            has_control(key) || !valid_utf8(key, strlen(key)) ? "?" : key);
	}
	if (!get_string(e->payload, "from", true, &from, &from_len, err, errlen) ||
	    !get_string(e->payload, "subject", true, &m->subject, &subj_len, err, errlen) ||
	    !get_string(e->payload, "text", true, &m->text, &m->text_len, err, errlen) ||
	    !get_string(e->payload, "html", false, &m->html, &m->html_len, err, errlen))
		return false;
	if (has_injection(m->subject, subj_len))
		return fail(err, errlen, "payload.subject: contains CR or LF (header injection refused)");
	if (has_control(m->subject))
		return fail(err, errlen, "payload.subject: contains control characters");
	if (!parse_from(from, from_len, m, err, errlen))
		return false;
	v = json_object_get(e->payload, "headers");
	if (v != NULL && !json_is_null(v)) {
		const json_t *hv;
		const char *name;

		if (!json_is_object(v))
			return fail(err, errlen, "payload.headers: must be an object of strings");
		json_object_foreach((json_t *)v, name, hv) {
			const char *val;
			size_t vlen;

			if (has_injection(name, strlen(name)))
				return fail(err, errlen,
				            "payload.headers: a header name contains CR or LF (header injection refused)");
			if (!valid_header_name(name))
				return fail(err, errlen,
				            "payload.headers: \"%.64s\" is not a valid header name",
				            is_ascii_printable(name) ? name : "?");
			if (reserved_header(name))
				return fail(err, errlen,
				            "payload.headers.%s: set by the email provider, cannot be overridden",
				            name);
			if (!json_is_string(hv))
				return fail(err, errlen, "payload.headers.%s: must be a string", name);
			val = json_string_value(hv);
			vlen = json_string_length(hv);
			if (has_injection(val, vlen))
				return fail(err, errlen,
				            "payload.headers.%s: contains CR, LF or NUL (header injection refused)",
				            name);
			if (!valid_utf8(val, vlen))
				return fail(err, errlen, "payload.headers.%s: not valid UTF-8", name);
			if (has_control(val))
				return fail(err, errlen, "payload.headers.%s: contains control characters", name);
		}
		m->headers = v;
	}
	return true;
}

/* ---- building the message ------------------------------------------------ */

/* Normalise line ends to CRLF; true when the result can go as 7bit. */
static bool body_normalise(const char *s, size_t len, struct sbuf *out)
{
	bool seven = true;
	size_t line = 0;

	for (size_t i = 0; i < len; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '\r' || c == '\n') {
			if (c == '\r' && i + 1 < len && s[i + 1] == '\n')
				i++;
			sb_add(out, "\r\n", 2);
			line = 0;
			continue;
		}
		if (c >= 0x80 || (c < 0x20 && c != '\t') || c == 0x7f)
			seven = false;
		if (++line > 998)
			seven = false;
		sb_add(out, (const char *)&c, 1);
	}
	if (out->len < 2 || memcmp(out->p + out->len - 2, "\r\n", 2) != 0)
		sb_add(out, "\r\n", 2);
	return seven;
}

static void sb_part(struct sbuf *b, const char *subtype, const char *body, size_t len, bool force_b64)
{
	struct sbuf norm = { 0 };
	bool seven = body_normalise(body, len, &norm);

	sb_printf(b, "Content-Type: text/%s; charset=utf-8\r\n", subtype);
	if (seven && !force_b64) {
		sb_puts(b, "Content-Transfer-Encoding: 7bit\r\n\r\n");
		sb_add(b, norm.p, norm.len);
	} else {
		sb_puts(b, "Content-Transfer-Encoding: base64\r\n\r\n");
		sb_base64_lines(b, (const unsigned char *)norm.p, norm.len);
	}
	free(norm.p);
}

static char *email_build(const struct outbox_effect *e, const struct email_msg *m,
                         const char *msgid_domain, size_t *lenp)
{
	struct sbuf b = { 0 };

	sb_puts(&b, "From: ");
	if (m->from_name) {
		char *name = email_alloc(m->from_name_len + 1);
		memcpy(name, m->from_name, m->from_name_len);
		if (is_ascii_printable(name) && strstr(name, "=?") == NULL) {
			sb_add(&b, "\"", 1);
			for (const char *p = name; *p; p++) {
				if (*p == '"' || *p == '\\')
					sb_add(&b, "\\", 1);
				sb_add(&b, p, 1);
			}
			sb_add(&b, "\" ", 2);
		} else {
			sb_encoded_words(&b, name);
			sb_add(&b, " ", 1);
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
	return b.p;
}

/* ---- the pool ------------------------------------------------------------ */

enum job_state { JOB_QUEUED, JOB_RUNNING, JOB_FINISHED };

enum job_phase { PH_QUEUED, PH_STARTED, PH_CONNECTED, PH_ENVELOPE, PH_DATA, PH_END, PH_REPLIED };

struct reply {
	int code;                       /* 0: none */
	char text[EMAIL_REPLY_MAX];
};

struct email;

struct email_job {
	TAILQ_ENTRY(email_job) link;
	struct email *em;

	/* Loop side only. */
	outbox_done_fn done;
	void *token;
	struct event *timer;
	int64_t enqueued_ms, deadline_ms;
	long timeout_ms, connect_timeout_ms;   /* the config at send() */

	/* Immutable copies (the effect may be gone before the thread is). */
	char effect_id[65];
	char *from_addr, *rcpt;
	char *message;
	size_t message_len;

	/* Under em->mu. */
	enum job_state state;
	enum job_phase phase;
	bool reported;                  /* done already called (timer) */
	bool cancel;                    /* do not commit the end of data */
	int64_t started_ms, end_ms;
	struct reply mail, rcpt_reply, data_cmd, final, session, auth;
	bool auth_ok, starttls_sent, tls_ok, tls_refused, starttls_missing;
	char tls_why[160];
	char last_cmd[12];
	struct outbox_result result;    /* by the thread when FINISHED */

	/* Thread side only. */
	size_t msg_pos;
	char rline[512];
	size_t rline_len;
	bool wline_start;
	void *rcpt_handle;
	auth_context_t auth_ctx;
};

TAILQ_HEAD(job_list, email_job);

struct email {
	const struct outbox_host *host;
	struct event_base *base;
	char server[256];
	enum starttls_option starttls;
	char *username, *password;
	char helo[256];
	char msgid_domain[256];
	const struct outbox_conf *conf;    /* re-read per send: reloads apply */
	int nthreads;
	SSL_CTX *tls;

	pthread_mutex_t mu;
	pthread_cond_t cv;
	pthread_t *threads;
	int started_threads;
	int refs;                       /* loop + each live thread */
	bool stopping;
	struct job_list queue, running, finished;

	int wake[2];
	struct event *wake_ev;
};

static void email_unref(struct email *em)
{
	bool last;

	pthread_mutex_lock(&em->mu);
	last = --em->refs == 0;
	pthread_mutex_unlock(&em->mu);
	if (!last)
		return;
	if (em->wake[0] >= 0)
		close(em->wake[0]);
	if (em->wake[1] >= 0)
		close(em->wake[1]);
	if (em->password) {
		explicit_bzero(em->password, strlen(em->password));
		free(em->password);
	}
	free(em->username);
	free(em->threads);
	if (em->tls)
		SSL_CTX_free(em->tls);
	pthread_cond_destroy(&em->cv);
	pthread_mutex_destroy(&em->mu);
	free(em);
}

static void job_free(struct email_job *j)
{
	if (j == NULL)
		return;
	if (j->timer)
		event_free(j->timer);
	free(j->from_addr);
	free(j->rcpt);
	free(j->message);
	free(j);
}

static void reply_set(struct reply *r, int code, const char *text)
{
	r->code = code;
	copy_printable(r->text, text ? text : "", text ? strlen(text) : 0, sizeof(r->text));
}

static void reply_set_status(struct reply *r, const smtp_status_t *st)
{
	if (st == NULL)
		reply_set(r, 0, "");
	else
		reply_set(r, st->code, st->text);
}

/* ---- classification -------------------------------------------------------- */

static void result_set(struct outbox_result *r, enum outbox_outcome o, int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void result_set(struct outbox_result *r, enum outbox_outcome o, int status, const char *fmt, ...)
{
	va_list ap;

	r->outcome = o;
	r->status = status;
	r->retry_after_ms = -1;
	va_start(ap, fmt);
	vsnprintf(r->error, sizeof(r->error), fmt, ap);
	va_end(ap);
}

/* 4xx: retry; 5xx: terminal; anything else (a broken relay): retry. */
static enum outbox_outcome class_of(int code)
{
	return code >= 500 && code < 600 ? OUTCOME_TERMINAL : OUTCOME_RETRY;
}

/* The provider id of an accepted message: the queue id when the reply
 * names one the usual ways ("queued as ID" from Postfix and most relays,
 * "id=ID" from Exim), else the reply text itself. */
static void provider_id_from(const char *text, char *out, size_t size)
{
	static const char *const marks[] = { "queued as ", "id=", NULL };

	for (size_t i = 0; marks[i]; i++) {
		const char *p = strcasestr(text, marks[i]);
		if (p == NULL)
			continue;
		p += strlen(marks[i]);
		size_t n = strcspn(p, " \t;,)>");
		if (n > 0 && n < size) {
			memcpy(out, p, n);
			out[n] = '\0';
			return;
		}
	}
	copy_str(out, text[0] ? text : "250", size);
}

/* The outcome for the (one) recipient, from what the session saw.  Called
 * under em->mu, by the thread when the session has ended, or by the loop
 * when it gives up on a session still running (abandoned: no answer
 * will be trusted after this point; "waited" is the time since start). */
static void job_classify(struct email_job *j, bool abandoned, const char *lib_err, int64_t now,
                         struct outbox_result *r)
{
	const struct email *em = j->em;
	int64_t waited = now - (j->started_ms ? j->started_ms : j->enqueued_ms);
	const char *cmd = j->last_cmd[0] ? j->last_cmd : "the greeting";
	char why[160];

	memset(r, 0, sizeof(*r));
	if (abandoned)
		snprintf(why, sizeof(why), "no answer within %lld ms", (long long)waited);
	else
		snprintf(why, sizeof(why), "%s", lib_err && lib_err[0] ? lib_err : "connection closed");

	if (j->tls_refused) {
		result_set(r, OUTCOME_NOT_SENT, 0, "TLS with relay %s refused: %s; nothing sent", em->server,
		           j->tls_why);
		return;
	}
	if (j->starttls_missing) {
		result_set(r, OUTCOME_TERMINAL, 0,
		           "relay %s does not offer STARTTLS and starttls = required; nothing sent",
		           em->server);
		return;
	}
	if (j->phase < PH_CONNECTED) {
		if (abandoned && j->phase < PH_STARTED)
			result_set(r, OUTCOME_NOT_SENT, 0,
			           "not started within timeout_ms (%ld ms): all %d SMTP threads busy",
			           j->timeout_ms, em->nthreads);
		else if (abandoned)
			result_set(r, OUTCOME_NOT_SENT, 0, "connect to relay %s timed out after %lld ms",
			           em->server, (long long)waited);
		else
			result_set(r, OUTCOME_NOT_SENT, 0, "cannot connect to relay %s: %s", em->server, why);
		return;
	}
	if (j->auth.code >= 400 && !j->auth_ok) {
		result_set(r, class_of(j->auth.code), j->auth.code,
		           "relay %s refused AUTH: %d %s; nothing sent", em->server, j->auth.code,
		           j->auth.text);
		return;
	}
	if (em->username && !j->auth_ok && j->phase >= PH_ENVELOPE) {
		/* AUTH is configured but did not happen: whatever the relay
		 * said to MAIL/RCPT, on_message would not have handed over an
		 * unauthenticated message. */
		result_set(r, OUTCOME_TERMINAL, 0,
		           "relay %s offered no usable AUTH mechanism for username (PLAIN and LOGIN "
		           "are only used inside TLS); nothing sent", em->server);
		return;
	}
	if (j->mail.code == 0) {
		if (j->phase >= PH_ENVELOPE) {
			result_set(r, OUTCOME_RETRY, 0, "no reply to MAIL FROM: %s; nothing sent", why);
		} else if (j->session.code >= 400) {
			result_set(r, class_of(j->session.code), j->session.code,
			           "relay %s refused the session after %s: %d %s; nothing sent", em->server,
			           cmd, j->session.code, j->session.text);
		} else if (j->starttls_sent && !j->tls_ok) {
			result_set(r, OUTCOME_NOT_SENT, 0, "TLS handshake with relay %s failed: %s; nothing sent",
			           em->server, why);
		} else {
			result_set(r, OUTCOME_NOT_SENT, 0,
			           "session with relay %s ended before MAIL FROM (after %s): %s; nothing sent",
			           em->server, cmd, why);
		}
		return;
	}
	if (j->mail.code / 100 != 2) {
		result_set(r, class_of(j->mail.code), j->mail.code, "MAIL FROM refused: %d %s",
		           j->mail.code, j->mail.text);
		return;
	}
	/* Per recipient (an email effect has exactly one: its target). */
	if (j->rcpt_reply.code == 0) {
		result_set(r, OUTCOME_RETRY, 0, "no reply to RCPT TO: %s; nothing sent", why);
		return;
	}
	if (j->rcpt_reply.code / 100 != 2) {
		result_set(r, class_of(j->rcpt_reply.code), j->rcpt_reply.code,
		           "RCPT TO refused: %d %s", j->rcpt_reply.code, j->rcpt_reply.text);
		return;
	}
	if (j->phase < PH_DATA) {
		if (j->data_cmd.code >= 400)
			result_set(r, class_of(j->data_cmd.code), j->data_cmd.code, "DATA refused: %d %s",
			           j->data_cmd.code, j->data_cmd.text);
		else
			result_set(r, OUTCOME_RETRY, 0, "no reply to DATA: %s; nothing sent", why);
		return;
	}
	if (j->phase < PH_END) {
		result_set(r, OUTCOME_RETRY, 0,
		           "transfer aborted before the end of data (%s); the relay cannot have "
		           "accepted it", abandoned ? why : "connection lost");
		return;
	}
	if (j->final.code / 100 == 2) {
		result_set(r, OUTCOME_ACCEPTED, j->final.code, "%s", "");
		provider_id_from(j->final.text, r->provider_id, sizeof(r->provider_id));
		return;
	}
	if (j->final.code >= 400) {
		result_set(r, class_of(j->final.code), j->final.code,
		           "message refused after the end of data: %d %s", j->final.code, j->final.text);
		return;
	}
	result_set(r, OUTCOME_AMBIGUOUS, 0,
	           "no reply after the end of data (%s, %lld ms after the terminator): the relay "
	           "may have queued the message",
	           abandoned ? "timed out" : why, (long long)(now - j->end_ms));
}

/* ---- libesmtp callbacks (pool thread) ------------------------------------------ */

static void monitor_reply_line(struct email_job *j, const char *line, size_t len)
{
	int code;

	if (len < 4 || line[0] < '2' || line[0] > '5' || line[1] < '0' || line[1] > '9' ||
	    line[2] < '0' || line[2] > '9' || line[3] != ' ')
		return;   /* not the last line of a reply */
	code = (line[0] - '0') * 100 + (line[1] - '0') * 10 + (line[2] - '0');
	if (strcmp(j->last_cmd, "QUIT") == 0)
		return;
	if (strcmp(j->last_cmd, "AUTH") == 0) {
		if (code == 235)
			j->auth_ok = true;
		else if (code >= 400) {
			j->auth.code = code;
			copy_printable(j->auth.text, line + 4, len - 4, sizeof(j->auth.text));
		}
	}
	j->session.code = code;
	copy_printable(j->session.text, line + 4, len - 4, sizeof(j->session.text));
}

/* Sees the protocol (never the message): replies are assembled into lines
 * and remembered; of what we write, only the command verb is looked at
 * (AUTH lines carry credentials: never copied). */
static void on_monitor(const char *buf, int buflen, int writing, void *arg)
{
	struct email_job *j = arg;
	struct email *em = j->em;

	pthread_mutex_lock(&em->mu);
	if (writing == SMTP_CB_WRITING) {
		static const char *const verbs[] = { "EHLO", "HELO", "STARTTLS", "AUTH", "MAIL",
		                                     "RCPT", "DATA", "RSET", "QUIT", NULL };
		for (int i = 0; i < buflen; i++) {
			if (i == 0 ? j->wline_start : buf[i - 1] == '\n') {
				for (size_t v = 0; verbs[v]; v++) {
					size_t n = strlen(verbs[v]);
					if ((size_t)(buflen - i) >= n && strncasecmp(buf + i, verbs[v], n) == 0) {
						copy_str(j->last_cmd, verbs[v], sizeof(j->last_cmd));
						if (strcmp(verbs[v], "MAIL") == 0 && j->phase < PH_ENVELOPE)
							j->phase = PH_ENVELOPE;
						if (strcmp(verbs[v], "STARTTLS") == 0)
							j->starttls_sent = true;
						break;
					}
				}
			}
		}
		j->wline_start = buflen > 0 && buf[buflen - 1] == '\n';
	} else if (writing == SMTP_CB_READING) {
		for (int i = 0; i < buflen; i++) {
			char c = buf[i];
			if (c == '\n') {
				size_t n = j->rline_len;
				if (n > 0 && j->rline[n - 1] == '\r')
					n--;
				monitor_reply_line(j, j->rline, n);
				j->rline_len = 0;
			} else if (j->rline_len < sizeof(j->rline)) {
				j->rline[j->rline_len++] = c;
			}
		}
	}
	pthread_mutex_unlock(&em->mu);
}

static void on_event(smtp_session_t session, int event_no, void *arg, ...)
{
	struct email_job *j = arg;
	struct email *em = j->em;
	va_list ap;
	int *ok;

	(void)session;
	va_start(ap, arg);
	pthread_mutex_lock(&em->mu);
	switch (event_no) {
	case SMTP_EV_CONNECT:
		if (j->phase < PH_CONNECTED)
			j->phase = PH_CONNECTED;
		break;
	case SMTP_EV_MAILSTATUS: {
		(void)va_arg(ap, const char *);
		smtp_message_t msg = va_arg(ap, smtp_message_t);
		reply_set_status(&j->mail, smtp_reverse_path_status(msg));
		break;
	}
	case SMTP_EV_RCPTSTATUS: {
		(void)va_arg(ap, const char *);
		smtp_recipient_t rcpt = va_arg(ap, smtp_recipient_t);
		if ((void *)rcpt == j->rcpt_handle)
			reply_set_status(&j->rcpt_reply, smtp_recipient_status(rcpt));
		break;
	}
	case SMTP_EV_MESSAGESENT: {
		smtp_message_t msg = va_arg(ap, smtp_message_t);
		const smtp_status_t *st = smtp_message_transfer_status(msg);
		if (j->phase >= PH_END) {
			reply_set_status(&j->final, st);
			if (j->final.code != 0)
				j->phase = PH_REPLIED;
		} else if (j->phase < PH_DATA) {
			reply_set_status(&j->data_cmd, st);
		}
		break;
	}
	case SMTP_EV_EXTNA_STARTTLS:
		j->starttls_missing = true;
		break;
	case SMTP_EV_STARTTLS_OK:
		j->tls_ok = true;
		/* Plain-text AUTH mechanisms only inside TLS. */
		if (j->auth_ctx)
			auth_set_mechanism_flags(j->auth_ctx, AUTH_PLUGIN_PLAIN, 0);
		break;
	case SMTP_EV_INVALID_PEER_CERTIFICATE: {
		long vfy = va_arg(ap, long);
		ok = va_arg(ap, int *);
		*ok = 0;
		j->tls_refused = true;
		snprintf(j->tls_why, sizeof(j->tls_why), "certificate verification failed: %s",
		         X509_verify_cert_error_string(vfy));
		break;
	}
	case SMTP_EV_NO_PEER_CERTIFICATE:
		ok = va_arg(ap, int *);
		*ok = 0;
		j->tls_refused = true;
		copy_str(j->tls_why, "the relay presented no certificate", sizeof(j->tls_why));
		break;
	case SMTP_EV_WRONG_PEER_CERTIFICATE:
		ok = va_arg(ap, int *);
		*ok = 0;
		j->tls_refused = true;
		snprintf(j->tls_why, sizeof(j->tls_why), "the certificate does not name the relay %.100s", em->server);
		break;
	case SMTP_EV_WEAK_CIPHER:
		(void)va_arg(ap, int);
		ok = va_arg(ap, int *);
		*ok = 0;
		j->tls_refused = true;
		copy_str(j->tls_why, "cipher too weak", sizeof(j->tls_why));
		break;
	case SMTP_EV_NO_CLIENT_CERTIFICATE:
		ok = va_arg(ap, int *);
		*ok = 0;
		j->tls_refused = true;
		copy_str(j->tls_why, "client certificate unusable", sizeof(j->tls_why));
		break;
	case SMTP_EV_UNUSABLE_CLIENT_CERTIFICATE:
	case SMTP_EV_UNUSABLE_CA_LIST:
		j->tls_refused = true;
		copy_str(j->tls_why,
		         event_no == SMTP_EV_UNUSABLE_CA_LIST
		             ? "unusable CA list"
		             : "unusable client certificate under $HOME/.config/libesmtp",
		         sizeof(j->tls_why));
		break;
	default:
		/* SYNTAXWARNING and the extension events: libesmtp's defaults
		 * (tolerant, quit_now = 0) are right for a submission client. */
		break;
	}
	pthread_mutex_unlock(&em->mu);
	va_end(ap);
}

/* Hands libesmtp the message in one piece.  The call that answers "end of
 * message" is the commit point: the terminator follows it. */
static const char *on_message(void **ctx, int *len, void *arg)
{
	struct email_job *j = arg;
	struct email *em = j->em;
	const char *out = NULL;
	int n = 0;
	bool abort_now = false;

	(void)ctx;
	pthread_mutex_lock(&em->mu);
	if (len == NULL) {                      /* rewind: DATA got its 354 */
		j->msg_pos = 0;
		if (j->phase < PH_DATA)
			j->phase = PH_DATA;
		pthread_mutex_unlock(&em->mu);
		return NULL;
	}
	if (j->cancel) {
		abort_now = true;
	} else if (em->username && !j->auth_ok) {
		/* AUTH was configured but did not happen: do not hand an
		 * unauthenticated message to the relay. */
		abort_now = true;
	} else if (j->msg_pos < j->message_len) {
		out = j->message + j->msg_pos;
		n = (int)(j->message_len - j->msg_pos);
		j->msg_pos = j->message_len;
	} else {
		j->phase = PH_END;
		j->end_ms = mono_ms();
	}
	pthread_mutex_unlock(&em->mu);
	*len = n;
	/* libesmtp drops the connection without a terminator when the
	 * callback ends the message with errno set. */
	errno = abort_now ? ECANCELED : 0;
	return out;
}

static int on_interact(auth_client_request_t req, char **result, int fields, void *arg)
{
	struct email_job *j = arg;

	for (int i = 0; i < fields; i++) {
		if (req[i].flags & AUTH_USER)
			result[i] = j->em->username;
		else if (req[i].flags & AUTH_PASS)
			result[i] = j->em->password;
		else if (req[i].flags & AUTH_REALM)
			result[i] = (char *)"";
		else
			return 0;
	}
	return 1;
}

/* The thread half of one job: one SMTP session. */
static void job_run(struct email_job *j)
{
	struct email *em = j->em;
	smtp_session_t s = smtp_create_session();
	smtp_message_t msg = NULL;
	auth_context_t auth = NULL;
	char lib_err[128] = "";
	long per_read;
	int ok;

	if (s == NULL) {
		pthread_mutex_lock(&em->mu);
		result_set(&j->result, OUTCOME_NOT_SENT, 0, "libesmtp: cannot create a session");
		pthread_mutex_unlock(&em->mu);
		return;
	}
	/* libesmtp's timeouts are per read; the loop's timer bounds the whole
	 * call.  Give libesmtp what is left, so the thread ends soon after. */
	per_read = (long)(j->deadline_ms - mono_ms()) + 800;
	if (per_read < 1000)
		per_read = 1000;
	smtp_set_timeout(s, Timeout_GREETING | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
	smtp_set_timeout(s, Timeout_ENVELOPE | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
	smtp_set_timeout(s, Timeout_DATA | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
	smtp_set_timeout(s, Timeout_TRANSFER | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
	smtp_set_timeout(s, Timeout_DATA2 | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
	ok = smtp_set_server(s, em->server) && (em->helo[0] == '\0' || smtp_set_hostname(s, em->helo)) &&
	     smtp_starttls_enable(s, em->starttls) &&
	     (em->starttls == Starttls_DISABLED || smtp_starttls_set_ctx(s, em->tls)) && smtp_set_eventcb(s, on_event, j) &&
	     smtp_set_monitorcb(s, on_monitor, j, 0);
	if (ok && em->username) {
		auth = auth_create_context();
		/* Plain-text mechanisms stay off until TLS is up (on_event);
		 * challenge-response ones may run anyway. */
		j->auth_ctx = auth;
		ok = auth != NULL && auth_set_mechanism_flags(auth, 0, AUTH_PLUGIN_PLAIN) &&
		     auth_set_interact_cb(auth, on_interact, j) && smtp_auth_set_context(s, auth);
	}
	if (ok) {
		msg = smtp_add_message(s);
		ok = msg != NULL && smtp_set_reverse_path(msg, j->from_addr) &&
		     smtp_set_messagecb(msg, on_message, j);
	}
	if (ok) {
		j->rcpt_handle = smtp_add_recipient(msg, j->rcpt);
		ok = j->rcpt_handle != NULL;
	}
	if (ok) {
		if (!smtp_start_session(s))
			smtp_strerror(smtp_errno(), lib_err, sizeof(lib_err));
	} else {
		smtp_strerror(smtp_errno(), lib_err, sizeof(lib_err));
		pthread_mutex_lock(&em->mu);
		result_set(&j->result, OUTCOME_NOT_SENT, 0, "libesmtp: cannot set up the session: %s",
		           lib_err);
		pthread_mutex_unlock(&em->mu);
		smtp_destroy_session(s);
		if (auth)
			auth_destroy_context(auth);
		return;
	}
	pthread_mutex_lock(&em->mu);
	job_classify(j, false, lib_err, mono_ms(), &j->result);
	pthread_mutex_unlock(&em->mu);
	smtp_destroy_session(s);
	if (auth)
		auth_destroy_context(auth);
}

static void *pool_main(void *arg)
{
	struct email *em = arg;
	struct email_job *j;

	pthread_mutex_lock(&em->mu);
	for (;;) {
		while (!em->stopping && TAILQ_EMPTY(&em->queue))
			pthread_cond_wait(&em->cv, &em->mu);
		if (em->stopping)
			break;
		j = TAILQ_FIRST(&em->queue);
		TAILQ_REMOVE(&em->queue, j, link);
		TAILQ_INSERT_TAIL(&em->running, j, link);
		j->state = JOB_RUNNING;
		j->phase = PH_STARTED;
		j->started_ms = mono_ms();
		pthread_mutex_unlock(&em->mu);

		job_run(j);

		pthread_mutex_lock(&em->mu);
		TAILQ_REMOVE(&em->running, j, link);
		j->state = JOB_FINISHED;
		if (em->stopping) {
			/* Abandoned by shutdown(): nobody else will free it. */
			pthread_mutex_unlock(&em->mu);
			job_free(j);
			pthread_mutex_lock(&em->mu);
			continue;
		}
		TAILQ_INSERT_TAIL(&em->finished, j, link);
		{
			char c = 1;
			/* Non-blocking; a full pipe already means "wake up". */
			if (write(em->wake[1], &c, 1) < 0 && errno != EAGAIN)
				abort();
		}
	}
	pthread_mutex_unlock(&em->mu);
	email_unref(em);
	return NULL;
}

/* ---- the loop half -------------------------------------------------------------- */

static void log_late(struct email *em, struct email_job *j)
{
	if (j->result.outcome == OUTCOME_ACCEPTED)
		em->host->log(OLOG_WARN, EMAIL_NAME,
		              "effect %s: the relay accepted the message after the attempt had been "
		              "given up on: %d, provider id %s (evidence for resolving it)",
		              j->effect_id, j->result.status, j->result.provider_id);
	else
		em->host->log(OLOG_INFO, EMAIL_NAME,
		              "effect %s: the SMTP session given up on ended: %s", j->effect_id,
		              j->result.error);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
	struct email *em = arg;
	struct job_list done_list;
	struct email_job *j;
	char buf[64];

	(void)what;
	while (read(fd, buf, sizeof(buf)) > 0)
		;
	TAILQ_INIT(&done_list);
	pthread_mutex_lock(&em->mu);
	TAILQ_CONCAT(&done_list, &em->finished, link);
	pthread_mutex_unlock(&em->mu);
	while ((j = TAILQ_FIRST(&done_list)) != NULL) {
		TAILQ_REMOVE(&done_list, j, link);
		if (j->reported) {
			log_late(em, j);
		} else {
			j->reported = true;
			if (j->timer) {
				event_free(j->timer);
				j->timer = NULL;
			}
			j->done(j->token, &j->result);
		}
		job_free(j);
	}
}

static void timer_arm(struct email_job *j, int64_t at, int64_t now)
{
	int64_t d = at > now ? at - now : 0;
	struct timeval tv = { (time_t)(d / 1000), (suseconds_t)((d % 1000) * 1000) };

	evtimer_add(j->timer, &tv);
}

/* The loop's bound on one job: timeout_ms from send() (queue wait
 * included), connect_timeout_ms from the moment a thread starts it. */
static void on_timer(evutil_socket_t fd, short what, void *arg)
{
	struct email_job *j = arg;
	struct email *em = j->em;
	struct outbox_result r;
	int64_t now = mono_ms();
	bool give_up = false, unqueue = false;

	(void)fd;
	(void)what;
	pthread_mutex_lock(&em->mu);
	switch (j->state) {
	case JOB_QUEUED:
		if (now >= j->deadline_ms) {
			TAILQ_REMOVE(&em->queue, j, link);
			give_up = unqueue = true;
		} else {
			timer_arm(j, j->deadline_ms, now);
		}
		break;
	case JOB_RUNNING: {
		int64_t connect_by = j->started_ms + j->connect_timeout_ms;
		if (now >= j->deadline_ms || (j->phase < PH_CONNECTED && now >= connect_by)) {
			give_up = true;
			j->cancel = true;
		} else {
			int64_t next = j->deadline_ms;
			if (j->phase < PH_CONNECTED && connect_by < next)
				next = connect_by;
			timer_arm(j, next, now);
		}
		break;
	}
	case JOB_FINISHED:
		/* The result is in the pipe; on_wake reports it. */
		break;
	}
	if (give_up) {
		job_classify(j, true, NULL, now, &r);
		j->reported = true;
	}
	pthread_mutex_unlock(&em->mu);
	if (!give_up)
		return;
	event_free(j->timer);
	j->timer = NULL;
	em->host->log(OLOG_WARN, EMAIL_NAME, "effect %s: SMTP session given up after %lld ms: %s",
	              j->effect_id, (long long)(now - j->enqueued_ms), r.error);
	j->done(j->token, &r);
	if (unqueue)
		job_free(j);
	/* else: the thread still owns it; on_wake frees it (and logs what
	 * the session finally said). */
}

/* ---- the provider interface ----------------------------------------------------- */

static bool valid_server(const char *s, char *host_err, size_t errlen)
{
	const char *colon = strchr(s, ':');
	char *end;
	long port;

	if (colon == NULL || colon == s)
		return fail(host_err, errlen, "must be host:port (e.g. 127.0.0.1:25)");
	if (strchr(colon + 1, ':') || s[0] == '[')
		return fail(host_err, errlen,
		            "IPv6 literals are not supported by libesmtp: use a host name");
	for (const char *p = s; p < colon; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
		      *p == '.' || *p == '-' || *p == '_'))
			return fail(host_err, errlen, "host name contains characters outside [A-Za-z0-9._-]");
	errno = 0;
	port = strtol(colon + 1, &end, 10);
	if (errno || end == colon + 1 || *end != '\0' || port < 1 || port > 65535)
		return fail(host_err, errlen, "port must be 1..65535");
	return true;
}

static void pin_module(void)
{
	Dl_info info;

	/* A thread left running at shutdown still executes our callbacks:
	 * keep the code mapped even when the dispatcher dlclose()s us. */
	if (dladdr((void *)pin_module, &info) && info.dli_fname)
		(void)dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

static void email_shutdown(void *self);

static pthread_once_t auth_once = PTHREAD_ONCE_INIT;

static void *email_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                        size_t errlen)
{
	struct email *em = email_alloc(sizeof(*em));
	const char *server = host->conf_str(conf, "server");
	const char *tls = host->conf_str(conf, "starttls");
	const char *user = host->conf_str(conf, "username");
	const char *pass = host->conf_str(conf, "password");
	const char *helo = host->conf_str(conf, "helo_name");
	const char *domain = host->conf_str(conf, "message_id_domain");
	char why[160];
	sigset_t all, old;

	em->host = host;
	em->base = host->base;
	em->wake[0] = em->wake[1] = -1;
	em->refs = 1;
	pthread_mutex_init(&em->mu, NULL);
	pthread_cond_init(&em->cv, NULL);
	TAILQ_INIT(&em->queue);
	TAILQ_INIT(&em->running);
	TAILQ_INIT(&em->finished);

	if (!valid_server(server, why, sizeof(why))) {
		snprintf(err, errlen, "%s: \"%.64s\": %s", host->conf_where(conf, "server"), server, why);
		goto fail;
	}
	copy_str(em->server, server, sizeof(em->server));
	if (strcmp(tls, "required") == 0)
		em->starttls = Starttls_REQUIRED;
	else if (strcmp(tls, "optional") == 0)
		em->starttls = Starttls_ENABLED;
	else if (strcmp(tls, "off") == 0)
		em->starttls = Starttls_DISABLED;
	else {
		snprintf(err, errlen, "%s: must be required, optional or off (got \"%.32s\")",
		         host->conf_where(conf, "starttls"), tls);
		goto fail;
	}
	if (has_injection(user, strlen(user)) || has_control(user)) {
		snprintf(err, errlen, "%s: contains control characters", host->conf_where(conf, "username"));
		goto fail;
	}
	if (user[0] && pass[0] == '\0') {
		snprintf(err, errlen, "%s: username is set but the password is empty",
		         host->conf_where(conf, "password"));
		goto fail;
	}
	if (user[0] == '\0' && pass[0]) {
		snprintf(err, errlen, "%s: a password without a username", host->conf_where(conf, "username"));
		goto fail;
	}
	if (user[0]) {
		em->username = email_strdup(user);
		em->password = email_strdup(pass);
	}
	if (helo[0] && !valid_domain(helo, strlen(helo))) {
		snprintf(err, errlen, "%s: not a valid host name or [address]",
		         host->conf_where(conf, "helo_name"));
		goto fail;
	}
	copy_str(em->helo, helo, sizeof(em->helo));
	if (!valid_domain(domain, strlen(domain)) || domain[0] == '[') {
		snprintf(err, errlen, "%s: not a valid domain name", host->conf_where(conf, "message_id_domain"));
		goto fail;
	}
	copy_str(em->msgid_domain, domain, sizeof(em->msgid_domain));
	{
		/* Built (and ca_file checked) even with starttls = off: a broken
		 * setting is refused now, not when someone turns TLS on. */
		const char *ca = host->conf_str(conf, "ca_file");
		/* Our own context rather than libesmtp's default: it trusts the
		 * system's CAs (or ca_file), and it stops at TLS 1.2.  libesmtp
		 * 1.1 polls for the EHLO reply before flushing EHLO; a TLS 1.3
		 * relay's post-handshake NewSessionTicket makes that poll
		 * succeed early and the session stalls until its timeout. */
		em->tls = SSL_CTX_new(TLS_client_method());
		if (em->tls == NULL || !SSL_CTX_set_min_proto_version(em->tls, TLS1_2_VERSION) ||
		    !SSL_CTX_set_max_proto_version(em->tls, TLS1_2_VERSION)) {
			snprintf(err, errlen, "email: cannot create a TLS context");
			goto fail;
		}
		if (ca[0] ? SSL_CTX_load_verify_locations(em->tls, ca, NULL) != 1
		          : SSL_CTX_set_default_verify_paths(em->tls) != 1) {
			snprintf(err, errlen, "%s: cannot load CA certificates from \"%.200s\"",
			         host->conf_where(conf, "ca_file"), ca[0] ? ca : "the system store");
			goto fail;
		}
	}
	em->conf = conf;
	em->nthreads = (int)host->conf_int(conf, "threads");

	if (pipe2(em->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
		snprintf(err, errlen, "email: pipe: %s", strerror(errno));
		goto fail;
	}
	em->wake_ev = event_new(em->base, em->wake[0], EV_READ | EV_PERSIST, on_wake, em);
	if (em->wake_ev == NULL || event_add(em->wake_ev, NULL) < 0) {
		snprintf(err, errlen, "email: cannot watch the result pipe");
		goto fail;
	}
	pthread_once(&auth_once, auth_client_init);

	/* Pool threads take no signals (SIGPIPE from a relay that hung up
	 * becomes EPIPE; SIGTERM and SIGHUP stay with the loop). */
	em->threads = email_alloc(sizeof(pthread_t) * (size_t)em->nthreads);
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (int i = 0; i < em->nthreads; i++) {
		int rc;
		pthread_mutex_lock(&em->mu);
		em->refs++;
		pthread_mutex_unlock(&em->mu);
		rc = pthread_create(&em->threads[i], NULL, pool_main, em);
		if (rc != 0) {
			pthread_mutex_lock(&em->mu);
			em->refs--;
			pthread_mutex_unlock(&em->mu);
			pthread_sigmask(SIG_SETMASK, &old, NULL);
			snprintf(err, errlen, "%s: cannot start SMTP thread %d of %d: %s",
			         host->conf_where(conf, "threads"), i + 1, em->nthreads, strerror(rc));
			goto fail;
		}
		em->started_threads++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);

	if (host->conf_int(conf, "max_in_flight") > em->nthreads)
		host->log(OLOG_INFO, EMAIL_NAME,
		          "max_in_flight (%ld) is above threads (%d): sends beyond %d wait in a queue, and "
		          "the wait counts against timeout_ms",
		          host->conf_int(conf, "max_in_flight"), em->nthreads, em->nthreads);
	host->log(OLOG_INFO, EMAIL_NAME,
	          "relay %s, starttls %s, auth %s, %d threads, timeout %ld ms, connect timeout %ld ms",
	          em->server, tls, em->username ? "on (password: ********)" : "off", em->nthreads,
	          host->conf_int(conf, "timeout_ms"), host->conf_int(conf, "connect_timeout_ms"));
	return em;

fail:
	email_shutdown(em);
	return NULL;
}

static bool email_validate(void *self, const struct outbox_effect *e, char *host_key,
                           size_t host_keylen, char *err, size_t errlen)
{
	struct email *em = self;
	struct email_msg m;

	if (!email_parse(e, &m, err, errlen))
		return false;
	copy_str(host_key, em->server, host_keylen);
	return true;
}

static bool email_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
                       char *err, size_t errlen)
{
	struct email *em = self;
	struct email_msg m;
	struct email_job *j;
	int64_t now = mono_ms();

	if (!email_parse(e, &m, err, errlen))
		return false;
	j = email_alloc(sizeof(*j));
	j->em = em;
	j->done = done;
	j->token = token;
	j->enqueued_ms = now;
	/* Timeouts are common keys: a SIGHUP reload changes them for the
	 * sends that start afterwards. */
	j->timeout_ms = em->host->conf_int(em->conf, "timeout_ms");
	j->connect_timeout_ms = em->host->conf_int(em->conf, "connect_timeout_ms");
	if (j->connect_timeout_ms > j->timeout_ms)
		j->connect_timeout_ms = j->timeout_ms;
	j->deadline_ms = now + j->timeout_ms;
	copy_str(j->effect_id, e->effect_id, sizeof(j->effect_id));
	j->from_addr = email_strdup(m.from_addr);
	j->rcpt = email_strdup(e->target);
	j->message = email_build(e, &m, em->msgid_domain, &j->message_len);
	j->wline_start = true;
	j->state = JOB_QUEUED;
	j->phase = PH_QUEUED;
	j->timer = evtimer_new(em->base, on_timer, j);
	if (j->timer == NULL) {
		job_free(j);
		return fail(err, errlen, "email: cannot create a timer");
	}
	pthread_mutex_lock(&em->mu);
	if (em->stopping || em->started_threads == 0) {
		pthread_mutex_unlock(&em->mu);
		job_free(j);
		return fail(err, errlen, "email: the SMTP pool is stopped");
	}
	TAILQ_INSERT_TAIL(&em->queue, j, link);
	pthread_cond_signal(&em->cv);
	timer_arm(j, now + j->connect_timeout_ms, now);
	pthread_mutex_unlock(&em->mu);
	return true;
}

static void email_shutdown(void *self)
{
	struct email *em = self;
	struct job_list drop;
	struct email_job *j;
	bool left_behind = false;

	if (em == NULL)
		return;
	TAILQ_INIT(&drop);
	pthread_mutex_lock(&em->mu);
	em->stopping = true;
	TAILQ_CONCAT(&drop, &em->queue, link);
	TAILQ_CONCAT(&drop, &em->finished, link);
	/* Running jobs belong to their threads, which free them; they may
	 * not reach the end of data any more, and their timers (the loop's)
	 * go now. */
	for (j = TAILQ_FIRST(&em->running); j != NULL; j = TAILQ_NEXT(j, link)) {
		j->cancel = true;
		if (j->timer) {
			event_free(j->timer);
			j->timer = NULL;
		}
	}
	pthread_cond_broadcast(&em->cv);
	pthread_mutex_unlock(&em->mu);
	/* Queued and finished jobs: done is called for none (provider.h). */
	while ((j = TAILQ_FIRST(&drop)) != NULL) {
		TAILQ_REMOVE(&drop, j, link);
		job_free(j);
	}
	for (int i = 0; i < em->started_threads; i++) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += (long)EMAIL_JOIN_MS * 1000000L;
		ts.tv_sec += ts.tv_nsec / 1000000000L;
		ts.tv_nsec %= 1000000000L;
		if (pthread_timedjoin_np(em->threads[i], NULL, &ts) != 0) {
			pthread_detach(em->threads[i]);
			left_behind = true;
		}
	}
	if (left_behind) {
		pin_module();
		em->host->log(OLOG_WARN, EMAIL_NAME,
		              "shutdown: SMTP sessions still running were left behind (their outcome is "
		              "not recorded; their effects end unknown when their leases expire)");
	}
	if (em->wake_ev)
		event_free(em->wake_ev);
	em->wake_ev = NULL;
	email_unref(em);
}

static const struct outbox_provider email_provider = {
	.abi = OUTBOX_PROVIDER_ABI,
	.name = EMAIL_NAME,
	.caps = 0,   /* SMTP has no idempotency keys and cannot be asked later */
	.keys = email_keys,
	.init = email_init,
	.validate = email_validate,
	.send = email_send,
	.reconcile = NULL,
	.shutdown = email_shutdown,
};

const struct outbox_provider *outbox_provider_entry(void)
{
	return &email_provider;
}

/* SPDX-License-Identifier: ISC */
/*
 * message.h: validation of an email effect and the message built from it
 * (message.c).  No network, no shared state: safe from any thread.
 */
#ifndef OUTBOX_EMAIL_MESSAGE_H
#define OUTBOX_EMAIL_MESSAGE_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "provider.h"

#define EMAIL_ADDR_MAX 254

/* Everything the message is built from, pointing into the effect. */
struct email_msg {
	const char *from_name;    /* NULL: no display name */
	size_t from_name_len;
	char from_addr[EMAIL_ADDR_MAX + 1];
	const char *subject, *text, *html;
	size_t text_len, html_len;
	const json_t *headers;    /* object or NULL */
};

/* Everything validate() checks: target, keys, payload shape, header
 * injection.  False with the reason in err (starting with the field). */
bool email_parse(const struct outbox_effect *e, struct email_msg *m, char *err, size_t errlen);

/* The complete RFC 5322 message (CRLF line ends, not dot-stuffed: libesmtp
 * does that), malloc'd; its length in *lenp.  m from email_parse(e). */
char *email_build(const struct outbox_effect *e, const struct email_msg *m,
                  const char *msgid_domain, size_t *lenp);

/* CR, LF or NUL in s[0..len): the characters that split or cut a header. */
bool email_has_injection(const char *s, size_t len);
/* Control characters other than TAB. */
bool email_has_control(const char *s);
/* A host name (labels of [A-Za-z0-9-]) or an IPv4 literal [a.b.c.d]. */
bool email_valid_domain(const char *d, size_t len);

/* snprintf into err; returns false (for `return email_fail(...)`). */
bool email_fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif

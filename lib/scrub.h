/* SPDX-License-Identifier: ISC */
/*
 * scrub.h: secret values cut out of text a peer wrote.  A provider that
 * puts a secret into a request (a header naming one, an access token, a
 * password) cannot stop the peer from echoing it: a router copying
 * X-Request-Id back, a 401 body quoting the Authorization line.  Whatever
 * goes to the database or the log from a peer's answer (provider ids,
 * error texts, log lines) is passed through a scrub first, and every
 * occurrence of a secret is replaced by "[secret]".
 *
 * A value is matched as-is and in the spellings an echo commonly gives it,
 * where they are cheap to list: JSON-escaped, percent-encoded, hex, base64
 * of it (padded, unpadded, base64url; also the part of a longer base64
 * text that stands for it alone, at each of the 3 offsets) and, when the value is itself base64
 * (a Basic credential), its decoded text ("user:pass") and the password
 * after the first ':'.  Each of these is also matched with its bytes
 * escaped one by one and mixed (%XX of either case on some bytes only, '+'
 * for a space, \u00XX, a backslash before punctuation), as encoders that
 * leave some bytes alone write it.  An echo in any other encoding is not
 * caught: a
 * secret goes only to the URL prefixes the operator declared for it.
 *
 * Only whole spellings are matched.  A text cut at a bound (a body at
 * max_response_bytes, a header at its longest) may end inside a secret:
 * its last (SCRUB_MAX_WIDTH * longest spelling - 1) bytes are dropped, whatever they are
 * (scrub_text's cut), so that what is dropped never depends on the
 * secret.  Sources are scrubbed before excerpts are cut from them.
 * Derived spellings shorter than
 * SCRUB_MIN_DERIVED bytes are not listed (they would match by chance).
 */
#ifndef OUTBOX_SCRUB_H
#define OUTBOX_SCRUB_H

#include <stdbool.h>
#include <stddef.h>

#define SCRUB_MARK "[secret]"
#define SCRUB_MIN_DERIVED 4
#define SCRUB_MAX_WIDTH 6   /* bytes an escape of one byte takes at most (\u00XX) */

struct scrub {
	char **v;          /* the spellings, longest first; wiped when freed */
	size_t *len;
	int n;
};

/* Adds value[0..len) and its derived spellings (len 0: nothing). */
void scrub_add(struct scrub *s, const char *value, size_t len);
void scrub_free(struct scrub *s);
/* The text src[0..len) scrubbed, newly allocated (NUL-terminated, *outlen
 * bytes), or NULL when nothing matched. */
char *scrub_dup(const struct scrub *s, const char *src, size_t len, size_t *outlen);
/* The NUL-terminated text in buf[size] scrubbed in place (cut to fit);
 * true when something was replaced. */
bool scrub_buf(const struct scrub *s, char *buf, size_t size);
/* A malloc'd text *data of *len bytes (NUL-terminated) scrubbed: replaced
 * (the old one wiped and freed) when something matched; cut: the text was
 * cut at a bound, and its possibly partial tail is dropped first. */
void scrub_text(const struct scrub *s, char **data, size_t *len, bool cut);
/* A malloc'd NUL-terminated string (or NULL) scrubbed in place: *p is
 * replaced (the old one wiped and freed) when something matched. */
void scrub_str(const struct scrub *s, char **p);

#endif

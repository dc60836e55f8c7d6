/* SPDX-License-Identifier: ISC */
/*
 * json_text.h: a payload's JSON as text, for providers that forward a
 * value exactly as the producer wrote it.
 *
 * jansson holds a number as an int64 or a double, so re-encoding a parsed
 * payload changes what leaves: 19.99 becomes 19.989999999999998, 1.50
 * becomes 1.5, and an integer beyond 64 bits cannot be sent at all.  The
 * worker hands every provider the payload's text as stored (PostgreSQL's
 * jsonb output: valid JSON, keys unique, a space after every ':' and ',');
 * these functions find a top-level member in it and drop the spaces.
 * They never read past `len`.  Their answers assume valid JSON, which
 * jsonb's text always is: malformed structure they notice is "not found"
 * (the caller falls back to jansson), but a malformed value inside a
 * member (`{"body": tru}`) is found as it stands.
 */
#ifndef OUTBOX_JSON_TEXT_H
#define OUTBOX_JSON_TEXT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* The value of the top-level member `key` of the object in text[0..len),
 * as written (no surrounding white space): *val and *val_len point into
 * text.  The key is compared as written (a key spelled with escapes is
 * not found; jsonb prints none for keys that need none), and a key with
 * a backslash or a quote is never found.  With duplicate
 * keys, the last wins, as in jansson.  False when text is not an object,
 * the key is absent, or the text is malformed. */
bool json_text_member(const char *text, size_t len, const char *key, const char **val,
                      size_t *val_len);

/* A malloc'd, NUL-terminated copy of the JSON text[0..len) without white
 * space outside strings (strings, escapes included, are copied byte for
 * byte); its length in *out_len if not NULL.  NULL when a string is left
 * open. */
char *json_text_compact(const char *text, size_t len, size_t *out_len);

/* json_loadb() of the object in text[0..len), except the top-level members
 * named in `skip` (NULL-terminated; NULL: none): each one found is put
 * back as null for jansson and deleted from the result, so that jansson
 * never reads a value its caller takes from the text.  A member that
 * cannot be found (malformed text, a key spelled with escapes) is parsed
 * as usual.  Flags and error as json_loadb(). */
json_t *json_text_parse_except(const char *text, size_t len, const char *const *skip, size_t flags,
                               json_error_t *error);

#endif

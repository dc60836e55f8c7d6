/* SPDX-License-Identifier: ISC */
/*
 * json_text.c: find a top-level member in JSON text and compact it (see
 * json_text.h).  A scanner, not a parser: it knows strings (so that a
 * brace or a space inside one is not structure) and nesting, and nothing
 * about what values mean.
 */
#include "json_text.h"
#include "text.h"

#include <stdlib.h>
#include <string.h>

/* The deepest nesting skipped; deeper text is "malformed" (jansson's own
 * limit is 2048). */
#define JSON_TEXT_MAX_DEPTH 2048
/* Members json_text_parse_except() leaves out; more are parsed. */
#define JSON_TEXT_MAX_SKIP 8

static bool is_space(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static size_t skip_space(const char *s, size_t len, size_t i)
{
	while (i < len && is_space(s[i]))
		i++;
	return i;
}

/* s[i] is '"': the index just past the closing quote, or len + 1 when the
 * string does not close. */
static size_t skip_string(const char *s, size_t len, size_t i)
{
	for (i++; i < len; i++) {
		if (s[i] == '\\')
			i++;
		else if (s[i] == '"')
			return i + 1;
	}
	return len + 1;
}

/* One value starting at s[i] (no leading space): the index just past it,
 * or len + 1 when it is malformed or does not end. */
static size_t skip_value(const char *s, size_t len, size_t i)
{
	size_t depth = 0;

	if (i >= len)
		return len + 1;
	if (s[i] != '{' && s[i] != '[') {
		if (s[i] == '"')
			return skip_string(s, len, i);
		/* number, true, false, null: up to the next delimiter */
		while (i < len && !is_space(s[i]) && s[i] != ',' && s[i] != '}' && s[i] != ']' &&
		       s[i] != ':' && s[i] != '"')
			i++;
		return i;
	}
	while (i < len) {
		switch (s[i]) {
		case '"':
			i = skip_string(s, len, i);
			continue;
		case '{':
		case '[':
			if (++depth > JSON_TEXT_MAX_DEPTH)
				return len + 1;
			break;
		case '}':
		case ']':
			if (--depth == 0)
				return i + 1;
			break;
		default:
			break;
		}
		i++;
	}
	return len + 1;
}

bool json_text_member(const char *text, size_t len, const char *key, const char **val,
                      size_t *val_len)
{
	size_t klen = strlen(key), i = skip_space(text, len, 0);
	bool found = false;

	/* A key that needs escaping in JSON could match a different key as
	 * written: only plain keys are looked up. */
	if (i >= len || text[i] != '{' || strpbrk(key, "\\\"") != NULL)
		return false;
	i = skip_space(text, len, i + 1);
	if (i < len && text[i] == '}')
		return false;
	while (i < len) {
		size_t k0, k1, v0, v1;

		if (text[i] != '"')
			return false;
		k0 = i + 1;
		i = skip_string(text, len, i);
		if (i > len)
			return false;
		k1 = i - 1;   /* the closing quote */
		i = skip_space(text, len, i);
		if (i >= len || text[i] != ':')
			return false;
		v0 = skip_space(text, len, i + 1);
		v1 = skip_value(text, len, v0);
		if (v1 > len || v1 == v0)
			return false;
		if (k1 - k0 == klen && memcmp(text + k0, key, klen) == 0) {
			*val = text + v0;
			*val_len = v1 - v0;
			found = true;   /* keep going: a later duplicate wins */
		}
		i = skip_space(text, len, v1);
		if (i >= len)
			return false;
		if (text[i] == '}')
			return found;
		if (text[i] != ',')
			return false;
		i = skip_space(text, len, i + 1);
	}
	return false;
}

char *json_text_compact(const char *text, size_t len, size_t *out_len)
{
	char *out = text_alloc(len + 1);
	size_t n = 0;

	for (size_t i = 0; i < len;) {
		if (text[i] == '"') {
			size_t end = skip_string(text, len, i);

			if (end > len) {
				free(out);
				return NULL;
			}
			memcpy(out + n, text + i, end - i);
			n += end - i;
			i = end;
		} else {
			if (!is_space(text[i]))
				out[n++] = text[i];
			i++;
		}
	}
	out[n] = '\0';
	if (out_len)
		*out_len = n;
	return out;
}

json_t *json_text_parse_except(const char *text, size_t len, const char *const *skip, size_t flags,
                               json_error_t *error)
{
	char *copy = NULL;
	const char *cur = text;
	size_t cur_len = len;
	bool spliced[JSON_TEXT_MAX_SKIP] = { false };
	json_t *parsed;

	for (size_t i = 0; skip && i < JSON_TEXT_MAX_SKIP && skip[i]; i++) {
		const char *v;
		size_t n, at;
		char *next;

		if (!json_text_member(cur, cur_len, skip[i], &v, &n))
			continue;
		at = (size_t)(v - cur);
		next = text_alloc(cur_len - n + 4);
		memcpy(next, cur, at);
		memcpy(next + at, "null", 4);
		memcpy(next + at + 4, cur + at + n, cur_len - at - n);
		cur_len = cur_len - n + 4;
		free(copy);
		copy = next;
		cur = next;
		spliced[i] = true;
	}
	parsed = json_loadb(cur, cur_len, flags, error);
	free(copy);
	for (size_t i = 0; parsed && skip && i < JSON_TEXT_MAX_SKIP && skip[i]; i++)
		if (spliced[i])
			json_object_del(parsed, skip[i]);
	return parsed;
}

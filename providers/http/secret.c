/* SPDX-License-Identifier: ISC */
/*
 * secret.c: payload header values that name a secret instead of carrying
 * it ({"secret": NAME, "prefix": "Bearer "}).  Only a secret the operator
 * declared ([provider.http] secrets: NAME=PREFIX ...) may be named, and
 * only for a target under one of its URL prefixes; its value is the first
 * line of secrets_dir/NAME (no default directory), read when the request
 * is built and wiped once written into it.  The payload, its hash, the
 * attempts and the logs only ever hold the name; no message here quotes a
 * secret's value or shows the directory (producers read last_error).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "http/http.h"
#include "text.h"

bool http_secret_name_ok(const char *name)
{
	size_t n = strlen(name);

	/* No '/', and no leading '.': neither "..", nor a hidden file. */
	if (n == 0 || n > HTTP_SECRET_NAME_MAX || name[0] == '.')
		return false;
	for (const char *c = name; *c; c++)
		if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
		      *c == '_' || *c == '-' || *c == '.'))
			return false;
	return true;
}

static char *trim(char *s)
{
	char *end;

	while (*s == ' ' || *s == '\t')
		s++;
	end = s + strlen(s);
	while (end > s && (end[-1] == ' ' || end[-1] == '\t'))
		*--end = '\0';
	return s;
}

void http_secrets_free(struct http_provider *hp)
{
	for (int i = 0; i < hp->n_secrets; i++) {
		for (int j = 0; j < hp->secrets[i].n_to; j++)
			url_prefix_free(&hp->secrets[i].to[j]);
		free(hp->secrets[i].to);
		free(hp->secrets[i].name);
	}
	free(hp->secrets);
	hp->secrets = NULL;
	hp->n_secrets = 0;
}

/* One "NAME=PREFIX PREFIX" declaration (text cut out of the key). */
static bool parse_decl(struct http_provider *hp, char *decl, char *err, size_t errlen)
{
	char *eq = strchr(decl, '='), *save = NULL, *tok;
	struct http_secret_decl *d;

	if (eq == NULL) {
		snprintf(err, errlen, "\"%.64s\": each declaration is NAME=URL-PREFIX [URL-PREFIX...]",
		         decl);
		return false;
	}
	*eq = '\0';
	decl = trim(decl);
	if (!http_secret_name_ok(decl)) {
		snprintf(err, errlen, "\"%.64s\": a secret's name is a plain file name (letters, digits, "
		         "'_', '-', '.', not starting with '.')", decl);
		return false;
	}
	for (int i = 0; i < hp->n_secrets; i++)
		if (strcmp(hp->secrets[i].name, decl) == 0) {
			snprintf(err, errlen, "secret %s is declared twice", decl);
			return false;
		}
	hp->secrets = text_realloc(hp->secrets, (size_t)(hp->n_secrets + 1) * sizeof(*hp->secrets));
	d = &hp->secrets[hp->n_secrets++];
	memset(d, 0, sizeof(*d));
	d->name = text_strdup(decl);
	for (tok = strtok_r(eq + 1, " \t,", &save); tok; tok = strtok_r(NULL, " \t,", &save)) {
		char why[256];

		if (strstr(tok, "://") == NULL) {
			snprintf(err, errlen, "secret %s: \"%.64s\" is not a URL prefix "
			         "(https://host[:port]/path)", d->name, tok);
			return false;
		}
		d->to = text_realloc(d->to, (size_t)(d->n_to + 1) * sizeof(*d->to));
		if (!url_prefix_parse(tok, &d->to[d->n_to], why, sizeof(why))) {
			snprintf(err, errlen, "secret %s: %s", d->name, why);
			return false;
		}
		d->n_to++;
	}
	if (d->n_to == 0) {
		snprintf(err, errlen, "secret %s: no URL prefix it may be sent to", d->name);
		return false;
	}
	return true;
}

bool http_secrets_parse(struct http_provider *hp, const char *spec, char *err, size_t errlen)
{
	char *copy = text_strdup(spec), *save = NULL;
	bool ok = true;

	for (char *decl = strtok_r(copy, ";", &save); decl && ok; decl = strtok_r(NULL, ";", &save))
		if (trim(decl)[0] != '\0')
			ok = parse_decl(hp, decl, err, errlen);
	free(copy);
	if (!ok)
		http_secrets_free(hp);
	return ok;
}

/* Whether the secret may go to this target: declared, and the target under
 * one of its prefixes (the lookup's matching, url.c). */
static bool secret_allowed(const struct http_provider *hp, const char *name, const char *target,
                           char *err, size_t errlen)
{
	const struct http_secret_decl *d = NULL;
	struct url_parts t;
	char why[256], *path = NULL;
	bool ok = false;

	for (int i = 0; i < hp->n_secrets && d == NULL; i++)
		if (strcmp(hp->secrets[i].name, name) == 0)
			d = &hp->secrets[i];
	if (d == NULL) {
		snprintf(err, errlen, "secret %s is not declared ([provider.http] secrets)", name);
		return false;
	}
	if (!url_split(target, &t, &path, why, sizeof(why))) {
		snprintf(err, errlen, "secret %s: %s", name, why);
		return false;
	}
	if (url_path_ambiguous(path) != NULL) {
		snprintf(err, errlen, "secret %s: %s", name, url_path_ambiguous(path));
	} else {
		for (int i = 0; i < d->n_to && !ok; i++)
			ok = url_prefix_matches(&d->to[i], &t, path);
		if (!ok)
			snprintf(err, errlen, "secret %s may not be sent to this target (not under its "
			         "URL prefixes in [provider.http] secrets)", name);
	}
	free(path);
	return ok;
}

bool http_secret_read(const struct http_provider *hp, const char *name, const char *target,
                      char *out, size_t outlen, char *err, size_t errlen)
{
	char path[4096 + HTTP_SECRET_NAME_MAX + 2];
	struct stat st;
	ssize_t got;
	size_t len;
	int fd;

	if (!http_secret_name_ok(name)) {
		snprintf(err, errlen, "secret name \"%.64s\" is not a plain file name (letters, digits, "
		         "'_', '-', '.', not starting with '.')", name);
		return false;
	}
	if (!secret_allowed(hp, name, target, err, errlen))
		return false;
	if (hp->secrets_dir == NULL) {
		snprintf(err, errlen, "secret %s is not available", name);
		return false;
	}
	snprintf(path, sizeof(path), "%s/%s", hp->secrets_dir, name);
	/* Not through a symlink; a FIFO neither blocks the open nor is read. */
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_size > (off_t)outlen) {
		/* One message for every cause: last_error tells producers nothing
		 * about the directory (missing, unreadable, not a file). */
		if (fd >= 0)
			close(fd);
		snprintf(err, errlen, "secret %s is not available", name);
		return false;
	}
	got = read(fd, out, outlen - 1);
	close(fd);
	if (got < 0) {
		snprintf(err, errlen, "secret %s is not available", name);
		return false;
	}
	out[got] = '\0';
	len = strcspn(out, "\r\n");
	if (len == (size_t)got && (size_t)got == outlen - 1) {
		explicit_bzero(out, outlen);
		snprintf(err, errlen, "secret %s is longer than %zu bytes", name, outlen - 2);
		return false;
	}
	out[len] = '\0';
	explicit_bzero(out + len, outlen - len);
	for (size_t i = 0; i < len; i++)
		if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f) {
			explicit_bzero(out, outlen);
			snprintf(err, errlen, "secret %s contains control characters", name);
			return false;
		}
	if (len == 0) {
		snprintf(err, errlen, "secret %s is empty", name);
		return false;
	}
	return true;
}

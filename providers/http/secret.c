/* SPDX-License-Identifier: ISC */
/*
 * secret.c: payload header values that name a secret instead of carrying
 * it ({"secret": NAME, "prefix": "Bearer "}): the name is a plain file
 * name in the worker's secrets directory (secrets_dir, by default
 * $CREDENTIALS_DIRECTORY), read when the request is built and wiped once
 * written into it.  The payload, its hash, the attempts and the logs only
 * ever hold the name; no message here quotes a secret's value.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "http/http.h"

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

bool http_secret_read(const struct http_provider *hp, const char *name, char *out, size_t outlen,
                      char *err, size_t errlen)
{
	char path[4096 + HTTP_SECRET_NAME_MAX + 2];
	ssize_t got;
	size_t len;
	int fd;

	if (!http_secret_name_ok(name)) {
		snprintf(err, errlen, "secret name \"%.64s\" is not a plain file name (letters, digits, "
		         "'_', '-', '.', not starting with '.')", name);
		return false;
	}
	if (hp->secrets_dir == NULL) {
		snprintf(err, errlen, "secret \"%s\": no secrets directory (set [provider.http] "
		         "secrets_dir, or run the worker with CREDENTIALS_DIRECTORY)", name);
		return false;
	}
	snprintf(path, sizeof(path), "%s/%s", hp->secrets_dir, name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		snprintf(err, errlen, "secret \"%s\" is not in the credentials directory (%s: %s)", name,
		         hp->secrets_dir, strerror(errno));
		return false;
	}
	got = read(fd, out, outlen - 1);
	close(fd);
	if (got < 0) {
		snprintf(err, errlen, "secret \"%s\": cannot read it: %s", name, strerror(errno));
		return false;
	}
	out[got] = '\0';
	len = strcspn(out, "\r\n");
	if (len == (size_t)got && (size_t)got == outlen - 1) {
		memset(out, 0, outlen);
		snprintf(err, errlen, "secret \"%s\" is longer than %zu bytes", name, outlen - 2);
		return false;
	}
	out[len] = '\0';
	memset(out + len, 0, outlen - len);
	for (size_t i = 0; i < len; i++)
		if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f) {
			memset(out, 0, outlen);
			snprintf(err, errlen, "secret \"%s\" contains control characters", name);
			return false;
		}
	if (len == 0) {
		snprintf(err, errlen, "secret \"%s\" is empty", name);
		return false;
	}
	return true;
}

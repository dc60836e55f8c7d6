/* SPDX-License-Identifier: ISC */
/*
 * url.h: the one parser of http(s) URLs the providers use (libcurl's URL
 * API): a send's target, the lookup's reconcile_targets entries and the
 * lookup URL are all split here, so what is matched, checked by the SSRF
 * rules and connected to is the same host.
 *
 * Matching is on the parsed, normalised parts: scheme and host in lower
 * case (IPv6 without brackets), the port with the scheme's default filled
 * in, the path with dot segments removed; user-info is never part of the
 * origin.
 */
#ifndef OUTBOX_URL_H
#define OUTBOX_URL_H

#include <stdbool.h>
#include <stddef.h>

struct url_parts {
	char scheme[8];            /* "http" or "https" */
	char host[256];            /* lower case; IPv6 without brackets */
	long port;                 /* the scheme's default when not written */
	bool has_userinfo;         /* user or password present */
	bool has_query;            /* a query or a fragment present */
};

/* url into *u: http or https only, a plain-ASCII host without a trailing
 * dot.  path (may be NULL): the normalised path ("/" at least), malloc'd,
 * the caller frees it.  False with err naming what is wrong. */
bool url_split(const char *url, struct url_parts *u, char **path, char *err, size_t errlen);

/* "scheme://host" with ":port" when it is not the scheme's default, IPv6
 * in brackets; never user-info, path or query.  False when out is too
 * small. */
bool url_origin(const struct url_parts *u, char *out, size_t len);

/* One reconcile_targets entry: a URL prefix (scheme, host, port and a path
 * prefix) or a host name alone, which means https on port 443 of that host,
 * any path. */
struct url_prefix {
	struct url_parts at;
	char *path;                /* "/" matches every path */
};

/* False with err: not a URL without user-info, query or fragment, nor a
 * host name or address. */
bool url_prefix_parse(const char *entry, struct url_prefix *p, char *err, size_t errlen);
void url_prefix_free(struct url_prefix *p);

/* Why a path cannot be matched against a path prefix, or NULL: it holds
 * '\\' or a percent-encoded '.', '/' or '\\' (any case), which libcurl
 * leaves as written but servers may decode and route elsewhere ("/crm/
 * %2e%2e/admin" is under "/crm/" as written, and not as routed). */
const char *url_path_ambiguous(const char *path);

/* The target's parsed parts and path are under the prefix: same scheme,
 * host and port, and the path equals the prefix's or continues it after a
 * '/' (a prefix "/api" covers "/api" and "/api/x", never "/apix"); never
 * a path url_path_ambiguous() refuses. */
bool url_prefix_matches(const struct url_prefix *p, const struct url_parts *t, const char *path);

#endif

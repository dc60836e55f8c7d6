/* SPDX-License-Identifier: ISC */
/*
 * curl_io.h: what the providers' libcurl transfers share: the socket
 * callback that applies the SSRF rules to the very address libcurl is
 * about to connect to, a response body kept up to a bound, and the value
 * of a named response header.  One copy for http's sends, its lookups
 * (http_lookup.c) and crm.
 */
#ifndef OUTBOX_CURL_IO_H
#define OUTBOX_CURL_IO_H

#include <curl/curl.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>

struct netrules;

/* CURLOPT_OPENSOCKETFUNCTION with CURLOPT_OPENSOCKETDATA = a curl_guard:
 * an address the rules refuse is not connected to (refused is set and the
 * address written down), unless host_listed (allow_hosts names the host:
 * all its addresses pass). */
struct curl_guard {
	const struct netrules *rules;
	bool host_listed;
	bool refused;
	char refused_addr[INET6_ADDRSTRLEN];
};
curl_socket_t curl_guard_open_socket(void *guard, curlsocktype purpose, struct curl_sockaddr *a);

/* CURLOPT_WRITEFUNCTION with CURLOPT_WRITEDATA = a curl_body: the first
 * max bytes are kept, NUL-terminated.  Past max, the rest is dropped
 * (truncated is set) or, with fail_past_max, the transfer fails. */
struct curl_body {
	char *data;                /* NULL until the first byte */
	size_t len;
	size_t max;
	bool fail_past_max;
	bool truncated;
};
size_t curl_body_write(char *ptr, size_t size, size_t nmemb, void *body);
void curl_body_free(struct curl_body *b);

/* For a header line (as CURLOPT_HEADERFUNCTION gets it) "Name: value" whose
 * name is `name` (any case): *out = the value, trimmed, at most
 * OUTBOX_PROVIDER_ID_MAX - 1 bytes, replacing an earlier one; true.  False
 * for any other line. */
bool curl_header_take(const char *line, size_t n, const char *name, char **out);

/* What every transfer a provider makes has, in one place (curl_loop_add()
 * applies it to every handle, after the caller's own options):
 *   - only the given protocols, for the request and any redirect;
 *   - no redirects (a redirect would reach an address never checked);
 *   - TLS peer and host verified, against ca_file when set (NULL or empty:
 *     the system's CAs);
 *   - the configured proxy, or none: NULL or empty ignores http_proxy,
 *     https_proxy, ALL_PROXY and the rest of the environment (a proxy
 *     would receive Authorization headers and tokens);
 *   - no .netrc, no signals. */
struct curl_safety {
	const char *protocols;     /* "http,https", "https" */
	const char *ca_file;
	const char *proxy;
};
void curl_io_safe_options(CURL *easy, const struct curl_safety *s);

/* Retry-After delta-seconds as milliseconds, clamped to [0, max_ms]
 * (the header is the peer's: 9223372036854776 s must not overflow). */
long curl_io_retry_after_ms(long long secs, long max_ms);

/* Sets the callbacks on easy: the guard's socket check (guard NULL: none,
 * for a server the configuration names), the body, and header_fn called
 * with header_arg for each response header line. */
void curl_io_attach(CURL *easy, struct curl_guard *guard, struct curl_body *body,
                    curl_write_callback header_fn, void *header_arg);

#endif

/* SPDX-License-Identifier: ISC */
/*
 * curl_io.c: the safety options, the SSRF-checked socket, the bounded
 * response body and the header value that every provider's libcurl
 * transfer uses (curl_io.h).
 */
#include "lib/curl_io.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "lib/netrules.h"
#include "text.h"
#include "provider.h"

curl_socket_t curl_guard_open_socket(void *guard, curlsocktype purpose, struct curl_sockaddr *a)
{
	struct curl_guard *g = guard;
	curl_socket_t fd;

	(void)purpose;
	if (!g->host_listed && !netrules_addr_allowed(g->rules, &a->addr)) {
		g->refused = true;
		netrules_format_addr(&a->addr, g->refused_addr, sizeof(g->refused_addr));
		return CURL_SOCKET_BAD;
	}
	fd = socket(a->family, a->socktype, a->protocol);
	return fd < 0 ? CURL_SOCKET_BAD : fd;
}

size_t curl_body_write(char *ptr, size_t size, size_t nmemb, void *body)
{
	struct curl_body *b = body;
	size_t n = size * nmemb, keep = n;

	if (b->len + n > b->max) {
		if (b->fail_past_max)
			return 0;
		b->truncated = true;
		keep = b->max - b->len;
		if (keep == 0)
			return n;
	}
	b->data = text_realloc(b->data, b->len + keep + 1);
	memcpy(b->data + b->len, ptr, keep);
	b->len += keep;
	b->data[b->len] = '\0';
	return n;
}

void curl_body_free(struct curl_body *b)
{
	free(b->data);
	b->data = NULL;
	b->len = 0;
}

bool curl_header_take(const char *line, size_t n, const char *name, char **out)
{
	size_t namelen = strlen(name), len;
	const char *v, *end = line + n;
	char *copy;

	if (namelen == 0 || n <= namelen || line[namelen] != ':' ||
	    strncasecmp(line, name, namelen) != 0)
		return false;
	v = line + namelen + 1;
	while (v < end && (*v == ' ' || *v == '\t'))
		v++;
	while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
		end--;
	len = (size_t)(end - v);
	if (len > OUTBOX_PROVIDER_ID_MAX - 1)
		len = OUTBOX_PROVIDER_ID_MAX - 1;
	copy = text_strndup(v, len);
	free(*out);
	*out = copy;
	return true;
}

void curl_io_safe_options(CURL *easy, const struct curl_safety *s)
{
	curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, s->protocols);
	curl_easy_setopt(easy, CURLOPT_REDIR_PROTOCOLS_STR, s->protocols);
	curl_easy_setopt(easy, CURLOPT_FOLLOWLOCATION, 0L);
	curl_easy_setopt(easy, CURLOPT_SSL_VERIFYPEER, 1L);
	curl_easy_setopt(easy, CURLOPT_SSL_VERIFYHOST, 2L);
	if (s->ca_file && s->ca_file[0])
		curl_easy_setopt(easy, CURLOPT_CAINFO, s->ca_file);
	/* "" (not NULL): libcurl then reads no proxy variable either. */
	curl_easy_setopt(easy, CURLOPT_PROXY, s->proxy ? s->proxy : "");
	curl_easy_setopt(easy, CURLOPT_NETRC, (long)CURL_NETRC_IGNORED);
	curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
}

long curl_io_retry_after_ms(long long secs, long max_ms)
{
	if (secs <= 0)
		return 0;
	if (secs > max_ms / 1000)
		return max_ms;
	return (long)secs * 1000;
}

void curl_io_attach(CURL *easy, struct curl_guard *guard, struct curl_body *body,
                    curl_write_callback header_fn, void *header_arg)
{
	if (guard != NULL) {
		curl_easy_setopt(easy, CURLOPT_OPENSOCKETFUNCTION, curl_guard_open_socket);
		curl_easy_setopt(easy, CURLOPT_OPENSOCKETDATA, guard);
	}
	curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, curl_body_write);
	curl_easy_setopt(easy, CURLOPT_WRITEDATA, body);
	curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, header_fn);
	curl_easy_setopt(easy, CURLOPT_HEADERDATA, header_arg);
}

/* SPDX-License-Identifier: ISC */
/*
 * hosts.c: per-host concurrency and circuit breaker (see hosts.h).  The
 * questions (host_may_send(), host_probe_due()) change nothing; the
 * breaker moves only in host_half_open(), host_send_started() and
 * host_send_done().
 */
#include "hosts.h"

#include <stdlib.h>
#include <string.h>

#include "hostname.h"
#include "util.h"

#define HOSTS_BUCKETS 256

struct hosts {
	struct host_state *bucket[HOSTS_BUCKETS];
	size_t count;
};

struct hosts *hosts_new(void)
{
	return text_alloc(sizeof(struct hosts));
}

void hosts_free(struct hosts *h)
{
	if (h == NULL)
		return;
	for (int i = 0; i < HOSTS_BUCKETS; i++) {
		struct host_state *hs = h->bucket[i], *next;
		for (; hs; hs = next) {
			next = hs->next;
			free(hs->key);
			free(hs);
		}
	}
	free(h);
}

static unsigned hash_key(const char *s)
{
	unsigned v = 2166136261u;

	for (; *s; s++)
		v = (v ^ (unsigned char)*s) * 16777619u;
	return v;
}

void hosts_summary(const struct hosts *h, int *busiest, int *breakers_open)
{
	*busiest = 0;
	*breakers_open = 0;
	for (int i = 0; i < HOSTS_BUCKETS; i++)
		for (const struct host_state *hs = h->bucket[i]; hs; hs = hs->next) {
			if (hs->in_flight > *busiest)
				*busiest = hs->in_flight;
			*breakers_open += hs->breaker != BREAKER_CLOSED;
		}
}

struct host_state *hosts_get(struct hosts *h, const char *key)
{
	unsigned b = hash_key(key) % HOSTS_BUCKETS;
	struct host_state *hs;

	for (hs = h->bucket[b]; hs; hs = hs->next)
		if (strcmp(hs->key, key) == 0) {
			hs->users++;
			return hs;
		}
	hs = text_alloc(sizeof(*hs));
	hs->key = text_strdup(key);
	hs->next = h->bucket[b];
	h->bucket[b] = hs;
	h->count++;
	hs->users++;
	return hs;
}

static bool remembers_nothing(const struct host_state *hs)
{
	return hs->users == 0 && hs->in_flight == 0 && hs->failures == 0 &&
	       hs->breaker == BREAKER_CLOSED && !hs->probe_in_flight;
}

void hosts_release(struct hosts *h, struct host_state *hs)
{
	struct host_state **p;

	if (hs == NULL)
		return;
	if (hs->users > 0)
		hs->users--;
	if (!remembers_nothing(hs))
		return;
	for (p = &h->bucket[hash_key(hs->key) % HOSTS_BUCKETS]; *p; p = &(*p)->next)
		if (*p == hs) {
			*p = hs->next;
			h->count--;
			free(hs->key);
			free(hs);
			return;
		}
}

size_t hosts_count(const struct hosts *h)
{
	return h->count;
}

bool host_probe_due(const struct host_state *hs, int64_t now_ms)
{
	return hs->breaker == BREAKER_OPEN && now_ms >= hs->open_until_ms;
}

void host_half_open(struct host_state *hs)
{
	hs->breaker = BREAKER_HALF_OPEN;
	hs->probe_in_flight = false;
}

bool host_may_send(const struct host_state *hs, int max_per_host, int64_t now_ms,
                   int64_t *retry_in_ms)
{
	*retry_in_ms = 0;
	switch (hs->breaker) {
	case BREAKER_OPEN:
		if (now_ms < hs->open_until_ms) {
			*retry_in_ms = hs->open_until_ms - now_ms;
			return false;
		}
		/* Its time is up: as half-open with no probe out (the caller
		 * makes it so, host_half_open()). */
		return hs->in_flight < max_per_host;
	case BREAKER_HALF_OPEN:
		if (hs->probe_in_flight) {
			*retry_in_ms = 100;
			return false;
		}
		return hs->in_flight < max_per_host;
	case BREAKER_CLOSED:
		return hs->in_flight < max_per_host;
	}
	return false;
}

void host_send_started(struct host_state *hs)
{
	hs->in_flight++;
	if (hs->breaker == BREAKER_HALF_OPEN)
		hs->probe_in_flight = true;
}

static bool is_host_failure(const struct outbox_result *r)
{
	switch (r->outcome) {
	case OUTCOME_NOT_SENT:
	case OUTCOME_AMBIGUOUS:
		return true;
	case OUTCOME_RETRY:
		/* 401: the credentials are refused for every effect to this host,
		 * 421: the SMTP relay is shutting the service down;
		 * let the breaker hold them instead of spending their attempts. */
		return r->status == 0 || r->status == 401 || r->status == 421 || r->status == 429 ||
		       r->status >= 500;
	case OUTCOME_ACCEPTED:
	case OUTCOME_TERMINAL:
		return false;
	}
	return false;
}

/* The wait before the next probe: BREAKER_FIRST_PROBE_MS after the breaker
 * opens, doubled by each failed probe, never above open_ms. */
static int64_t next_probe_wait(int64_t last_ms, int64_t open_ms)
{
	int64_t next = last_ms > 0 ? last_ms * 2 : BREAKER_FIRST_PROBE_MS;

	return next < open_ms ? next : open_ms;
}

bool host_send_done(struct host_state *hs, const struct outbox_result *r, int failures_to_open,
                    int64_t open_ms, int64_t now_ms)
{
	bool failed = is_host_failure(r);

	if (hs->in_flight > 0)
		hs->in_flight--;
	if (!failed) {
		hs->failures = 0;
		hs->breaker = BREAKER_CLOSED;
		hs->probe_in_flight = false;
		hs->probe_wait_ms = 0;
		return false;
	}
	hs->failures++;
	if (hs->breaker == BREAKER_HALF_OPEN ||
	    (hs->breaker == BREAKER_CLOSED && hs->failures >= failures_to_open)) {
		bool opened = hs->breaker == BREAKER_CLOSED;
		hs->probe_wait_ms = next_probe_wait(opened ? 0 : hs->probe_wait_ms, open_ms);
		hs->breaker = BREAKER_OPEN;
		hs->open_until_ms = now_ms + hs->probe_wait_ms;
		hs->probe_in_flight = false;
		return opened;
	}
	return false;
}

void host_key_host(const char *key, char *out, size_t len)
{
	const char *scheme = strstr(key, "://"), *start = scheme ? scheme + 3 : key, *end;
	const char *colon = strrchr(start, ':');
	char raw[256];
	size_t n;

	if (*start == '[') {
		start++;
		end = strchr(start, ']');
		if (end == NULL)
			end = start + strlen(start);
	} else if (scheme) {
		/* The http provider's "scheme://host:port": the port is always
		 * there, after the last colon (an IPv6 host is written bare). */
		end = colon ? colon : start + strlen(start);
	} else {
		/* "host:port": a port follows the last colon, unless the colons
		 * are an address's own (a bare IPv6 address has more than one). */
		end = colon && strchr(start, ':') == colon ? colon : start + strlen(start);
	}
	n = (size_t)(end - start);
	if (len == 0)
		return;
	if (n >= sizeof(raw))
		n = sizeof(raw) - 1;
	memcpy(raw, start, n);
	raw[n] = '\0';
	/* The one spelling scopes are stored in: "::ffff:127.0.0.2",
	 * "0x7f.0.0.2" and "127.2" all connect to 127.0.0.2. */
	host_canon(raw, out, len);
}

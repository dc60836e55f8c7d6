/* SPDX-License-Identifier: ISC */
/*
 * hosts.h: per-destination bookkeeping: sends in flight per host (for
 * max_per_host) and a circuit breaker, so a dead endpoint is not
 * hammered: its effects wait and spend no attempt.
 *
 * Breaker: closed → open after `failures` consecutive failures (not sent,
 * ambiguous, 5xx/429 retries); open → half-open after the probe wait,
 * letting one probe through; the probe's success closes it, its failure
 * re-opens it with the wait doubled.  The first wait is
 * BREAKER_FIRST_PROBE_MS, doubling up to open_ms (breaker_open_ms): an
 * endpoint back after a short outage is found within seconds, one down
 * for long is probed once per open_ms.
 */
#ifndef OUTBOX_HOSTS_H
#define OUTBOX_HOSTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "provider.h"

enum breaker_state { BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN };

#define BREAKER_FIRST_PROBE_MS 1000

struct host_state {
	struct host_state *next;
	char *key;
	int in_flight;
	int failures;
	enum breaker_state breaker;
	int64_t open_until_ms;     /* monotonic: the next probe may go then */
	int64_t probe_wait_ms;     /* the wait that set open_until_ms (doubles per failed probe) */
	bool probe_in_flight;
	int users;                 /* effects holding it (hosts_get .. hosts_release) */
};

struct hosts;

struct hosts *hosts_new(void);
void hosts_free(struct hosts *h);
/* The host's state, made on first use; the caller holds it until
 * hosts_release().  A state no effect holds and that remembers nothing (no
 * send in flight, breaker closed, no failure counted) is freed then: the
 * table holds the hosts in use and those with a breaker story, not every
 * host ever seen. */
struct host_state *hosts_get(struct hosts *h, const char *key);
void hosts_release(struct hosts *h, struct host_state *hs);
/* Hosts in the table. */
size_t hosts_count(const struct hosts *h);

/* May a send to this host start now?  False with *retry_in_ms > 0 when the
 * breaker is open (wait that long), or == 0 when only the concurrency
 * limit is in the way (wait for a slot).  An open breaker whose wait is
 * over answers as half-open with no probe out: changing nothing, the
 * question leaves that move to the caller (host_probe_due(),
 * host_half_open()). */
bool host_may_send(const struct host_state *hs, int max_per_host, int64_t now_ms,
                   int64_t *retry_in_ms);
/* Whether the breaker is open and its wait over: it should half-open. */
bool host_probe_due(const struct host_state *hs, int64_t now_ms);
/* Open → half-open: the next send is its one probe. */
void host_half_open(struct host_state *hs);
void host_send_started(struct host_state *hs);
/* The most sends in flight to any one host, and how many hosts have a
 * breaker open or half-open.  (Walks every host in the table.) */
void hosts_summary(const struct hosts *h, int *busiest, int *breakers_open);
/* Returns true when this outcome opened the breaker (from closed).
 * open_ms caps the wait between probes. */
bool host_send_done(struct host_state *hs, const struct outbox_result *r, int failures_to_open,
                    int64_t open_ms, int64_t now_ms);

/* The host name or address in a provider's host key (validate()'s
 * host_key: "https://api.example.com:443", "https://::1:443",
 * "relay.example.com:587", "[::1]:25"), without scheme, port or brackets,
 * in the one spelling of lib/hostname.h (IPv4 and IPv4-mapped addresses
 * as the dotted quad, IPv6 as RFC 5952, names in lower case without a
 * trailing dot): the host a scope names (docs/design.md, "Scoped pauses
 * and rate limits").  Empty when the key has none. */
void host_key_host(const char *key, char *out, size_t len);

#endif

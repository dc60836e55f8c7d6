/* SPDX-License-Identifier: ISC */
/*
 * test_hosts.c: dispatcher/hosts.c, per-host concurrency and the circuit
 * breaker: closed → open after N consecutive host failures, open waits
 * BREAKER_FIRST_PROBE_MS, then twice as long after each failed probe, up
 * to open_ms; half-open lets exactly one probe through, the probe's
 * success closes (and resets the wait) and its failure re-opens; 4xx
 * answers are not host failures.  Hosts no effect holds and that remember
 * nothing are pruned.  host_may_send() and host_probe_due() change
 * nothing: the caller half-opens (host_half_open()).  The clock is passed
 * in, so no test sleeps.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "hosts.h"
#include "hostname.h"

#define N_FAIL   3
#define OPEN_MS  30000
#define T0       1000000

static struct outbox_result res(enum outbox_outcome o, int status)
{
	struct outbox_result r;

	memset(&r, 0, sizeof(r));
	r.outcome = o;
	r.status = status;
	r.retry_after_ms = -1;
	return r;
}

static const struct outbox_result *ok(void)
{
	static struct outbox_result r;
	r = res(OUTCOME_ACCEPTED, 200);
	return &r;
}

static const struct outbox_result *down(void)
{
	static struct outbox_result r;
	r = res(OUTCOME_NOT_SENT, 0);
	return &r;
}

/* As the dispatcher asks (decide.c's slot_free(), then mark.c or
 * claim.c): the answer, and a breaker whose wait is over moved to
 * half-open by the caller, the question itself changing nothing. */
static bool may_send(struct host_state *hs, int max_per_host, int64_t now, int64_t *wait)
{
	bool due = host_probe_due(hs, now);
	bool yes = host_may_send(hs, max_per_host, now, wait);

	if (due)
		host_half_open(hs);
	return yes;
}

/* One whole send: may_send, started, done.  Returns host_send_done's value. */
static bool send_one(struct host_state *hs, const struct outbox_result *r, int64_t now)
{
	int64_t wait = -1;

	assert_true(may_send(hs, 16, now, &wait));
	assert_int_equal(wait, 0);
	host_send_started(hs);
	return host_send_done(hs, r, N_FAIL, OPEN_MS, now);
}

static int setup(void **state)
{
	*state = hosts_new();
	return *state ? 0 : -1;
}

static int teardown(void **state)
{
	hosts_free(*state);
	return 0;
}

static void test_lookup(void **state)
{
	struct hosts *h = *state;
	struct host_state *a = hosts_get(h, "http|https://a.example:443");
	struct host_state *b = hosts_get(h, "http|https://b.example:443");
	char key[64];

	assert_non_null(a);
	assert_ptr_not_equal(a, b);
	assert_ptr_equal(hosts_get(h, "http|https://a.example:443"), a);
	assert_string_equal(a->key, "http|https://a.example:443");
	assert_int_equal(a->breaker, BREAKER_CLOSED);
	assert_int_equal(a->in_flight, 0);
	/* many hosts (more than the buckets): each found again, state kept */
	for (int i = 0; i < 2000; i++) {
		snprintf(key, sizeof(key), "http|https://h%d.example:443", i);
		hosts_get(h, key)->failures = i;
	}
	for (int i = 0; i < 2000; i++) {
		snprintf(key, sizeof(key), "http|https://h%d.example:443", i);
		assert_int_equal(hosts_get(h, key)->failures, i);
	}
	hosts_free(NULL);
}

static void test_per_host_concurrency(void **state)
{
	struct hosts *h = *state;
	struct host_state *a = hosts_get(h, "a"), *b = hosts_get(h, "b");
	int64_t wait = -1;

	assert_true(may_send(a, 2, T0, &wait));
	host_send_started(a);
	assert_true(may_send(a, 2, T0, &wait));
	host_send_started(a);
	assert_int_equal(a->in_flight, 2);
	/* full: wait for a slot (0), not for the breaker */
	wait = -1;
	assert_false(may_send(a, 2, T0, &wait));
	assert_int_equal(wait, 0);
	/* another host is not affected */
	assert_true(may_send(b, 2, T0, &wait));
	/* a finished send frees a slot, whatever its outcome */
	assert_false(host_send_done(a, down(), N_FAIL, OPEN_MS, T0));
	assert_true(may_send(a, 2, T0, &wait));
	assert_false(host_send_done(a, ok(), N_FAIL, OPEN_MS, T0));
	assert_int_equal(a->in_flight, 0);
	/* never below zero */
	assert_false(host_send_done(a, ok(), N_FAIL, OPEN_MS, T0));
	assert_int_equal(a->in_flight, 0);
}

static void test_opens_after_n_consecutive_failures(void **state)
{
	struct host_state *hs = hosts_get(*state, "dead");
	int64_t wait = -1;

	for (int i = 1; i < N_FAIL; i++) {
		assert_false(send_one(hs, down(), T0));
		assert_int_equal(hs->breaker, BREAKER_CLOSED);
		assert_int_equal(hs->failures, i);
	}
	assert_true(send_one(hs, down(), T0 + 5));          /* the Nth opens it */
	assert_int_equal(hs->breaker, BREAKER_OPEN);
	assert_int_equal(hs->open_until_ms, T0 + 5 + BREAKER_FIRST_PROBE_MS);
	/* open: nothing goes, and the caller learns how long to wait */
	assert_false(may_send(hs, 16, T0 + 5, &wait));
	assert_int_equal(wait, BREAKER_FIRST_PROBE_MS);
	assert_false(may_send(hs, 16, T0 + 5 + BREAKER_FIRST_PROBE_MS - 1, &wait));
	assert_int_equal(wait, 1);
	assert_int_equal(hs->breaker, BREAKER_OPEN);
}

static void test_success_resets_the_count(void **state)
{
	struct host_state *hs = hosts_get(*state, "flaky");

	for (int round = 0; round < 5; round++) {
		for (int i = 1; i < N_FAIL; i++)
			assert_false(send_one(hs, down(), T0));
		assert_false(send_one(hs, ok(), T0));
		assert_int_equal(hs->failures, 0);
		assert_int_equal(hs->breaker, BREAKER_CLOSED);
	}
}

static void open_breaker(struct host_state *hs, int64_t now)
{
	for (int i = 0; i < N_FAIL; i++)
		(void)send_one(hs, down(), now);
	assert_int_equal(hs->breaker, BREAKER_OPEN);
}

static void test_half_open_lets_exactly_one_probe(void **state)
{
	struct host_state *hs = hosts_get(*state, "probe");
	int64_t wait = -1, t = T0 + OPEN_MS;

	open_breaker(hs, T0);
	/* open_ms later: half-open, one probe may go even with room for 16 */
	assert_true(may_send(hs, 16, t, &wait));
	assert_int_equal(hs->breaker, BREAKER_HALF_OPEN);
	host_send_started(hs);
	assert_true(hs->probe_in_flight);
	for (int i = 0; i < 10; i++) {
		wait = 0;
		assert_false(may_send(hs, 16, t + i * 1000, &wait));
		assert_true(wait > 0);                          /* wait, don't spend attempts */
	}
	assert_int_equal(hs->in_flight, 1);
}

/* The questions change nothing: an open breaker whose wait is over answers
 * as half-open with no probe out and stays open until host_half_open(). */
static void test_questions_change_nothing(void **state)
{
	struct host_state *hs = hosts_get(*state, "pure");
	int64_t wait = -1, t = T0 + OPEN_MS;

	open_breaker(hs, T0);
	assert_false(host_probe_due(hs, hs->open_until_ms - 1));
	assert_false(host_may_send(hs, 16, hs->open_until_ms - 1, &wait));
	assert_int_equal(wait, 1);
	for (int i = 0; i < 3; i++) {
		assert_true(host_probe_due(hs, t));
		assert_true(host_may_send(hs, 16, t, &wait));
		assert_int_equal(wait, 0);
		assert_int_equal(hs->breaker, BREAKER_OPEN);
	}
	/* the host's own limit still counts while the probe is due */
	hs->in_flight = 16;
	assert_false(host_may_send(hs, 16, t, &wait));
	assert_int_equal(wait, 0);
	hs->in_flight = 0;
	host_half_open(hs);
	assert_int_equal(hs->breaker, BREAKER_HALF_OPEN);
	assert_false(hs->probe_in_flight);
	assert_false(host_probe_due(hs, t));
	assert_true(host_may_send(hs, 16, t, &wait));
}

static void test_probe_success_closes(void **state)
{
	struct host_state *hs = hosts_get(*state, "recovers");
	int64_t wait = -1, t = T0 + OPEN_MS;

	open_breaker(hs, T0);
	assert_true(may_send(hs, 16, t, &wait));
	host_send_started(hs);
	assert_false(host_send_done(hs, ok(), N_FAIL, OPEN_MS, t + 10));
	assert_int_equal(hs->breaker, BREAKER_CLOSED);
	assert_int_equal(hs->failures, 0);
	assert_false(hs->probe_in_flight);
	/* closed again: full concurrency */
	for (int i = 0; i < 16; i++) {
		assert_true(may_send(hs, 16, t + 10, &wait));
		host_send_started(hs);
	}
	assert_false(may_send(hs, 16, t + 10, &wait));
	assert_int_equal(wait, 0);
}

static void test_probe_failure_reopens(void **state)
{
	struct host_state *hs = hosts_get(*state, "still-dead");
	int64_t wait = -1, t = T0 + OPEN_MS;

	open_breaker(hs, T0);
	assert_true(may_send(hs, 16, t, &wait));
	host_send_started(hs);
	/* one failed probe is enough: no N more failures needed */
	(void)host_send_done(hs, down(), N_FAIL, OPEN_MS, t + 50);
	assert_int_equal(hs->breaker, BREAKER_OPEN);
	assert_int_equal(hs->open_until_ms, t + 50 + 2 * BREAKER_FIRST_PROBE_MS);
	assert_false(hs->probe_in_flight);
	assert_false(may_send(hs, 16, t + 51, &wait));
	assert_int_equal(wait, 2 * BREAKER_FIRST_PROBE_MS - 1);
	/* and the cycle repeats: half-open again after the (doubled) wait */
	assert_true(may_send(hs, 16, t + 50 + 2 * BREAKER_FIRST_PROBE_MS, &wait));
	assert_int_equal(hs->breaker, BREAKER_HALF_OPEN);
}

/* Probe at the earliest moment, fail: the waits are 1, 2, 4, 8, 16 s,
 * then open_ms (30 s) for as long as the host stays down; a probe that
 * succeeds closes the breaker, and the next opening starts at 1 s again. */
static void probe_fails(struct host_state *hs, int64_t *t, int64_t expect_wait)
{
	int64_t wait = -1;

	*t = hs->open_until_ms;
	assert_false(may_send(hs, 16, *t - 1, &wait));
	assert_int_equal(wait, 1);
	assert_true(may_send(hs, 16, *t, &wait));
	assert_int_equal(hs->breaker, BREAKER_HALF_OPEN);
	host_send_started(hs);
	assert_false(host_send_done(hs, down(), N_FAIL, OPEN_MS, *t));   /* not a new opening */
	assert_int_equal(hs->breaker, BREAKER_OPEN);
	assert_int_equal(hs->open_until_ms - *t, expect_wait);
}

static void test_probe_schedule_backs_off_to_open_ms(void **state)
{
	struct host_state *hs = hosts_get(*state, "backoff");
	static const int64_t waits[] = { 2000, 4000, 8000, 16000, OPEN_MS, OPEN_MS, OPEN_MS };
	int64_t wait = -1, t = T0;

	assert_int_equal(BREAKER_FIRST_PROBE_MS, 1000);
	open_breaker(hs, t);
	assert_int_equal(hs->open_until_ms - t, 1000);
	for (size_t i = 0; i < sizeof(waits) / sizeof(waits[0]); i++)
		probe_fails(hs, &t, waits[i]);
	/* back: the next probe succeeds and closes */
	t = hs->open_until_ms;
	assert_true(may_send(hs, 16, t, &wait));
	host_send_started(hs);
	assert_false(host_send_done(hs, ok(), N_FAIL, OPEN_MS, t));
	assert_int_equal(hs->breaker, BREAKER_CLOSED);
	/* down again: the schedule starts over at the first wait */
	for (int i = 0; i < N_FAIL - 1; i++)
		assert_false(send_one(hs, down(), t));
	assert_true(send_one(hs, down(), t));
	assert_int_equal(hs->open_until_ms - t, BREAKER_FIRST_PROBE_MS);
}

/* A breaker_open_ms below the first wait caps it: the breaker never
 * waits longer than configured. */
static void test_short_open_ms_caps_the_first_wait(void **state)
{
	struct host_state *hs = hosts_get(*state, "short");
	int64_t wait = -1;

	for (int i = 0; i < N_FAIL - 1; i++)
		assert_false(host_send_done(hs, down(), N_FAIL, 200, T0));
	assert_true(host_send_done(hs, down(), N_FAIL, 200, T0));
	assert_int_equal(hs->open_until_ms, T0 + 200);
	assert_true(may_send(hs, 16, T0 + 200, &wait));
	host_send_started(hs);
	assert_false(host_send_done(hs, down(), N_FAIL, 200, T0 + 200));
	assert_int_equal(hs->open_until_ms, T0 + 400);
}

static void test_what_counts_as_a_host_failure(void **state)
{
	static const struct {
		enum outbox_outcome o;
		int status;
		bool host_failure;
	} cases[] = {
		{ OUTCOME_NOT_SENT, 0, true },      /* DNS, refused, TLS */
		{ OUTCOME_AMBIGUOUS, 0, true },     /* timeout after sending */
		{ OUTCOME_AMBIGUOUS, 500, true },
		{ OUTCOME_AMBIGUOUS, 502, true },
		{ OUTCOME_AMBIGUOUS, 504, true },
		{ OUTCOME_RETRY, 503, true },
		{ OUTCOME_RETRY, 429, true },
		{ OUTCOME_RETRY, 0, true },         /* SMTP 4xx before DATA has no HTTP status */
		{ OUTCOME_RETRY, 409, false },      /* key in flight: the host is fine */
		{ OUTCOME_RETRY, 401, true },       /* credentials refused (crm token): hold them all */
		{ OUTCOME_TERMINAL, 400, false },
		{ OUTCOME_TERMINAL, 401, false },
		{ OUTCOME_TERMINAL, 404, false },
		{ OUTCOME_TERMINAL, 422, false },
		{ OUTCOME_TERMINAL, 0, false },     /* invalid for the provider */
		{ OUTCOME_ACCEPTED, 200, false },
		{ OUTCOME_ACCEPTED, 202, false },
	};
	char key[32];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct outbox_result r = res(cases[i].o, cases[i].status);
		struct host_state *hs;
		bool opened = false;

		snprintf(key, sizeof(key), "case%zu", i);
		hs = hosts_get(*state, key);
		for (int k = 0; k < 20 && hs->breaker == BREAKER_CLOSED; k++)
			opened |= send_one(hs, &r, T0 + k);
		if (opened != cases[i].host_failure ||
		    (hs->breaker == BREAKER_OPEN) != cases[i].host_failure)
			fail_msg("%d/%d x20: breaker %s, want %s", (int)cases[i].o, cases[i].status,
			         hs->breaker == BREAKER_OPEN ? "open" : "not open",
			         cases[i].host_failure ? "open" : "closed");
	}
}

static void test_4xx_does_not_count_and_resets(void **state)
{
	/* A 404 for one bad URL says the host answers: it does not open the
	 * breaker, and (as a success of the host) resets the count. */
	struct host_state *hs = hosts_get(*state, "mixed");
	struct outbox_result r404 = res(OUTCOME_TERMINAL, 404);

	for (int i = 0; i < 10; i++) {
		assert_false(send_one(hs, &r404, T0));
		assert_int_equal(hs->breaker, BREAKER_CLOSED);
	}
	assert_false(send_one(hs, down(), T0));
	assert_false(send_one(hs, down(), T0));
	assert_false(send_one(hs, &r404, T0));
	assert_int_equal(hs->failures, 0);
	assert_false(send_one(hs, down(), T0));
	assert_int_equal(hs->breaker, BREAKER_CLOSED);
}

static void test_stragglers_while_open(void **state)
{
	/* Sends started before the breaker opened may finish while it is
	 * open: failures keep it open without pushing the deadline, the
	 * in-flight count still drops. */
	struct host_state *hs = hosts_get(*state, "stragglers");
	int64_t wait = -1;

	for (int i = 0; i < 5; i++) {
		assert_true(may_send(hs, 16, T0, &wait));
		host_send_started(hs);
	}
	assert_false(host_send_done(hs, down(), N_FAIL, OPEN_MS, T0));
	assert_false(host_send_done(hs, down(), N_FAIL, OPEN_MS, T0));
	assert_true(host_send_done(hs, down(), N_FAIL, OPEN_MS, T0));
	assert_int_equal(hs->breaker, BREAKER_OPEN);
	assert_false(host_send_done(hs, down(), N_FAIL, OPEN_MS, T0 + 500));
	assert_int_equal(hs->breaker, BREAKER_OPEN);
	assert_int_equal(hs->open_until_ms, T0 + BREAKER_FIRST_PROBE_MS);
	assert_int_equal(hs->in_flight, 1);
	/* half-open with a straggler still in flight: the probe still goes */
	assert_true(may_send(hs, 16, T0 + BREAKER_FIRST_PROBE_MS, &wait));
	host_send_started(hs);
	assert_false(may_send(hs, 16, T0 + BREAKER_FIRST_PROBE_MS, &wait));
	assert_true(wait > 0);
}

/* 20,000 hosts each sent to once: none is kept once its effects are gone,
 * except the ones whose failures the breaker must remember; a host still
 * held by an effect stays whatever its state. */
static void test_idle_hosts_are_pruned(void **state)
{
	struct hosts *h = *state;
	struct host_state *failing, *held;
	char key[64];

	for (int i = 0; i < 20000; i++) {
		struct host_state *hs;

		snprintf(key, sizeof(key), "http|https://h%d.example:443", i);
		hs = hosts_get(h, key);
		send_one(hs, ok(), T0);
		hosts_release(h, hs);
	}
	assert_int_equal(hosts_count(h), 0);

	failing = hosts_get(h, "http|down");
	send_one(failing, down(), T0);
	hosts_release(h, failing);
	held = hosts_get(h, "http|held");
	assert_int_equal(hosts_count(h), 2);
	/* The failure count is kept: the breaker still opens on time. */
	failing = hosts_get(h, "http|down");
	for (int i = 1; i < N_FAIL - 1; i++)
		send_one(failing, down(), T0);
	assert_true(send_one(failing, down(), T0));
	hosts_release(h, failing);
	assert_int_equal(hosts_count(h), 2);
	/* Two effects on one host: kept until the last lets go. */
	assert_ptr_equal(hosts_get(h, "http|held"), held);
	hosts_release(h, held);
	assert_int_equal(hosts_count(h), 2);
	hosts_release(h, held);
	assert_int_equal(hosts_count(h), 1);
}

/* The host a scope names, from each provider's host key. */
static void test_host_key_host(void **state)
{
	static const struct {
		const char *key, *host;
	} cases[] = {
		{ "https://api.example.com:443", "api.example.com" },   /* http */
		{ "http://API.Example.COM:8080", "api.example.com" },
		{ "https://[::1]:8443", "::1" },
		{ "https://::1:443", "::1" },          /* the http provider writes IPv6 bare */
		{ "::1", "::1" },                      /* bare, no port */
		{ "acme.my.salesforce.com:443", "acme.my.salesforce.com" },   /* crm */
		{ "[::1]:25", "::1" },                 /* email relay */
		{ "127.0.0.1:25", "127.0.0.1" },
		{ "relay", "relay" },
		{ "", "" },
		{ "[unclosed", "unclosed" },
		/* One spelling per address: what a scope is stored as. */
		{ "https://::ffff:127.0.0.2:443", "127.0.0.2" },
		{ "[::FFFF:7f00:2]:25", "127.0.0.2" },
		{ "0x7f.0.0.2:25", "127.0.0.2" },
		{ "Relay.Example.COM.:587", "relay.example.com" },
		{ "https://2001:DB8:0:0:0:0:0:1:443", "2001:db8::1" },
	};
	char out[64];

	(void)state;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		host_key_host(cases[i].key, out, sizeof(out));
		assert_string_equal(out, cases[i].host);
	}
	/* Cut to the buffer, never past it. */
	host_key_host("https://api.example.com:443", out, 4);
	assert_string_equal(out, "api");
}

/* Every spelling of an address libcurl and inet_aton() accept comes out
 * as the one the worker connects to; what can never be connected to is
 * refused. */
static void test_host_canon(void **state)
{
	static const struct {
		const char *in, *out;
		enum host_form form;
	} cases[] = {
		/* IPv4: dotted, decimal, hex, octal, short, zero-padded */
		{ "127.0.0.2", "127.0.0.2", HOST_IPV4 },
		{ "2130706434", "127.0.0.2", HOST_IPV4 },
		{ "0x7f000002", "127.0.0.2", HOST_IPV4 },
		{ "0X7F000002", "127.0.0.2", HOST_IPV4 },
		{ "0x7f.0.0.2", "127.0.0.2", HOST_IPV4 },
		{ "0x7f.0x0.0x0.0x2", "127.0.0.2", HOST_IPV4 },
		{ "0177.0.0.2", "127.0.0.2", HOST_IPV4 },
		{ "0177.0000.0000.0002", "127.0.0.2", HOST_IPV4 },
		{ "017700000002", "127.0.0.2", HOST_IPV4 },
		{ "127.2", "127.0.0.2", HOST_IPV4 },
		{ "127.0.2", "127.0.0.2", HOST_IPV4 },
		{ "127.0.0x2", "127.0.0.2", HOST_IPV4 },
		{ "127.000.000.002", "127.0.0.2", HOST_IPV4 },
		{ "127.0.0.2.", "127.0.0.2", HOST_IPV4 },
		{ "0", "0.0.0.0", HOST_IPV4 },
		{ "4294967295", "255.255.255.255", HOST_IPV4 },
		{ "1.16777215", "1.255.255.255", HOST_IPV4 },
		{ "1.2.65535", "1.2.255.255", HOST_IPV4 },
		/* IPv4-mapped IPv6: the IPv4 address */
		{ "::ffff:127.0.0.2", "127.0.0.2", HOST_IPV4 },
		{ "[::ffff:127.0.0.2]", "127.0.0.2", HOST_IPV4 },
		{ "::FFFF:7F00:2", "127.0.0.2", HOST_IPV4 },
		{ "0:0:0:0:0:ffff:7f00:0002", "127.0.0.2", HOST_IPV4 },
		{ "0000:0000:0000:0000:0000:ffff:127.0.0.2", "127.0.0.2", HOST_IPV4 },
		/* IPv6: RFC 5952 */
		{ "::1", "::1", HOST_IPV6 },
		{ "[::1]", "::1", HOST_IPV6 },
		{ "0:0:0:0:0:0:0:1", "::1", HOST_IPV6 },
		{ "0000:0000:0000:0000:0000:0000:0000:0001", "::1", HOST_IPV6 },
		{ "2001:DB8::1", "2001:db8::1", HOST_IPV6 },
		{ "2001:0db8:0000:0000:0000:0000:0000:0001", "2001:db8::1", HOST_IPV6 },
		{ "2001:db8:0:1:0:0:0:1", "2001:db8:0:1::1", HOST_IPV6 },
		{ "2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1", HOST_IPV6 },
		{ "2001:db8:0:1:1:1:1:1", "2001:db8:0:1:1:1:1:1", HOST_IPV6 },
		{ "::", "::", HOST_IPV6 },
		/* names */
		{ "API.Example.COM", "api.example.com", HOST_NAME },
		{ "api.example.com.", "api.example.com", HOST_NAME },
		{ "localhost", "localhost", HOST_NAME },
		{ "xn--bcher-kva.example", "xn--bcher-kva.example", HOST_NAME },
		{ "a_b.example", "a_b.example", HOST_NAME },
		{ "127.0.0.08", "127.0.0.08", HOST_BAD },     /* not octal, not a name */
		{ "00x1", "00x1", HOST_NAME },                /* libcurl: a name */
		/* nothing a connection can be made to */
		{ "", "", HOST_BAD },
		{ ".", ".", HOST_BAD },
		{ "127.0.0.2:80", "127.0.0.2:80", HOST_BAD },
		{ "::::", "::::", HOST_BAD },
		{ "1.2.3.4.5", "1.2.3.4.5", HOST_BAD },
		{ "256.1.1.1", "256.1.1.1", HOST_BAD },
		{ "4294967296", "4294967296", HOST_BAD },
		{ "1.16777216", "1.16777216", HOST_BAD },
		{ "0x", "0x", HOST_NAME },                    /* libcurl: a name */
		{ "[127.0.0.1]", "[127.0.0.1]", HOST_BAD },
		{ "fe80::1%eth0", "fe80::1%eth0", HOST_BAD },
		{ "a..example", "a..example", HOST_BAD },
		{ "-a.example", "-a.example", HOST_BAD },
		{ "host/path", "host/path", HOST_BAD },
		{ "user@host", "user@host", HOST_BAD },
		{ "1::2::3", "1::2::3", HOST_BAD },
		{ "::ffff:1.2.3.256", "::ffff:1.2.3.256", HOST_BAD },
	};
	char out[256];

	(void)state;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		enum host_form form = host_canon(cases[i].in, out, sizeof(out));
		if (form != cases[i].form || strcmp(out, cases[i].out) != 0)
			fail_msg("host_canon(\"%s\") = %d \"%s\", expected %d \"%s\"", cases[i].in,
			         form, out, cases[i].form, cases[i].out);
	}
	/* Cut to the buffer, never past it. */
	assert_int_equal(host_canon("api.example.com", out, 4), HOST_NAME);
	assert_string_equal(out, "api");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_lookup, setup, teardown),
		cmocka_unit_test_setup_teardown(test_per_host_concurrency, setup, teardown),
		cmocka_unit_test_setup_teardown(test_opens_after_n_consecutive_failures, setup, teardown),
		cmocka_unit_test_setup_teardown(test_success_resets_the_count, setup, teardown),
		cmocka_unit_test_setup_teardown(test_half_open_lets_exactly_one_probe, setup, teardown),
		cmocka_unit_test_setup_teardown(test_questions_change_nothing, setup, teardown),
		cmocka_unit_test_setup_teardown(test_probe_success_closes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_probe_failure_reopens, setup, teardown),
		cmocka_unit_test_setup_teardown(test_probe_schedule_backs_off_to_open_ms, setup, teardown),
		cmocka_unit_test_setup_teardown(test_short_open_ms_caps_the_first_wait, setup, teardown),
		cmocka_unit_test_setup_teardown(test_what_counts_as_a_host_failure, setup, teardown),
		cmocka_unit_test_setup_teardown(test_4xx_does_not_count_and_resets, setup, teardown),
		cmocka_unit_test_setup_teardown(test_stragglers_while_open, setup, teardown),
		cmocka_unit_test_setup_teardown(test_idle_hosts_are_pruned, setup, teardown),
		cmocka_unit_test(test_host_key_host),
		cmocka_unit_test(test_host_canon),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

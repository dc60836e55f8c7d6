/* SPDX-License-Identifier: ISC */
/*
 * test_decide.c: dispatcher/decide.c, the worker's pure decisions, each
 * as a table of cases: the claim's room and its row count (or lease, or
 * wait and ask again when), a lease worth its round trip, a claim, a lease
 * or neither, the connection for outcomes, how long outcomes gather, a
 * free send slot (the provider's and the host's limits beside the batch
 * being built, the breaker, which the answer leaves as it was), a busy
 * queueing provider marked later, and the lease mode after a timed scan
 * from the due index's head.  Each row says why it is there.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decide.h"
#include "hosts.h"
#include "plugin.h"
#include "worker_internal.h"

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* ---- decide_claim_room ---------------------------------------------------- */

struct room_case {
	const char *why;
	int in_flight[2], max_in_flight[2], max_per_host[2];
	size_t providers;
	int busiest, leasing_rows;
	int want;
};

static const struct room_case room_cases[] = {
	{ "idle, one provider: its per-host limit", { 0 }, { 256 }, { 64 }, 1, 0, 0, 64 },
	{ "the busiest host's sends count against the per-host limit", { 10 }, { 256 }, { 64 }, 1, 10, 0, 54 },
	{ "provider slots smaller than the per-host room", { 250 }, { 256 }, { 64 }, 1, 0, 0, 6 },
	{ "rows a lease on the wire may bring are not claimed twice", { 0 }, { 256 }, { 64 }, 1, 0, 20, 44 },
	{ "the tightest of two providers", { 0, 30 }, { 256, 32 }, { 64, 16 }, 2, 0, 0, 2 },
	{ "the smallest per-host limit of any provider", { 0, 0 }, { 256, 256 }, { 64, 16 }, 2, 4, 0, 12 },
	{ "never negative: full host", { 0 }, { 256 }, { 64 }, 1, 64, 0, 0 },
	{ "never negative: leases bring more than fits", { 0 }, { 256 }, { 64 }, 1, 0, 100, 0 },
	{ "never negative: provider over its limit after a reload", { 40 }, { 32 }, { 64 }, 1, 0, 0, 0 },
};

static void test_claim_room(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(room_cases); i++) {
		const struct room_case *c = &room_cases[i];
		struct provider_slot slots[2];
		struct provider_set set = { slots, c->providers };

		memset(slots, 0, sizeof(slots));
		for (size_t p = 0; p < c->providers; p++) {
			slots[p].in_flight = c->in_flight[p];
			slots[p].policy.max_in_flight = c->max_in_flight[p];
			slots[p].policy.max_per_host = c->max_per_host[p];
		}
		if (decide_claim_room(&set, c->busiest, c->leasing_rows) != c->want)
			fail_msg("%s: room %d, want %d", c->why,
			         decide_claim_room(&set, c->busiest, c->leasing_rows), c->want);
	}
}

/* ---- decide_claim_limit --------------------------------------------------- */

struct claim_case {
	const char *why;
	struct claim_view v;
	int limit, full;
	int want;
	int64_t want_kick_ms;
};

/* A worker that may claim, nothing waiting or on the wire, no breaker open. */
#define CLAIMS .claim_on = true, .claimable = true

static const struct claim_case claim_cases[] = {
	{ "room for every row asked for: claim them all",
	  { CLAIMS, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, 64, 0 },
	{ "room for more than asked: claim what was asked",
	  { CLAIMS, .room = 200, .oldest_send_age_ms = -1 }, 32, 64, 32, 0 },
	{ "room for half a batch: claim the room",
	  { CLAIMS, .room = 32, .oldest_send_age_ms = -1 }, 64, 64, 32, 0 },
	{ "claim off in the config: lease",
	  { .claimable = true, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, 0, 0 },
	{ "a provider whose sends queue (email): lease",
	  { .claim_on = true, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, 0, 0 },
	{ "effects wait for a slot: lease, so they keep their order",
	  { CLAIMS, .waiting = true, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, 0, 0 },
	{ "a breaker open: lease (a claimed row would only be given back)",
	  { CLAIMS, .breakers_open = 1, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, 0, 0 },
	{ "a mark or lease on the wire: wait for its answer, no timer",
	  { CLAIMS, .lease_wire_busy = true, .room = 64, .oldest_send_age_ms = -1 }, 64, 64, -1, 0 },
	{ "little room, young sends in flight: wait for them, ask again when the oldest is 100 ms old",
	  { CLAIMS, .room = 10, .oldest_send_age_ms = 30 }, 64, 64, -1, CLAIM_WAIT_MS - 30 },
	{ "little room, a send just started: wait the whole 100 ms",
	  { CLAIMS, .room = 10, .oldest_send_age_ms = 0 }, 64, 64, -1, CLAIM_WAIT_MS },
	{ "little room, the oldest send is slow: lease ahead",
	  { CLAIMS, .room = 10, .oldest_send_age_ms = CLAIM_WAIT_MS }, 64, 64, 0, 0 },
	{ "little room, nothing in flight: lease",
	  { CLAIMS, .room = 10, .oldest_send_age_ms = -1 }, 64, 64, 0, 0 },
	{ "no room at all, young sends: wait",
	  { CLAIMS, .room = 0, .oldest_send_age_ms = 99 }, 64, 64, -1, 1 },
	{ "a small batch: room for half of it is enough",
	  { CLAIMS, .room = 4, .oldest_send_age_ms = 10 }, 8, 8, 4, 0 },
};

static void test_claim_limit(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(claim_cases); i++) {
		const struct claim_case *c = &claim_cases[i];
		int64_t kick = -7;
		int got = decide_claim_limit(&c->v, c->limit, c->full, &kick);

		if (got != c->want || kick != c->want_kick_ms)
			fail_msg("%s: %d rows, kick in %lld ms; want %d, %lld", c->why, got,
			         (long long)kick, c->want, (long long)c->want_kick_ms);
	}
}

/* ---- decide_lease_worth_it ------------------------------------------------ */

struct worth_case {
	const char *why;
	int in_flight_rows, limit, full;
	bool want;
};

static const struct worth_case worth_cases[] = {
	{ "idle: any row is worth a lease (latency)", 0, 1, 64, true },
	{ "busy, a whole batch fits", 100, 64, 64, true },
	{ "busy, exactly half a batch fits", 100, 32, 64, true },
	{ "busy, less than half a batch: wait for more room", 100, 31, 64, false },
	{ "rows on the wire count as busy", 1, 10, 64, false },
	{ "no room: never", 0, 0, 64, false },
	{ "a batch of one: one row is half of it", 5, 1, 1, true },
};

static void test_lease_worth_it(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(worth_cases); i++) {
		const struct worth_case *c = &worth_cases[i];

		if (decide_lease_worth_it(c->in_flight_rows, c->limit, c->full) != c->want)
			fail_msg("%s: want %d", c->why, c->want);
	}
}

/* ---- decide_take ---------------------------------------------------------- */

struct take_case {
	const char *why;
	int claim, limit, full, in_flight_rows;
	bool want;
	enum take_kind kind;
	int rows;
};

static const struct take_case take_cases[] = {
	{ "claim_limit says wait: neither", -1, 64, 64, 0, false, TAKE_LEASE, 0 },
	{ "claim_limit says wait, even with a full batch of room", -1, 64, 64, 100, false, TAKE_LEASE, 0 },
	{ "idle, a claim on offer: claim that many", 10, 64, 64, 0, true, TAKE_CLAIM, 10 },
	{ "busy, a claim of half a batch: claim", 32, 64, 64, 100, true, TAKE_CLAIM, 32 },
	{ "busy, a claim of less than half a batch: neither (no lease instead)", 31, 64, 64, 100,
	  false, TAKE_LEASE, 0 },
	{ "no claim (0), idle: lease the whole limit", 0, 5, 64, 0, true, TAKE_LEASE, 5 },
	{ "no claim, busy, half a batch of room: lease", 0, 32, 64, 100, true, TAKE_LEASE, 32 },
	{ "no claim, busy, less than half a batch: neither", 0, 31, 64, 100, false, TAKE_LEASE, 0 },
	{ "no claim, no room: neither", 0, 0, 64, 0, false, TAKE_LEASE, 0 },
	{ "a claim is never bigger than it was offered", 3, 64, 64, 0, true, TAKE_CLAIM, 3 },
};

static void test_take(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(take_cases); i++) {
		const struct take_case *c = &take_cases[i];
		enum take_kind kind = TAKE_KINDS;
		int rows = -1;
		bool got = decide_take(c->claim, c->limit, c->full, c->in_flight_rows, &kind, &rows);

		if (got != c->want)
			fail_msg("%s: want %d, got %d", c->why, c->want, got);
		if (got && (kind != c->kind || rows != c->rows))
			fail_msg("%s: want kind %d rows %d, got kind %d rows %d", c->why, c->kind, c->rows,
			         kind, rows);
		if (!got && (kind != TAKE_KINDS || rows != -1))
			fail_msg("%s: neither, yet kind or rows written", c->why);
	}
}

/* ---- decide_outcomes_on_lease_db ------------------------------------------ */

struct outcomes_case {
	const char *why;
	int busy_connections, full_leases;
	bool lease_db_up, want;
};

static const struct outcomes_case outcomes_cases[] = {
	{ "a backlog: outcomes behind the leases, one busy backend", 1, BACKLOG_FULL_LEASES, true, true },
	{ "a long backlog", 1, 50, true, true },
	{ "one full lease short of a backlog: the records connection", 1, BACKLOG_FULL_LEASES - 1, true, false },
	{ "no backlog", 1, 0, true, false },
	{ "busy_connections = 2 keeps the split", 2, 50, true, false },
	{ "the lease connection down: the records connection", 1, 50, false, false },
};

static void test_outcomes_on_lease_db(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(outcomes_cases); i++) {
		const struct outcomes_case *c = &outcomes_cases[i];

		if (decide_outcomes_on_lease_db(c->busy_connections, c->full_leases, c->lease_db_up) != c->want)
			fail_msg("%s: want %d", c->why, c->want);
	}
}

/* ---- decide_gather_ms ------------------------------------------------------- */

struct gather_case {
	const char *why;
	struct gather_view v;
	int64_t want;
};

/* A claiming worker in a backlog with sends in flight, a batch of 100. */
#define BACKLOG .claimable = true, .full_leases = BACKLOG_FULL_LEASES, .in_flight = true, \
                .complete_batch = 100

static const struct gather_case gather_cases[] = {
	{ "backlog, a few fresh outcomes: wait the rest of the 15 ms",
	  { BACKLOG, .oldest_age_ms = 0, .queued = 10 }, BACKLOG_GATHER_MS },
	{ "backlog, the oldest 10 ms old: wait 5 more",
	  { BACKLOG, .oldest_age_ms = 10, .queued = 10 }, BACKLOG_GATHER_MS - 10 },
	{ "waited long enough: record now",
	  { BACKLOG, .oldest_age_ms = BACKLOG_GATHER_MS, .queued = 10 }, 0 },
	{ "half a completion batch queued: record now",
	  { BACKLOG, .oldest_age_ms = 0, .queued = 50 }, 0 },
	{ "just under half a batch: wait",
	  { BACKLOG, .oldest_age_ms = 0, .queued = 49 }, BACKLOG_GATHER_MS },
	{ "a not-sent outcome: record now (it stays sending until recorded)",
	  { BACKLOG, .oldest_age_ms = 0, .queued = 3, .any_not_sent = true }, 0 },
	{ "no backlog: record now",
	  { .claimable = true, .full_leases = BACKLOG_FULL_LEASES - 1, .in_flight = true,
	    .complete_batch = 100, .queued = 3 }, 0 },
	{ "nothing in flight to bring more: record now",
	  { .claimable = true, .full_leases = BACKLOG_FULL_LEASES, .complete_batch = 100,
	    .queued = 3 }, 0 },
	{ "a worker whose sends queue (email): record now",
	  { .full_leases = BACKLOG_FULL_LEASES, .in_flight = true, .complete_batch = 100,
	    .queued = 3 }, 0 },
};

static void test_gather(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(gather_cases); i++) {
		const struct gather_case *c = &gather_cases[i];
		int64_t got = decide_gather_ms(&c->v);

		if (got != c->want)
			fail_msg("%s: %lld ms, want %lld", c->why, (long long)got, (long long)c->want);
	}
}

/* ---- slot_free ------------------------------------------------------------ */

struct slot_case {
	const char *why;
	int prov_in_flight, max_in_flight, max_per_host;
	int host_in_flight;
	enum breaker_state breaker;
	int64_t open_until_ms;
	bool probe_in_flight;
	int batch_same_host, batch_other_host;   /* effects already in the batch being built */
	bool want;
	int64_t want_wait_ms;
	bool want_half_open;     /* the caller is to half-open the breaker */
};

#define NOW 1000000

static const struct slot_case slot_cases[] = {
	{ "room everywhere", 0, 256, 64, 0, BREAKER_CLOSED, 0, false, 0, 0, true, 0, false },
	{ "the provider full", 256, 256, 64, 0, BREAKER_CLOSED, 0, false, 0, 0, false, 0, false },
	{ "the provider full with the batch", 250, 256, 64, 0, BREAKER_CLOSED, 0, false, 3, 3, false, 0,
	  false },
	{ "the host full", 10, 256, 64, 64, BREAKER_CLOSED, 0, false, 0, 0, false, 0, false },
	{ "the host full with the batch's rows for it", 10, 256, 64, 60, BREAKER_CLOSED, 0, false, 4, 0,
	  false, 0, false },
	{ "the batch's rows for other hosts leave this host's room", 10, 256, 64, 60, BREAKER_CLOSED, 0,
	  false, 3, 20, true, 0, false },
	{ "breaker open: wait until it may probe", 0, 256, 64, 0, BREAKER_OPEN, NOW + 250, false, 0, 0,
	  false, 250, false },
	{ "breaker open, its time up: one probe may go, the caller half-opens it", 0, 256, 64, 0,
	  BREAKER_OPEN, NOW, false, 0, 0, true, 0, true },
	{ "breaker open, its time up, the host full: no slot, still to be half-opened", 0, 256, 64, 64,
	  BREAKER_OPEN, NOW, false, 0, 0, false, 0, true },
	{ "breaker open, its time up, the provider full: no slot, the breaker not asked", 256, 256, 64,
	  0, BREAKER_OPEN, NOW, false, 0, 0, false, 0, false },
	{ "half-open with its probe out: wait 100 ms", 0, 256, 64, 1, BREAKER_HALF_OPEN, 0, true, 0, 0,
	  false, 100, false },
	{ "half-open, no probe out: the probe may go", 0, 256, 64, 1, BREAKER_HALF_OPEN, 0, false, 0, 0,
	  true, 0, false },
};

static void test_slot_free(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(slot_cases); i++) {
		const struct slot_case *c = &slot_cases[i];
		struct provider_slot prov;
		struct host_state host, other;
		struct effect e, same, diff;
		size_t n = (size_t)(c->batch_same_host + c->batch_other_host);
		struct batch *b = calloc(1, sizeof(*b) + (n ? n : 1) * sizeof(b->items[0]));
		int64_t wait_ms = -7;
		bool got, half_open = !c->want_half_open;

		assert_non_null(b);
		memset(&prov, 0, sizeof(prov));
		memset(&host, 0, sizeof(host));
		memset(&other, 0, sizeof(other));
		memset(&e, 0, sizeof(e));
		prov.in_flight = c->prov_in_flight;
		prov.policy.max_in_flight = c->max_in_flight;
		prov.policy.max_per_host = c->max_per_host;
		host.in_flight = c->host_in_flight;
		host.breaker = c->breaker;
		host.open_until_ms = c->open_until_ms;
		host.probe_in_flight = c->probe_in_flight;
		e.prov = &prov;
		e.host = &host;
		same = e;
		diff = e;
		diff.host = &other;
		for (int k = 0; k < c->batch_same_host; k++)
			b->items[b->n++] = &same;
		for (int k = 0; k < c->batch_other_host; k++)
			b->items[b->n++] = &diff;
		got = slot_free(n ? b : NULL, &e, NOW, &wait_ms, &half_open);
		if (got != c->want || wait_ms != c->want_wait_ms || half_open != c->want_half_open)
			fail_msg("%s: %d, wait %lld ms, half-open %d; want %d, %lld, %d", c->why, got,
			         (long long)wait_ms, half_open, c->want, (long long)c->want_wait_ms,
			         c->want_half_open);
		/* A decision: the host is as it was. */
		if (host.breaker != c->breaker || host.probe_in_flight != c->probe_in_flight ||
		    host.in_flight != c->host_in_flight || host.open_until_ms != c->open_until_ms)
			fail_msg("%s: slot_free changed the host", c->why);
		free(b);
	}
}

/* ---- decide_mark_later ------------------------------------------------------ */

struct later_case {
	const char *why;
	unsigned caps;
	long max_in_flight;
	int in_flight;
	bool want;
};

#define AT_ONCE OUTBOX_CAP_STARTS_AT_ONCE

static const struct later_case later_cases[] = {
	{ "a queueing provider, half of its slots in flight: later", 0, 16, 8, true },
	{ "a queueing provider, all its slots in flight: later", 0, 16, 16, true },
	{ "a queueing provider, one short of half: mark now", 0, 16, 7, false },
	{ "a queueing provider, idle: mark now", 0, 16, 0, false },
	{ "a provider that starts its sends at once: never later", AT_ONCE, 16, 16, false },
	{ "max_in_flight below 8: no queue worth the name, kept full", 0, 7, 7, false },
	{ "max_in_flight exactly 8, 4 in flight: later", 0, 8, 4, true },
	{ "other capability bits do not make it start at once", 0x1u | 0x2u, 16, 8, true },
};

static void test_mark_later(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(later_cases); i++) {
		const struct later_case *c = &later_cases[i];
		struct outbox_provider ops;
		struct provider_slot p;

		memset(&ops, 0, sizeof(ops));
		memset(&p, 0, sizeof(p));
		ops.caps = c->caps;
		p.ops = &ops;
		p.policy.max_in_flight = c->max_in_flight;
		p.in_flight = c->in_flight;
		if (decide_mark_later(&p) != c->want)
			fail_msg("%s: want %d", c->why, c->want);
		if (p.in_flight != c->in_flight)
			fail_msg("%s: decide_mark_later changed the provider", c->why);
	}
}

/* ---- decide_head_scan ------------------------------------------------------- */

struct head_case {
	const char *why;
	struct head_scan_view v;
	int64_t took;
	struct head_scan_verdict want;
	int64_t passed;          /* index entries passed over; 0 unless said */
};

/* [dispatcher] lease_head_slow_ms = 20, a warning long ago. */
#define HEAD(pos, streak) .from_position = (pos), .slow_streak = (streak), .slow_ms = 20, \
                          .warned_mono = NOW - HEAD_SLOW_WARN_EVERY_MS - 1
/* The next scan from the head: HEAD_SCAN_FACTOR times `took`, at least
 * HEAD_SCAN_MIN_MS. */
#define NEXT(took) (NOW + ((took) * HEAD_SCAN_FACTOR > HEAD_SCAN_MIN_MS \
                           ? (took) * HEAD_SCAN_FACTOR : HEAD_SCAN_MIN_MS))

static const struct head_case head_cases[] = {
	{ "from the head, fast: stays, no log", { HEAD(false, 0) }, 5,
	  { 0, false, false, false, NEXT(5), 0 }, 0 },
	{ "from the head, one slow scan: counted, not yet a switch", { HEAD(false, 0) }, 50,
	  { 1, false, false, false, NEXT(50), 0 }, 0 },
	{ "from the head, the second slow one in a row", { HEAD(false, 1) }, 50,
	  { 2, false, false, false, NEXT(50), 0 }, 0 },
	{ "the third slow one in a row: position mode, at info (under 100 ms)",
	  { HEAD(false, HEAD_SLOW_STREAK - 1) }, 50, { HEAD_SLOW_STREAK, true, true, false, NEXT(50), 0 }, 0 },
	{ "the third slow one, 100 ms or more: position mode, at warn",
	  { HEAD(false, HEAD_SLOW_STREAK - 1) }, HEAD_SLOW_WARN_MS,
	  { HEAD_SLOW_STREAK, true, true, true, NEXT(HEAD_SLOW_WARN_MS), 0 }, 0 },
	{ "a fast one resets the streak before the switch", { HEAD(false, HEAD_SLOW_STREAK - 1) }, 20,
	  { 0, false, false, false, NEXT(20), 0 }, 0 },
	{ "in position mode, still slow, under 100 ms: stays, no log", { HEAD(true, 5) }, 50,
	  { 6, true, false, false, NEXT(50), 0 }, 0 },
	{ "in position mode, very slow, last warning a minute ago: warn again", { HEAD(true, 5) }, 500,
	  { 6, true, true, true, NEXT(500), 0 }, 0 },
	{ "in position mode, very slow, warned within the minute: no log",
	  { .from_position = true, .slow_streak = 5, .slow_ms = 20,
	    .warned_mono = NOW - HEAD_SLOW_WARN_EVERY_MS }, 500, { 6, true, false, false, NEXT(500), 0 }, 0 },
	{ "in position mode, the first fast one: back to the head, at info", { HEAD(true, 5) }, 3,
	  { 0, false, true, false, NEXT(3), 0 }, 0 },
	{ "lease_head_slow_ms = 0: every scan is slow", { .slow_ms = 0, .warned_mono = NOW }, 0,
	  { 1, false, false, false, NEXT(0), 0 }, 0 },
	{ "a scan of 150 ms: the next one 1.5 s later", { HEAD(false, 0) }, 150,
	  { 1, false, false, false, NOW + 1500, 0 }, 0 },
	/* A fast machine under a held snapshot: each scan quick, its walk long. */
	{ "fast, but past more entries than HEAD_PASSED_ENTRIES: position mode at once, at info",
	  { HEAD(false, 0) }, 2, { HEAD_SLOW_STREAK, true, true, false, NEXT(2), 0 },
	  HEAD_PASSED_ENTRIES + 1 },
	{ "such a scan after slow ones: the streak goes on", { HEAD(true, 5) },
	  2, { 6, true, false, false, NEXT(2), 0 }, HEAD_PASSED_ENTRIES + 1 },
	{ "past HEAD_PASSED_WARN_ENTRIES: at warn", { HEAD(false, HEAD_SLOW_STREAK - 1) }, 2,
	  { HEAD_SLOW_STREAK, true, true, true, NEXT(2), 0 }, HEAD_PASSED_WARN_ENTRIES },
	{ "exactly HEAD_PASSED_ENTRIES is not slow", { HEAD(true, 5) }, 2,
	  { 0, false, true, false, NEXT(2), 0 }, HEAD_PASSED_ENTRIES },
	{ "not counted (a lease), fast: a fast one", { HEAD(false, 1) }, 2,
	  { 0, false, false, false, NEXT(2), 0 }, HEAD_PASSED_UNKNOWN },
	{ "unseen (an empty claim), fast, from the head: says nothing", { HEAD(false, 2) }, 2,
	  { 2, false, false, false, NEXT(2), 1 }, HEAD_PASSED_UNSEEN },
	{ "unseen, fast, in position mode: stays", { HEAD(true, 5), .unseen_streak = 3 }, 2,
	  { 5, true, false, false, NEXT(2), 4 }, HEAD_PASSED_UNSEEN },
	{ "the HEAD_UNSEEN_EXIT-th unseen fast one in position mode: back to the head",
	  { HEAD(true, 5), .unseen_streak = HEAD_UNSEEN_EXIT - 1 }, 2,
	  { 0, false, true, false, NEXT(2), HEAD_UNSEEN_EXIT }, HEAD_PASSED_UNSEEN },
	{ "unseen but slow by its time: slow, the unseen streak reset",
	  { HEAD(true, 5), .unseen_streak = 3 }, 50, { 6, true, false, false, NEXT(50), 0 },
	  HEAD_PASSED_UNSEEN },
	{ "a counted fast one in position mode: back to the head at once",
	  { HEAD(true, 5), .unseen_streak = 3 }, 2, { 0, false, true, false, NEXT(2), 0 }, 10 },
	{ "in position mode, past few entries but slow: stays", { HEAD(true, 5) }, 50,
	  { 6, true, false, false, NEXT(50), 0 }, 10 },
};

static void test_head_scan(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_OF(head_cases); i++) {
		const struct head_case *c = &head_cases[i];
		struct head_scan_verdict d = decide_head_scan(&c->v, c->took, c->passed, NOW);

		if (d.slow_streak != c->want.slow_streak || d.from_position != c->want.from_position ||
		    d.log != c->want.log || d.warn != c->want.warn ||
		    d.next_scan_mono != c->want.next_scan_mono || d.unseen_streak != c->want.unseen_streak)
			fail_msg("%s: streak %d, position %d, log %d, warn %d, next +%lld, unseen %d; "
			         "want %d, %d, %d, %d, +%lld, %d", c->why, d.slow_streak, d.from_position,
			         d.log, d.warn, (long long)(d.next_scan_mono - NOW), d.unseen_streak,
			         c->want.slow_streak, c->want.from_position, c->want.log, c->want.warn,
			         (long long)(c->want.next_scan_mono - NOW), c->want.unseen_streak);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_claim_room),
		cmocka_unit_test(test_claim_limit),
		cmocka_unit_test(test_lease_worth_it),
		cmocka_unit_test(test_take),
		cmocka_unit_test(test_outcomes_on_lease_db),
		cmocka_unit_test(test_gather),
		cmocka_unit_test(test_slot_free),
		cmocka_unit_test(test_mark_later),
		cmocka_unit_test(test_head_scan),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

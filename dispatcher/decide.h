/* SPDX-License-Identifier: ISC */
/*
 * decide.h: the worker's pure decisions (decide.c), each a function of
 * what it reads, passed in as arguments: whether a take of due rows is a
 * claim or a lease (or neither now) and of how many rows, whether it is
 * worth its round trip, which connection records outcomes, whether
 * outcomes wait for more to share their call, and whether an effect has a
 * send slot.  claim.c, take.c and send.c read
 * the worker's state into them and act on the answer;
 * tests/unit/test_decide.c tables each one.
 */
#ifndef OUTBOX_DECIDE_H
#define OUTBOX_DECIDE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct batch;
struct effect;
struct provider_set;

/* Full leases in a row that make a backlog: outcomes then go on the lease
 * connection (decide_outcomes_on_lease_db()).  One full lease is a burst
 * of a steady load, whose medians suffer when outcomes queue behind
 * leases; three are ~200 rows waiting. */
#ifndef BACKLOG_FULL_LEASES
#define BACKLOG_FULL_LEASES 3
#endif
/* In a backlog, outcomes wait at most this long for more to share their
 * outbox_complete() call (decide_gather_ms()). */
#ifndef BACKLOG_GATHER_MS
#define BACKLOG_GATHER_MS 15
#endif
/* While the room is below half a batch and every send in flight started
 * less than this long ago, wait for them to finish (each finish runs
 * take_batch() again) rather than lease ahead the old way: a fast host
 * frees its slots within milliseconds; a slow one must not hold up the
 * rows of the others. */
#define CLAIM_WAIT_MS 100

/* Rows the providers (their free slots and max_per_host) and the busiest
 * host (`busiest` sends in flight) have room for beside what is in flight
 * and what leases on the wire may bring (`leasing_rows`); never negative. */
int decide_claim_room(const struct provider_set *providers, int busiest, int leasing_rows);

/* What claim_limit() reads of the worker. */
struct claim_view {
	bool claim_on;           /* [dispatcher] claim */
	bool claimable;          /* every provider starts its sends at once */
	bool waiting;            /* effects wait for a slot */
	int breakers_open;       /* hosts whose breaker is open */
	bool lease_wire_busy;    /* a mark or a lease on the lease connection is on the wire */
	int room;                /* decide_claim_room() */
	int64_t oldest_send_age_ms; /* the oldest send in flight started this long ago; -1: none */
};

/* For a lease of `limit` rows (`full`: a whole batch): > 0 claim that many
 * rows; 0 lease instead; -1 neither now, and *kick_in_ms > 0 asks to be
 * called again that much later (0: an answer on the wire will). */
int decide_claim_limit(const struct claim_view *v, int limit, int full, int64_t *kick_in_ms);

/* A busy worker (`in_flight_rows`: effects held plus rows leases on the
 * wire may bring) leases only once at least half a batch fits: a round
 * trip per few rows costs the database more than the rows themselves. */
bool decide_lease_worth_it(int in_flight_rows, int limit, int full);

/* The two kinds of request that take due rows (take.c). */
enum take_kind {
	TAKE_LEASE,              /* outbox_lease: rows get our lease, marked later */
	TAKE_CLAIM,              /* outbox_claim: lease and mark in one call */
	TAKE_KINDS
};

/* For a take of `limit` rows (`full`: a whole batch), with `claim` what
 * decide_claim_limit() said and `in_flight_rows` as for
 * decide_lease_worth_it(): true with *kind and *rows, a claim of `claim`
 * rows if worth its round trip, else a lease of `limit` if no claim was on
 * offer (claim 0) and it is worth it; false: neither now. */
bool decide_take(int claim, int limit, int full, int in_flight_rows, enum take_kind *kind,
                 int *rows);

/* Whether outcomes go on the lease connection: in a backlog
 * (BACKLOG_FULL_LEASES full leases in a row) with one busy connection per
 * worker configured and the lease connection up; else on the records
 * connection. */
bool decide_outcomes_on_lease_db(int busy_connections, int full_leases, bool lease_db_up);

/* What gathering outcomes reads of the worker and its queue of outcomes. */
struct gather_view {
	bool claimable;          /* every provider starts its sends at once */
	int full_leases;         /* full leases in a row */
	bool in_flight;          /* sends, or a lease or mark on the wire */
	int64_t oldest_age_ms;   /* the first queued outcome ended this long ago */
	size_t queued;           /* outcomes queued */
	bool any_not_sent;       /* one of them was not sent */
	size_t complete_batch;   /* [dispatcher] complete_batch */
};

/* How long the queued outcomes should wait for more to share their
 * outbox_complete() call; 0: record them now. */
int64_t decide_gather_ms(const struct gather_view *v);

/* Whether e's provider and host have room beside the batch b being built
 * (NULL: none); *wait_ms > 0 when its host's breaker is open.  An open
 * breaker whose time is up becomes half-open here (host_may_send()). */
bool slot_free(const struct batch *b, const struct effect *e, int64_t now, int64_t *wait_ms);

#endif

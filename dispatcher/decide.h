/* SPDX-License-Identifier: ISC */
/*
 * decide.h: the worker's pure decisions (decide.c), each a function of
 * what it reads, passed in as arguments: whether a take of due rows is a
 * claim or a lease (or neither now) and of how many rows, whether it is
 * worth its round trip, which connection records outcomes, whether
 * outcomes wait for more to share their call, whether an effect has a
 * send slot, whether a busy queueing provider is marked for later, and
 * what a timed scan from the due index's head makes of the lease mode.
 * None changes state: claim.c, take.c, mark.c and send.c read the
 * worker's state into them and make the changes the answer asks for;
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
struct provider_slot;

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
 * (NULL: none); *wait_ms > 0 when its host's breaker is open.  *half_open:
 * the host's breaker is open and its wait over (host_probe_due()), which
 * the answer took as half-open: the caller moves it (host_half_open())
 * before it picks the effect, so that its send is the one probe. */
bool slot_free(const struct batch *b, const struct effect *e, int64_t now, int64_t *wait_ms,
               bool *half_open);

/* Whether the waiting effects of provider p are left for a later mark: p
 * queues its sends (no OUTBOX_CAP_STARTS_AT_ONCE: email's thread pool) and
 * is busy (half of its max_in_flight, at least 8, or more in flight), so
 * answers keep coming while its queue keeps its threads at work, and a
 * mark call per freed slot (a slow relay's sends end one by one) would
 * cost the database a round trip per row.  It is marked for once half of
 * its max_in_flight is free. */
bool decide_mark_later(const struct provider_slot *p);

/* Leasing from the position (take.c): scans from the head at least this
 * far apart, and at least HEAD_SCAN_FACTOR times as long as the last one
 * took, so that a head full of dead entries (vacuum held back) costs the
 * lease path at most a tenth of its time. */
#define HEAD_SCAN_MIN_MS 1000
#define HEAD_SCAN_FACTOR 10
/* A scan from the head is slow also when its walk passed over more index
 * entries than this without taking them (read, not returned: the dead
 * entries of effects finished while a long transaction holds vacuum back,
 * sends in flight).  A count, not a time, so that it holds on a fast
 * machine too: under a held snapshot each scan there took under 10 ms yet
 * cost the database 1.7 times its CPU per effect. */
#define HEAD_PASSED_ENTRIES 2000
/* What a scan from the head says of the entries it passed over, when not a
 * count: a lease does not count them (its time alone decides); a claim
 * that returned no row had no row to say it on.  Such a scan that is fast
 * says nothing, except that HEAD_UNSEEN_EXIT of them in a row in position
 * mode go back to the head (in position mode most scans from the head find
 * nothing: were each a fast one, every scan would go back to the head and
 * the next claims walk the dead entries again). */
#define HEAD_PASSED_UNKNOWN (-1)
#define HEAD_PASSED_UNSEEN (-2)
#define HEAD_UNSEEN_EXIT 10
/* Slow leases from the head in a row before leasing from the position: one
 * slow answer is more often a busy machine than a head full of dead
 * entries, and a switch makes late-committed rows wait for a head scan.
 * A walk past more than HEAD_PASSED_ENTRIES is a count, not a moment of
 * the machine: it switches at once (a worker started under a held
 * snapshot would otherwise walk all of them three times). */
#define HEAD_SLOW_STREAK 3
/* A head this slow is worth an operator's look (a long transaction holding
 * vacuum back): lease_mode is logged at warn, once a minute at most (under
 * a held-back vacuum the head can be fast and slow by turns).  Between
 * lease_head_slow_ms and this, a busy queue between two autovacuums: info. */
#define HEAD_SLOW_WARN_MS 100
#define HEAD_PASSED_WARN_ENTRIES 50000
#define HEAD_SLOW_WARN_EVERY_MS 60000

/* What a timed scan from the head reads of the lease state. */
struct head_scan_view {
	bool from_position;      /* leasing from the position now */
	int slow_streak;         /* slow scans from the head in a row before this one */
	long slow_ms;            /* [dispatcher] lease_head_slow_ms; 0: every scan is slow */
	int64_t warned_mono;     /* the last warning that the head is slow */
	int unseen_streak;       /* fast scans that could not count, in a row */
};

/* What becomes of it. */
struct head_scan_verdict {
	int slow_streak;         /* slow scans in a row, this one counted */
	bool from_position;      /* lease from the position from now on */
	bool log;                /* log lease_mode: the mode changed, or warn */
	bool warn;               /* at warn level (and warned_mono becomes now) */
	int64_t next_scan_mono;  /* the next scan from the head, not before */
	int unseen_streak;       /* fast scans that could not count, in a row, this one counted */
};

/* After a scan from the head that took `took` ms and passed over `passed`
 * index entries (or HEAD_PASSED_UNKNOWN, HEAD_PASSED_UNSEEN), at `now`:
 * slow when over lease_head_slow_ms or HEAD_PASSED_ENTRIES; into position
 * mode after
 * HEAD_SLOW_STREAK slow ones in a row, out of it at the first fast one
 * (an unseen one: HEAD_UNSEEN_EXIT in a row);
 * the next scan from the head HEAD_SCAN_FACTOR times `took` later,
 * HEAD_SCAN_MIN_MS at least. */
struct head_scan_verdict decide_head_scan(const struct head_scan_view *v, int64_t took,
                                          int64_t passed, int64_t now);

#endif

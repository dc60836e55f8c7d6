/* SPDX-License-Identifier: ISC */
/*
 * decide.c: the worker's pure decisions (see decide.h): claim, lease or
 * neither and how many rows, a lease worth its round trip, the connection for
 * outcomes, outcomes gathering, a free send slot, a mark left for later,
 * the lease mode after a scan from the head.  Nothing here reads a clock,
 * a connection or a list, nor changes what it reads: the callers pass what
 * each one reads and make the changes it answers.
 */
#include "decide.h"

#include <limits.h>

#include "hosts.h"
#include "plugin.h"
#include "worker_internal.h"

int decide_claim_room(const struct provider_set *providers, int busiest, int leasing_rows)
{
	int room = INT_MAX, per_host = INT_MAX;

	for (size_t i = 0; i < providers->n; i++) {
		const struct provider_slot *p = &providers->slots[i];
		int free_slots = (int)p->policy.max_in_flight - p->in_flight;

		if (free_slots < room)
			room = free_slots;
		if ((int)p->policy.max_per_host < per_host)
			per_host = (int)p->policy.max_per_host;
	}
	per_host -= busiest;
	if (per_host < room)
		room = per_host;
	room -= leasing_rows;
	return room > 0 ? room : 0;
}

int decide_claim_limit(const struct claim_view *v, int limit, int full, int64_t *kick_in_ms)
{
	int64_t age;

	*kick_in_ms = 0;
	if (!v->claim_on || !v->claimable || v->waiting)
		return 0;
	/* Behind an open breaker a claimed row would only be given back (a
	 * non-HOT update each way): lease those. */
	if (v->breakers_open > 0)
		return 0;
	/* A mark or a lease on the lease connection on the wire: its answer
	 * runs this again.  (Not a head scan on the records connection: its
	 * answer may queue behind outcomes.) */
	if (v->lease_wire_busy)
		return -1;
	if (v->room >= limit || v->room * 2 >= full)
		return v->room < limit ? v->room : limit;
	age = v->oldest_send_age_ms >= 0 ? v->oldest_send_age_ms : CLAIM_WAIT_MS;
	if (age < CLAIM_WAIT_MS) {
		*kick_in_ms = CLAIM_WAIT_MS - age;
		return -1;
	}
	return 0;
}

bool decide_lease_worth_it(int in_flight_rows, int limit, int full)
{
	return limit > 0 && (in_flight_rows == 0 || limit * 2 >= full);
}

bool decide_take(int claim, int limit, int full, int in_flight_rows, enum take_kind *kind,
                 int *rows)
{
	if (claim < 0)
		return false;
	if (claim > 0 && decide_lease_worth_it(in_flight_rows, claim, full)) {
		*kind = TAKE_CLAIM;
		*rows = claim;
		return true;
	}
	/* A claim on offer but too small: wait for more room rather than
	 * lease rows that would then wait for a slot. */
	if (claim > 0 || !decide_lease_worth_it(in_flight_rows, limit, full))
		return false;
	*kind = TAKE_LEASE;
	*rows = limit;
	return true;
}

bool decide_outcomes_on_lease_db(int busy_connections, int full_leases, bool lease_db_up)
{
	return busy_connections == 1 && full_leases >= BACKLOG_FULL_LEASES && lease_db_up;
}

int64_t decide_gather_ms(const struct gather_view *v)
{
	if (!v->claimable || v->full_leases < BACKLOG_FULL_LEASES || !v->in_flight ||
	    v->oldest_age_ms >= BACKLOG_GATHER_MS)
		return 0;
	/* A row that was not sent stays `sending` until recorded: a worker
	 * killed meanwhile would leave it `unknown`.  Record those at once. */
	if (v->any_not_sent || v->queued * 2 >= v->complete_batch)
		return 0;
	return BACKLOG_GATHER_MS - v->oldest_age_ms;
}

bool slot_free(const struct batch *b, const struct effect *e, int64_t now, int64_t *wait_ms,
               bool *half_open)
{
	int pending_for_host = 0, pending_for_prov = 0;

	*wait_ms = 0;
	*half_open = false;
	for (size_t i = 0; b && i < b->n; i++) {
		pending_for_host += b->items[i]->host == e->host;
		pending_for_prov += b->items[i]->prov == e->prov;
	}
	if (e->prov->in_flight + pending_for_prov >= e->prov->policy.max_in_flight)
		return false;
	*half_open = host_probe_due(e->host, now);
	return host_may_send(e->host, (int)e->prov->policy.max_per_host - pending_for_host, now,
	                     wait_ms);
}

/* p queues its sends and half of its max_in_flight or more is in flight.
 * A max_in_flight below 8 leaves no queue worth the name: kept full. */
static bool queue_busy(const struct provider_slot *p)
{
	return !(p->ops->caps & OUTBOX_CAP_STARTS_AT_ONCE) && p->policy.max_in_flight >= 8 &&
	       (long)p->in_flight * 2 >= p->policy.max_in_flight;
}

bool decide_mark_later(const struct provider_slot *p)
{
	return queue_busy(p) && p->in_flight > 0;
}

struct head_scan_verdict decide_head_scan(const struct head_scan_view *v, int64_t took,
                                          int64_t passed, int64_t now)
{
	struct head_scan_verdict d;
	int64_t wait = took * HEAD_SCAN_FACTOR;
	bool slow = v->slow_ms == 0 || took > v->slow_ms || passed > HEAD_PASSED_ENTRIES;
	bool unseen = !slow && passed == HEAD_PASSED_UNSEEN;

	d.unseen_streak = unseen ? v->unseen_streak + 1 : 0;
	if (unseen && !(v->from_position && d.unseen_streak >= HEAD_UNSEEN_EXIT))
		d.slow_streak = v->slow_streak;     /* says nothing */
	else
		d.slow_streak = slow ? v->slow_streak + 1 : 0;
	/* A count is not a busy moment of the machine: no streak needed. */
	if (passed > HEAD_PASSED_ENTRIES && d.slow_streak < HEAD_SLOW_STREAK)
		d.slow_streak = HEAD_SLOW_STREAK;
	d.from_position = v->from_position ? d.slow_streak > 0 : d.slow_streak >= HEAD_SLOW_STREAK;
	d.warn = d.from_position && (took >= HEAD_SLOW_WARN_MS || passed >= HEAD_PASSED_WARN_ENTRIES) &&
	         now - v->warned_mono > HEAD_SLOW_WARN_EVERY_MS;
	d.log = d.from_position != v->from_position || d.warn;
	d.next_scan_mono = now + (wait > HEAD_SCAN_MIN_MS ? wait : HEAD_SCAN_MIN_MS);
	return d;
}

/* SPDX-License-Identifier: ISC */
/*
 * test_policy.c: dispatcher/policy.c, the failure-class matrix of docs/design.md:
 * every outcome × attempts left / exhausted × provider honours keys or
 * not, backoff with full jitter, and Retry-After within and beyond
 * retry_after_max_ms.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "policy.h"

static struct provider_policy policy(long max_attempts, long base, long cap, long ra_max)
{
	struct provider_policy p = {
		.timeout_ms = 10000, .connect_timeout_ms = 3000,
		.max_attempts = max_attempts, .backoff_base_ms = base, .backoff_cap_ms = cap,
		.retry_after_max_ms = ra_max, .honours_keys = -1,
		.max_in_flight = 128, .max_per_host = 16, .breaker_failures = 5, .breaker_open_ms = 30000,
	};
	return p;
}

static struct outbox_result result(enum outbox_outcome o, int status, long retry_after_ms)
{
	struct outbox_result r;

	memset(&r, 0, sizeof(r));
	r.outcome = o;
	r.status = status;
	r.retry_after_ms = retry_after_ms;
	return r;
}

/* ceiling of the backoff before attempt+1: min(cap, base * 2^(attempt-1)) */
static int64_t ceiling_of(const struct provider_policy *p, int attempt)
{
	int64_t c = p->backoff_base_ms;

	for (int i = 1; i < attempt; i++) {
		c *= 2;
		if (c >= p->backoff_cap_ms)
			break;
	}
	return c < p->backoff_cap_ms ? c : p->backoff_cap_ms;
}

/* The matrix, written out: docs/design.md, "Failure classes" and "Effect states". */
static const struct row {
	enum outbox_outcome outcome;
	bool attempts_left;
	bool honours;
	enum effect_next next;
	bool exhausted;
} matrix[] = {
	/* 2xx: completed, whatever else is true */
	{ OUTCOME_ACCEPTED, true, false, NEXT_COMPLETED, false },
	{ OUTCOME_ACCEPTED, true, true, NEXT_COMPLETED, false },
	{ OUTCOME_ACCEPTED, false, false, NEXT_COMPLETED, false },
	{ OUTCOME_ACCEPTED, false, true, NEXT_COMPLETED, false },
	/* nothing left the host: pending with backoff, failed when exhausted */
	{ OUTCOME_NOT_SENT, true, false, NEXT_PENDING, false },
	{ OUTCOME_NOT_SENT, true, true, NEXT_PENDING, false },
	{ OUTCOME_NOT_SENT, false, false, NEXT_FAILED, true },
	{ OUTCOME_NOT_SENT, false, true, NEXT_FAILED, true },
	/* 429/503/409: same */
	{ OUTCOME_RETRY, true, false, NEXT_PENDING, false },
	{ OUTCOME_RETRY, true, true, NEXT_PENDING, false },
	{ OUTCOME_RETRY, false, false, NEXT_FAILED, true },
	{ OUTCOME_RETRY, false, true, NEXT_FAILED, true },
	/* other 4xx, 422, SMTP 5xx, invalid: failed at once, not "exhausted" */
	{ OUTCOME_TERMINAL, true, false, NEXT_FAILED, false },
	{ OUTCOME_TERMINAL, true, true, NEXT_FAILED, false },
	{ OUTCOME_TERMINAL, false, false, NEXT_FAILED, false },
	{ OUTCOME_TERMINAL, false, true, NEXT_FAILED, false },
	/* ambiguous: retried with the same key only when keys are honoured;
	 * never re-sent blindly; out of attempts it may have gone through */
	{ OUTCOME_AMBIGUOUS, true, false, NEXT_UNKNOWN, false },
	{ OUTCOME_AMBIGUOUS, true, true, NEXT_PENDING, false },
	{ OUTCOME_AMBIGUOUS, false, false, NEXT_UNKNOWN, false },
	{ OUTCOME_AMBIGUOUS, false, true, NEXT_UNKNOWN, true },
};

static void check_row(const struct row *m, const struct provider_policy *p, int attempt)
{
	struct outbox_result r = result(m->outcome, 0, -1);

	for (int draw = 0; draw < 50; draw++) {
		struct policy_decision d = policy_decide(&r, attempt, p, m->honours);

		if (d.next != m->next || d.exhausted != m->exhausted)
			fail_msg("%s, attempt %d of %ld, honours=%d: got %s exhausted=%d, want %s "
			         "exhausted=%d", outcome_name(m->outcome), attempt, p->max_attempts,
			         m->honours, next_state_name(d.next), d.exhausted,
			         next_state_name(m->next), m->exhausted);
		if (d.next == NEXT_PENDING) {
			if (d.delay_ms < 0 || d.delay_ms > ceiling_of(p, attempt))
				fail_msg("%s attempt %d: delay %lld outside [0, %lld]",
				         outcome_name(m->outcome), attempt, (long long)d.delay_ms,
				         (long long)ceiling_of(p, attempt));
		} else {
			assert_int_equal(d.delay_ms, 0);
		}
	}
}

static void test_failure_matrix(void **state)
{
	const struct provider_policy p5 = policy(5, 100, 1600, 300000);
	const struct provider_policy p1 = policy(1, 100, 1600, 300000);

	(void)state;
	for (size_t i = 0; i < sizeof(matrix) / sizeof(matrix[0]); i++) {
		const struct row *m = &matrix[i];
		if (m->attempts_left) {
			check_row(m, &p5, 1);
			check_row(m, &p5, 2);
			check_row(m, &p5, 4);        /* the last attempt that leaves one */
		} else {
			check_row(m, &p5, 5);        /* attempt == max_attempts */
			check_row(m, &p5, 9);        /* beyond it (max lowered on reload) */
			check_row(m, &p1, 1);        /* max_attempts = 1: the first is the last */
		}
	}
}

static void test_status_does_not_change_the_class(void **state)
{
	/* The provider classifies; policy only maps classes.  A key conflict
	 * (422) is terminal and flagged, nothing more. */
	const struct provider_policy p = policy(5, 100, 1600, 300000);
	struct outbox_result r = result(OUTCOME_TERMINAL, 422, -1);
	struct policy_decision d;

	(void)state;
	r.key_conflict = true;
	d = policy_decide(&r, 1, &p, true);
	assert_int_equal(d.next, NEXT_FAILED);
	assert_false(d.exhausted);
	r = result(OUTCOME_ACCEPTED, 202, 60000);     /* Retry-After on a 2xx: ignored */
	d = policy_decide(&r, 1, &p, false);
	assert_int_equal(d.next, NEXT_COMPLETED);
	assert_int_equal(d.delay_ms, 0);
}

/* ---- Retry-After --------------------------------------------------------------- */

static void test_retry_after_within_cap(void **state)
{
	/* Backoff at most 1 ms, so the delay is the Retry-After itself. */
	const struct provider_policy p = policy(5, 1, 1, 300000);
	struct outbox_result r;
	struct policy_decision d;

	(void)state;
	r = result(OUTCOME_RETRY, 503, 5000);
	d = policy_decide(&r, 1, &p, false);
	assert_int_equal(d.next, NEXT_PENDING);
	assert_int_equal(d.delay_ms, 5000);

	r = result(OUTCOME_RETRY, 429, 300000);       /* exactly the cap */
	d = policy_decide(&r, 3, &p, true);
	assert_int_equal(d.delay_ms, 300000);

	/* Honoured for every class that goes back to pending. */
	r = result(OUTCOME_NOT_SENT, 0, 7000);
	d = policy_decide(&r, 2, &p, false);
	assert_int_equal(d.next, NEXT_PENDING);
	assert_int_equal(d.delay_ms, 7000);
	r = result(OUTCOME_AMBIGUOUS, 504, 8000);
	d = policy_decide(&r, 2, &p, true);
	assert_int_equal(d.next, NEXT_PENDING);
	assert_int_equal(d.delay_ms, 8000);

	/* Not when nothing is retried. */
	r = result(OUTCOME_RETRY, 503, 5000);
	d = policy_decide(&r, 5, &p, false);
	assert_int_equal(d.next, NEXT_FAILED);
	assert_int_equal(d.delay_ms, 0);
	r = result(OUTCOME_AMBIGUOUS, 504, 5000);
	d = policy_decide(&r, 1, &p, false);
	assert_int_equal(d.next, NEXT_UNKNOWN);
	assert_int_equal(d.delay_ms, 0);
}

static void test_retry_after_beyond_cap(void **state)
{
	const struct provider_policy p = policy(5, 1, 1, 300000);
	const struct provider_policy off = policy(5, 1, 1, 0);
	struct outbox_result r = result(OUTCOME_RETRY, 503, 86400000);
	struct policy_decision d;

	(void)state;
	d = policy_decide(&r, 1, &p, false);
	assert_int_equal(d.next, NEXT_PENDING);
	assert_int_equal(d.delay_ms, 300000);         /* capped at retry_after_max_ms */
	r.retry_after_ms = 300001;
	d = policy_decide(&r, 1, &p, false);
	assert_int_equal(d.delay_ms, 300000);
	/* retry_after_max_ms = 0: Retry-After is not honoured at all */
	d = policy_decide(&r, 1, &off, false);
	assert_in_range(d.delay_ms, 0, 1);
}

static void test_retry_after_below_backoff(void **state)
{
	/* A Retry-After shorter than the drawn backoff does not shorten it:
	 * the delay is max(backoff draw, Retry-After). */
	const struct provider_policy p = policy(5, 100000, 100000, 300000);
	struct outbox_result r = result(OUTCOME_RETRY, 503, 1000);
	struct outbox_result none = result(OUTCOME_RETRY, 503, -1);
	struct outbox_result zero = result(OUTCOME_RETRY, 503, 0);
	int above = 0, small_none = 0;

	(void)state;
	for (int i = 0; i < 2000; i++) {
		struct policy_decision d = policy_decide(&r, 1, &p, false);
		assert_in_range(d.delay_ms, 1000, 100000);
		above += d.delay_ms > 1000;
		d = policy_decide(&none, 1, &p, false);
		assert_in_range(d.delay_ms, 0, 100000);
		small_none += d.delay_ms < 1000;
		d = policy_decide(&zero, 1, &p, false);
		assert_in_range(d.delay_ms, 0, 100000);
	}
	assert_true(above > 1900);        /* ~99% of draws exceed 1000 */
	assert_true(small_none > 0);      /* without it, small draws happen (p ~ 1 - 0.99^2000) */
}

/* ---- jitter ------------------------------------------------------------------- */

static void test_backoff_jitter_over_many_draws(void **state)
{
	const struct provider_policy p = policy(20, 250, 30000, 300000);
	struct outbox_result r = result(OUTCOME_NOT_SENT, 0, -1);

	(void)state;
	for (int attempt = 1; attempt < 20; attempt++) {
		int64_t ceil = ceiling_of(&p, attempt), lo = INT64_MAX, hi = -1;
		double sum = 0;
		enum { DRAWS = 5000 };

		for (int i = 0; i < DRAWS; i++) {
			struct policy_decision d = policy_decide(&r, attempt, &p, false);
			assert_int_equal(d.next, NEXT_PENDING);
			if (d.delay_ms < 0 || d.delay_ms > ceil)
				fail_msg("attempt %d: %lld outside [0, %lld]", attempt,
				         (long long)d.delay_ms, (long long)ceil);
			lo = d.delay_ms < lo ? d.delay_ms : lo;
			hi = d.delay_ms > hi ? d.delay_ms : hi;
			sum += (double)d.delay_ms;
		}
		/* full jitter: from about 0 to about the ceiling, mean ~ ceiling/2 */
		assert_true(lo <= ceil / 20);
		assert_true(hi >= ceil - ceil / 20);
		assert_true(sum / DRAWS > 0.45 * (double)ceil && sum / DRAWS < 0.55 * (double)ceil);
	}
	/* the ceilings themselves: 250, 500, 1000, ... capped at 30000 */
	assert_int_equal(ceiling_of(&p, 1), 250);
	assert_int_equal(ceiling_of(&p, 4), 2000);
	assert_int_equal(ceiling_of(&p, 8), 30000);
}

/* ---- names -------------------------------------------------------------------- */

static void test_names(void **state)
{
	(void)state;
	assert_string_equal(outcome_name(OUTCOME_ACCEPTED), "accepted");
	assert_string_equal(outcome_name(OUTCOME_NOT_SENT), "not_sent");
	assert_string_equal(outcome_name(OUTCOME_RETRY), "retry");
	assert_string_equal(outcome_name(OUTCOME_TERMINAL), "terminal");
	assert_string_equal(outcome_name(OUTCOME_AMBIGUOUS), "ambiguous");
	assert_string_equal(outcome_name((enum outbox_outcome)77), "ambiguous");
	assert_string_equal(next_state_name(NEXT_COMPLETED), "completed");
	assert_string_equal(next_state_name(NEXT_PENDING), "pending");
	assert_string_equal(next_state_name(NEXT_FAILED), "failed");
	assert_string_equal(next_state_name(NEXT_UNKNOWN), "unknown");
	assert_string_equal(next_state_name((enum effect_next)77), "unknown");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_failure_matrix),
		cmocka_unit_test(test_status_does_not_change_the_class),
		cmocka_unit_test(test_retry_after_within_cap),
		cmocka_unit_test(test_retry_after_beyond_cap),
		cmocka_unit_test(test_retry_after_below_backoff),
		cmocka_unit_test(test_backoff_jitter_over_many_draws),
		cmocka_unit_test(test_names),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

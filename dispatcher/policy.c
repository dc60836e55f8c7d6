/* SPDX-License-Identifier: ISC */
/*
 * policy.c: the failure classes of docs/design.md → next state.
 *
 *   accepted             completed
 *   not sent, retry      pending after backoff (Retry-After honoured within
 *                        retry_after_max_ms); failed when attempts run out
 *   terminal             failed
 *   ambiguous            pending with the same key when the provider honours
 *                        idempotency keys, else unknown; unknown also when an
 *                        honouring provider has no attempts left, because the
 *                        last try may have gone through
 */
#include "policy.h"

#include "util.h"

const char *outcome_name(enum outbox_outcome o)
{
	switch (o) {
	case OUTCOME_ACCEPTED:
		return "accepted";
	case OUTCOME_NOT_SENT:
		return "not_sent";
	case OUTCOME_RETRY:
		return "retry";
	case OUTCOME_TERMINAL:
		return "terminal";
	case OUTCOME_AMBIGUOUS:
		return "ambiguous";
	}
	return "ambiguous";
}

const char *next_state_name(enum effect_next n)
{
	switch (n) {
	case NEXT_COMPLETED:
		return "completed";
	case NEXT_PENDING:
		return "pending";
	case NEXT_FAILED:
		return "failed";
	case NEXT_UNKNOWN:
		return "unknown";
	}
	return "unknown";
}

static int64_t retry_delay(const struct outbox_result *r, int attempt, const struct provider_policy *p)
{
	int64_t d = backoff_full_jitter_ms(p->backoff_base_ms, p->backoff_cap_ms, attempt);

	if (r->retry_after_ms >= 0) {
		int64_t ra = r->retry_after_ms;
		if (ra > p->retry_after_max_ms)
			ra = p->retry_after_max_ms;
		if (ra > d)
			d = ra;
	}
	return d;
}

struct policy_decision policy_decide(const struct outbox_result *r, int attempt,
                                     const struct provider_policy *p, bool honours_keys)
{
	struct policy_decision d = { NEXT_FAILED, 0, false };
	bool attempts_left = attempt < p->max_attempts;

	switch (r->outcome) {
	case OUTCOME_ACCEPTED:
		d.next = NEXT_COMPLETED;
		break;
	case OUTCOME_TERMINAL:
		d.next = NEXT_FAILED;
		break;
	case OUTCOME_NOT_SENT:
	case OUTCOME_RETRY:
		if (attempts_left) {
			d.next = NEXT_PENDING;
			d.delay_ms = retry_delay(r, attempt, p);
		} else {
			d.next = NEXT_FAILED;
			d.exhausted = true;
		}
		break;
	case OUTCOME_AMBIGUOUS:
		if (honours_keys && attempts_left) {
			d.next = NEXT_PENDING;
			d.delay_ms = retry_delay(r, attempt, p);
		} else {
			d.next = NEXT_UNKNOWN;
			d.exhausted = honours_keys;
		}
		break;
	}
	return d;
}

/* SPDX-License-Identifier: ISC */
/*
 * policy.h: the failure-class matrix of docs/design.md as one function: given a
 * provider's outcome, the attempt number and the provider's policy, which
 * state the effect goes to next and when it is due again.
 */
#ifndef OUTBOX_POLICY_H
#define OUTBOX_POLICY_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "provider.h"

enum effect_next { NEXT_COMPLETED, NEXT_PENDING, NEXT_FAILED, NEXT_UNKNOWN };

struct policy_decision {
	enum effect_next next;
	int64_t delay_ms;       /* NEXT_PENDING: not due before this */
	bool exhausted;         /* max_attempts reached */
};

struct policy_decision policy_decide(const struct outbox_result *r, int attempt,
                                     const struct provider_policy *p, bool honours_keys);

const char *outcome_name(enum outbox_outcome o);
const char *next_state_name(enum effect_next n);

#endif

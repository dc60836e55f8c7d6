/* SPDX-License-Identifier: ISC */
/*
 * late.c: a provider's acceptance that arrives after the provider itself
 * reported the call ambiguous (host->late_result; the email provider's
 * relay answering 250 past its timeout).  The acceptance is proof the
 * effect was sent once: outbox_resolve_late_accepted completes it if it is
 * `unknown` because of exactly that attempt of this worker, and writes a
 * resolution row.  Nothing here ever sends.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "metrics.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

struct late_call {
	char id[40];
	int attempt;
	char provider_id[OUTBOX_PROVIDER_ID_MAX];
};

static void on_late_resolved(struct db *db, PGresult *r, void *arg)
{
	struct late_call *lc = arg;

	(void)db;
	if (pg_ok(r, worker_sql[SQL_RESOLVE_LATE].name) && PQntuples(r) == 1) {
		bool applied = !PQgetisnull(r, 0, COL_LATE_RESOLVED);

		if (applied)
			metrics_count_unknown_resolved("late_accepted");
		log_event(applied ? OLOG_INFO : OLOG_WARN, applied ? "unknown_resolved" : "late_acceptance_unused",
		          json_pack("{s:s,s:s,s:i,s:s,s:s}", "effect_id", lc->id, "how", "late_accepted",
		                    "attempt", lc->attempt, "provider_id", lc->provider_id, "msg",
		                    applied ? "the provider's late acceptance completed the unknown effect"
		                            : "the provider's late acceptance came for an effect that had "
		                              "moved on (not unknown from this attempt): nothing changed"));
	}
	free(lc);
}

/* Safe to repeat (DBQ_RETRY): the database changes the effect only while
 * it is `unknown` because of this very attempt of this owner. */
static void resolve_late(struct worker *w, const char *id, int attempt, const struct outbox_result *res)
{
	struct late_call *lc = text_alloc(sizeof(*lc));
	char att[16], status[16];
	const char *params[6];

	text_copy(lc->id, id, sizeof(lc->id));
	lc->attempt = attempt;
	text_copy(lc->provider_id, res->provider_id, sizeof(lc->provider_id));
	providers_scrub(lc->provider_id, sizeof(lc->provider_id));
	if (!utf8_valid(lc->provider_id, strlen(lc->provider_id)))
		lc->provider_id[0] = '\0';
	snprintf(att, sizeof(att), "%d", attempt);
	snprintf(status, sizeof(status), "%d", res->status);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = lc->id;
	params[3] = att;
	params[4] = status;
	params[5] = lc->provider_id;
	worker_query(w->rec, SQL_RESOLVE_LATE, params, on_late_resolved, lc, DBQ_RETRY);
}

/* host->late_result, through plugin.c, on the loop thread. */
void on_late_result(void *arg, const char *provider, const char *effect_id, int attempt,
                    const struct outbox_result *res)
{
	struct worker *w = arg;
	struct effect *e;

	if (res->outcome != OUTCOME_ACCEPTED)
		return;
	log_event(OLOG_INFO, "late_acceptance",
	          json_pack("{s:s,s:s,s:i,s:i}", "provider", provider, "effect_id", effect_id,
	                    "attempt", attempt, "status", res->status));
	e = held_find(w, effect_id);
	if (e != NULL && e->view.attempt == attempt &&
	    (e->phase == PH_DONE || e->phase == PH_RECORDING)) {
		/* Its ambiguous verdict is not recorded yet (queued or on the
		 * wire): resolved once on_complete() has it.  Held in any other
		 * phase (being reconciled), the verdict is in the database. */
		if (e->late == NULL)
			e->late = text_alloc(sizeof(*e->late));
		*e->late = *res;
		return;
	}
	resolve_late(w, effect_id, attempt, res);
}

/* The effect's own verdict is recorded: now the late acceptance. */
void late_resolve_recorded(struct worker *w, struct effect *e)
{
	resolve_late(w, e->id, e->view.attempt, e->late);
}

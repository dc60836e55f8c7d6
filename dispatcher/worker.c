/*
 * worker.c: the dispatcher's engine (see worker.h).
 *
 * An effect's life in one worker, each step a batch and one round trip:
 *
 *   lease        outbox_lease(): pending rows get this worker's lease
 *   validate     payload parsed and checked by its provider; bad rows go
 *                to outbox_fail_invalid() with the reason (nothing sent)
 *   wait         until its provider and host have a free slot and the
 *                host's breaker lets it through (lease renewed meanwhile)
 *   mark         outbox_mark_sending(): the CAS to `sending` under the
 *                kill-switch lock; blocked rows are released by the same
 *                call, lost rows are dropped
 *   send         provider->send(); its done callback records the outcome
 *   record       outbox_complete(): attempts-log row + CAS to the state
 *                policy_decide() chose (completed, pending, failed, unknown);
 *                a late acceptance or not-sent of an attempt the reaper
 *                made `unknown` resolves it there (outbox_complete)
 *
 * Two connections: `db` (the lease connection: lease, mark, renew,
 * release; LISTEN) and `rec` (the records connection: housekeeping,
 * invalid rows, reconciliation, head scans in position mode).  Outcomes go
 * on `rec` while the queue is short and on `db` in a backlog
 * (outcomes_db()), so that a busy worker keeps one backend busy.
 *
 * Lease renewal (heartbeat), the reaper, unknown-type failing, provider
 * registration and reconciliation run from timers.  Nothing here blocks:
 * every database call goes through db.c, every send through a provider.
 */
#include "worker.h"

#include <event2/event.h>
#include <event2/thread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <unistd.h>

#include "config.h"
#include "db.h"
#include "hosts.h"
#include "lib/json_text.h"
#include "log.h"
#include "metrics.h"
#include "migrate.h"
#include "plugin.h"
#include "policy.h"
#include "sdnotify.h"
#include "util.h"

#define LISTEN_CHANNEL "effect_outbox"
#define HELD_BUCKETS 1024
#define RECONCILE_BATCH 50
#define RECONCILE_BATCH_STR "50"
#define RECONCILE_INTERVAL_MS 60000
/* Leasing from the position (see lease_batch()): scans from the head at
 * least this far apart, and at least HEAD_SCAN_FACTOR times as long as the
 * last one took, so that a head full of dead entries (vacuum held back)
 * costs the lease path at most a tenth of its time. */
#define HEAD_SCAN_MIN_MS 1000
#define HEAD_SCAN_FACTOR 10
/* Slow leases from the head in a row before leasing from the position: one
 * slow answer is more often a busy machine than a head full of dead
 * entries, and a switch makes late-committed rows wait for a head scan. */
#define HEAD_SLOW_STREAK 3
/* A head this slow is worth an operator's look (a long transaction holding
 * vacuum back): lease_mode is logged at warn.  Between lease_head_slow_ms
 * and this, a busy queue between two autovacuums: info. */
#define HEAD_SLOW_WARN_MS 100
/* A maintenance pass (reaper, sweep, gauges) starts at least this many
 * times its predecessor's duration after it ended: under a held-back
 * vacuum the reaper's and the gauge's index scans walk dead entries
 * (66 ms and 270 ms a call after a held minute, measured), and a pass every
 * maintenance_interval_ms spent a fifth of the records connection's time
 * on them (8 s of the database's 74 in a held-snapshot run; 2.8 s after).
 * Never more than half of lease_seconds, so the reaper still comes round
 * within a lease period. */
#ifndef MAINT_BACKOFF_FACTOR
#define MAINT_BACKOFF_FACTOR 10
#endif
/* The queue-lag gauge reads the due index from its head: asked again after
 * this many times its last answer's wait (a gauge a few seconds old is
 * still a gauge; 250 ms walks of a held-back head every 2.5 s were 4 % of
 * the database's CPU in a held-snapshot run).  Both can be set with -D
 * for an A/B build (docs/performance.md). */
#ifndef GAUGE_LAG_FACTOR
#define GAUGE_LAG_FACTOR 30
#endif
/* Full leases in a row that make a backlog: outcomes then go on the lease
 * connection (outcomes_db()).  One full lease is a burst of a steady load
 * (at 1,000/s, recording on the lease connection after any full lease
 * added 1-2 ms to the median); three are ~200 rows waiting. */
#ifndef BACKLOG_FULL_LEASES
#define BACKLOG_FULL_LEASES 3
#endif
/* The fleet-wide sweep of the pending backlog runs at most this often. */
#define SWEEP_MAX_EVERY_S 30
/* The weekly figures (an aggregate over this week's rows, outbox_weekly_figures) are recomputed
 * by one worker of the fleet at most this often; the others read them. */
#define WEEKLY_REFRESH_S "300"
/* Lease, mark, renew or complete statements refused in a row after which
 * /healthz fails: one refusal is a blip (a deadlock victim, a statement
 * timeout), three in a row a worker that cannot do its job. */
#define LEASE_ERRORS_UNHEALTHY 3

enum effect_phase {
	PH_WAITING,     /* leased, valid, waiting for a slot */
	PH_MARKING,     /* in an outbox_mark_sending() call */
	PH_SENDING,     /* the provider has it */
	PH_DONE,        /* outcome known, queued for outbox_complete() */
	PH_RECORDING,   /* in an outbox_complete() call */
	PH_RECONCILING, /* an unknown effect being asked about */
	PH_RECONCILED,  /* verdict known, queued for outbox_reconcile_record() */
};

struct effect {
	TAILQ_ENTRY(effect) link;
	struct effect *held_next;     /* in the worker's set of held ids */
	struct worker *w;
	enum effect_phase phase;
	char id[40];
	char *run_key, *type, *target, *payload_text, *payload_hash, *effect_key, *approved_by;
	size_t payload_len;           /* of payload_text (jsonb's text: no NUL inside) */
	json_t *payload;
	json_t *metadata;
	int prior_attempts;           /* attempts column when leased */
	int retry_base;               /* attempts before the current retry budget */
	struct provider_slot *prov;
	struct host_state *host;
	char host_key[256];
	struct outbox_effect view;    /* what the provider sees */
	int64_t started_wall_ms, started_mono_ms, ended_mono_ms;
	struct outbox_result result;
	struct policy_decision decision;
	struct outbox_recon_result recon;
	uint64_t renew_gen;
	bool lease_lost;
	/* The provider's acceptance that came after its ambiguous verdict,
	 * before that verdict was recorded: resolved once it is. */
	struct outbox_result *late;
};
TAILQ_HEAD(effect_list, effect);

/* glibc's sys/queue.h lacks the _SAFE variant. */
#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
	for ((var) = TAILQ_FIRST(head); (var) && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

struct batch {
	struct worker *w;
	uint64_t gen;
	bool from_head;               /* a lease that scanned the due index from its head */
	bool on_rec;                  /* a lease on the records connection (a head scan in position mode) */
	int64_t sent_mono;            /* when the statement was queued */
	char call[37];                /* outbox_mark_sending's call token */
	size_t n;
	struct effect *items[];
};

struct worker {
	struct event_base *base;
	char *config_path;
	struct config *cfg;
	struct core_settings s;
	struct provider_set providers;
	struct hosts *hosts;
	/* Two connections, so that the latency path never waits behind a
	 * completion batch or a maintenance query (measured at 1,000 effects/s:
	 * p99 57.7 -> 19.5 ms):
	 *   db   LISTEN, lease, mark, renew, release: what decides when a send
	 *        starts, and every statement that updates leased waiting rows
	 *        (one connection, so they cannot lock those rows in opposite
	 *        orders)
	 *   rec  complete, fail_invalid, reconcile, maintenance */
	struct db *db;
	struct db *rec;
	char owner[37];
	char name[128];
	char *instance;               /* --instance N, or NULL */
	char listen[128];             /* [metrics] listen for this instance */
	char name_cfg[128];           /* [dispatcher] worker_name for this instance */
	char types_array[1024];       /* {http,email}: types this worker serves */
	char idem_array[1024];        /* types whose provider honours keys */
	char recon_array[1024];       /* types whose provider reconciles */
	bool env_enabled;
	bool schema_ok;
	/* Readiness: READY=1 goes to systemd once, when both connections are
	 * up and the schema check passed; until then STATUS= says why not. */
	bool ready_sent;
	char schema_error[256];       /* the schema check's last failure */
	/* Health: lease, mark, renew and complete statements the database
	 * refused in a row (not lost connections: those are db_up's).  At
	 * LEASE_ERRORS_UNHEALTHY the worker cannot do its job: /healthz fails
	 * and STATUS= says why. */
	int lease_error_streak;
	char lease_error[256];
	bool stopping;

	struct effect_list waiting, sending, done_q, recon_q;
	/* Every effect this worker holds, by id: a row whose lease expired
	 * while it waited here can come back in a later lease of ours, and
	 * must not become a second copy. */
	struct effect *held[HELD_BUCKETS];
	int n_active;                 /* effects this worker holds, all phases */
	int leasing_rows;             /* rows asked for by leases on the wire */
	int n_sending;
	int n_reconciling;
	bool lease_busy, head_busy, mark_busy, complete_busy, recon_busy, recon_record_busy;
	/* A housekeeping pass is in flight until its last query (the gauges)
	 * answers, also across a lost connection: the rest of a cut pass runs
	 * after the reconnect, and a new pass beside it would pile up. */
	bool maint_busy;
	bool more_due;                /* the last lease came back full (cleared by the next lease) */
	int full_leases;              /* leases on the lease connection that came back full, in a row */
	/* The due-index position after the last row leased (SQL 007); empty:
	 * the next lease scans from the head. */
	char lease_after_at[48], lease_after_id[40];
	bool lease_from_position;     /* the head is slow: lease from the position */
	int head_slow_streak;         /* slow leases from the head in a row */
	int64_t lease_mode_warned_mono; /* the last "head is slow" warning */
	int64_t head_scan_due_mono;   /* then, the next lease from the head */
	int64_t gauge_lag_due_mono;   /* the next queue-lag gauge (it reads the due index's head) */
	int64_t maint_started_mono;   /* the maintenance pass in flight began */
	int64_t maint_due_mono;       /* no pass before (MAINT_BACKOFF_FACTOR) */
	bool maint_lost;              /* the records connection broke since the pass began */
	bool gauge_lag_asked;         /* the gauge query in flight includes the lag */
	bool lease_wanted;            /* a NOTIFY, a poll tick or a reconnect asked for a lease */
	bool recon_requested;
	bool recon_pass_asked;        /* the pass in progress answers an operator's request */
	int64_t recon_pass_start_mono;
	int64_t recon_next_mono;
	uint64_t renew_gen;
	int64_t last_register_mono;
	int64_t last_weekly_mono;
	int64_t complete_retry_mono;  /* after a refused outbox_complete() */

	struct event *pump_ev, *poll_ev, *heartbeat_ev, *maint_ev, *grace_ev;
	struct event *sigterm_ev, *sigint_ev, *sighup_ev;
};

static void worker_kick(struct worker *w);
static void worker_maybe_exit(struct worker *w);
static void release_waiting(struct worker *w);
static void build_type_arrays(struct worker *w);

/* An effect picked for a mark batch that will not be sent after all: a
 * half-open breaker must not wait forever for its probe. */
static void unmark_probe(struct effect *e)
{
	if (e->host && e->host->breaker == BREAKER_HALF_OPEN && e->host->in_flight == 0)
		e->host->probe_in_flight = false;
}

/* ---- effects ---------------------------------------------------------- */

static unsigned held_bucket(const char *id)
{
	unsigned v = 2166136261u;

	for (; *id; id++)
		v = (v ^ (unsigned char)*id) * 16777619u;
	return v % HELD_BUCKETS;
}

static struct effect *held_find(struct worker *w, const char *id)
{
	struct effect *e;

	for (e = w->held[held_bucket(id)]; e; e = e->held_next)
		if (strcmp(e->id, id) == 0)
			return e;
	return NULL;
}

static void held_add(struct worker *w, struct effect *e)
{
	unsigned b = held_bucket(e->id);

	e->held_next = w->held[b];
	w->held[b] = e;
}

static void held_remove(struct worker *w, struct effect *e)
{
	struct effect **pp = &w->held[held_bucket(e->id)];

	for (; *pp; pp = &(*pp)->held_next)
		if (*pp == e) {
			*pp = e->held_next;
			return;
		}
}

static void effect_free(struct effect *e)
{
	held_remove(e->w, e);
	e->w->n_active--;
	free(e->run_key);
	free(e->type);
	free(e->target);
	free(e->payload_text);
	free(e->payload_hash);
	free(e->effect_key);
	free(e->approved_by);
	json_decref(e->payload);
	json_decref(e->metadata);
	free(e->late);
	free(e);
}

static char *dup_field(PGresult *r, int row, int col)
{
	return PQgetisnull(r, row, col) ? NULL : xstrdup(PQgetvalue(r, row, col));
}

/* Columns: effect_id, idempotency_key, effect_type, target, payload,
 * payload_hash, effect_key, attempts[, metadata, approved_by] */
static struct effect *effect_from_row(struct worker *w, PGresult *r, int row, bool full)
{
	struct effect *e = xcalloc(1, sizeof(*e));

	e->w = w;
	w->n_active++;
	str_copy(e->id, PQgetvalue(r, row, 0), sizeof(e->id));
	e->run_key = dup_field(r, row, 1);
	e->type = dup_field(r, row, 2);
	e->target = dup_field(r, row, 3);
	e->payload_text = dup_field(r, row, 4);
	e->payload_len = e->payload_text ? (size_t)PQgetlength(r, row, 4) : 0;
	e->payload_hash = dup_field(r, row, 5);
	e->effect_key = dup_field(r, row, 6);
	e->prior_attempts = atoi(PQgetvalue(r, row, 7));
	if (full) {
		if (!PQgetisnull(r, row, 8))
			e->metadata = json_loads(PQgetvalue(r, row, 8), 0, NULL);
		e->approved_by = dup_field(r, row, 9);
		e->retry_base = atoi(PQgetvalue(r, row, 10));
	}
	e->prov = providers_find(&w->providers, e->type);
	held_add(w, e);
	return e;
}

static void effect_fill_view(struct effect *e, int attempt)
{
	e->view = (struct outbox_effect){
		.effect_id = e->id, .run_key = e->run_key, .effect_key = e->effect_key,
		.effect_type = e->type, .target = e->target, .payload = e->payload,
		.payload_hash = e->payload_hash, .attempt = attempt,
		.payload_text = e->payload_text ? e->payload_text : "", .payload_len = e->payload_len,
		.attempt_age_ms = -1,
	};
}

/* The payload as jansson values, for the provider's checks (what leaves is
 * payload_text: provider.h), without the members the provider reads from
 * the text (its text_members: http's body).  An integer beyond 64 bits is
 * valid JSON and jsonb keeps it; jansson refuses it unless integers are
 * read as doubles, so such a payload is read again that way.  NULL with
 * jansson's reason. */
static json_t *payload_parse(const struct effect *e, json_error_t *jerr)
{
	const char *text = e->payload_text ? e->payload_text : "";
	const char *const *skip = e->prov ? e->prov->ops->text_members : NULL;
	json_t *p = json_text_parse_except(text, e->payload_len, skip, JSON_DECODE_ANY, jerr);

	if (p == NULL && json_error_code(jerr) == json_error_numeric_overflow)
		p = json_text_parse_except(text, e->payload_len, skip,
		                           JSON_DECODE_ANY | JSON_DECODE_INT_AS_REAL, jerr);
	return p;
}

/* Parse and check an effect; false with the reason in err. */
static bool effect_validate(struct worker *w, struct effect *e, char *err, size_t errlen)
{
	json_error_t jerr;
	size_t len = e->payload_len;

	if (e->prov == NULL) {
		snprintf(err, errlen, "unknown effect type \"%.64s\": no provider loaded", e->type);
		return false;
	}
	if ((long)len > w->s.max_payload_bytes) {
		snprintf(err, errlen, "payload is %zu bytes, over the limit of %ld", len,
		         w->s.max_payload_bytes);
		return false;
	}
	e->payload = payload_parse(e, &jerr);
	if (e->payload == NULL) {
		/* PostgreSQL accepted it: deeper than jansson's limit is not "invalid". */
		if (json_error_code(&jerr) == json_error_stack_overflow)
			snprintf(err, errlen, "payload is nested too deeply (limit %d)", JSON_PARSER_MAX_DEPTH);
		else
			snprintf(err, errlen, "payload is not valid JSON: %s", jerr.text);
		return false;
	}
	if (!json_is_object(e->payload)) {
		snprintf(err, errlen, "payload must be a JSON object");
		return false;
	}
	effect_fill_view(e, e->prior_attempts + 1);
	err[0] = '\0';
	if (!e->prov->ops->validate(e->prov->self, &e->view, e->host_key, sizeof(e->host_key), err,
	                            errlen)) {
		if (err[0] == '\0')
			snprintf(err, errlen, "rejected by provider %s", e->prov->name);
		return false;
	}
	{
		char key[320];
		snprintf(key, sizeof(key), "%s|%s", e->prov->name, e->host_key);
		e->host = hosts_get(w->hosts, key);
	}
	return true;
}

static struct batch *batch_new(struct worker *w, size_t cap)
{
	struct batch *b = xcalloc(1, sizeof(*b) + cap * sizeof(struct effect *));

	b->w = w;
	return b;
}

/* A JSON array of uuid text, as a PostgreSQL array literal. */
static char *ids_array(struct effect **items, size_t n)
{
	size_t len = 3 + n * 38;
	char *s = xmalloc(len), *p = s;

	*p++ = '{';
	for (size_t i = 0; i < n; i++) {
		if (i)
			*p++ = ',';
		memcpy(p, items[i]->id, strlen(items[i]->id));
		p += strlen(items[i]->id);
	}
	*p++ = '}';
	*p = '\0';
	return s;
}

static bool pg_ok(PGresult *r, const char *what)
{
	if (r == NULL)
		return false;
	if (PQresultStatus(r) == PGRES_TUPLES_OK || PQresultStatus(r) == PGRES_COMMAND_OK)
		return true;
	log_msg(OLOG_ERROR, "db_error", "%s: %s", what, PQresultErrorMessage(r));
	return false;
}

/* ---- readiness and health ------------------------------------------------ */

/* The first line of a result's error, for STATUS= and /healthz. */
static void error_line(PGresult *r, char *buf, size_t len)
{
	str_copy(buf, r ? PQresultErrorMessage(r) : "connection lost", len);
	buf[strcspn(buf, "\r\n")] = '\0';
	if (strncmp(buf, "ERROR:  ", 8) == 0)
		memmove(buf, buf + 8, strlen(buf + 8) + 1);
}

/* pg_ok() for the statements a worker needs to do its job (lease, mark,
 * renew, complete): counts the database's refusals for /healthz, STATUS=
 * and outbox_lease_errors_total.  A lost connection (r == NULL) is not
 * counted here: db_up and the reconnects say that. */
static bool job_ok(struct worker *w, PGresult *r, const char *what)
{
	if (pg_ok(r, what)) {
		if (w->lease_error_streak >= LEASE_ERRORS_UNHEALTHY)
			sdnotify_status("serving again after %d refused statements", w->lease_error_streak);
		w->lease_error_streak = 0;
		return true;
	}
	if (r != NULL) {
		char line[200];

		error_line(r, line, sizeof(line));
		snprintf(w->lease_error, sizeof(w->lease_error), "%s: %s", what, line);
		metrics_inc(M_LEASE_ERRORS, 1);
		if (++w->lease_error_streak == LEASE_ERRORS_UNHEALTHY)
			sdnotify_status("cannot lease: %s", w->lease_error);
	}
	return false;
}

/* Why the worker cannot serve, or false when it can.  Shared by /healthz
 * and the STATUS= shown while it starts. */
static bool worker_why_not(const struct worker *w, char *why, size_t len)
{
	if (!db_is_up(w->db) || !db_is_up(w->rec)) {
		snprintf(why, len, "database unreachable: %s",
		         db_last_error(db_is_up(w->db) ? w->rec : w->db));
		return true;
	}
	if (!w->schema_ok) {
		snprintf(why, len, "%s", w->schema_error[0] ? w->schema_error : "checking the database schema");
		return true;
	}
	if (w->lease_error_streak >= LEASE_ERRORS_UNHEALTHY) {
		snprintf(why, len, "cannot lease: %s", w->lease_error);
		return true;
	}
	return false;
}

/* READY=1 once, when the worker can serve; before that, STATUS= says what
 * it waits for (database unreachable, permission denied, schema too old). */
static void readiness_update(struct worker *w)
{
	char why[512];

	if (w->ready_sent || w->stopping)
		return;
	if (worker_why_not(w, why, sizeof(why))) {
		sdnotify_status("starting: %s", why);
		return;
	}
	w->ready_sent = true;
	log_msg(OLOG_INFO, "serving", "both database connections up and the schema checked: serving");
	sdnotify_ready(w->env_enabled ? "ready" : "ready; AI_ACTIONS_ENABLED is not true: not sending");
}

/* ---- logging of one attempt -------------------------------------------- */

/* resolved: the state change applied to an `unknown` effect the reaper
 * had made of this attempt (outbox_complete), not under the lease. */
static void log_attempt(struct worker *w, struct effect *e, bool applied, const char *resolved)
{
	enum outbox_log_level level = !applied ? OLOG_WARN
	                              : e->result.outcome == OUTCOME_ACCEPTED ? OLOG_INFO
	                              : e->result.key_conflict ? OLOG_ERROR : OLOG_WARN;
	json_t *f;

	/* On the hot path: at [log] level = warn, accepted attempts are not
	 * printed, so their line is not built either. */
	if (!log_wants(level))
		return;
	f = json_pack("{s:s,s:s,s:s,s:s,s:s,s:i,s:s,s:s,s:i,s:I,s:i,s:b}",
	                      "run_key", e->run_key, "effect_id", e->id, "type", e->type,
	                      "target_class", e->host_key, "payload_hash", e->payload_hash ? e->payload_hash : "",
	                      "attempt", e->view.attempt, "outcome", outcome_name(e->result.outcome),
	                      "next_state", applied ? next_state_name(e->decision.next) : "lease_lost",
	                      "provider_status", e->result.status,
	                      "duration_ms", (json_int_t)(e->ended_mono_ms - e->started_mono_ms),
	                      "retry_count", e->view.attempt - 1, "lease_held", applied && !resolved);

	if (e->result.provider_id[0])
		json_object_set_new(f, "provider_id", json_string(e->result.provider_id));
	if (e->result.error[0])
		json_object_set_new(f, "error", json_string(e->result.error));
	if (resolved)
		json_object_set_new(f, "resolved", json_string(resolved));
	if (e->metadata)
		json_object_set(f, "metadata", e->metadata);
	if (e->approved_by)
		json_object_set_new(f, "approver", json_string(e->approved_by));
	if (e->decision.next == NEXT_PENDING && applied)
		json_object_set_new(f, "retry_in_ms", json_integer(e->decision.delay_ms));
	if (e->decision.exhausted)
		json_object_set_new(f, "retries_exhausted", json_true());
	log_event(level, "attempt", f);
}

/* ---- recording outcomes ------------------------------------------------- */

/* This attempt's late outcome resolved the `unknown` effect the reaper had
 * made of it (outbox_complete): counted and logged once, when the database says
 * so. */
static void log_resolved(struct effect *e, const char *how)
{
	metrics_count_unknown_resolved(how);
	log_event(OLOG_INFO, "unknown_resolved",
	          json_pack("{s:s,s:s,s:s,s:s,s:i,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
	                    "type", e->type, "how", how, "attempt", e->view.attempt, "provider_id",
	                    e->result.provider_id, "msg",
	                    strcmp(how, "late_accepted") == 0
	                            ? "the provider's late acceptance completed the unknown effect"
	                            : "the attempt given up on was not sent: back to pending, same key"));
}

/* ---- a provider's late acceptance (host->late_result) -------------------- */

struct late_call {
	struct worker *w;
	char id[40];
	int attempt;
	char provider_id[OUTBOX_PROVIDER_ID_MAX];
};

static void on_late_resolved(struct db *db, PGresult *r, void *arg)
{
	struct late_call *lc = arg;

	(void)db;
	if (pg_ok(r, "outbox_resolve_late_accepted") && PQntuples(r) == 1) {
		bool applied = !PQgetisnull(r, 0, 0);

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
	struct late_call *lc = xcalloc(1, sizeof(*lc));
	char att[16], status[16];
	const char *params[6];

	lc->w = w;
	str_copy(lc->id, id, sizeof(lc->id));
	lc->attempt = attempt;
	str_copy(lc->provider_id, res->provider_id, sizeof(lc->provider_id));
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
	db_query(w->rec, "SELECT outbox_resolve_late_accepted($1, $2, $3, $4, $5, $6)", 6, params,
	         on_late_resolved, lc, DBQ_RETRY);
}

static void on_late_result(void *arg, const char *provider, const char *effect_id, int attempt,
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
	if (e != NULL && e->view.attempt == attempt) {
		/* Its ambiguous verdict is not recorded yet (queued or on the
		 * wire): resolve once on_complete() has it. */
		if (e->late == NULL)
			e->late = xmalloc(sizeof(*e->late));
		*e->late = *res;
		return;
	}
	resolve_late(w, effect_id, attempt, res);
}

static void on_complete(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;

	(void)db;
	if (!job_ok(w, r, "outbox_complete")) {
		/* Keep the evidence: back to the queue, tried again after a
		 * pause (the database refused it; do not spin). */
		for (size_t i = b->n; i-- > 0;) {
			b->items[i]->phase = PH_DONE;
			TAILQ_INSERT_HEAD(&w->done_q, b->items[i], link);
		}
		free(b);
		w->complete_busy = false;
		w->complete_retry_mono = now_mono_ms() + 1000;
		return;
	}
	for (size_t i = 0; i < b->n; i++) {
		struct effect *e = b->items[i];
		bool applied = false;
		const char *resolved = NULL;

		for (int row = 0; row < PQntuples(r); row++)
			if (strcmp(PQgetvalue(r, row, 0), e->id) == 0) {
				applied = PQgetvalue(r, row, 1)[0] == 't';
				if (!PQgetisnull(r, row, 3))
					resolved = PQgetvalue(r, row, 3);
				break;
			}
		log_attempt(w, e, applied, resolved);
		if (resolved)
			log_resolved(e, resolved);
		if (e->late)
			resolve_late(w, e->id, e->view.attempt, e->late);
		if (!applied)
			metrics_inc(M_LEASE_LOST, 1);
		else if (e->decision.exhausted && e->decision.next == NEXT_FAILED)
			metrics_inc(M_RETRIES_EXHAUSTED, 1);
		effect_free(e);
	}
	free(b);
	w->complete_busy = false;
	worker_kick(w);
}

/* One outcome as an element of outbox_complete()'s p_results (the keys of
 * its jsonb_to_recordset; status, provider_id and error only when set).
 * Written as text: json_pack + json_dumps per batch was ~10 % of the
 * worker's instructions. */
static void completion_json(struct strbuf *sb, const struct effect *e)
{
	char ts[40];

	format_iso8601(e->started_wall_ms, ts, sizeof(ts));
	sb_puts(sb, "{\"effect_id\":");
	sb_json_string(sb, e->id);
	sb_puts(sb, ",\"attempt\":");
	sb_int(sb, e->view.attempt);
	sb_puts(sb, ",\"started_at\":");
	sb_json_string(sb, ts);
	sb_puts(sb, ",\"outcome\":");
	sb_json_string(sb, outcome_name(e->result.outcome));
	sb_puts(sb, ",\"next_state\":");
	sb_json_string(sb, next_state_name(e->decision.next));
	sb_puts(sb, ",\"retry_delay_ms\":");
	sb_int(sb, e->decision.delay_ms);
	if (e->result.status) {
		sb_puts(sb, ",\"status\":");
		sb_int(sb, e->result.status);
	}
	/* Both are valid UTF-8 (on_send_done() sees to it). */
	if (e->result.provider_id[0]) {
		sb_puts(sb, ",\"provider_id\":");
		sb_json_string(sb, e->result.provider_id);
	}
	if (e->result.error[0]) {
		sb_puts(sb, ",\"error\":");
		sb_json_string(sb, e->result.error);
	}
	sb_append(sb, "}", 1);
}

/* Where outcomes are recorded.  In a backlog (BACKLOG_FULL_LEASES full
 * leases in a row), on the lease connection, behind the latency path's urgent
 * queries: one busy backend per worker instead of two (two workers
 * draining a backlog on two cores: 12-25 % less database CPU and 11 % less
 * WAL per effect, see docs/performance.md).  Otherwise on the records
 * connection, so that a lease never waits for an outcome on the wire. */
static struct db *outcomes_db(const struct worker *w)
{
	return w->s.busy_connections == 1 && w->full_leases >= BACKLOG_FULL_LEASES && db_is_up(w->db)
	               ? w->db : w->rec;
}

static void flush_completions(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	struct strbuf js;
	const char *params[3];
	size_t n = 0;

	if (w->complete_busy || TAILQ_EMPTY(&w->done_q) || !db_is_up(outcomes_db(w)) ||
	    now_mono_ms() < w->complete_retry_mono)
		return;
	b = batch_new(w, (size_t)w->s.complete_batch);
	sb_init(&js, 4096);
	sb_append(&js, "[", 1);
	while ((e = TAILQ_FIRST(&w->done_q)) != NULL && n < (size_t)w->s.complete_batch) {
		TAILQ_REMOVE(&w->done_q, e, link);
		e->phase = PH_RECORDING;
		b->items[n++] = e;
		if (n > 1)
			sb_append(&js, ",", 1);
		completion_json(&js, e);
	}
	sb_append(&js, "]", 1);
	b->n = n;
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = js.s;
	w->complete_busy = true;
	/* Safe to repeat after a lost connection: CAS + unique attempt rows. */
	db_query(outcomes_db(w), "SELECT effect_id, applied, state, resolved FROM outbox_complete($1, $2, $3)", 3,
	         params, on_complete, b, DBQ_RETRY);
	free(js.s);
}

/* The provider's answer, on the loop thread. */
static void on_send_done(void *token, const struct outbox_result *res)
{
	struct effect *e = token;
	struct worker *w = e->w;
	struct provider_slot *p = e->prov;
	int64_t now = now_mono_ms();

	e->result = *res;
	e->result.provider_id[sizeof(e->result.provider_id) - 1] = '\0';
	e->result.error[sizeof(e->result.error) - 1] = '\0';
	if (!utf8_valid(e->result.error, strlen(e->result.error)))
		str_copy(e->result.error, "(provider error text was not UTF-8)", sizeof(e->result.error));
	if (!utf8_valid(e->result.provider_id, strlen(e->result.provider_id)))
		e->result.provider_id[0] = '\0';
	e->ended_mono_ms = now;
	e->decision = policy_decide(&e->result, e->view.attempt - e->retry_base, &p->policy,
	                            p->honours_keys);
	/* Every completed effect has a provider id (docs/design.md, "Providers"). */
	if (e->result.outcome == OUTCOME_ACCEPTED && e->result.provider_id[0] == '\0')
		snprintf(e->result.provider_id, sizeof(e->result.provider_id), "local:%s:%d:a%d",
		         p->name, e->result.status, e->view.attempt);
	p->in_flight--;
	if (host_send_done(e->host, &e->result, (int)p->policy.breaker_failures,
	                   p->policy.breaker_open_ms, now)) {
		metrics_inc(M_BREAKER_OPENED, 1);
		log_event(OLOG_WARN, "breaker_open",
		          json_pack("{s:s,s:s,s:I}", "provider", p->name, "host", e->host_key,
		                    "open_ms", (json_int_t)p->policy.breaker_open_ms));
	}
	if (e->result.key_conflict)
		metrics_inc(M_KEY_CONFLICTS, 1);
	metrics_count_send(p->name, outcome_name(e->result.outcome));
	metrics_observe_send(p->name, (double)(now - e->started_mono_ms) / 1000.0);
	TAILQ_REMOVE(&w->sending, e, link);
	w->n_sending--;
	metrics_set(G_IN_FLIGHT, w->n_sending);
	e->phase = PH_DONE;
	TAILQ_INSERT_TAIL(&w->done_q, e, link);
	worker_kick(w);
}

/* Hand the effect to its provider; with `refuse`, record it as not sent
 * instead (the same bookkeeping, no call). */
static void start_send(struct worker *w, struct effect *e, int attempt, const char *refuse)
{
	char err[OUTBOX_ERROR_MAX] = "";

	effect_fill_view(e, attempt);
	e->phase = PH_SENDING;
	e->started_wall_ms = now_wall_ms();
	e->started_mono_ms = now_mono_ms();
	e->prov->in_flight++;
	host_send_started(e->host);
	TAILQ_INSERT_TAIL(&w->sending, e, link);
	w->n_sending++;
	metrics_set(G_IN_FLIGHT, w->n_sending);
	if (refuse) {
		struct outbox_result r = { .outcome = OUTCOME_NOT_SENT, .retry_after_ms = -1 };
		snprintf(r.error, sizeof(r.error), "not sent: %.480s", refuse);
		on_send_done(e, &r);
	} else if (!e->prov->ops->send(e->prov->self, &e->view, on_send_done, e, err, sizeof(err))) {
		struct outbox_result r = { .outcome = OUTCOME_NOT_SENT, .retry_after_ms = -1 };
		snprintf(r.error, sizeof(r.error), "could not start: %.480s", err[0] ? err : "provider refused");
		on_send_done(e, &r);
	}
}

/* ---- the sending transition --------------------------------------------- */

static void on_marked(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	size_t blocked = 0, lost = 0;
	json_t *blocked_ids = NULL;

	(void)db;
	w->mark_busy = false;
	if (!job_ok(w, r, "outbox_mark_sending")) {
		/* Not sent, not marked (or the retry will find them): the leases
		 * expire and the rows are leased again; nothing was sent. */
		for (size_t i = 0; i < b->n; i++) {
			unmark_probe(b->items[i]);
			effect_free(b->items[i]);
		}
		free(b);
		worker_kick(w);
		return;
	}
	for (size_t i = 0; i < b->n; i++) {
		struct effect *e = b->items[i];
		int row = -1;

		for (int k = 0; k < PQntuples(r); k++)
			if (strcmp(PQgetvalue(r, k, 0), e->id) == 0) {
				row = k;
				break;
			}
		if (row < 0) {
			/* CAS found the lease gone (expired, cancelled, taken). */
			lost++;
			metrics_inc(M_LEASE_LOST, 1);
			log_event(OLOG_WARN, "lease_lost",
			          json_pack("{s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
			                    "phase", "mark_sending"));
			unmark_probe(e);
			effect_free(e);
		} else if (PQgetvalue(r, row, 2)[0] == 't') {
			blocked++;
			if (blocked_ids == NULL)
				blocked_ids = json_array();
			if (json_array_size(blocked_ids) < 20)
				json_array_append_new(blocked_ids, json_string(e->id));
			unmark_probe(e);
			effect_free(e);
		} else {
			/* An answer that came so late (a stopped process, a stalled
			 * database) that the lease may have lapsed, and the reaper
			 * or a kill switch turned off meanwhile moved on: send
			 * nothing, record it as not sent. */
			bool late = now_mono_ms() - b->sent_mono > w->s.lease_seconds * 1000 * 2 / 3;
			start_send(w, e, atoi(PQgetvalue(r, row, 1)),
			           late ? "the sending transition was confirmed too late to act on" : NULL);
		}
	}
	if (blocked) {
		metrics_inc(M_KILL_SWITCH_BLOCKED, blocked);
		metrics_set(G_KILL_SWITCH_ON, 0);
		log_event(OLOG_WARN, "kill_switch_blocked",
		          json_pack("{s:I,s:o,s:s}", "count", (json_int_t)blocked, "effect_ids",
		                    blocked_ids, "msg",
		                    "kill switch is off: leases released, no attempt spent"));
	}
	(void)lost;
	free(b);
	worker_kick(w);
}

/* Move effects whose provider and host have room from waiting to a mark
 * batch; release those whose host's breaker is open. */
static void mark_ready(struct worker *w)
{
	struct effect *e, *next;
	struct batch *b, *rel = NULL;
	int64_t now = now_mono_ms(), rel_delay = 0;
	char *ids;
	const char *params[6];
	char lease[16];

	/* Both connections: a send needs its lease renewed and its outcome
	 * recorded, which happen on the other one. */
	if (w->mark_busy || TAILQ_EMPTY(&w->waiting) || !db_is_up(w->db) || !db_is_up(w->rec) ||
	    w->stopping)
		return;
	b = batch_new(w, (size_t)w->s.batch_size * 4);
	for (e = TAILQ_FIRST(&w->waiting); e && b->n < (size_t)w->s.batch_size * 4; e = next) {
		int64_t wait_ms;
		int pending_for_host = 0;
		next = TAILQ_NEXT(e, link);
		int pending_for_prov = 0;
		for (size_t i = 0; i < b->n; i++) {
			pending_for_host += b->items[i]->host == e->host;
			pending_for_prov += b->items[i]->prov == e->prov;
		}
		if (e->prov->in_flight + pending_for_prov >= e->prov->policy.max_in_flight)
			continue;
		if (!host_may_send(e->host, (int)e->prov->policy.max_per_host - pending_for_host, now,
		                   &wait_ms)) {
			if (wait_ms > 0) {
				/* Breaker open: give it back, due when the breaker
				 * half-opens; no attempt is spent. */
				if (rel == NULL)
					rel = batch_new(w, (size_t)w->n_active + 1);
				TAILQ_REMOVE(&w->waiting, e, link);
				rel->items[rel->n++] = e;
				if (wait_ms > rel_delay)
					rel_delay = wait_ms;
			}
			continue;
		}
		TAILQ_REMOVE(&w->waiting, e, link);
		e->phase = PH_MARKING;
		b->items[b->n++] = e;
		/* Count a half-open probe now so only one goes through. */
		if (e->host->breaker == BREAKER_HALF_OPEN)
			e->host->probe_in_flight = true;
	}
	if (rel) {
		char delay[24];
		ids = ids_array(rel->items, rel->n);
		snprintf(delay, sizeof(delay), "%lld", (long long)rel_delay);
		params[0] = w->owner;
		params[1] = ids;
		params[2] = delay;
		db_query(w->db, "SELECT outbox_release($1, $2, $3)", 3, params, NULL, NULL, DBQ_RETRY);
		free(ids);
		for (size_t i = 0; i < rel->n; i++)
			effect_free(rel->items[i]);
		free(rel);
	}
	if (b->n == 0) {
		free(b);
		return;
	}
	ids = ids_array(b->items, b->n);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	uuid_v4(b->call);
	b->sent_mono = now_mono_ms();
	params[0] = w->owner;
	params[1] = ids;
	params[2] = w->env_enabled ? "true" : "false";
	params[3] = w->idem_array;
	params[4] = lease;
	params[5] = b->call;
	w->mark_busy = true;
	/* Repeatable: the same call token gets its own rows back. */
	db_query(w->db, "SELECT effect_id, attempts, blocked FROM outbox_mark_sending($1, $2, $3, $4, $5, $6)",
	         6, params, on_marked, b, DBQ_RETRY | DBQ_URGENT);
	free(ids);
}

/* ---- leasing ------------------------------------------------------------ */

/* Rows come back in due-index order; the position is after the last one.
 * In position mode a scan from the head only picks up what became due
 * behind the position, which stays where it is (ahead).  `took` is the
 * lease's time on the wire and in the server (not its wait in the queue).
 * HEAD_SLOW_STREAK slow scans from the head in a row switch to leasing from
 * the position, with the next scan from the head HEAD_SCAN_FACTOR times the
 * last one's duration later; a fast one switches back. */
static void lease_cursor_update(struct worker *w, PGresult *r, bool from_head, int64_t took)
{
	int n = PQntuples(r);
	int64_t now = now_mono_ms();
	bool was_position = w->lease_from_position;

	if (from_head) {
		bool slow;
		int64_t wait = took * HEAD_SCAN_FACTOR;

		w->head_slow_streak = w->s.lease_head_slow_ms == 0 || took > w->s.lease_head_slow_ms
		                      ? w->head_slow_streak + 1 : 0;
		/* Into position mode after a streak; out of it at the first fast
		 * scan from the head. */
		slow = w->lease_from_position ? w->head_slow_streak > 0
		                              : w->head_slow_streak >= HEAD_SLOW_STREAK;

		/* Warn once a minute at most: under a held-back vacuum the head
		 * can be fast and slow by turns. */
		bool warn = slow && took >= HEAD_SLOW_WARN_MS &&
		            now - w->lease_mode_warned_mono > 60000;

		if (warn)
			w->lease_mode_warned_mono = now;
		/* A change of mode at info; a slow head at warn, also while the
		 * mode stays (a snapshot held for an hour is still news). */
		if (slow != w->lease_from_position || warn) {
			const char *msg =
				!slow ? "the due index's head is fast again: leasing from the head"
				: warn ? "the due index's head is slow (dead entries: is a long transaction "
				         "holding vacuum back?): leasing from the last position, from the "
				         "head only now and then"
				       : "the due index's head is slower than lease_head_slow_ms (dead entries "
				         "of a busy queue between vacuums): leasing from the last position, "
				         "from the head only now and then";

			log_event(warn ? OLOG_WARN : OLOG_INFO, "lease_mode",
			          json_pack("{s:s,s:I,s:s}", "mode", slow ? "position" : "head",
			                    "head_scan_ms", (json_int_t)took, "msg", msg));
		}
		w->lease_from_position = slow;
		w->head_scan_due_mono = now + (wait > HEAD_SCAN_MIN_MS ? wait : HEAD_SCAN_MIN_MS);
	}
	/* While leasing from the head the position follows every lease, so that
	 * it is current when the head turns slow. */
	if (n == 0 || (from_head && was_position && w->lease_after_id[0]))
		return;
	str_copy(w->lease_after_at, PQgetvalue(r, n - 1, 11), sizeof(w->lease_after_at));
	str_copy(w->lease_after_id, PQgetvalue(r, n - 1, 0), sizeof(w->lease_after_id));
}

/* Forget the position: the next lease scans from the head (rows given back
 * behind it, e.g. while the kill switch was off, or a new connection). */
static void lease_cursor_reset(struct worker *w)
{
	w->lease_after_at[0] = '\0';
	w->lease_after_id[0] = '\0';
}

static void on_leased(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;   /* carries w, the limit in gen, from_head and on_rec */
	struct worker *w = b->w;
	int limit = (int)b->gen;
	bool from_head = b->from_head;
	json_t *invalid = NULL;
	struct effect **again = NULL;
	size_t n_again = 0;

	bool b_on_rec = b->on_rec;

	if (b_on_rec)
		w->head_busy = false;
	else
		w->lease_busy = false;
	w->leasing_rows -= limit;
	free(b);
	if (!job_ok(w, r, "outbox_lease")) {
		w->more_due = false;
		return;
	}
	w->more_due = PQntuples(r) >= limit;
	if (!b_on_rec)
		w->full_leases = w->more_due ? w->full_leases + 1 : 0;
	metrics_inc(M_LEASED, (unsigned long)PQntuples(r));
	lease_cursor_update(w, r, from_head, now_mono_ms() - db_head_sent_mono(db));
	for (int row = 0; row < PQntuples(r); row++) {
		struct effect *e, *held = held_find(w, PQgetvalue(r, row, 0));
		char err[OUTBOX_ERROR_MAX];

		if (held && (held->phase == PH_DONE || held->phase == PH_RECORDING ||
		             held->phase == PH_RECONCILING || held->phase == PH_RECONCILED)) {
			/* A retry whose outcome (or reconciliation verdict)
			 * committed on the other connection before we read its
			 * answer: not ours to send yet; back to the queue, due
			 * again shortly. */
			if (again == NULL)
				again = xcalloc((size_t)PQntuples(r), sizeof(*again));
			again[n_again++] = held;
			continue;
		}
		if (held) {
			/* Ours already (its lease had lapsed while it waited): the
			 * lease is fresh again; keep the one copy we have. */
			continue;
		}
		e = effect_from_row(w, r, row, true);

		if (!effect_validate(w, e, err, sizeof(err))) {
			if (invalid == NULL)
				invalid = json_array();
			json_array_append_new(invalid, json_pack("{s:s,s:s,s:s}", "effect_id", e->id,
			                                         "error_class", "invalid", "error", err));
			log_event(OLOG_WARN, "effect_invalid",
			          json_pack("{s:s,s:s,s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
			                    "type", e->type, "payload_hash",
			                    e->payload_hash ? e->payload_hash : "", "error", err));
			metrics_inc(M_INVALID, 1);
			effect_free(e);
			continue;
		}
		e->phase = PH_WAITING;
		TAILQ_INSERT_TAIL(&w->waiting, e, link);
	}
	if (invalid) {
		char *js = json_dumps(invalid, JSON_COMPACT);
		const char *params[2] = { w->owner, js };
		db_query(w->rec, "SELECT effect_id FROM outbox_fail_invalid($1, $2)", 2, params, NULL,
		         NULL, DBQ_RETRY);
		free(js);
		json_decref(invalid);
	}
	if (again) {
		char *ids = ids_array(again, n_again);
		const char *params[3] = { w->owner, ids, "100" };
		db_query(w->db, "SELECT outbox_release($1, $2, $3)", 3, params, NULL, NULL, DBQ_RETRY);
		free(ids);
		free(again);
	}
	/* A lease that was on the wire when SIGTERM came: give it back. */
	if (w->stopping)
		release_waiting(w);
	worker_kick(w);
}

/* One outbox_lease() call on `db`, from the head or from the position. */
static void lease_send(struct worker *w, struct db *db, bool from_head, int limit)
{
	char lim[16], lease[16];
	const char *params[8];
	struct batch *b = batch_new(w, 0);

	snprintf(lim, sizeof(lim), "%d", limit);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = lim;
	params[3] = lease;
	params[4] = w->types_array;
	params[5] = w->env_enabled ? "true" : "false";
	params[6] = from_head ? NULL : w->lease_after_at;
	params[7] = from_head ? NULL : w->lease_after_id;
	b->gen = (uint64_t)limit;
	b->from_head = from_head;
	b->on_rec = db == w->rec;
	if (b->on_rec)
		w->head_busy = true;
	else
		w->lease_busy = true;
	w->leasing_rows += limit;
	db_query(db,
	         "SELECT effect_id, idempotency_key, effect_type, target, payload, payload_hash, "
	         "effect_key, attempts, metadata, approved_by, retry_base, available_at "
	         "FROM outbox_lease($1, $2, $3, $4, $5, $6, $7, $8)",
	         8, params, on_leased, b, b->on_rec ? 0 : DBQ_URGENT);
}

/* A busy worker leases only once at least half a batch fits: a round trip
 * per few rows costs the database more than the rows themselves. */
static bool lease_worth_it(const struct worker *w, int limit, int full)
{
	return limit > 0 && (w->n_active + w->leasing_rows == 0 || limit * 2 >= full);
}

static void lease_batch(struct worker *w)
{
	int full = w->s.max_in_flight < w->s.batch_size ? (int)w->s.max_in_flight : (int)w->s.batch_size;
	int room = (int)w->s.max_in_flight - w->n_active - w->leasing_rows;
	int limit = room < full ? room : full;
	bool position = w->lease_from_position && w->lease_after_id[0] != '\0';
	bool issued = false;

	if (w->stopping || !w->schema_ok || !db_is_up(w->db) || !db_is_up(w->rec))
		return;
	/* Lease only when there may be work: after a full batch, a NOTIFY, a
	 * poll tick or a reconnect.  An empty answer ends the burst. */
	if (!w->more_due && !w->lease_wanted)
		return;
	/* Do not lease more than can be marked soon: rows waiting for a slot
	 * already cover the next batch. */
	if (!TAILQ_EMPTY(&w->waiting) && w->n_active - w->n_sending >= (int)w->s.batch_size)
		return;
	/* From the head of the due index, which finds every due row.  While
	 * that is slow (the entries earlier rows left there pile up when a
	 * long transaction holds vacuum back), from the position after the
	 * last row leased; and from the head now and then for rows that became
	 * due behind it, on the other connection, so that its walk never holds
	 * up the latency path. */
	if (position && !w->head_busy && now_mono_ms() >= w->head_scan_due_mono &&
	    lease_worth_it(w, limit, full)) {
		lease_send(w, w->rec, true, limit);
		issued = true;
		room -= limit;
		limit = room < full ? room : full;
	}
	if (!w->lease_busy && lease_worth_it(w, limit, full)) {
		lease_send(w, w->db, !position, limit);
		issued = true;
	}
	if (issued) {
		w->more_due = false;
		w->lease_wanted = false;
	}
}

/* ---- reconciliation ----------------------------------------------------- */

static void on_recon_recorded(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;

	(void)db;
	/* Count what the answers resolved (applied: the effect was still
	 * unknown and ours to move). */
	if (pg_ok(r, "outbox_reconcile_record"))
		for (int row = 0; row < PQntuples(r); row++) {
			const char *st = PQgetvalue(r, row, 2);
			if (PQgetvalue(r, row, 1)[0] != 't')
				continue;
			if (strcmp(st, "completed") == 0)
				metrics_count_unknown_resolved("lookup_sent");
			else if (strcmp(st, "pending") == 0)
				metrics_count_unknown_resolved("lookup_not_sent");
		}
	for (size_t i = 0; i < b->n; i++)
		effect_free(b->items[i]);
	free(b);
	w->recon_record_busy = false;
	worker_kick(w);
}

static void flush_reconciled(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	json_t *arr;
	char *js;
	const char *params[3];

	if (w->recon_record_busy || TAILQ_EMPTY(&w->recon_q) || !db_is_up(w->rec))
		return;
	b = batch_new(w, RECONCILE_BATCH);
	arr = json_array();
	while ((e = TAILQ_FIRST(&w->recon_q)) != NULL && b->n < RECONCILE_BATCH) {
		static const char *const verdicts[] = { "sent", "not_sent", "unknown" };
		json_t *o;
		TAILQ_REMOVE(&w->recon_q, e, link);
		b->items[b->n++] = e;
		o = json_pack("{s:s,s:s}", "effect_id", e->id, "verdict", verdicts[e->recon.verdict]);
		if (e->recon.status)
			json_object_set_new(o, "status", json_integer(e->recon.status));
		if (e->recon.provider_id[0])
			json_object_set_new(o, "provider_id", json_string(e->recon.provider_id));
		if (e->recon.error[0])
			json_object_set_new(o, "error", json_string(e->recon.error));
		json_array_append_new(arr, o);
		log_event(OLOG_INFO, "reconciled",
		          json_pack("{s:s,s:s,s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
		                    "type", e->type, "verdict", verdicts[e->recon.verdict],
		                    "provider_id", e->recon.provider_id));
	}
	js = json_dumps(arr, JSON_COMPACT);
	json_decref(arr);
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = js;
	w->recon_record_busy = true;
	db_query(w->rec, "SELECT * FROM outbox_reconcile_record($1, $2, $3)", 3, params,
	         on_recon_recorded, b, DBQ_RETRY);
	free(js);
}

static void on_recon_done(void *token, const struct outbox_recon_result *res)
{
	struct effect *e = token;
	struct worker *w = e->w;

	e->recon = *res;
	e->recon.provider_id[sizeof(e->recon.provider_id) - 1] = '\0';
	e->recon.error[sizeof(e->recon.error) - 1] = '\0';
	if (!utf8_valid(e->recon.error, strlen(e->recon.error)))
		e->recon.error[0] = '\0';
	if (!utf8_valid(e->recon.provider_id, strlen(e->recon.provider_id)))
		e->recon.provider_id[0] = '\0';
	if ((unsigned)e->recon.verdict > RECON_CANNOT_TELL)
		e->recon.verdict = RECON_CANNOT_TELL;
	e->phase = PH_RECONCILED;
	w->n_reconciling--;
	TAILQ_INSERT_TAIL(&w->recon_q, e, link);
	worker_kick(w);
}

static void on_recon_leased(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;

	(void)db;
	w->recon_busy = false;
	if (!pg_ok(r, "outbox_reconcile_lease"))
		return;
	/* A full batch of an operator's pass: more may be waiting; otherwise
	 * the pass is over. */
	if (w->recon_pass_asked && PQntuples(r) >= RECONCILE_BATCH)
		w->recon_requested = true;
	else
		w->recon_pass_asked = false;
	for (int row = 0; row < PQntuples(r); row++) {
		struct effect *e;
		char err[OUTBOX_ERROR_MAX] = "";
		json_error_t jerr;

		if (held_find(w, PQgetvalue(r, row, 0)))
			continue;
		e = effect_from_row(w, r, row, false);

		e->phase = PH_RECONCILING;
		w->n_reconciling++;
		e->payload = payload_parse(e, &jerr);
		if (e->prov == NULL || !e->prov->can_reconcile || e->payload == NULL) {
			struct outbox_recon_result rr = { .verdict = RECON_CANNOT_TELL };
			str_copy(rr.error, "no provider here can reconcile it", sizeof(rr.error));
			on_recon_done(e, &rr);
			continue;
		}
		effect_fill_view(e, e->prior_attempts);
		if (!PQgetisnull(r, row, 8))
			e->view.attempt_age_ms = strtoll(PQgetvalue(r, row, 8), NULL, 10);
		if (!e->prov->ops->reconcile(e->prov->self, &e->view, on_recon_done, e, err, sizeof(err))) {
			struct outbox_recon_result rr = { .verdict = RECON_CANNOT_TELL };
			snprintf(rr.error, sizeof(rr.error), "could not ask: %.480s", err);
			on_recon_done(e, &rr);
		}
	}
	worker_kick(w);
}

static void reconcile_pass(struct worker *w, bool asked)
{
	const char *params[5];
	char interval[24];

	if (w->recon_busy || w->stopping || !w->schema_ok || !db_is_up(w->rec) ||
	    strcmp(w->recon_array, "{}") == 0 || w->n_reconciling > 0)
		return;
	/* An operator's request re-asks everything; the periodic pass leaves
	 * recently asked effects alone. */
	/* An asked-for pass re-asks everything in its first batch; its later
	 * batches skip what this pass has already asked. */
	if (!asked) {
		snprintf(interval, sizeof(interval), "%d", RECONCILE_INTERVAL_MS / 1000);
	} else if (!w->recon_pass_asked) {
		w->recon_pass_start_mono = now_mono_ms();
		snprintf(interval, sizeof(interval), "0");
	} else {
		snprintf(interval, sizeof(interval), "%ld",
		         (long)((now_mono_ms() - w->recon_pass_start_mono) / 1000 + 1));
	}
	w->recon_pass_asked = asked;
	params[0] = w->owner;
	params[1] = w->name;
	params[2] = w->recon_array;
	params[3] = RECONCILE_BATCH_STR;
	params[4] = interval;
	w->recon_busy = true;
	w->recon_requested = false;
	db_query(w->rec,
	         "SELECT effect_id, idempotency_key, effect_type, target, payload, payload_hash, "
	         "effect_key, attempts, attempt_age_ms FROM outbox_reconcile_lease($1, $2, $3, $4, $5)",
	         5, params, on_recon_leased, w, 0);
}

/* ---- the pump: what to do next ------------------------------------------ */

static void on_pump(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;

	(void)fd;
	(void)what;
	/* Each step checks the connection it needs. */
	flush_completions(w);
	flush_reconciled(w);
	mark_ready(w);
	if (!w->stopping) {
		lease_batch(w);
		if (w->recon_requested)
			reconcile_pass(w, true);
	}
	worker_maybe_exit(w);
}

static void worker_kick(struct worker *w)
{
	event_active(w->pump_ev, EV_TIMEOUT, 0);
}

static void on_poll(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;

	(void)fd;
	(void)what;
	w->lease_wanted = true;
	worker_kick(w);
}

/* ---- heartbeat: lease renewal ------------------------------------------- */

static void on_renewed(struct db *db, PGresult *r, void *arg)
{
	struct batch *b = arg;
	struct worker *w = b->w;
	struct effect *e, *next;

	(void)db;
	if (!job_ok(w, r, "outbox_renew")) {
		free(b);
		return;
	}
	/* Effects included in this renewal that did not come back lost their
	 * lease: a waiting one is dropped, a sending one is flagged (its
	 * outcome is still recorded; the CAS will say it was lost). */
	TAILQ_FOREACH_SAFE(e, &w->sending, link, next) {
		bool found = false;
		if (e->renew_gen != b->gen || e->lease_lost)
			continue;
		for (int row = 0; row < PQntuples(r) && !found; row++)
			found = strcmp(PQgetvalue(r, row, 0), e->id) == 0;
		if (!found) {
			e->lease_lost = true;
			log_event(OLOG_WARN, "lease_lost",
			          json_pack("{s:s,s:s,s:s}", "effect_id", e->id, "run_key", e->run_key,
			                    "phase", "sending"));
		}
	}
	TAILQ_FOREACH_SAFE(e, &w->waiting, link, next) {
		bool found = false;
		if (e->renew_gen != b->gen)
			continue;
		for (int row = 0; row < PQntuples(r) && !found; row++)
			found = strcmp(PQgetvalue(r, row, 0), e->id) == 0;
		if (!found) {
			TAILQ_REMOVE(&w->waiting, e, link);
			metrics_inc(M_LEASE_LOST, 1);
			effect_free(e);
		}
	}
	free(b);
	worker_kick(w);   /* room for a lease */
}

static void on_heartbeat(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;
	struct effect *e;
	struct batch *b;
	char *ids, lease[16], cap[16];
	const char *params[4];

	(void)fd;
	(void)what;
	if (!db_is_up(w->db) || (TAILQ_EMPTY(&w->sending) && TAILQ_EMPTY(&w->waiting)))
		return;
	b = batch_new(w, (size_t)w->n_active + 1);
	b->gen = ++w->renew_gen;
	TAILQ_FOREACH(e, &w->sending, link) {
		/* cppcheck-suppress uninitvar ; e is a list element, set by the macro */
		if (e->lease_lost)
			continue;
		e->renew_gen = b->gen;
		b->items[b->n++] = e;
	}
	TAILQ_FOREACH(e, &w->waiting, link) {
		e->renew_gen = b->gen;
		b->items[b->n++] = e;
	}
	ids = ids_array(b->items, b->n);
	snprintf(lease, sizeof(lease), "%ld", w->s.lease_seconds);
	snprintf(cap, sizeof(cap), "%ld", w->s.max_lease_seconds);
	params[0] = w->owner;
	params[1] = ids;
	params[2] = lease;
	params[3] = cap;
	/* The batch is only a generation marker now: effects may be freed
	 * before the answer, so on_renewed walks the live lists instead. */
	b->n = 0;
	/* On the lease connection, like mark and release, which update the
	 * same waiting rows: two connections could lock them in opposite
	 * orders and deadlock. */
	db_query(w->db, "SELECT effect_id FROM outbox_renew($1, $2, $3, $4)", 4, params, on_renewed,
	         b, 0);
	free(ids);
}

/* ---- maintenance: reaper, unknown types, registration, gauges ----------- */

static void on_reaped(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;

	(void)db;
	if (!pg_ok(r, "outbox_reap"))
		return;
	for (int row = 0; row < PQntuples(r); row++) {
		bool unknown = strcmp(PQgetvalue(r, row, 1), "unknown") == 0;
		metrics_inc(unknown ? M_REAPED_UNKNOWN : M_REAPED_PENDING, 1);
		log_event(OLOG_WARN, "reaped",
		          json_pack("{s:s,s:s,s:s,s:s}", "effect_id", PQgetvalue(r, row, 0), "state",
		                    PQgetvalue(r, row, 1), "lost_worker", PQgetvalue(r, row, 2), "msg",
		                    unknown ? "lease expired while sending: outcome unknown, not re-sent"
		                            : "lease expired while sending: provider honours keys, retried with the same key"));
	}
	(void)w;
}

static void on_swept(struct db *db, PGresult *r, void *arg)
{
	(void)db;
	(void)arg;
	if (!pg_ok(r, "outbox_sweep"))
		return;
	for (int row = 0; row < PQntuples(r); row++) {
		metrics_inc(M_INVALID, 1);
		log_event(OLOG_WARN, "effect_invalid",
		          json_pack("{s:s,s:s,s:s}", "effect_id", PQgetvalue(r, row, 0), "type",
		                    PQgetvalue(r, row, 1), "error", "unknown effect type: no worker serves it"));
	}
}

static void on_gauges(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;
	bool lag = w->gauge_lag_asked;
	bool ok = pg_ok(r, "gauges") && PQntuples(r) == 1;

	w->maint_busy = false;
	w->gauge_lag_asked = false;
	/* Only a whole pass on one connection is timed: one that a lost
	 * connection cut (its rest ran after the reconnect) would charge the
	 * outage to housekeeping and stop it for ten times as long. */
	if (ok && !w->maint_lost) {
		int64_t took = now_mono_ms() - w->maint_started_mono;
		int64_t wait = took * MAINT_BACKOFF_FACTOR;
		/* The reaper must still come round within a lease period. */
		int64_t cap = w->s.lease_seconds * 1000 / 2;

		w->maint_due_mono = now_mono_ms() + (wait < cap ? wait : cap);
		metrics_inc(M_MAINT_PASSES, 1);
		metrics_set(G_MAINT_PASS_SECONDS, (double)took / 1000.0);
	}
	if (!ok)
		return;
	if (lag) {
		/* The lag reads the head of the due index, which a held-back
		 * vacuum makes slow: ask again after GAUGE_LAG_FACTOR times this
		 * answer's wait, at the soonest on the next pass. */
		w->gauge_lag_due_mono = now_mono_ms() + (now_mono_ms() - db_head_sent_mono(db)) * GAUGE_LAG_FACTOR;
		metrics_set(G_QUEUE_LAG_SECONDS, strtod(PQgetvalue(r, 0, 0), NULL));
	}
	metrics_set(G_UNKNOWN, strtod(PQgetvalue(r, 0, 1), NULL));
	metrics_set(G_KILL_SWITCH_ON, w->env_enabled && PQgetvalue(r, 0, 2)[0] == 't');
}

static void on_weekly(struct db *db, PGresult *r, void *arg)
{
	static const enum metric_gauge cols[] = {
		G_WEEK_DUPLICATE_SHARE, G_WEEK_APPROVAL_WAIT_P50, G_WEEK_APPROVAL_WAIT_P95,
		G_WEEK_VALIDATION_FAILURE_SHARE, G_WEEK_AUTOMATIC_SHARE, G_WEEK_RETRIES_EXHAUSTED,
	};

	(void)db;
	(void)arg;
	if (!pg_ok(r, "outbox_weekly_figures") || PQntuples(r) != 1)
		return;
	for (int i = 0; i < (int)(sizeof(cols) / sizeof(cols[0])); i++)
		metrics_set(cols[i], PQgetisnull(r, 0, i) ? 0 : strtod(PQgetvalue(r, 0, i), NULL));
}

static void register_providers(struct worker *w)
{
	const char *params[2] = { w->types_array, w->recon_array };

	db_query(w->rec, "SELECT outbox_register_providers($1, $2)", 2, params, NULL, NULL, 0);
	w->last_register_mono = now_mono_ms();
}

static void on_schema(struct db *db, PGresult *r, void *arg)
{
	struct worker *w = arg;
	int have;

	(void)db;
	if (!pg_ok(r, "schema version")) {
		char line[200];

		if (r == NULL)
			return;   /* connection lost: checked again on reconnect */
		/* e.g. "permission denied for table schema_migrations": the
		 * login lacks a grant (sql/101_gate_and_evidence.sql gives it). */
		error_line(r, line, sizeof(line));
		snprintf(w->schema_error, sizeof(w->schema_error), "schema check failed: %s", line);
		readiness_update(w);
		return;
	}
	have = atoi(PQgetvalue(r, 0, 0));
	if (have < migrate_latest_version()) {
		w->schema_ok = false;
		snprintf(w->schema_error, sizeof(w->schema_error),
		         "database schema behind (too old: version %d, this worker needs %d): "
		         "run outboxctl migrate", have, migrate_latest_version());
		log_msg(OLOG_ERROR, "schema_behind",
		        "database schema is at version %d, this worker needs %d: run 'outboxctl migrate'",
		        have, migrate_latest_version());
		readiness_update(w);
		return;
	}
	w->schema_error[0] = '\0';
	if (!w->schema_ok) {
		w->schema_ok = true;
		register_providers(w);
	}
	readiness_update(w);
	w->lease_wanted = true;
	worker_kick(w);
}

static void on_maintenance(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;
	char grace[24], every[24];
	const char *params[4];
	long sweep_every = w->s.unknown_type_grace_seconds / 2;

	(void)fd;
	(void)what;
	metrics_heartbeat();
	metrics_set(G_DB_UP, db_is_up(w->db) && db_is_up(w->rec));
	metrics_set(G_IN_FLIGHT, w->n_sending);
	/* A connection that never came up calls no state callback: say why
	 * the worker still is not ready on every pass. */
	readiness_update(w);
	if (!w->schema_ok) {
		if (db_is_up(w->db))
			db_query(w->db, MIGRATE_VERSION_SQL, 0, NULL, on_schema, w, 0);
		return;
	}
	if (!db_is_up(w->rec))
		return;
	if (w->maint_busy || now_mono_ms() < w->maint_due_mono)
		return;   /* the database is slow; do not pile up */
	w->maint_busy = true;
	w->maint_started_mono = now_mono_ms();
	w->maint_lost = false;
	params[0] = w->name;
	params[1] = "500";
	db_query(w->rec, "SELECT effect_id, state, coalesce(lost_worker, '') FROM outbox_reap($1, $2)",
	         2, params, on_reaped, w, 0);
	/* One worker of the fleet, at most every half grace (and 30 s): it
	 * walks the whole pending backlog. */
	snprintf(grace, sizeof(grace), "%ld", w->s.unknown_type_grace_seconds);
	snprintf(every, sizeof(every), "%ld", sweep_every < SWEEP_MAX_EVERY_S ? sweep_every : SWEEP_MAX_EVERY_S);
	params[0] = w->name;
	params[1] = grace;
	params[2] = every;
	params[3] = "500";
	db_query(w->rec, "SELECT effect_id, effect_type FROM outbox_sweep($1, $2, $3, $4)", 4,
	         params, on_swept, w, 0);
	if (now_mono_ms() - w->last_register_mono > 30000)
		register_providers(w);
	if (w->last_weekly_mono == 0 || now_mono_ms() - w->last_weekly_mono > 30000) {
		/* The seeds' weekly figures, this week so far: an aggregate over
		 * the week's rows, so not on every pass. */
		w->last_weekly_mono = now_mono_ms();
		params[0] = w->name;
		params[1] = WEEKLY_REFRESH_S;
		db_query(w->rec,
		         "SELECT duplicate_share, approval_wait_p50_seconds, approval_wait_p95_seconds,"
		         " validation_failure_share, automatic_share, retries_exhausted"
		         " FROM outbox_weekly_figures($1, $2)",
		         2, params, on_weekly, w, 0);
	}
	/* Last of the pass: its answer clears maint_busy. */
	if (now_mono_ms() >= w->gauge_lag_due_mono) {
		w->gauge_lag_asked = true;
		db_query(w->rec,
		         "SELECT coalesce((SELECT extract(epoch FROM now() - min(available_at)) FROM effect_outbox "
		         "  WHERE state = 'pending' AND available_at <= now()), 0),"
		         " (SELECT count(*) FROM effect_outbox WHERE state = 'unknown'),"
		         " (SELECT enabled FROM outbox_control WHERE id = 1)",
		         0, NULL, on_gauges, w, 0);
	} else {
		db_query(w->rec,
		         "SELECT NULL, (SELECT count(*) FROM effect_outbox WHERE state = 'unknown'),"
		         " (SELECT enabled FROM outbox_control WHERE id = 1)",
		         0, NULL, on_gauges, w, 0);
	}
	if (now_mono_ms() >= w->recon_next_mono) {
		w->recon_next_mono = now_mono_ms() + RECONCILE_INTERVAL_MS;
		reconcile_pass(w, false);
	}
	worker_kick(w);
}

/* ---- database state ----------------------------------------------------- */

static void on_db_state(struct db *db, bool up, void *arg)
{
	struct worker *w = arg;

	metrics_set(G_DB_UP, up && db_is_up(w->rec));
	if (!up) {
		/* lease_busy stays: a lease on the wire was answered NULL
		 * (on_leased() cleared it); a queued one survives the
		 * reconnect and clears it when it is answered. */
		metrics_inc(M_DB_RECONNECTS, 1);
		if (w->ready_sent)
			sdnotify_status("database connection lost: %s", db_last_error(db));
		else
			readiness_update(w);
		return;
	}
	lease_cursor_reset(w);
	/* Urgent, so that no lease issued after the reconnect passes it. */
	db_query(db, MIGRATE_VERSION_SQL, 0, NULL, on_schema, w, DBQ_URGENT);
	if (w->ready_sent)
		sdnotify_status("connected; %s", w->env_enabled ? "sending" : "AI_ACTIONS_ENABLED is not true: not sending");
	else
		readiness_update(w);
	worker_kick(w);
}

static void on_rec_state(struct db *db, bool up, void *arg)
{
	struct worker *w = arg;

	metrics_set(G_DB_UP, up && db_is_up(w->db));
	if (!up) {
		metrics_inc(M_DB_RECONNECTS, 1);
		w->maint_lost = true;
		w->maint_due_mono = 0;
		if (w->ready_sent)
			sdnotify_status("database connection (records) lost: %s", db_last_error(db));
		else
			readiness_update(w);
		return;
	}
	readiness_update(w);
	worker_kick(w);
}

static void on_notify(struct db *db, const char *channel, const char *payload, void *arg)
{
	struct worker *w = arg;

	(void)db;
	(void)channel;
	if (payload && strcmp(payload, "reconcile") == 0) {
		w->recon_requested = true;
		w->recon_pass_asked = false;   /* a new request starts a new pass */
	}
	else
		w->lease_wanted = true;
	/* Rows given back while the switch was off sit behind our position. */
	if (payload && strcmp(payload, "kill-switch-on") == 0)
		lease_cursor_reset(w);
	worker_kick(w);
}

/* ---- signals: stop and reload ------------------------------------------- */

static void release_waiting(struct worker *w)
{
	struct effect *e;
	struct batch *b;
	char *ids;
	const char *params[3];

	if (TAILQ_EMPTY(&w->waiting))
		return;
	b = batch_new(w, (size_t)w->n_active + 1);
	while ((e = TAILQ_FIRST(&w->waiting)) != NULL) {
		TAILQ_REMOVE(&w->waiting, e, link);
		b->items[b->n++] = e;
	}
	ids = ids_array(b->items, b->n);
	params[0] = w->owner;
	params[1] = ids;
	params[2] = "0";
	db_query(w->db, "SELECT outbox_release($1, $2, $3)", 3, params, NULL, NULL, DBQ_RETRY);
	log_msg(OLOG_INFO, "leases_released", "released %zu unstarted leases", b->n);
	for (size_t i = 0; i < b->n; i++)
		effect_free(b->items[i]);
	free(ids);
	free(b);
}

static void worker_maybe_exit(struct worker *w)
{
	if (!w->stopping)
		return;
	if (w->n_sending > 0 || w->n_reconciling > 0 || !TAILQ_EMPTY(&w->done_q) || w->lease_busy || w->head_busy ||
	    !TAILQ_EMPTY(&w->recon_q) || w->complete_busy || w->recon_record_busy || w->mark_busy ||
	    (db_is_up(w->db) && db_queue_len(w->db) > 0) || (db_is_up(w->rec) && db_queue_len(w->rec) > 0))
		return;
	log_msg(OLOG_INFO, "stopped", "all sends finished and recorded");
	event_base_loopbreak(w->base);
}

static void on_grace_over(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;

	(void)fd;
	(void)what;
	log_msg(OLOG_WARN, "shutdown_timeout",
	        "%d sends still in flight after shutdown_grace_ms=%ld: exiting; their leases expire "
	        "and the reaper marks them unknown (or pending where keys are honoured)",
	        w->n_sending, w->s.shutdown_grace_ms);
	event_base_loopbreak(w->base);
}

static void on_sigterm(evutil_socket_t sig, short what, void *arg)
{
	struct worker *w = arg;
	struct timeval tv;

	(void)what;
	if (w->stopping) {
		log_msg(OLOG_WARN, "shutdown_now", "second %s: exiting at once", strsignal((int)sig));
		event_base_loopbreak(w->base);
		return;
	}
	w->stopping = true;
	sdnotify_stopping();
	log_msg(OLOG_INFO, "stopping", "%s: no new leases; waiting up to %ld ms for %d sends in flight",
	        strsignal((int)sig), w->s.shutdown_grace_ms, w->n_sending);
	evtimer_del(w->poll_ev);
	release_waiting(w);
	tv.tv_sec = w->s.shutdown_grace_ms / 1000;
	tv.tv_usec = (w->s.shutdown_grace_ms % 1000) * 1000;
	w->grace_ev = evtimer_new(w->base, on_grace_over, w);
	evtimer_add(w->grace_ev, &tv);
	worker_maybe_exit(w);
}

static void apply_timers(struct worker *w)
{
	struct timeval tv;
	long hb = w->s.lease_seconds * 1000 / 3;

	tv.tv_sec = w->s.poll_interval_ms / 1000;
	tv.tv_usec = (w->s.poll_interval_ms % 1000) * 1000;
	if (!w->stopping)
		evtimer_add(w->poll_ev, &tv);
	tv.tv_sec = hb / 1000;
	tv.tv_usec = (hb % 1000) * 1000;
	evtimer_add(w->heartbeat_ev, &tv);
	tv.tv_sec = w->s.maintenance_interval_ms / 1000;
	tv.tv_usec = (w->s.maintenance_interval_ms % 1000) * 1000;
	evtimer_add(w->maint_ev, &tv);
}

static void on_sighup(evutil_socket_t sig, short what, void *arg)
{
	struct worker *w = arg;
	char err[1024];
	struct config *fresh;
	struct core_settings s;
	char name[sizeof(w->name_cfg)], listen[sizeof(w->listen)];

	(void)sig;
	(void)what;
	/* Before READY=1 systemd has nothing to reload (and would take a
	 * READY=1 ending the reload as the end of the start). */
	if (w->ready_sent)
		sdnotify_reloading();
	fresh = config_load(w->config_path, err, sizeof(err));
	if (fresh == NULL || !config_core(fresh, &s, err, sizeof(err)) ||
	    !config_instance(&s, w->instance, name, sizeof(name), listen, sizeof(listen), err,
	                     sizeof(err)) ||
	    !providers_reload_policy(&w->providers, fresh, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "reload_failed", "config not reloaded, keeping the old one: %s", err);
		config_free(fresh);
		if (w->ready_sent)
			sdnotify_ready("reload failed; running with the old config");
		return;
	}
	if (strcmp(s.conninfo, w->s.conninfo) || strcmp(listen, w->s.metrics_listen) ||
	    strcmp(s.provider_dir, w->s.provider_dir) || strcmp(s.providers, w->s.providers) ||
	    strcmp(name, w->s.worker_name))
		log_msg(OLOG_WARN, "reload_partial",
		        "conninfo, metrics listen, worker_name, provider_dir and providers change only "
		        "on restart; the other settings are applied");
	/* Values needing a restart were copied where they are used (db.c owns
	 * its conninfo, w->name the worker name), so every pointer can move to
	 * the new config at once. */
	providers_rebind(&w->providers, fresh);
	config_free(w->cfg);
	w->cfg = fresh;
	w->s = s;
	/* Restart-only: the running name and address stay. */
	w->s.worker_name = w->name_cfg;
	w->s.metrics_listen = w->listen;
	build_type_arrays(w);   /* honours_idempotency_keys may have changed */
	log_set_min_level(!strcmp(w->s.log_level, "debug") ? OLOG_DEBUG
	                  : !strcmp(w->s.log_level, "warn") ? OLOG_WARN
	                  : !strcmp(w->s.log_level, "error") ? OLOG_ERROR : OLOG_INFO);
	apply_timers(w);
	log_msg(OLOG_INFO, "reloaded", "config reloaded from %s", w->config_path);
	if (w->ready_sent)
		sdnotify_ready("config reloaded");
}

/* ---- life cycle ---------------------------------------------------------- */

static bool worker_ready(void *arg, char *why, size_t len)
{
	return !worker_why_not(arg, why, len);
}

static void build_type_arrays(struct worker *w)
{
	size_t a = 0, b = 0, c = 0;

	w->types_array[a++] = '{';
	w->idem_array[b++] = '{';
	w->recon_array[c++] = '{';
	for (size_t i = 0; i < w->providers.n; i++) {
		struct provider_slot *p = &w->providers.slots[i];
		a += (size_t)snprintf(w->types_array + a, sizeof(w->types_array) - a, "%s\"%s\"",
		                      a > 1 ? "," : "", p->name);
		if (p->honours_keys)
			b += (size_t)snprintf(w->idem_array + b, sizeof(w->idem_array) - b, "%s\"%s\"",
			                      b > 1 ? "," : "", p->name);
		if (p->can_reconcile)
			c += (size_t)snprintf(w->recon_array + c, sizeof(w->recon_array) - c, "%s\"%s\"",
			                      c > 1 ? "," : "", p->name);
	}
	snprintf(w->types_array + a, sizeof(w->types_array) - a, "}");
	snprintf(w->idem_array + b, sizeof(w->idem_array) - b, "}");
	snprintf(w->recon_array + c, sizeof(w->recon_array) - c, "}");
}

/* The instance's worker name and metrics address replace the file's. */
static bool apply_instance(struct worker *w, struct core_settings *s, char *err, size_t errlen)
{
	char name[sizeof(w->name_cfg)], listen[sizeof(w->listen)];

	if (!config_instance(s, w->instance, name, sizeof(name), listen, sizeof(listen), err, errlen))
		return false;
	memcpy(w->name_cfg, name, sizeof(name));
	memcpy(w->listen, listen, sizeof(listen));
	s->worker_name = w->name_cfg;
	s->metrics_listen = w->listen;
	return true;
}

struct worker *worker_new(struct event_base *base, const struct worker_options *opt)
{
	struct worker *w = xcalloc(1, sizeof(*w));
	char err[1024], dir[4096], shown[512], host[64];
	const char *env = getenv("AI_ACTIONS_ENABLED");
	const char *config_path = opt->config_path;

	w->base = base;
	w->config_path = xstrdup(config_path);
	w->instance = opt->instance ? xstrdup(opt->instance) : NULL;
	TAILQ_INIT(&w->waiting);
	TAILQ_INIT(&w->sending);
	TAILQ_INIT(&w->done_q);
	TAILQ_INIT(&w->recon_q);
	w->cfg = config_load(config_path, err, sizeof(err));
	if (w->cfg == NULL || !config_core(w->cfg, &w->s, err, sizeof(err)) ||
	    !apply_instance(w, &w->s, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "config_error", "%s", err);
		worker_free(w);
		return NULL;
	}
	log_set_min_level(!strcmp(w->s.log_level, "debug") ? OLOG_DEBUG
	                  : !strcmp(w->s.log_level, "warn") ? OLOG_WARN
	                  : !strcmp(w->s.log_level, "error") ? OLOG_ERROR : OLOG_INFO);
	uuid_v4(w->owner);
	if (w->s.worker_name[0]) {
		str_copy(w->name, w->s.worker_name, sizeof(w->name));
	} else {
		if (gethostname(host, sizeof(host)) != 0)
			str_copy(host, "host", sizeof(host));
		host[sizeof(host) - 1] = '\0';
		if (w->instance)
			snprintf(w->name, sizeof(w->name), "%s-%s", host, w->instance);
		else
			snprintf(w->name, sizeof(w->name), "%s-%d", host, (int)getpid());
	}
	log_set_worker(w->name);
	metrics_init(w->name);
	w->env_enabled = env != NULL && strcmp(env, "true") == 0;

	if (w->s.provider_dir[0])
		str_copy(dir, w->s.provider_dir, sizeof(dir));
	else
		providers_default_dir(dir, sizeof(dir));
	providers_on_late_result(on_late_result, w);
	if (!providers_load(&w->providers, w->cfg, dir, w->s.providers, base, w->name, err,
	                    sizeof(err))) {
		log_msg(OLOG_ERROR, "provider_error", "%s", err);
		worker_free(w);
		return NULL;
	}
	for (size_t i = 0; i < w->providers.n; i++) {
		struct provider_slot *p = &w->providers.slots[i];
		if (p->policy.timeout_ms / 1000 >= w->s.max_lease_seconds)
			log_msg(OLOG_WARN, "config_warning",
			        "[provider.%s] timeout_ms=%ld is not below [dispatcher] max_lease_seconds=%ld: "
			        "a slow send can outlive its lease and end unknown",
			        p->name, p->policy.timeout_ms, w->s.max_lease_seconds);
	}
	build_type_arrays(w);
	if (opt->check_only)
		return w;   /* no listener, no connection: see worker_options */
	w->hosts = hosts_new();
	if (!metrics_start(base, w->s.metrics_listen, worker_ready, w, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "metrics_error", "%s", err);
		worker_free(w);
		return NULL;
	}
	w->db = db_new(base, w->s.conninfo, w->s.reconnect_min_ms, w->s.reconnect_max_ms,
	               w->s.poll_only ? NULL : LISTEN_CHANNEL);
	db_set_callbacks(w->db, on_db_state, on_notify, w);
	w->rec = db_new(base, w->s.conninfo, w->s.reconnect_min_ms, w->s.reconnect_max_ms, NULL);
	db_set_callbacks(w->rec, on_rec_state, NULL, w);
	{
		char app[sizeof(w->name) + 32];
		/* The role first: the server cuts names at 63 bytes. */
		snprintf(app, sizeof(app), "outbox lease %s", w->name);
		db_set_application_name(w->db, app);
		snprintf(app, sizeof(app), "outbox records %s", w->name);
		db_set_application_name(w->rec, app);
	}

	w->pump_ev = event_new(base, -1, 0, on_pump, w);
	w->poll_ev = event_new(base, -1, EV_PERSIST, on_poll, w);
	w->heartbeat_ev = event_new(base, -1, EV_PERSIST, on_heartbeat, w);
	w->maint_ev = event_new(base, -1, EV_PERSIST, on_maintenance, w);
	w->sigterm_ev = evsignal_new(base, SIGTERM, on_sigterm, w);
	w->sigint_ev = evsignal_new(base, SIGINT, on_sigterm, w);
	w->sighup_ev = evsignal_new(base, SIGHUP, on_sighup, w);
	event_add(w->sigterm_ev, NULL);
	event_add(w->sigint_ev, NULL);
	event_add(w->sighup_ev, NULL);
	apply_timers(w);
	w->recon_next_mono = now_mono_ms() + 5000;

	if (!w->env_enabled)
		log_msg(OLOG_WARN, "kill_switch_env",
		        "AI_ACTIONS_ENABLED is not exactly \"true\": this worker sends nothing");
	db_redact_conninfo(w->s.conninfo, shown, sizeof(shown));
	log_event(OLOG_INFO, "ready",
	          json_pack("{s:s,s:s,s:s,s:b,s:b,s:I,s:I,s:s}", "owner", w->owner, "providers",
	                    w->types_array, "database", shown, "ai_actions_enabled", w->env_enabled,
	                    "poll_only", w->s.poll_only, "lease_seconds", (json_int_t)w->s.lease_seconds,
	                    "max_in_flight", (json_int_t)w->s.max_in_flight, "metrics",
	                    w->s.metrics_listen));
	sdnotify_init(base);
	metrics_heartbeat();
	/* READY=1 waits for both connections and the schema check
	 * (readiness_update); TimeoutStartSec= applies until then. */
	sdnotify_status("starting: connecting to the database");
	db_start(w->db);
	db_start(w->rec);
	return w;
}

int worker_run(struct worker *w)
{
	event_base_dispatch(w->base);
	/* Only a signal ends the loop: a stop, drained or not.  Sends cut off
	 * by the grace period or a second signal are the reaper's (their
	 * leases expire), not a failure of this process: systemd must not
	 * count a requested stop as one. */
	return 0;
}

void worker_free(struct worker *w)
{
	struct effect *e;

	if (w == NULL)
		return;
	/* Effects still with a provider are abandoned by its shutdown(). */
	providers_unload(&w->providers);
	providers_on_late_result(NULL, NULL);
	while ((e = TAILQ_FIRST(&w->sending)) != NULL) {
		TAILQ_REMOVE(&w->sending, e, link);
		effect_free(e);
	}
	while ((e = TAILQ_FIRST(&w->waiting)) != NULL) {
		TAILQ_REMOVE(&w->waiting, e, link);
		effect_free(e);
	}
	while ((e = TAILQ_FIRST(&w->done_q)) != NULL) {
		TAILQ_REMOVE(&w->done_q, e, link);
		effect_free(e);
	}
	while ((e = TAILQ_FIRST(&w->recon_q)) != NULL) {
		TAILQ_REMOVE(&w->recon_q, e, link);
		effect_free(e);
	}
	db_free(w->db);
	db_free(w->rec);
	metrics_stop();
	sdnotify_shutdown();
	hosts_free(w->hosts);
	if (w->pump_ev)
		event_free(w->pump_ev);
	if (w->poll_ev)
		event_free(w->poll_ev);
	if (w->heartbeat_ev)
		event_free(w->heartbeat_ev);
	if (w->maint_ev)
		event_free(w->maint_ev);
	if (w->grace_ev)
		event_free(w->grace_ev);
	if (w->sigterm_ev)
		event_free(w->sigterm_ev);
	if (w->sigint_ev)
		event_free(w->sigint_ev);
	if (w->sighup_ev)
		event_free(w->sighup_ev);
	config_free(w->cfg);
	free(w->config_path);
	free(w->instance);
	free(w);
}

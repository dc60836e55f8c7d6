/* SPDX-License-Identifier: ISC */
/*
 * worker_internal.h: what the worker's files share (not for the rest of
 * the program, which sees worker.h): struct worker, split by the role
 * that owns each part, the effect and its phases, and each file's entry
 * points.
 *
 *   worker.c        loop, pump, signals, reload, start and teardown
 *   health.c        readiness (READY=1, STATUS=) and /healthz
 *   effect.c        the effect, the held set, effect_set_phase()
 *   take.c          taking due rows: a claim or a lease, how many, on
 *                   which connection; the one sender and answer path for
 *                   both (a table of the two kinds); the due-index position
 *   lease.c         the lease kind: validating leased rows; failing the
 *                   invalid rows of an answer; lease renewal, giving
 *                   leases back
 *   claim.c         the claim kind (lease and mark in one call for rows
 *                   that go at once): how many rows, sending them, giving
 *                   back what cannot go
 *   decide.c        the pure decisions: claim or lease, how many rows, where
 *                   outcomes go, whether they wait, a free slot, a mark
 *                   left for later, the lease mode after a head scan
 *                   (decide.h); none changes state
 *   mark.c          mark (the commit point: kill switch and scopes)
 *   send.c          send, record
 *   wire.c          leases, claims and marks on the wire; given up at a
 *                   forced exit
 *   late.c          a provider's acceptance after an ambiguous verdict
 *   reconcile.c     asking providers about `unknown` effects
 *   housekeeping.c  reaper, sweep, gauges, weekly figures, schema check
 *   worker_sql.c    every statement the worker runs, with its columns
 */
#ifndef OUTBOX_WORKER_INTERNAL_H
#define OUTBOX_WORKER_INTERNAL_H

#include <event2/util.h>
#include <jansson.h>
#include <libpq-fe.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "config.h"
#include "decide.h"
#include "plugin.h"
#include "policy.h"
#include "worker.h"
#include "worker_sql.h"

struct db;
struct event;
struct event_base;
struct hosts;
struct host_state;

#define LISTEN_CHANNEL "effect_outbox"
#define HELD_BUCKETS 1024
#define RECONCILE_BATCH 50
#define RECONCILE_BATCH_STR "50"
#define RECONCILE_INTERVAL_MS 60000
/* At most one pass per this many ms starts on notifications: NOTIFY needs
 * no privilege, so a flood of them is a pass a second at most (and the
 * lease re-asks an effect early only after an operator's request). */
#define RECONCILE_NOTIFY_GAP_MS 1000
/* Lease, mark, renew or complete statements refused in a row after which
 * /healthz fails: one refusal is a blip (a deadlock victim, a statement
 * timeout), three in a row a worker that cannot do its job. */
#define LEASE_ERRORS_UNHEALTHY 3

/* Where an effect is in this worker.  Only effect_set_phase() changes it
 * (and with it the lists and counters below), refusing impossible moves. */
enum effect_phase {
	PH_NEW,              /* just read from a row, on no list yet */
	PH_WAITING,          /* leased, valid, waiting for a slot (effects.waiting) */
	PH_MARKING,          /* in an outbox_mark_sending() call */
	PH_SENDING,          /* the provider has it (effects.sending) */
	PH_DONE,             /* outcome known, queued for outbox_complete() (effects.done_q) */
	PH_RECORDING,        /* in an outbox_complete() call */
	PH_RECONCILING,      /* an unknown effect being asked about */
	PH_RECONCILED,       /* verdict known, queued for outbox_reconcile_record() (effects.recon_q) */
	PH_RECORDING_VERDICT, /* in an outbox_reconcile_record() call */
	PH_GONE,             /* freed: this worker holds it no more */
};

struct effect {
	TAILQ_ENTRY(effect) link;
	struct effect *held_next;     /* in the worker's set of held ids */
	struct worker *w;
	enum effect_phase phase;
	char id[40];
	char *run_key, *type, *target, *payload_text, *payload_hash, *effect_key, *approved_by;
	size_t payload_len;           /* of payload_text (jsonb's text: no NUL inside),
	                               * or of the text the lease withheld (NULL text) */
	json_t *payload;
	json_t *metadata;
	size_t metadata_withheld_len; /* metadata the lease withheld as oversized, or 0 */
	int prior_attempts;           /* attempts column when leased */
	int retry_base;               /* attempts before the current retry budget */
	struct provider_slot *prov;
	struct host_state *host;
	char host_key[256];
	struct outbox_effect view;    /* what the provider sees */
	int64_t started_mono_ms, ended_mono_ms;
	/* A send's outcome or, for an `unknown` effect being reconciled, the
	 * provider's verdict: an effect is one or the other, never both. */
	union {
		struct outbox_result result;
		struct outbox_recon_result recon;
	};
	struct policy_decision decision;
	uint64_t renew_gen;
	bool lease_lost;
	/* The provider's acceptance that came after its ambiguous verdict,
	 * before that verdict was recorded: resolved once it is (late.c). */
	struct outbox_result *late;
};
TAILQ_HEAD(effect_list, effect);

/* glibc's sys/queue.h lacks the _SAFE variant. */
#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
	for ((var) = TAILQ_FIRST(head); (var) && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

/* The effects of one statement, handed to its answer's callback. */
struct batch {
	struct worker *w;
	/* A claim or a lease (take.c): */
	enum take_kind kind;
	int rows_asked;               /* its row limit (counted in lease.leasing_rows until answered) */
	bool from_head;               /* it scanned the due index from its head */
	bool on_rec;                  /* on the records connection (a head scan in position mode) */
	/* A renewal (lease.c): the generation it covers (effect.renew_gen). */
	uint64_t renew_gen;
	int64_t sent_mono;            /* when the statement was queued */
	char call[37];                /* outbox_mark_sending's or outbox_claim's call token */
	size_t n;
	struct effect *items[];
};

/* effect.c: the effects this worker holds, by phase. */
struct worker_effects {
	struct effect_list waiting, sending, done_q, recon_q;
	/* Every effect this worker holds, by id: a row whose lease expired
	 * while it waited here can come back in a later lease of ours, and
	 * must not become a second copy. */
	struct effect *held[HELD_BUCKETS];
	int n_active;                 /* effects this worker holds, all phases */
	int n_sending;                /* PH_SENDING */
	int n_reconciling;            /* PH_RECONCILING */
};

/* worker.c and health.c: start, readiness, health, stop. */
struct worker_life {
	bool stopping;
	bool schema_ok;
	/* Readiness: READY=1 goes to systemd once, when both connections are
	 * up and the schema check passed; until then STATUS= says why not. */
	bool ready_sent;              /* READY=1 told (serving, or up and not ready) */
	bool serving;                 /* ready once: connected, schema checked */
	unsigned reloads;             /* SIGHUPs answered (reload.c) */
	char schema_error[256];       /* the schema check's last failure */
	/* Health: lease, mark, renew and complete statements the database
	 * refused in a row (not lost connections: those are db_up's).  At
	 * LEASE_ERRORS_UNHEALTHY the worker cannot do its job: /healthz fails
	 * and STATUS= says why. */
	int lease_error_streak;
	char lease_error[256];
	struct event *pump_ev, *poll_ev, *grace_ev;
	/* Rows a rate limit deferred are due then: a lease when it fires. */
	struct event *held_due_ev;
	int64_t held_due_mono;
	struct event *sigterm_ev, *sigint_ev, *sighup_ev;
};

/* take.c: claims and leases on the wire, the due-index position; lease.c:
 * renewal. */
struct worker_lease {
	int leasing_rows;             /* rows asked for by claims and leases on the wire */
	bool busy;                    /* a claim or lease on the lease connection is on the wire */
	bool head_busy;               /* a head scan on the records connection is on the wire */
	bool wanted;                  /* a NOTIFY, a poll tick or a reconnect asked for a lease */
	bool more_due;                /* the last lease came back full (cleared by the next lease) */
	int full_leases;              /* leases on the lease connection that came back full, in a row */
	/* The due-index position after the last row leased; empty: the next
	 * lease scans from the head. */
	char after_at[48], after_id[40];
	bool from_position;           /* the head is slow: lease from the position */
	int head_slow_streak;         /* slow leases from the head in a row */
	int head_unseen_streak;       /* fast ones in a row with no count (decide.h) */
	int64_t mode_warned_mono;     /* the last "head is slow" warning */
	int64_t head_scan_due_mono;   /* then, the next lease from the head */
	uint64_t renew_gen;           /* the last renewal's generation */
	struct event *heartbeat_ev;
};

/* mark.c and send.c: the mark and completion batches. */
struct worker_send {
	bool mark_busy;               /* an outbox_mark_sending() call is on the wire */
	bool complete_busy;           /* an outbox_complete() call is on the wire */
	int64_t complete_retry_mono;  /* after a refused outbox_complete() */
};

/* reconcile.c */
struct worker_recon {
	bool busy;                    /* an outbox_reconcile_lease() call is on the wire */
	bool record_busy;             /* an outbox_reconcile_record() call is on the wire */
	bool requested;               /* a pass is to run now (an operator's request, more of its batches) */
	bool notified;                /* NOTIFY reconcile came: maybe a request (outbox_reconcile_requests) */
	int64_t notified_pass_mono;   /* when a notification last started a pass */
	bool pass_asked;              /* the pass in progress answers an operator's request */
	int64_t pass_start_mono;
	int64_t next_mono;            /* the next periodic pass */
};

/* late.c */
void on_late_result(void *arg, const char *provider, const char *effect_id, int attempt,
                    const struct outbox_result *res);
void late_resolve_recorded(struct worker *w, struct effect *e);

/* housekeeping.c */
struct worker_hk {
	/* A housekeeping pass is in flight until its last query (the gauges)
	 * answers, also across a lost connection: the rest of a cut pass runs
	 * after the reconnect, and a new pass beside it would pile up. */
	bool maint_busy;
	bool maint_lost;              /* the records connection broke since the pass began */
	bool gauge_lag_asked;         /* the gauge query in flight includes the lag */
	int64_t maint_started_mono;   /* the maintenance pass in flight began */
	int64_t maint_due_mono;       /* no pass before (MAINT_BACKOFF_FACTOR) */
	int64_t gauge_lag_due_mono;   /* the next queue-lag gauge (it reads the due index's head) */
	int64_t last_register_mono;
	int64_t last_weekly_mono;
	struct event *maint_ev;
};

/* wire.c: leases, claims and marks sent or queued whose answer has not
 * come back (a lease or claim on each connection, and a mark); the owner
 * of their batches at teardown. */
#define WIRE_CALLS_MAX 4
struct worker_wire {
	const struct batch *b[WIRE_CALLS_MAX];
	struct db *db[WIRE_CALLS_MAX];
};

struct worker {
	struct event_base *base;
	char *config_path;
	struct config *cfg;
	struct core_settings s;
	struct provider_set providers;
	struct hosts *hosts;
	/* Two connections, so that the latency path never waits behind a
	 * completion batch or a maintenance query (docs/performance.md, "Where
	 * the time goes"):
	 *   db   LISTEN, claim, lease, mark, renew, release, unclaim: what
	 *        decides when a send starts, and every statement that updates
	 *        leased waiting rows (one connection, so they cannot lock those
	 *        rows in opposite orders); in position mode the head scans
	 *        (claim or lease, SKIP LOCKED) go on rec
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
	bool env_enabled;             /* AI_ACTIONS_ENABLED=true */
	bool claimable;               /* every provider OUTBOX_CAP_STARTS_AT_ONCE (claim.c) */

	struct worker_effects fx;
	struct worker_life life;
	struct worker_lease lease;
	struct worker_send send;
	struct worker_recon recon;
	struct worker_hk hk;
	struct worker_wire wire;
};

/* worker.c */
void worker_kick(struct worker *w);
void worker_kick_in(struct worker *w, int64_t ms);
void worker_lease_in(struct worker *w, int64_t ms);
void worker_maybe_exit(struct worker *w);

/* wire.c */
void wire_sent(struct worker *w, struct db *db, const struct batch *b);
void wire_answered(struct worker *w, const struct batch *b);
void wire_give_up(struct worker *w);
/* Teardown, before the effects and connections are freed (their
 * callbacks then never run): the batches still on the wire, and a mark's
 * effects. */
void wire_free_all(struct worker *w);

/* health.c */
bool pg_ok(PGresult *r, const char *what);
void error_line(PGresult *r, char *buf, size_t len);
bool job_ok(struct worker *w, PGresult *r, const char *what);
bool worker_why_not(const struct worker *w, char *why, size_t len);
void readiness_update(struct worker *w);
bool worker_ready(void *arg, char *why, size_t len);

/* effect.c */
bool effect_set_phase(struct worker *w, struct effect *e, enum effect_phase to);
struct effect *effect_from_row(struct worker *w, PGresult *r, int row, bool full);
void effect_free(struct effect *e);
struct effect *held_find(struct worker *w, const char *id);
void effect_fill_view(struct effect *e, int attempt);
json_t *payload_parse(const struct effect *e, json_error_t *jerr);
bool effect_validate(struct worker *w, struct effect *e, char *err, size_t errlen);
void effect_invalid(struct effect *e, const char *err, const char *call, json_t **invalid);
void mark_probe(struct effect *e);
void unmark_probe(struct effect *e);
struct batch *batch_new(struct worker *w, size_t cap);
char *ids_array(struct effect **items, size_t n);
char *hosts_array(struct effect **items, size_t n);
void effects_free_all(struct worker *w);

/* take.c */
void take_batch(struct worker *w);
void take_cursor_reset(struct worker *w);

/* What a kind's statement gets (take.c fills it in), as text parameters. */
struct take_args {
	const char *owner, *name, *limit, *lease_seconds, *types, *env_enabled;
	const char *idem_types;       /* types whose provider honours idempotency keys */
	const char *call;             /* the batch's call token */
	const char *after_at, *after_id; /* the due-index position; NULL: from the head */
	const char *max_payload;
	const char *type_hosts;       /* claim_type_hosts(), aligned with types */
};
#define TAKE_PARAMS_MAX 14

/* One kind of request take.c sends and answers: its statement, the flags
 * it goes with (besides DBQ_URGENT on the lease connection), whether it
 * carries a call token, its parameters in the statement's order, and what
 * becomes of its answer.  rows() gets an answer that passed job_ok();
 * refused() one that did not (r NULL: the connection is being freed) and
 * says whether the pump should run again.  Neither frees the batch. */
struct take_handlers {
	enum worker_stmt stmt;
	unsigned flags;
	bool has_call;
	void (*params)(const struct take_args *a, const char *params[TAKE_PARAMS_MAX]);
	/* Which kind's rows() takes an answer (a claim that only leased is
	 * the lease kind's); NULL: always this kind's. */
	enum take_kind (*answered_as)(const PGresult *r);
	void (*rows)(struct worker *w, const struct batch *b, PGresult *r);
	bool (*refused)(struct worker *w, const struct batch *b, PGresult *r);
	/* The column with the due index's entries the walk read (the same on
	 * every row); -1: the statement does not say. */
	int entries_col;
};

/* lease.c */
extern const struct take_handlers lease_take;
void fail_invalid(struct worker *w, json_t *invalid);
void release_waiting(struct worker *w);
void on_heartbeat(evutil_socket_t fd, short what, void *arg);

/* claim.c: rows to claim for a take of `limit` (batch `full`): > 0 claim
 * that many, 0 lease instead, -1 neither now (sends in flight will make
 * room). */
extern const struct take_handlers claim_take;
int claim_limit(struct worker *w, int limit, int full);
char *claim_type_hosts(const struct worker *w);
/* mark.c */
void mark_ready(struct worker *w);
/* send.c */
void start_send(struct worker *w, struct effect *e, int attempt, int64_t confirmed_sent_mono);
void flush_completions(struct worker *w);

/* reconcile.c */
void reconcile_pass(struct worker *w, bool asked);
void reconcile_on_notify(struct worker *w);
void flush_reconciled(struct worker *w);

/* housekeeping.c */
void on_maintenance(evutil_socket_t fd, short what, void *arg);
void on_schema(struct db *db, PGresult *r, void *arg);

#endif

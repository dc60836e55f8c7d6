/* SPDX-License-Identifier: ISC */
/*
 * metrics.h: the worker's counters and gauges, served in Prometheus text
 * format on [metrics] listen (/metrics), with /healthz for liveness and
 * readiness.  Everything runs on the worker's loop thread: no locks.
 */
#ifndef OUTBOX_METRICS_H
#define OUTBOX_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct event_base;

/* Provider label values kept apart; the last slot is "other", so the
 * series stay bounded whatever names plugins use. */
#define METRICS_MAX_PROVIDERS 8
/* Finite buckets of outbox_send_duration_seconds (+Inf comes on top). */
#define METRICS_HISTOGRAM_BUCKETS 12

/* Counters without labels. */
enum metric_counter {
	M_KILL_SWITCH_BLOCKED,   /* sends refused at the sending transition */
	M_SCOPE_HELD,            /* ... held back by a paused or limited scope */
	M_LEASE_LOST,            /* CAS found the lease gone */
	M_RETRIES_EXHAUSTED,     /* failed because max_attempts was reached */
	M_DB_RECONNECTS,
	M_LEASED,                /* rows leased */
	M_CLAIMED,               /* ... of which leased and marked in one statement */
	M_REAPED_UNKNOWN,        /* sending rows the reaper moved to unknown */
	M_REAPED_PENDING,        /* ... or back to pending (provider honours keys) */
	M_INVALID,               /* rows failed before sending (bad payload, type) */
	M_BREAKER_OPENED,
	M_KEY_CONFLICTS,         /* 422 same key, different payload: an alert */
	M_MAINT_PASSES,          /* housekeeping passes finished (reaper, sweep, gauges) */
	M_LEASE_ERRORS,          /* lease/mark/renew/complete refused by the database */
	M_COUNTER_MAX
};

/* Gauges. */
enum metric_gauge {
	G_IN_FLIGHT,             /* sends in flight in this worker */
	G_QUEUE_LAG_SECONDS,     /* age of the oldest due pending row */
	G_UNKNOWN,               /* effects in state unknown (fleet-wide) */
	G_KILL_SWITCH_ON,        /* 1 when sends are allowed for this worker */
	G_DB_UP,
	G_MAINT_PASS_SECONDS,    /* how long the last housekeeping pass took */
	/* The seeds' weekly figures for the current week (outbox_weekly_stats). */
	G_WEEK_DUPLICATE_SHARE,
	G_WEEK_APPROVAL_WAIT_P50,
	G_WEEK_APPROVAL_WAIT_P95,
	G_WEEK_VALIDATION_FAILURE_SHARE,
	G_WEEK_AUTOMATIC_SHARE,
	G_WEEK_RETRIES_EXHAUSTED,
	G_GAUGE_MAX
};

/* Readiness, asked by /healthz: database reachable, loop turning. */
typedef bool (*metrics_ready_fn)(void *arg, char *why, size_t len);

void metrics_init(const char *worker);
/* Start the HTTP listener (metrics_http.c); listen "" means off.  False
 * with err on failure.  At most METRICS_MAX_CONNECTIONS connections are
 * open at once (more are closed as soon as accepted), and each gets
 * METRICS_CONNECTION_MS in all to send its request and read the answer. */
#define METRICS_MAX_CONNECTIONS 64
#define METRICS_CONNECTION_MS 5000
bool metrics_start(struct event_base *base, const char *listen, metrics_ready_fn ready,
                   void *arg, char *err, size_t errlen);
void metrics_stop(void);
/* Open metrics connections (for the tests). */
int metrics_connections(void);

/* Who answers /healthz's readiness question. */
void metrics_set_ready(metrics_ready_fn ready, void *arg);
/* Why the worker is not healthy (starting, stalled, not ready), or "" when
 * it is. */
void metrics_health(char *why, size_t len);

/* The exported family name of a counter or gauge (NULL out of range). */
const char *metrics_counter_name(enum metric_counter c);
const char *metrics_gauge_name(enum metric_gauge g);

void metrics_inc(enum metric_counter c, unsigned long by);
void metrics_set(enum metric_gauge g, double v);
/* outbox_sends_total{provider,outcome}: outcome is a failure-class name. */
void metrics_count_send(const char *provider, const char *outcome);
/* outbox_unknown_resolved_total{how}: how is late_accepted, late_not_sent,
 * lookup_sent or lookup_not_sent (others are ignored). */
void metrics_count_unknown_resolved(const char *how);
/* outbox_send_duration_seconds histogram per provider. */
void metrics_observe_send(const char *provider, double seconds);
/* The loop calls this every pass of its housekeeping timer: /healthz says
 * "stalled" when it has not been called for a while. */
void metrics_heartbeat(void);
/* The same, as of mono_ms (now_mono_ms() time): metrics_heartbeat() is this
 * at now; an earlier time makes the loop look stalled (the unit tests use
 * it instead of waiting 30 s). */
void metrics_heartbeat_at(int64_t mono_ms);

/* The text /metrics serves (caller frees); for tests and outboxctl. */
char *metrics_render(void);

/* A paused or limited scope of the fleet, as housekeeping read it. */
#define METRICS_MAX_SCOPES 64
struct scope_gauge {
	char scope[128];        /* 'type:email', 'host:api.example.com' */
	bool paused;
	double rate;            /* sends per second; 0: no limit */
	double waiting;         /* pending rows it holds */
	double held_total;
	double paused_seconds;  /* since it was paused; 0: not paused */
	double oldest_held_seconds; /* age of the oldest effect it holds; 0: none */
};
void metrics_set_scopes(const struct scope_gauge *g, size_t n);

#endif

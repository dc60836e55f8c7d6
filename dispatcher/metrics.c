/* SPDX-License-Identifier: ISC */
/*
 * metrics.c: the worker's counters, gauges and send-latency histograms,
 * rendered in the Prometheus text exposition format (version 0.0.4), and
 * the /healthz verdict; metrics_http.c serves both on [metrics] listen.
 *
 * The label sets are bounded: at most METRICS_MAX_PROVIDERS provider names
 * (later names are counted under provider="other") times a fixed list of
 * outcome classes (an unknown class is counted as outcome="other").
 * Everything runs on the worker's loop thread: no locks.
 */
#include "metrics.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "log.h"
#include "util.h"
#include "version.h"

#define METRICS_PROVIDER_LEN 48
#define METRICS_STALL_MS 30000         /* /healthz: heartbeat older than this */

struct metric_desc {
	const char *name;
	const char *help;
};

static const struct metric_desc counter_desc[M_COUNTER_MAX] = {
	[M_KILL_SWITCH_BLOCKED] = { "outbox_kill_switch_blocked_total",
		"Sends refused at the sending transition because the kill switch was off." },
	[M_SCOPE_HELD] = { "outbox_scope_held_total",
		"Sends held back at the sending transition by a paused or rate-limited scope (this worker)." },
	[M_LEASE_LOST] = { "outbox_lease_lost_total",
		"State changes whose CAS found the lease gone (another worker or the reaper owns the row)." },
	[M_RETRIES_EXHAUSTED] = { "outbox_retries_exhausted_total",
		"Effects failed because max_attempts was reached." },
	[M_DB_RECONNECTS] = { "outbox_db_reconnects_total",
		"Database reconnections after a lost connection." },
	[M_LEASED] = { "outbox_leased_total",
		"Rows leased by this worker." },
	[M_CLAIMED] = { "outbox_claimed_total",
		"Rows of outbox_leased_total leased and marked sending in one statement (outbox_claim)." },
	[M_REAPED_UNKNOWN] = { "outbox_reaped_unknown_total",
		"Sending rows with an expired lease moved to unknown by this worker's reaper." },
	[M_REAPED_PENDING] = { "outbox_reaped_pending_total",
		"Sending rows with an expired lease moved back to pending (provider honours keys)." },
	[M_INVALID] = { "outbox_invalid_total",
		"Effects failed before sending (malformed payload, unknown type or provider, invalid target)." },
	[M_BREAKER_OPENED] = { "outbox_breaker_opened_total",
		"Per-host circuit breakers opened." },
	[M_KEY_CONFLICTS] = { "outbox_key_conflicts_total",
		"Provider answers 'same idempotency key, different payload' (422): an alert." },
	[M_MAINT_PASSES] = { "outbox_maintenance_passes_total",
		"Housekeeping passes (reaper, sweep, gauges) this worker finished." },
	[M_LEASE_ERRORS] = { "outbox_lease_errors_total",
		"Lease, mark, renew and complete statements the database refused (3 in a row fail /healthz)." },
};

static const struct metric_desc gauge_desc[G_GAUGE_MAX] = {
	[G_IN_FLIGHT] = { "outbox_sends_in_flight",
		"Provider calls in flight in this worker." },
	[G_QUEUE_LAG_SECONDS] = { "outbox_queue_lag_seconds",
		"Age of the oldest due pending effect (fleet-wide), in seconds." },
	[G_UNKNOWN] = { "outbox_unknown_effects",
		"Effects in state unknown (fleet-wide): each needs reconciliation or an operator." },
	[G_KILL_SWITCH_ON] = { "outbox_kill_switch_sends_allowed",
		"1 when the kill switch allows sends for this worker (environment and fleet row), else 0." },
	[G_DB_UP] = { "outbox_db_up",
		"1 when the worker's database connection is up, else 0." },
	[G_MAINT_PASS_SECONDS] = { "outbox_maintenance_pass_seconds",
		"Duration of the last housekeeping pass; the next starts no sooner than ten times this after it (at most lease_seconds/2)." },
	[G_WEEK_DUPLICATE_SHARE] = { "outbox_week_duplicate_delivery_share",
		"This week: claims that found their key already taken / all claims." },
	[G_WEEK_APPROVAL_WAIT_P50] = { "outbox_week_approval_wait_p50_seconds",
		"This week: median time from approval request to decision." },
	[G_WEEK_APPROVAL_WAIT_P95] = { "outbox_week_approval_wait_p95_seconds",
		"This week: 95th percentile time from approval request to decision." },
	[G_WEEK_VALIDATION_FAILURE_SHARE] = { "outbox_week_validation_failure_share",
		"This week: effects failed as invalid / effects created." },
	[G_WEEK_AUTOMATIC_SHARE] = { "outbox_week_automatic_share",
		"This week: effects enqueued without a human approval / effects created." },
	[G_WEEK_RETRIES_EXHAUSTED] = { "outbox_week_retries_exhausted",
		"This week: effects failed after using up their attempts." },
};

/* The failure classes of docs/design.md, as outboxctl and the attempts log name
 * them, and a catch-all. */
static const char *const outcome_names[] = {
	"accepted", "not_sent", "retry", "terminal", "ambiguous", "other",
};
#define N_OUTCOMES (sizeof(outcome_names) / sizeof(outcome_names[0]))

/* Histogram upper bounds in seconds (+Inf is implicit). */
static const double bucket_bounds[] = {
	0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
};
#define N_BUCKETS (sizeof(bucket_bounds) / sizeof(bucket_bounds[0]))
_Static_assert(N_BUCKETS == METRICS_HISTOGRAM_BUCKETS, "metrics.h says how many buckets");

struct provider_stats {
	char name[METRICS_PROVIDER_LEN];
	bool used;
	unsigned long long sends[N_OUTCOMES];
	unsigned long long buckets[N_BUCKETS + 1];   /* per bucket, not cumulative; last = +Inf */
	unsigned long long count;
	double sum;
};

static struct {
	char worker[128];
	unsigned long long counters[M_COUNTER_MAX];
	double gauges[G_GAUGE_MAX];
	bool gauge_set[G_GAUGE_MAX];   /* measured at least once */
	struct provider_stats providers[METRICS_MAX_PROVIDERS];
	int64_t start_wall_ms;
	int64_t heartbeat_ms;          /* now_mono_ms() of the last heartbeat; 0: none */

	struct scope_gauge scopes[METRICS_MAX_SCOPES];
	size_t n_scopes;

	metrics_ready_fn ready;
	void *ready_arg;
} M;

void metrics_init(const char *worker)
{
	memset(M.counters, 0, sizeof(M.counters));
	memset(M.gauges, 0, sizeof(M.gauges));
	memset(M.providers, 0, sizeof(M.providers));
	text_copy(M.worker, worker ? worker : "", sizeof(M.worker));
	M.start_wall_ms = now_wall_ms();
	M.heartbeat_ms = 0;
}

const char *metrics_counter_name(enum metric_counter c)
{
	return (unsigned)c < M_COUNTER_MAX ? counter_desc[c].name : NULL;
}

const char *metrics_gauge_name(enum metric_gauge g)
{
	return (unsigned)g < G_GAUGE_MAX ? gauge_desc[g].name : NULL;
}

void metrics_inc(enum metric_counter c, unsigned long by)
{
	if ((unsigned)c < M_COUNTER_MAX)
		M.counters[c] += by;
}

void metrics_set(enum metric_gauge g, double v)
{
	if ((unsigned)g < G_GAUGE_MAX) {
		M.gauges[g] = v;
		M.gauge_set[g] = true;
	}
}

void metrics_heartbeat_at(int64_t mono_ms)
{
	M.heartbeat_ms = mono_ms;
}

void metrics_heartbeat(void)
{
	metrics_heartbeat_at(now_mono_ms());
}

/* The slot for a provider name: an existing one, a free one, or "other". */
/* outbox_unknown_resolved_total{how}: `unknown` effects this worker
 * resolved from evidence (outbox_complete, outbox_reconcile_record), by mechanism.  A fixed label
 * set, so every series is present from the start (at 0). */
static const char *const resolved_hows[] = {
	"late_accepted", "late_not_sent", "lookup_sent", "lookup_not_sent",
};
#define N_RESOLVED_HOWS (sizeof(resolved_hows) / sizeof(resolved_hows[0]))
static unsigned long long resolved_counts[N_RESOLVED_HOWS];

void metrics_count_unknown_resolved(const char *how)
{
	for (size_t i = 0; how && i < N_RESOLVED_HOWS; i++)
		if (strcmp(how, resolved_hows[i]) == 0) {
			resolved_counts[i]++;
			return;
		}
}

static struct provider_stats *provider_slot(const char *provider)
{
	struct provider_stats *other = &M.providers[METRICS_MAX_PROVIDERS - 1];
	size_t i;

	if (!provider || !provider[0])
		provider = "other";
	for (i = 0; i < METRICS_MAX_PROVIDERS - 1; i++) {
		struct provider_stats *p = &M.providers[i];
		if (p->used && strncmp(p->name, provider, sizeof(p->name) - 1) == 0)
			return p;
		if (!p->used) {
			if (strcmp(provider, "other") == 0)
				break;
			p->used = true;
			text_copy(p->name, provider, sizeof(p->name));
			return p;
		}
	}
	if (!other->used) {
		other->used = true;
		text_copy(other->name, "other", sizeof(other->name));
	}
	return other;
}

static size_t outcome_index(const char *outcome)
{
	size_t i;

	for (i = 0; outcome && i < N_OUTCOMES - 1; i++)
		if (strcmp(outcome, outcome_names[i]) == 0)
			return i;
	return N_OUTCOMES - 1;
}

void metrics_count_send(const char *provider, const char *outcome)
{
	provider_slot(provider)->sends[outcome_index(outcome)]++;
}

void metrics_observe_send(const char *provider, double seconds)
{
	struct provider_stats *p = provider_slot(provider);
	size_t i;

	if (isnan(seconds) || seconds < 0)
		seconds = 0;
	for (i = 0; i < N_BUCKETS && seconds > bucket_bounds[i]; i++)
		;
	p->buckets[i]++;
	p->count++;
	p->sum += seconds;
}

/* ---- rendering ---- */

/* A label value with \, " and newline escaped, as the format wants. */
static void sb_label(struct strbuf *b, const char *v)
{
	for (; *v; v++) {
		if (*v == '\\')
			sb_printf(b, "\\\\");
		else if (*v == '"')
			sb_printf(b, "\\\"");
		else if (*v == '\n')
			sb_printf(b, "\\n");
		else
			sb_printf(b, "%c", *v);
	}
}

/* A sample value: Go's float formatting as Prometheus parses it. */
static void sb_value(struct strbuf *b, double v)
{
	if (isnan(v))
		sb_printf(b, "NaN");
	else if (isinf(v))
		sb_printf(b, v > 0 ? "+Inf" : "-Inf");
	else
		sb_printf(b, "%.15g", v);
}

static void sb_header(struct strbuf *b, const char *name, const char *type, const char *help)
{
	sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The worker's identity, start time and loop heartbeat. */
static void render_process(struct strbuf *b)
{
	sb_header(b, "outbox_worker_info", "gauge", "The worker this endpoint belongs to.");
	sb_printf(b, "outbox_worker_info{worker=\"");
	sb_label(b, M.worker);
	sb_printf(b, "\"} 1\n");

	sb_header(b, "outbox_process_start_time_seconds", "gauge",
	          "Start time of the worker since the Unix epoch, in seconds.");
	sb_printf(b, "outbox_process_start_time_seconds ");
	sb_value(b, (double)M.start_wall_ms / 1000.0);
	sb_printf(b, "\n");

	sb_header(b, "outbox_loop_heartbeat_age_seconds", "gauge",
	          "Seconds since the event loop's housekeeping timer last ran (/healthz fails above 30).");
	sb_printf(b, "outbox_loop_heartbeat_age_seconds ");
	if (M.heartbeat_ms)
		sb_value(b, (double)(now_mono_ms() - M.heartbeat_ms) / 1000.0);
	else
		sb_printf(b, "NaN");
	sb_printf(b, "\n");
}

/* /healthz's answer as a gauge, for alerts (OutboxWorkerNotReady). */
static void render_ready(struct strbuf *b)
{
	char why[512];

	metrics_health(why, sizeof(why));
	sb_header(b, "outbox_ready", "gauge",
	          "1 when /healthz answers 200 (ready to serve), 0 when it answers 503.");
	sb_printf(b, "outbox_ready %d\n", why[0] == '\0');
}

/* What build this is (the version of --version). */
static void render_build_info(struct strbuf *b)
{
	sb_header(b, "outbox_build_info", "gauge",
	          "1, labelled with the worker's version (outbox-dispatcher --version).");
	sb_printf(b, "outbox_build_info{version=\"%s\"} 1\n", OUTBOX_VERSION);
}

/* The label-less counters and gauges of the two tables. */
static void render_counters_and_gauges(struct strbuf *b)
{
	size_t i;

	for (i = 0; i < M_COUNTER_MAX; i++) {
		sb_header(b, counter_desc[i].name, "counter", counter_desc[i].help);
		sb_printf(b, "%s %llu\n", counter_desc[i].name, M.counters[i]);
	}
	for (i = 0; i < G_GAUGE_MAX; i++) {
		sb_header(b, gauge_desc[i].name, "gauge", gauge_desc[i].help);
		/* The database's figures have no sample until the worker read
		 * them: a worker just started (or started while the database
		 * is down) must not say "0 unknown" (OutboxUnknownRising
		 * compares the fleet's figure with its lowest). */
		if ((i == G_UNKNOWN || i == G_QUEUE_LAG_SECONDS) && !M.gauge_set[i])
			continue;
		sb_printf(b, "%s ", gauge_desc[i].name);
		sb_value(b, M.gauges[i]);
		sb_printf(b, "\n");
	}
}

/* outbox_sends_total{provider,outcome}. */
static void render_sends(struct strbuf *b)
{
	sb_header(b, "outbox_sends_total", "counter",
	          "Provider calls by provider and outcome class "
	          "(accepted, not_sent, retry, terminal, ambiguous).");
	for (size_t i = 0; i < METRICS_MAX_PROVIDERS; i++) {
		const struct provider_stats *p = &M.providers[i];
		if (!p->used)
			continue;
		for (size_t j = 0; j < N_OUTCOMES; j++) {
			if (j == N_OUTCOMES - 1 && p->sends[j] == 0)
				continue;   /* "other" only when something odd was counted */
			sb_printf(b, "outbox_sends_total{provider=\"");
			sb_label(b, p->name);
			sb_printf(b, "\",outcome=\"%s\"} %llu\n", outcome_names[j], p->sends[j]);
		}
	}
}

/* outbox_send_duration_seconds{provider}: cumulative buckets, sum, count. */
static void render_durations(struct strbuf *b)
{
	sb_header(b, "outbox_send_duration_seconds", "histogram",
	          "Provider call duration by provider, in seconds.");
	for (size_t i = 0; i < METRICS_MAX_PROVIDERS; i++) {
		const struct provider_stats *p = &M.providers[i];
		unsigned long long cum = 0;
		if (!p->used)
			continue;
		for (size_t j = 0; j <= N_BUCKETS; j++) {
			cum += p->buckets[j];
			sb_printf(b, "outbox_send_duration_seconds_bucket{provider=\"");
			sb_label(b, p->name);
			sb_printf(b, "\",le=\"");
			if (j < N_BUCKETS)
				sb_value(b, bucket_bounds[j]);
			else
				sb_printf(b, "+Inf");
			sb_printf(b, "\"} %llu\n", cum);
		}
		sb_printf(b, "outbox_send_duration_seconds_sum{provider=\"");
		sb_label(b, p->name);
		sb_printf(b, "\"} ");
		sb_value(b, p->sum);
		sb_printf(b, "\noutbox_send_duration_seconds_count{provider=\"");
		sb_label(b, p->name);
		sb_printf(b, "\"} %llu\n", p->count);
	}
}

void metrics_set_scopes(const struct scope_gauge *g, size_t n)
{
	M.n_scopes = n < METRICS_MAX_SCOPES ? n : METRICS_MAX_SCOPES;
	memcpy(M.scopes, g, M.n_scopes * sizeof(*g));
}

/* One series per scope of the fleet, as the last housekeeping pass read
 * them (outbox_scope_status). */
static void render_scopes(struct strbuf *b)
{
	static const struct {
		const char *name, *type, *help;
	} series[] = {
		{ "outbox_scope_paused", "gauge", "1 while the scope is paused (fleet-wide)." },
		{ "outbox_scope_rate_limit", "gauge",
		  "The scope's rate limit in sends per second across the fleet; 0: none." },
		{ "outbox_scope_waiting", "gauge", "Pending effects the scope holds back now." },
		{ "outbox_scope_held_fleet_total", "counter",
		  "Sends the scope has held back, by every worker, since it was set." },
		{ "outbox_scope_paused_seconds", "gauge",
		  "Seconds since the scope was paused; 0 when it is not." },
		{ "outbox_scope_oldest_held_seconds", "gauge",
		  "Age of the oldest effect the scope holds back now (since its creation); 0: none." },
	};

	for (size_t k = 0; k < sizeof(series) / sizeof(series[0]); k++) {
		sb_header(b, series[k].name, series[k].type, series[k].help);
		for (size_t i = 0; i < M.n_scopes; i++) {
			const struct scope_gauge *g = &M.scopes[i];
			double v = k == 0 ? g->paused : k == 1 ? g->rate : k == 2 ? g->waiting
			         : k == 3 ? g->held_total : k == 4 ? g->paused_seconds
			         : g->oldest_held_seconds;

			sb_printf(b, "%s{scope=\"", series[k].name);
			sb_label(b, g->scope);
			sb_printf(b, "\"} ");
			sb_value(b, v);
			sb_printf(b, "\n");
		}
	}
}

char *metrics_render(void)
{
	struct strbuf b;

	sb_init(&b, 4096);
	render_process(&b);
	render_ready(&b);
	render_build_info(&b);
	render_counters_and_gauges(&b);
	render_sends(&b);
	render_durations(&b);
	render_scopes(&b);
	sb_header(&b, "outbox_unknown_resolved_total", "counter",
	          "Effects this worker moved out of unknown on evidence: late_accepted, late_not_sent "
	          "(the attempt's own late outcome), lookup_sent, lookup_not_sent (the provider asked).");
	for (size_t i = 0; i < N_RESOLVED_HOWS; i++)
		sb_printf(&b, "outbox_unknown_resolved_total{how=\"%s\"} %llu\n", resolved_hows[i],
		          resolved_counts[i]);
	return b.s;
}

/* ---- /healthz ---- */

void metrics_set_ready(metrics_ready_fn ready, void *arg)
{
	M.ready = ready;
	M.ready_arg = arg;
}

void metrics_health(char *why, size_t len)
{
	int64_t now = now_mono_ms();

	why[0] = '\0';
	if (M.heartbeat_ms == 0) {
		snprintf(why, len, "starting: the event loop has not reported yet");
		return;
	}
	if (now - M.heartbeat_ms > METRICS_STALL_MS) {
		snprintf(why, len, "stalled: the event loop last reported %lld s ago",
		         (long long)((now - M.heartbeat_ms) / 1000));
		return;
	}
	if (M.ready && !M.ready(M.ready_arg, why, len)) {
		if (!why[0])
			snprintf(why, len, "not ready");
		return;
	}
	why[0] = '\0';
}


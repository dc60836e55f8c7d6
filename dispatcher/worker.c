/* SPDX-License-Identifier: ISC */
/*
 * worker.c: the worker's loop and life (see worker.h): loading the config
 * and the providers (worker_load(), all --check-config does), connecting
 * and starting the timers (worker_start()), the pump that runs each step
 * of the hot path when there is something to do, the connections' state
 * and NOTIFYs, SIGTERM (a graceful stop), SIGHUP (a reload), teardown.
 *
 * An effect's life in one worker, each step a batch and one round trip
 * (docs/architecture.md, "The hot path, in order").  take.c's
 * take_batch() asks for due rows, a claim or a lease, through one sender
 * and one answer path (take_send(), on_taken()); the kind's handlers
 * (claim.c, lease.c) say what becomes of the rows.  The default path,
 * for rows this worker can send at once (claim.c: claim_limit() says how
 * many; http and crm, whose sends start at once):
 *
 *   claim        take.c, claim.c: outbox_claim(): pending rows go straight
 *                to `sending` under the kill-switch lock (lease and mark
 *                in one call); each is validated, then sent as below; a row
 *                that cannot go after all is given back (outbox_unclaim())
 *
 * Otherwise (no room for every row asked for, or a provider such as
 * email whose sends wait in a queue):
 *
 *   lease        take.c, lease.c: outbox_lease(): pending rows get this
 *                worker's lease
 *   validate     effect.c: payload parsed and checked by its provider; bad
 *                rows go to outbox_fail_invalid() with the reason (nothing sent)
 *   wait         until its provider and host have a free slot and the
 *                host's breaker lets it through (lease renewed meanwhile)
 *   mark         send.c: outbox_mark_sending(): the CAS to `sending` under
 *                the kill-switch lock; blocked rows are released by the
 *                same call, lost rows are dropped
 *   send         send.c: provider->send(); its done callback records the outcome
 *   record       send.c: outbox_complete_sending(): attempts-log row + CAS
 *                to the state policy_decide() chose (completed, pending,
 *                failed, unknown); what it did not apply goes to
 *                outbox_complete_rest(), where a late acceptance or
 *                not-sent of an attempt the reaper made `unknown` resolves it
 *
 * Two connections: `db` (the lease connection: claim, lease, mark,
 * renew, release, unclaim; LISTEN) and `rec` (the records connection: housekeeping,
 * invalid rows, reconciliation, head scans in position mode).  Outcomes go
 * on `rec` while the queue is short and on `db` in a backlog (send.c,
 * outcomes_db()), so that a busy worker keeps one backend busy.
 *
 * Lease renewal (lease.c), the reaper, unknown-type failing, provider
 * registration (housekeeping.c) and reconciliation (reconcile.c) run from
 * timers.  Nothing here blocks: every database call goes through db.c,
 * every send through a provider.
 */
#include "worker.h"

#include <event2/event.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "db.h"
#include "hosts.h"
#include "log.h"
#include "metrics.h"
#include "reload.h"
#include "sdnotify.h"
#include "util.h"
#include "worker_internal.h"
#include "worker_sql.h"

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
	if (!w->life.stopping) {
		take_batch(w);
		reconcile_on_notify(w);
		if (w->recon.requested)
			reconcile_pass(w, true);
	}
	worker_maybe_exit(w);
}

void worker_kick(struct worker *w)
{
	event_active(w->life.pump_ev, EV_TIMEOUT, 0);
}

/* Run the pump again in `ms` at the latest: a "wait for a moment" of
 * claim_limit() or gather_more() that no other event may end.  An earlier
 * wake-up already set stands (every wait is re-checked when it runs). */
void worker_kick_in(struct worker *w, int64_t ms)
{
	struct timeval tv = { .tv_sec = (time_t)(ms / 1000), .tv_usec = (suseconds_t)(ms % 1000) * 1000 };

	if (!evtimer_pending(w->life.pump_ev, NULL))
		evtimer_add(w->life.pump_ev, &tv);
}

/* A lease in `ms` (rows a rate limit deferred are due then), unless one
 * is planned sooner: a limited destination's next slot wakes the worker
 * instead of waiting for the poll tick, and a worker told "fewer rows than
 * you asked for" does not ask again before then. */
void worker_lease_in(struct worker *w, int64_t ms)
{
	int64_t at = now_mono_ms() + ms;
	struct timeval tv = { .tv_sec = (time_t)(ms / 1000), .tv_usec = (suseconds_t)(ms % 1000) * 1000 };

	if (evtimer_pending(w->life.held_due_ev, NULL) && w->life.held_due_mono <= at)
		return;
	w->life.held_due_mono = at;
	evtimer_add(w->life.held_due_ev, &tv);
}

static void on_poll(evutil_socket_t fd, short what, void *arg)
{
	struct worker *w = arg;

	(void)fd;
	(void)what;
	w->lease.wanted = true;
	worker_kick(w);
}

/* ---- database state ----------------------------------------------------- */

static void on_db_state(struct db *db, bool up, void *arg)
{
	struct worker *w = arg;

	metrics_set(G_DB_UP, up && db_is_up(w->rec));
	if (!up) {
		/* lease.busy stays: a lease on the wire was answered NULL
		 * (on_taken() cleared it); a queued one survives the
		 * reconnect and clears it when it is answered. */
		metrics_inc(M_DB_RECONNECTS, 1);
		if (w->life.serving)
			sdnotify_status("database connection lost: %s", db_last_error(db));
		else
			readiness_update(w);
		return;
	}
	take_cursor_reset(w);
	/* Urgent, so that no lease issued after the reconnect passes it. */
	worker_query(db, SQL_SCHEMA_VERSION, NULL, on_schema, w, DBQ_URGENT);
	if (w->life.serving)
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
		w->hk.maint_lost = true;
		w->hk.maint_due_mono = 0;
		if (w->life.serving)
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
	/* A notification is a wake-up, never a command: any login may send
	 * one.  'reconcile' may mean an operator's request, which is a row
	 * the pass's lease reads (reconcile_on_notify()). */
	if (payload && strcmp(payload, "reconcile") == 0)
		w->recon.notified = true;
	else
		w->lease.wanted = true;
	/* Rows given back while the switch was off sit behind our position. */
	if (payload && strcmp(payload, "kill-switch-on") == 0)
		take_cursor_reset(w);
	worker_kick(w);
}

/* ---- signals: stop and reload ------------------------------------------- */

void worker_maybe_exit(struct worker *w)
{
	if (!w->life.stopping)
		return;
	if (w->fx.n_sending > 0 || w->fx.n_reconciling > 0 || !TAILQ_EMPTY(&w->fx.done_q) ||
	    w->lease.busy || w->lease.head_busy || !TAILQ_EMPTY(&w->fx.recon_q) ||
	    w->send.complete_busy || w->recon.record_busy || w->send.mark_busy ||
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
	        w->fx.n_sending, w->s.shutdown_grace_ms);
	wire_give_up(w);
	event_base_loopbreak(w->base);
}

static void on_sigterm(evutil_socket_t sig, short what, void *arg)
{
	struct worker *w = arg;
	struct timeval tv;

	(void)what;
	if (w->life.stopping) {
		log_msg(OLOG_WARN, "shutdown_now", "second %s: exiting at once", strsignal((int)sig));
		wire_give_up(w);
		event_base_loopbreak(w->base);
		return;
	}
	w->life.stopping = true;
	sdnotify_stopping();
	log_msg(OLOG_INFO, "stopping", "%s: no new leases; waiting up to %ld ms for %d sends in flight",
	        strsignal((int)sig), w->s.shutdown_grace_ms, w->fx.n_sending);
	evtimer_del(w->life.poll_ev);
	evtimer_del(w->life.held_due_ev);
	release_waiting(w);
	/* Outcomes held for more to share their outbox_complete() call go
	 * now: a grace shorter than the wait would leave them `sending`. */
	worker_kick(w);
	tv.tv_sec = w->s.shutdown_grace_ms / 1000;
	tv.tv_usec = (w->s.shutdown_grace_ms % 1000) * 1000;
	w->life.grace_ev = evtimer_new(w->base, on_grace_over, w);
	evtimer_add(w->life.grace_ev, &tv);
	worker_maybe_exit(w);
}

static void timer_every(struct event *ev, long ms)
{
	struct timeval tv = { .tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000 };

	evtimer_add(ev, &tv);
}

/* The database deadlines, from lease_seconds (docs/operating.md, "At
 * 3 a.m.: what to run"): a statement may take half a lease (at least
 * 5 s) on the server; an answer or a connect 2 s later than that is a
 * lost connection; unacknowledged data for a third of a lease (the
 * renewal period) or an idle connection silent for as long, probed every
 * tenth of a lease, 3 times, is a dead one.  In poll_only mode sessions
 * carry no settings (a transaction-mode pooler shares them). */
static void apply_db_timeouts(struct worker *w)
{
	long stmt_ms = w->s.lease_seconds * 1000 / 2 > 5000 ? w->s.lease_seconds * 1000 / 2 : 5000;
	long idle_s = w->s.lease_seconds / 3 > 1 ? w->s.lease_seconds / 3 : 1;
	long interval_s = w->s.lease_seconds / 10 > 1 ? w->s.lease_seconds / 10 : 1;
	struct db *both[] = { w->db, w->rec };

	for (size_t i = 0; i < sizeof(both) / sizeof(both[0]); i++)
		db_set_timeouts(both[i], w->s.poll_only ? 0 : stmt_ms, stmt_ms + 2000,
		                w->s.lease_seconds * 1000 / 3, idle_s, interval_s);
}

static void apply_timers(struct worker *w)
{
	apply_db_timeouts(w);
	if (!w->life.stopping)
		timer_every(w->life.poll_ev, w->s.poll_interval_ms);
	timer_every(w->lease.heartbeat_ev, w->s.lease_seconds * 1000 / 3);
	timer_every(w->hk.maint_ev, w->s.maintenance_interval_ms);
}

static void apply_log_level(const struct worker *w)
{
	log_set_min_level(!strcmp(w->s.log_level, "debug") ? OLOG_DEBUG
	                  : !strcmp(w->s.log_level, "warn") ? OLOG_WARN
	                  : !strcmp(w->s.log_level, "error") ? OLOG_ERROR : OLOG_INFO);
}

/* {http,email}-style arrays of the types served, of those whose provider
 * honours idempotency keys, and of those it can reconcile; whether every
 * provider starts its sends at once (claim.c). */
static void build_type_arrays(struct worker *w)
{
	size_t a = 0, b = 0, c = 0;

	w->types_array[a++] = '{';
	w->idem_array[b++] = '{';
	w->recon_array[c++] = '{';
	w->claimable = w->providers.n > 0;
	for (size_t i = 0; i < w->providers.n; i++) {
		struct provider_slot *p = &w->providers.slots[i];
		if (!(p->ops->caps & OUTBOX_CAP_STARTS_AT_ONCE))
			w->claimable = false;
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

/* The new config, its settings and the providers' policies, or NULL with
 * the reason in err (the old config stays). */
static struct config *reload_load(struct worker *w, struct core_settings *s, char *name,
                                  size_t namelen, char *listen, size_t listenlen, char *err,
                                  size_t errlen)
{
	struct config *fresh = config_load(w->config_path, err, errlen);

	if (fresh == NULL || !config_core(fresh, s, err, errlen) ||
	    !config_instance(s, w->instance, name, namelen, listen, listenlen, err, errlen) ||
	    !providers_reload_policy(&w->providers, fresh, err, errlen)) {
		config_free(fresh);
		return NULL;
	}
	return fresh;
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
	if (w->life.ready_sent)
		sdnotify_reloading();
	fresh = reload_load(w, &s, name, sizeof(name), listen, sizeof(listen), err, sizeof(err));
	if (fresh == NULL) {
		log_msg(OLOG_ERROR, "reload_failed", "config not reloaded, keeping the old one: %s", err);
		reload_report(++w->life.reloads, false, err);
		if (w->life.ready_sent)
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
	apply_log_level(w);
	apply_timers(w);
	log_msg(OLOG_INFO, "reloaded", "config reloaded from %s", w->config_path);
	reload_report(++w->life.reloads, true, "config reloaded");
	if (w->life.ready_sent)
		sdnotify_ready("config reloaded");
}

/* ---- life cycle ---------------------------------------------------------- */

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

/* worker_name, or <host>-<instance>, or <host>-<pid>. */
static void pick_name(struct worker *w)
{
	char host[64];

	if (w->s.worker_name[0]) {
		text_copy(w->name, w->s.worker_name, sizeof(w->name));
		return;
	}
	if (gethostname(host, sizeof(host)) != 0)
		text_copy(host, "host", sizeof(host));
	host[sizeof(host) - 1] = '\0';
	if (w->instance)
		snprintf(w->name, sizeof(w->name), "%s-%s", host, w->instance);
	else
		snprintf(w->name, sizeof(w->name), "%s-%d", host, (int)getpid());
}

static bool load_providers(struct worker *w, char *err, size_t errlen)
{
	char dir[4096];

	if (w->s.provider_dir[0])
		text_copy(dir, w->s.provider_dir, sizeof(dir));
	else
		providers_default_dir(dir, sizeof(dir));
	providers_on_late_result(on_late_result, w);
	if (!providers_load(&w->providers, w->cfg, dir, w->s.providers, w->base, w->name, err,
	                    errlen))
		return false;
	for (size_t i = 0; i < w->providers.n; i++) {
		struct provider_slot *p = &w->providers.slots[i];
		if (p->policy.timeout_ms / 1000 >= w->s.max_lease_seconds)
			log_msg(OLOG_WARN, "config_warning",
			        "[provider.%s] timeout_ms=%ld is not below [dispatcher] max_lease_seconds=%ld: "
			        "a slow send can outlive its lease and end unknown",
			        p->name, p->policy.timeout_ms, w->s.max_lease_seconds);
	}
	return true;
}

struct worker *worker_load(struct event_base *base, const struct worker_options *opt)
{
	struct worker *w = text_alloc(sizeof(*w));
	char err[1024];
	const char *env = getenv("AI_ACTIONS_ENABLED");

	w->base = base;
	w->config_path = text_strdup(opt->config_path);
	w->instance = opt->instance ? text_strdup(opt->instance) : NULL;
	TAILQ_INIT(&w->fx.waiting);
	TAILQ_INIT(&w->fx.sending);
	TAILQ_INIT(&w->fx.done_q);
	TAILQ_INIT(&w->fx.recon_q);
	w->cfg = config_load(w->config_path, err, sizeof(err));
	if (w->cfg == NULL || !config_core(w->cfg, &w->s, err, sizeof(err)) ||
	    !apply_instance(w, &w->s, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "config_error", "%s", err);
		worker_free(w);
		return NULL;
	}
	apply_log_level(w);
	uuid_v4(w->owner);
	pick_name(w);
	log_set_worker(w->name);
	metrics_init(w->name);
	w->env_enabled = env != NULL && strcmp(env, "true") == 0;
	if (!load_providers(w, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "provider_error", "%s", err);
		worker_free(w);
		return NULL;
	}
	build_type_arrays(w);
	return w;
}

/* The two connections, named by role (the role first: the server cuts
 * application names at 63 bytes). */
static void open_connections(struct worker *w)
{
	char app[sizeof(w->name) + 32];

	w->db = db_new(w->base, w->s.conninfo, w->s.reconnect_min_ms, w->s.reconnect_max_ms,
	               w->s.poll_only ? NULL : LISTEN_CHANNEL);
	db_set_callbacks(w->db, on_db_state, on_notify, w);
	w->rec = db_new(w->base, w->s.conninfo, w->s.reconnect_min_ms, w->s.reconnect_max_ms, NULL);
	db_set_callbacks(w->rec, on_rec_state, NULL, w);
	snprintf(app, sizeof(app), "outbox lease %s", w->name);
	db_set_application_name(w->db, app);
	snprintf(app, sizeof(app), "outbox records %s", w->name);
	db_set_application_name(w->rec, app);
}

static void add_events(struct worker *w)
{
	struct event_base *base = w->base;

	w->life.pump_ev = event_new(base, -1, 0, on_pump, w);
	w->life.poll_ev = event_new(base, -1, EV_PERSIST, on_poll, w);
	w->life.held_due_ev = event_new(base, -1, 0, on_poll, w);
	w->lease.heartbeat_ev = event_new(base, -1, EV_PERSIST, on_heartbeat, w);
	w->hk.maint_ev = event_new(base, -1, EV_PERSIST, on_maintenance, w);
	w->life.sigterm_ev = evsignal_new(base, SIGTERM, on_sigterm, w);
	w->life.sigint_ev = evsignal_new(base, SIGINT, on_sigterm, w);
	w->life.sighup_ev = evsignal_new(base, SIGHUP, on_sighup, w);
	event_add(w->life.sigterm_ev, NULL);
	event_add(w->life.sigint_ev, NULL);
	event_add(w->life.sighup_ev, NULL);
	apply_timers(w);
}

static void log_started(const struct worker *w)
{
	char shown[512];

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
}

bool worker_start(struct worker *w)
{
	char err[1024];

	w->hosts = hosts_new();
	if (!metrics_start(w->base, w->s.metrics_listen, worker_ready, w, err, sizeof(err))) {
		log_msg(OLOG_ERROR, "metrics_error", "%s", err);
		return false;
	}
	open_connections(w);
	add_events(w);
	w->recon.next_mono = now_mono_ms() + 5000;
	log_started(w);
	reload_report(0, true, "started");
	sdnotify_init(w->base);
	metrics_heartbeat();
	/* READY=1 waits for both connections and the schema check
	 * (readiness_update); TimeoutStartSec= applies until then. */
	sdnotify_status("starting: connecting to the database");
	db_start(w->db);
	db_start(w->rec);
	return true;
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

static void free_event(struct event *ev)
{
	if (ev)
		event_free(ev);
}

void worker_free(struct worker *w)
{
	if (w == NULL)
		return;
	/* Effects still with a provider are abandoned by its shutdown(). */
	providers_unload(&w->providers);
	providers_on_late_result(NULL, NULL);
	wire_free_all(w);
	effects_free_all(w);
	db_free(w->db);
	db_free(w->rec);
	metrics_stop();
	sdnotify_shutdown();
	hosts_free(w->hosts);
	free_event(w->life.pump_ev);
	free_event(w->life.poll_ev);
	free_event(w->life.held_due_ev);
	free_event(w->lease.heartbeat_ev);
	free_event(w->hk.maint_ev);
	free_event(w->life.grace_ev);
	free_event(w->life.sigterm_ev);
	free_event(w->life.sigint_ev);
	free_event(w->life.sighup_ev);
	config_free(w->cfg);
	free(w->config_path);
	free(w->instance);
	free(w);
}

/* SPDX-License-Identifier: ISC */
/*
 * pool.c: the loop half of the email provider: the queue of jobs, the
 * per-job timer, results coming back from the SMTP threads through a
 * pipe, and the threads' start and stop.
 *
 * Two bounds per job, both enforced here because libesmtp has no connect
 * timeout and only per-read timeouts:
 *   queued    queue_timeout_ms from send(); a job no thread took by then
 *             is not_sent ("all N SMTP threads busy").  Queue wait never
 *             counts against the SMTP budget.
 *   running   timeout_ms from the moment a thread took it (a fresh
 *             session's connect and greeting included), and
 *             connect_timeout_ms for the connect itself.
 * A thread that takes or restarts a job sets arm_pending and wakes the
 * loop, which re-arms the job's timer.  A job the timer gives up on is
 * reported at once; its thread finishes in the background (never past the
 * commit point); a late 250 is logged and handed to the dispatcher
 * (host->late_result) as evidence.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <event2/event.h>

#include "email.h"
#include "text.h"

/* Join a stuck thread this long at shutdown before leaving it behind. */
#define EMAIL_JOIN_MS 1000

int64_t email_mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void email_unref(struct email *em)
{
	bool last;

	pthread_mutex_lock(&em->mu);
	last = --em->refs == 0;
	pthread_mutex_unlock(&em->mu);
	if (!last)
		return;
	if (em->wake[0] >= 0)
		close(em->wake[0]);
	if (em->wake[1] >= 0)
		close(em->wake[1]);
	if (em->password) {
		explicit_bzero(em->password, strlen(em->password));
		free(em->password);
	}
	free(em->username);
	free(em->threads);
	if (em->tls)
		SSL_CTX_free(em->tls);
	pthread_cond_destroy(&em->cv);
	pthread_cond_destroy(&em->cv_session);
	pthread_mutex_destroy(&em->mu);
	free(em);
}

void email_job_free(struct email_job *j)
{
	if (j == NULL)
		return;
	if (j->timer)
		event_free(j->timer);
	free(j->from_addr);
	free(j->rcpt);
	free(j->message);
	free(j);
}

void email_wake_loop(struct email *em)
{
	char c = 1;

	/* Non-blocking; a full pipe already means "wake up". */
	if (write(em->wake[1], &c, 1) < 0 && errno != EAGAIN)
		abort();
}

void email_job_classify(struct email_job *j, bool abandoned, const char *lib_err, int64_t now,
                        struct outbox_result *r)
{
	const struct email *em = j->em;
	struct email_ctx ctx = { em->server, em->nthreads, em->queue_timeout_ms };
	int64_t waited = now - (j->started_ms ? j->started_ms : j->enqueued_ms);

	email_classify(&j->seen, &ctx, abandoned, lib_err, waited, now - j->end_ms, r);
}

/* ---- timers ------------------------------------------------------------- */

static void timer_arm(struct email_job *j, int64_t at, int64_t now)
{
	int64_t d = at > now ? at - now : 0;
	struct timeval tv = { (time_t)(d / 1000), (suseconds_t)((d % 1000) * 1000) };

	evtimer_add(j->timer, &tv);
}

/* When a running job is due: its deadline, or its connect deadline while
 * it is not connected. */
static int64_t running_due(const struct email_job *j)
{
	int64_t connect_by = j->started_ms + j->connect_timeout_ms;

	if (j->seen.phase < PH_CONNECTED && connect_by < j->deadline_ms)
		return connect_by;
	return j->deadline_ms;
}

static void on_timer(evutil_socket_t fd, short what, void *arg)
{
	struct email_job *j = arg;
	struct email *em = j->em;
	struct outbox_result r;
	int64_t now = email_mono_ms();
	bool give_up = false, unqueue = false;

	(void)fd;
	(void)what;
	pthread_mutex_lock(&em->mu);
	switch (j->state) {
	case JOB_QUEUED:
		if (now >= j->queue_deadline_ms) {
			TAILQ_REMOVE(&em->queue, j, link);
			give_up = unqueue = true;
		} else {
			timer_arm(j, j->queue_deadline_ms, now);
		}
		break;
	case JOB_RUNNING:
		if (now >= running_due(j)) {
			give_up = true;
			j->cancel = true;
		} else {
			timer_arm(j, running_due(j), now);
		}
		break;
	case JOB_FINISHED:
		/* The result is in the pipe; on_wake reports it. */
		break;
	}
	if (give_up) {
		email_job_classify(j, true, NULL, now, &r);
		j->reported = true;
	}
	pthread_mutex_unlock(&em->mu);
	if (!give_up)
		return;
	event_free(j->timer);
	j->timer = NULL;
	em->host->log(OLOG_WARN, EMAIL_NAME, "effect %s: SMTP send given up after %lld ms: %s",
	              j->effect_id, (long long)(now - j->enqueued_ms), r.error);
	j->done(j->token, &r);
	if (unqueue)
		email_job_free(j);
	/* else: the thread still owns it; on_wake frees it (and logs what
	 * the session finally said). */
}

/* ---- results ------------------------------------------------------------ */

/* A job given up on (already reported) that ended anyway.  A 250 is the
 * relay's proof of acceptance: handed to the dispatcher, which completes
 * the effect if it is `unknown` because of this very attempt. */
static void report_late(struct email *em, struct email_job *j)
{
	if (j->result.outcome == OUTCOME_ACCEPTED) {
		em->host->log(OLOG_WARN, EMAIL_NAME,
		              "effect %s: the relay accepted the message after the attempt had been "
		              "given up on: %d, provider id %s (evidence for resolving it)",
		              j->effect_id, j->result.status, j->result.provider_id);
		if (em->host->late_result)
			em->host->late_result(EMAIL_NAME, j->effect_id, j->attempt, &j->result);
	} else
		em->host->log(OLOG_INFO, EMAIL_NAME,
		              "effect %s: the SMTP session given up on ended: %s", j->effect_id,
		              j->result.error);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
	struct email *em = arg;
	struct job_list done_list;
	struct email_job *j;
	char buf[64];
	int64_t now = email_mono_ms();

	(void)what;
	while (read(fd, buf, sizeof(buf)) > 0)
		;
	TAILQ_INIT(&done_list);
	pthread_mutex_lock(&em->mu);
	for (j = TAILQ_FIRST(&em->running); j != NULL; j = TAILQ_NEXT(j, link)) {
		if (j->arm_pending && j->timer)
			timer_arm(j, running_due(j), now);
		j->arm_pending = false;
	}
	TAILQ_CONCAT(&done_list, &em->finished, link);
	pthread_mutex_unlock(&em->mu);
	while ((j = TAILQ_FIRST(&done_list)) != NULL) {
		TAILQ_REMOVE(&done_list, j, link);
		if (j->reported) {
			report_late(em, j);
		} else {
			j->reported = true;
			if (j->timer) {
				event_free(j->timer);
				j->timer = NULL;
			}
			j->done(j->token, &j->result);
		}
		email_job_free(j);
	}
}

/* ---- queue and threads ---------------------------------------------------- */

bool email_enqueue(struct email *em, struct email_job *j, char *err, size_t errlen)
{
	int64_t now = email_mono_ms();

	j->enqueued_ms = now;
	j->queue_deadline_ms = now + em->queue_timeout_ms;
	j->state = JOB_QUEUED;
	j->seen.phase = PH_QUEUED;
	j->timer = evtimer_new(em->base, on_timer, j);
	if (j->timer == NULL) {
		snprintf(err, errlen, "email: cannot create a timer");
		return false;
	}
	pthread_mutex_lock(&em->mu);
	if (em->stopping || em->started_threads == 0) {
		pthread_mutex_unlock(&em->mu);
		snprintf(err, errlen, "email: the SMTP pool is stopped");
		return false;
	}
	TAILQ_INSERT_TAIL(&em->queue, j, link);
	/* A thread holding an idle session takes it over the open
	 * connection; only when none waits does a thread open a new one. */
	if (em->idle_sessions > 0)
		pthread_cond_broadcast(&em->cv_session);
	else
		pthread_cond_signal(&em->cv);
	timer_arm(j, j->queue_deadline_ms, now);
	pthread_mutex_unlock(&em->mu);
	return true;
}

bool email_pool_start(struct email *em, char *err, size_t errlen)
{
	sigset_t all, old;
	bool ok = true;

	if (pipe2(em->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
		snprintf(err, errlen, "email: pipe: %s", strerror(errno));
		return false;
	}
	em->wake_ev = event_new(em->base, em->wake[0], EV_READ | EV_PERSIST, on_wake, em);
	if (em->wake_ev == NULL || event_add(em->wake_ev, NULL) < 0) {
		snprintf(err, errlen, "email: cannot watch the result pipe");
		return false;
	}
	/* Pool threads take no signals (SIGPIPE from a relay that hung up
	 * becomes EPIPE; SIGTERM and SIGHUP stay with the loop). */
	em->threads = text_array((size_t)em->nthreads, sizeof(pthread_t));
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (int i = 0; i < em->nthreads && ok; i++) {
		int rc;
		pthread_mutex_lock(&em->mu);
		em->refs++;
		pthread_mutex_unlock(&em->mu);
		rc = pthread_create(&em->threads[i], NULL, email_thread_main, em);
		if (rc != 0) {
			pthread_mutex_lock(&em->mu);
			em->refs--;
			pthread_mutex_unlock(&em->mu);
			snprintf(err, errlen, "cannot start SMTP thread %d of %d: %s", i + 1, em->nthreads,
			         strerror(rc));
			ok = false;
			break;
		}
		em->started_threads++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return ok;
}

static void pin_module(void);

void email_pool_stop(struct email *em)
{
	struct job_list drop;
	struct email_job *j;
	bool left_behind = false;

	TAILQ_INIT(&drop);
	pthread_mutex_lock(&em->mu);
	em->stopping = true;
	TAILQ_CONCAT(&drop, &em->queue, link);
	TAILQ_CONCAT(&drop, &em->finished, link);
	/* Running jobs belong to their threads, which free them; they may
	 * not reach the end of data any more, and their timers (the loop's)
	 * go now. */
	for (j = TAILQ_FIRST(&em->running); j != NULL; j = TAILQ_NEXT(j, link)) {
		j->cancel = true;
		if (j->timer) {
			event_free(j->timer);
			j->timer = NULL;
		}
	}
	pthread_cond_broadcast(&em->cv);
	pthread_cond_broadcast(&em->cv_session);
	pthread_mutex_unlock(&em->mu);
	/* Queued and finished jobs: done is called for none (provider.h). */
	while ((j = TAILQ_FIRST(&drop)) != NULL) {
		TAILQ_REMOVE(&drop, j, link);
		email_job_free(j);
	}
	for (int i = 0; i < em->started_threads; i++) {
		/* The deadline is on the monotonic clock: a wall clock stepped
		 * back during shutdown must not stretch the wait. */
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_nsec += (long)EMAIL_JOIN_MS * 1000000L;
		ts.tv_sec += ts.tv_nsec / 1000000000L;
		ts.tv_nsec %= 1000000000L;
		if (pthread_clockjoin_np(em->threads[i], NULL, CLOCK_MONOTONIC, &ts) != 0) {
			pthread_detach(em->threads[i]);
			left_behind = true;
		}
	}
	if (left_behind) {
		pin_module();
		em->host->log(OLOG_WARN, EMAIL_NAME,
		              "shutdown: SMTP sessions still running were left behind (their outcome is "
		              "not recorded; their effects end unknown when their leases expire)");
	}
	if (em->wake_ev)
		event_free(em->wake_ev);
	em->wake_ev = NULL;
}

static void pin_module(void)
{
	Dl_info info;

	/* A thread left running at shutdown still executes our callbacks:
	 * keep the code mapped even when the dispatcher dlclose()s us. */
	if (dladdr((void *)pin_module, &info) && info.dli_fname)
		(void)dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

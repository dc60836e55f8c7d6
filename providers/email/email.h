/* SPDX-License-Identifier: ISC */
/*
 * email.h: the email provider's shared state (email.c owns the provider
 * interface, pool.c the loop half, session.c the SMTP threads).
 *
 * One job per send.  Ownership: a QUEUED job belongs to the queue (the
 * loop frees it when its queue bound expires); a RUNNING job belongs to
 * its thread until the thread puts it on `finished`; the loop then calls
 * `done` (unless its timer already did) and frees it.  Everything marked
 * "under mu" is read and written with em->mu held.
 */
#ifndef OUTBOX_EMAIL_H
#define OUTBOX_EMAIL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include <openssl/ssl.h>   /* before libesmtp.h: declares smtp_starttls_set_ctx */
#include <libesmtp.h>

#include "provider.h"
#include "reply.h"

#define EMAIL_NAME        "email"
#define EMAIL_MAX_THREADS 256
/* max_in_flight above this many times threads gets a note at start: the
 * default is 8 times the default threads (email.c). */
#define EMAIL_QUEUE_NOTE_RATIO 16

enum job_state { JOB_QUEUED, JOB_RUNNING, JOB_FINISHED };

struct email;

struct email_job {
	TAILQ_ENTRY(email_job) link;
	struct email *em;

	/* Loop side only. */
	outbox_done_fn done;
	void *token;
	struct event *timer;
	int64_t enqueued_ms, queue_deadline_ms;
	long timeout_ms, connect_timeout_ms;   /* the config at send() */

	/* Immutable copies (the effect may be gone before the thread is). */
	char effect_id[65];
	int attempt;                    /* for a late acceptance's report */
	char *from_addr, *rcpt;
	char *message;
	size_t message_len;

	/* Under mu. */
	enum job_state state;
	struct email_seen seen;
	bool reported;                  /* done already called (timer) */
	bool cancel;                    /* do not commit the end of data */
	bool arm_pending;               /* (re)started: the loop re-arms its timer */
	bool reused;                    /* joined a session that had sent before */
	int64_t started_ms, deadline_ms, end_ms;
	struct outbox_result result;    /* by the thread when FINISHED */

	/* Thread side only. */
	size_t msg_pos;
	smtp_message_t msg;
	smtp_recipient_t rcpt_handle;
};

TAILQ_HEAD(job_list, email_job);

struct email {
	const struct outbox_host *host;
	struct event_base *base;
	char server[256];
	enum starttls_option starttls;
	char *username, *password;
	char helo[256];
	char msgid_domain[256];
	const struct outbox_conf *conf;    /* re-read per send: reloads apply */
	int nthreads;
	long queue_timeout_ms;
	long idle_ms;                      /* keep an idle session open this long */
	long max_per_session;              /* messages per SMTP session */
	SSL_CTX *tls;

	pthread_mutex_t mu;
	pthread_cond_t cv;              /* threads without a session wait here */
	pthread_cond_t cv_session;      /* threads holding an idle session wait here */
	pthread_t *threads;
	int started_threads;
	int refs;                       /* loop + each live thread */
	bool stopping;
	struct job_list queue, running, finished;
	int idle_sessions;              /* threads waiting on cv_session */

	int wake[2];
	struct event *wake_ev;
};

/* pool.c */
int64_t email_mono_ms(void);
void email_unref(struct email *em);
void email_job_free(struct email_job *j);
void email_wake_loop(struct email *em);        /* under mu */
void email_job_classify(struct email_job *j, bool abandoned, const char *lib_err, int64_t now,
                        struct outbox_result *r);   /* under mu */
bool email_pool_start(struct email *em, char *err, size_t errlen);
bool email_enqueue(struct email *em, struct email_job *j, char *err, size_t errlen);
void email_pool_stop(struct email *em);

/* session.c */
void *email_thread_main(void *arg);
/* The budget left before the terminator must be at least this. */
long email_margin_ms(long timeout_ms);

#endif

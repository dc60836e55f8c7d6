/* SPDX-License-Identifier: ISC */
/*
 * session.c: the SMTP threads (libesmtp), several messages per session.
 *
 * smtp_start_session() runs a whole session and blocks, so each pool
 * thread runs one session at a time.  A thread takes a job and opens a
 * session with that one message.  When the relay has answered the
 * message's transaction (SMTP_EV_MESSAGESENT, or a refused MAIL FROM),
 * the job is finished and handed to the loop at once; then, still inside
 * libesmtp's event callback, the thread waits up to session_idle_ms for
 * the next queued job and appends it with smtp_add_message().  libesmtp
 * looks for the next message only after that callback has returned
 * (next_message() follows the event in protocol.c), so the new message
 * goes over the same connection: MAIL FROM right after a 250, RSET first
 * after a refused end of data (libesmtp's rule; a 250 or a refused MAIL
 * FROM already leaves the relay with no transaction, RFC 5321 4.1.1).  A
 * refused DATA command is the exception: libesmtp picks its next message
 * before it reports that one, finds none and QUITs; the job taken then
 * finds its session gone and runs on a fresh one (run_again_locked).  No
 * job within the idle time, session_max_messages reached, or a message
 * given up on: the callback adds nothing and libesmtp sends QUIT.
 * PIPELINING is libesmtp's: when the relay offers it, RCPT TO and DATA go
 * in one write.  When the relay offers CHUNKING, libesmtp sends the
 * content as BDAT chunks; the provider then has RCPT TO answered before
 * the chunks (require_all_recipients, set from the EHLO reply in
 * monitor_reply_line(): libesmtp 1.1.0 crashes when a write of RCPT TO and
 * BDATs is lost before RCPT TO's reply), and keeps the monitor's view
 * itself after the first BDAT message, for which libesmtp switched the
 * monitor off for good (conn_add, on_event, on_message).
 *
 * The commit point stays per message: one message is in flight per
 * connection, and the next is added only after the relay answered the
 * one before.  So when a connection is lost after message k's terminator,
 * only k is ambiguous; messages before it have their answer, and the
 * next one has not been handed to libesmtp.  A message that joined a
 * reused session and lost it before any byte of its content (no reply to
 * MAIL FROM, or 421: the relay closed an idle connection) is run once
 * more on a fresh connection.
 *
 * What each message got to is recorded under em->mu in job->seen
 * (reply.h); on_message() takes the commit point under the mutex, and
 * refuses it (libesmtp then drops the connection without a terminator)
 * when the loop has given up on the job or when less than the margin
 * (email_margin_ms) of its timeout is left for the relay's answer.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <openssl/x509.h>
#include <auth-client.h>

#include "email.h"
#include "text.h"

/* One SMTP session of one thread. */
struct conn {
	struct email *em;
	smtp_session_t s;
	auth_context_t auth;
	struct email_job *job;      /* the message in flight; NULL between messages */
	int finished;               /* messages this session has answered */
	bool no_more;               /* take no further job (given up, 421, stopping) */
	bool connected;
	bool chunking;              /* the relay offered CHUNKING: content as BDAT */
	bool blind;                 /* a BDAT message switched libesmtp's monitor off */
	/* Connection facts, carried from one message to the next (under mu). */
	bool auth_ok, tls_ok, starttls_sent;
	char last_cmd[12];
	/* Thread only: the protocol monitor's line assembly. */
	char rline[512];
	size_t rline_len;
	bool wline_start;
};

long email_margin_ms(long timeout_ms)
{
	return timeout_ms / 5 > 1000 ? timeout_ms / 5 : 1000;
}

/* ---- jobs: taking and finishing (under mu) ------------------------------ */

static struct email_job *take_locked(struct email *em)
{
	struct email_job *j = TAILQ_FIRST(&em->queue);
	int64_t now = email_mono_ms();

	TAILQ_REMOVE(&em->queue, j, link);
	TAILQ_INSERT_TAIL(&em->running, j, link);
	j->state = JOB_RUNNING;
	j->seen.phase = PH_STARTED;
	/* The SMTP budget starts now, not at send(): queue wait has its
	 * own bound (queue_timeout_ms). */
	j->started_ms = now;
	j->deadline_ms = now + j->timeout_ms;
	j->arm_pending = true;
	email_wake_loop(em);
	return j;
}

static void finish_locked(struct email *em, struct email_job *j)
{
	TAILQ_REMOVE(&em->running, j, link);
	j->state = JOB_FINISHED;
	if (em->stopping) {
		/* Abandoned by shutdown(): nobody else will free it. */
		email_job_free(j);
		return;
	}
	TAILQ_INSERT_TAIL(&em->finished, j, link);
	email_wake_loop(em);
}

/* The next job for a live session: wait up to idle_ms. */
static struct email_job *next_for_session_locked(struct email *em)
{
	struct timespec until;
	int64_t ns;

	clock_gettime(CLOCK_MONOTONIC, &until);
	ns = until.tv_nsec + (em->idle_ms % 1000) * 1000000L;
	until.tv_sec += em->idle_ms / 1000 + ns / 1000000000L;
	until.tv_nsec = ns % 1000000000L;
	em->idle_sessions++;
	while (!em->stopping && TAILQ_EMPTY(&em->queue))
		if (pthread_cond_timedwait(&em->cv_session, &em->mu, &until) == ETIMEDOUT)
			break;
	em->idle_sessions--;
	if (em->stopping || TAILQ_EMPTY(&em->queue))
		return NULL;
	return take_locked(em);
}

/* ---- messages into the session ------------------------------------------ */

static const char *on_message(void **ctx, int *len, void *arg);

static void set_timeouts(smtp_session_t s, const struct email_job *j)
{
	static const int which[] = { Timeout_GREETING, Timeout_ENVELOPE, Timeout_DATA,
	                             Timeout_TRANSFER, Timeout_DATA2 };
	/* libesmtp's timeouts are per read; the loop's timer bounds the
	 * message.  Give libesmtp what is left, so the thread ends soon
	 * after the loop gives up. */
	long per_read = (long)(j->deadline_ms - email_mono_ms()) + 800;

	if (per_read < 1000)
		per_read = 1000;
	for (size_t i = 0; i < sizeof(which) / sizeof(which[0]); i++)
		smtp_set_timeout(s, which[i] | Timeout_OVERRIDE_RFC2822_MINIMUM, per_read);
}

/* Make j the session's next (and only unanswered) message. */
static bool conn_add(struct conn *c, struct email_job *j)
{
	struct email *em = c->em;
	smtp_message_t m = smtp_add_message(c->s);

	if (m == NULL || !smtp_set_reverse_path(m, j->from_addr) ||
	    !smtp_set_messagecb(m, on_message, j))
		return false;
	j->rcpt_handle = smtp_add_recipient(m, j->rcpt);
	if (j->rcpt_handle == NULL)
		return false;
	j->msg = m;
	set_timeouts(c->s, j);
	pthread_mutex_lock(&em->mu);
	memset(&j->seen, 0, sizeof(j->seen));
	j->seen.phase = c->connected ? PH_CONNECTED : PH_STARTED;
	j->seen.auth_required = em->username != NULL;
	j->seen.auth_ok = c->auth_ok;
	j->seen.tls_ok = c->tls_ok;
	j->seen.starttls_sent = c->starttls_sent;
	text_copy(j->seen.last_cmd, c->last_cmd, sizeof(j->seen.last_cmd));
	j->seen.bdat = c->chunking;
	if (c->blind && c->finished > 0) {
		/* The monitor is off for the rest of the session (libesmtp's BDAT
		 * code never turns it back on): what the monitor would have seen
		 * next is this message's MAIL FROM, written as soon as the
		 * callback that added it returns. */
		text_copy(c->last_cmd, "MAIL", sizeof(c->last_cmd));
		text_copy(j->seen.last_cmd, "MAIL", sizeof(j->seen.last_cmd));
		j->seen.phase = PH_ENVELOPE;
	}
	j->reused = c->finished > 0;
	j->msg_pos = 0;
	c->job = j;
	pthread_mutex_unlock(&em->mu);
	return true;
}

static void finish_not_sent(struct email *em, struct email_job *j, const char *what)
{
	char lib_err[128];

	smtp_strerror(smtp_errno(), lib_err, sizeof(lib_err));
	pthread_mutex_lock(&em->mu);
	memset(&j->result, 0, sizeof(j->result));
	j->result.outcome = OUTCOME_NOT_SENT;
	j->result.retry_after_ms = -1;
	snprintf(j->result.error, sizeof(j->result.error), "libesmtp: %s: %s", what, lib_err);
	finish_locked(em, j);
	pthread_mutex_unlock(&em->mu);
}

/* The relay answered the transaction of c->job: hand the job to the loop,
 * then wait for the next one to go over the same connection. */
static void transaction_done(struct conn *c)
{
	struct email *em = c->em;
	struct email_job *j = c->job, *next = NULL;

	pthread_mutex_lock(&em->mu);
	c->auth_ok = j->seen.auth_ok;
	c->tls_ok = j->seen.tls_ok;
	c->starttls_sent = j->seen.starttls_sent;
	if (j->seen.bdat && j->seen.phase >= PH_DATA)
		c->blind = true;
	if (j->reused && j->seen.mail.code == 421 && !j->reported && !j->cancel) {
		/* The relay is closing an idle connection: nothing of this
		 * message was taken; it gets a fresh one (conn_run). */
		c->no_more = true;
		pthread_mutex_unlock(&em->mu);
		return;
	}
	if (j->reported || j->cancel)
		c->no_more = true;   /* given up on: this connection's state is unsure */
	email_job_classify(j, false, NULL, email_mono_ms(), &j->result);
	finish_locked(em, j);
	c->job = NULL;
	c->finished++;
	if (!c->no_more && c->finished < em->max_per_session && em->idle_ms > 0)
		next = next_for_session_locked(em);
	pthread_mutex_unlock(&em->mu);
	if (next && !conn_add(c, next))
		finish_not_sent(em, next, "cannot add a message to the session");
}

/* ---- libesmtp callbacks (pool thread) ------------------------------------ */

/* Whether an EHLO reply line offers CHUNKING as libesmtp reads it (cb_ehlo:
 * blanks skipped, then an atom compared without case): "250- CHUNKING",
 * "250-chunking\t" or "250-CHUNKING;" enable BDAT in libesmtp as much as
 * "250-CHUNKING" does, and must set require_all_recipients as well. */
static bool ehlo_offers_chunking(const char *line, size_t len)
{
	size_t i = 4, from;

	if (len < 4 || line[0] != '2' || (line[3] != '-' && line[3] != ' '))
		return false;
	while (i < len && (line[i] == ' ' || line[i] == '\t' || line[i] == '\v' || line[i] == '\r'))
		i++;
	from = i;
	while (i < len && line[i] > ' ' && line[i] <= '~' && strchr("\"()<>[]@,;:\\.", line[i]) == NULL)
		i++;
	return i - from == 8 && strncasecmp(line + from, "CHUNKING", 8) == 0;
}

static void monitor_reply_line(struct conn *c, const char *line, size_t len)
{
	struct email_seen *s;
	int code;

	if (strcmp(c->last_cmd, "EHLO") == 0 && ehlo_offers_chunking(line, len)) {
		/* CHUNKING: libesmtp will send the content as BDAT.  With
		 * PIPELINING it writes RCPT TO and every BDAT chunk at once, and
		 * libesmtp 1.1.0 then crashes when the connection is lost before
		 * RCPT TO's reply: its protocol loop reads the replies still
		 * pending after it has ended the session, through the state
		 * table at index -1 (a NULL handler: SIGSEGV at pc 0).  With
		 * require_all_recipients RCPT TO is flushed and answered first
		 * (the one recipient either way: the same outcome); then only
		 * BDAT replies are pending, and libesmtp's BDAT handler reads
		 * them all itself.  Under the mutex: on_monitor. */
		c->chunking = true;
		smtp_option_require_all_recipients(c->s, 1);
		if (c->job)
			c->job->seen.bdat = true;
	}
	if (c->job == NULL || len < 4 || line[0] < '2' || line[0] > '5' || line[1] < '0' ||
	    line[1] > '9' || line[2] < '0' || line[2] > '9' || line[3] != ' ')
		return;   /* between messages, or not the last line of a reply */
	s = &c->job->seen;
	code = (line[0] - '0') * 100 + (line[1] - '0') * 10 + (line[2] - '0');
	if (strcmp(c->last_cmd, "QUIT") == 0)
		return;
	if (strcmp(c->last_cmd, "AUTH") == 0) {
		if (code == 235)
			s->auth_ok = true;
		else if (code >= 400)
			email_reply_set(&s->auth, code, line + 4, len - 4);
	}
	email_reply_set(&s->session, code, line + 4, len - 4);
}

static void monitor_written(struct conn *c, const char *buf, int buflen)
{
	static const char *const verbs[] = { "EHLO", "HELO", "STARTTLS", "AUTH", "MAIL",
	                                     "RCPT", "DATA", "BDAT", "RSET", "QUIT", NULL };

	for (int i = 0; i < buflen; i++) {
		if (!(i == 0 ? c->wline_start : buf[i - 1] == '\n'))
			continue;
		for (size_t v = 0; verbs[v]; v++) {
			size_t n = strlen(verbs[v]);
			if ((size_t)(buflen - i) < n || strncasecmp(buf + i, verbs[v], n) != 0)
				continue;
			text_copy(c->last_cmd, verbs[v], sizeof(c->last_cmd));
			if (c->job) {
				struct email_seen *s = &c->job->seen;
				text_copy(s->last_cmd, verbs[v], sizeof(s->last_cmd));
				if (strcmp(verbs[v], "MAIL") == 0 && s->phase < PH_ENVELOPE)
					s->phase = PH_ENVELOPE;
				if (strcmp(verbs[v], "STARTTLS") == 0)
					s->starttls_sent = true;
			}
			break;
		}
	}
	c->wline_start = buflen > 0 && buf[buflen - 1] == '\n';
}

/* Sees the protocol (never the message): replies are assembled into lines
 * and remembered; of what we write, only the command verb is looked at
 * (AUTH lines carry credentials: never copied). */
static void on_monitor(const char *buf, int buflen, int writing, void *arg)
{
	struct conn *c = arg;

	pthread_mutex_lock(&c->em->mu);
	if (writing == SMTP_CB_WRITING) {
		monitor_written(c, buf, buflen);
	} else if (writing == SMTP_CB_READING) {
		for (int i = 0; i < buflen; i++) {
			if (buf[i] == '\n') {
				size_t n = c->rline_len;
				if (n > 0 && c->rline[n - 1] == '\r')
					n--;
				monitor_reply_line(c, c->rline, n);
				c->rline_len = 0;
			} else if (c->rline_len < sizeof(c->rline)) {
				c->rline[c->rline_len++] = buf[i];
			}
		}
	}
	pthread_mutex_unlock(&c->em->mu);
}

static void reply_from_status(struct email_reply *r, const smtp_status_t *st)
{
	if (st == NULL || st->text == NULL)
		email_reply_set(r, st ? st->code : 0, "", 0);
	else
		email_reply_set(r, st->code, st->text, strlen(st->text));
}

static void tls_refused(struct email_seen *s, const char *why)
{
	s->tls_refused = true;
	text_copy(s->tls_why, why, sizeof(s->tls_why));
}

/* The certificate events: refuse (*ok = 0) and remember why. */
static void on_tls_event(struct conn *c, struct email_seen *s, int event_no, va_list ap)
{
	char why[160];
	int *ok;

	switch (event_no) {
	case SMTP_EV_INVALID_PEER_CERTIFICATE: {
		long vfy = va_arg(ap, long);
		snprintf(why, sizeof(why), "certificate verification failed: %s",
		         X509_verify_cert_error_string(vfy));
		tls_refused(s, why);
		break;
	}
	case SMTP_EV_WRONG_PEER_CERTIFICATE:
		snprintf(why, sizeof(why), "the certificate does not name the relay %.100s", c->em->server);
		tls_refused(s, why);
		break;
	case SMTP_EV_WEAK_CIPHER:
		(void)va_arg(ap, int);
		tls_refused(s, "cipher too weak");
		break;
	case SMTP_EV_NO_PEER_CERTIFICATE:
		tls_refused(s, "the relay presented no certificate");
		break;
	case SMTP_EV_NO_CLIENT_CERTIFICATE:
		tls_refused(s, "client certificate unusable");
		break;
	case SMTP_EV_UNUSABLE_CA_LIST:
		tls_refused(s, "unusable CA list");
		return;
	case SMTP_EV_UNUSABLE_CLIENT_CERTIFICATE:
		tls_refused(s, "unusable client certificate under $HOME/.config/libesmtp");
		return;
	}
	ok = va_arg(ap, int *);
	*ok = 0;
}

static void on_event(smtp_session_t session, int event_no, void *arg, ...)
{
	struct conn *c = arg;
	struct email *em = c->em;
	struct email_seen *s;
	bool ended = false;
	va_list ap;

	(void)session;
	va_start(ap, arg);
	pthread_mutex_lock(&em->mu);
	if (event_no == SMTP_EV_CONNECT)
		c->connected = true;
	s = c->job ? &c->job->seen : NULL;
	switch (s ? event_no : -1) {
	case SMTP_EV_CONNECT:
		if (s->phase < PH_CONNECTED)
			s->phase = PH_CONNECTED;
		break;
	case SMTP_EV_MAILSTATUS: {
		(void)va_arg(ap, const char *);
		smtp_message_t msg = va_arg(ap, smtp_message_t);
		reply_from_status(&s->mail, smtp_reverse_path_status(msg));
		/* A refused MAIL FROM ends the transaction (no RCPT, no DATA). */
		ended = s->mail.code / 100 != 2;
		if (!ended && c->blind) {
			/* Monitor off: RCPT TO is written next. */
			text_copy(c->last_cmd, "RCPT", sizeof(c->last_cmd));
			text_copy(s->last_cmd, "RCPT", sizeof(s->last_cmd));
		}
		break;
	}
	case SMTP_EV_RCPTSTATUS: {
		(void)va_arg(ap, const char *);
		smtp_recipient_t rcpt = va_arg(ap, smtp_recipient_t);
		if (rcpt == c->job->rcpt_handle)
			reply_from_status(&s->rcpt, smtp_recipient_status(rcpt));
		/* With require_all_recipients (CHUNKING) a refused recipient ends
		 * the transaction here: libesmtp sends no BDAT and reports no
		 * MESSAGESENT; it looks for a next message (RSET, then MAIL FROM)
		 * right after this event, so the next job may join. */
		if (c->chunking && s->rcpt.code / 100 != 2)
			ended = true;
		break;
	}
	case SMTP_EV_MESSAGESENT: {
		smtp_message_t msg = va_arg(ap, smtp_message_t);
		const smtp_status_t *st = smtp_message_transfer_status(msg);
		if (s->phase >= PH_END) {
			reply_from_status(&s->final, st);
			if (s->final.code != 0)
				s->phase = PH_REPLIED;
		} else if (s->phase < PH_DATA) {
			reply_from_status(&s->data_cmd, st);
		}
		ended = true;
		break;
	}
	case SMTP_EV_EXTNA_STARTTLS:
		s->starttls_missing = true;
		break;
	case SMTP_EV_STARTTLS_OK:
		s->tls_ok = true;
		/* Plain-text AUTH mechanisms only inside TLS. */
		if (c->auth)
			auth_set_mechanism_flags(c->auth, AUTH_PLUGIN_PLAIN, 0);
		break;
	case SMTP_EV_INVALID_PEER_CERTIFICATE:
	case SMTP_EV_NO_PEER_CERTIFICATE:
	case SMTP_EV_WRONG_PEER_CERTIFICATE:
	case SMTP_EV_WEAK_CIPHER:
	case SMTP_EV_NO_CLIENT_CERTIFICATE:
	case SMTP_EV_UNUSABLE_CLIENT_CERTIFICATE:
	case SMTP_EV_UNUSABLE_CA_LIST:
		on_tls_event(c, s, event_no, ap);
		break;
	default:
		/* SYNTAXWARNING and the extension events: libesmtp's defaults
		 * (tolerant, quit_now = 0) are right for a submission client.
		 * A certificate question between messages cannot happen. */
		break;
	}
	pthread_mutex_unlock(&em->mu);
	va_end(ap);
	if (ended)
		transaction_done(c);
}

/* Hands libesmtp the message in one piece.  The call that answers "end of
 * message" is the commit point: the terminator follows it. */
static const char *on_message(void **ctx, int *len, void *arg)
{
	struct email_job *j = arg;
	struct email *em = j->em;
	const char *out = NULL;
	int n = 0;
	bool abort_now = false;

	(void)ctx;
	pthread_mutex_lock(&em->mu);
	if (len == NULL) {   /* rewind: DATA got its 354, or BDAT starts (after RCPT's 250) */
		j->msg_pos = 0;
		if (j->seen.phase < PH_DATA)
			j->seen.phase = PH_DATA;
		if (j->seen.bdat)   /* the monitor is off from here on: it sees no BDAT */
			text_copy(j->seen.last_cmd, "BDAT", sizeof(j->seen.last_cmd));
		pthread_mutex_unlock(&em->mu);
		return NULL;
	}
	if (j->cancel || em->stopping) {
		abort_now = true;
	} else if (em->username && !j->seen.auth_ok) {
		/* AUTH was configured but did not happen: do not hand an
		 * unauthenticated message to the relay. */
		abort_now = true;
	} else if (j->msg_pos < j->message_len) {
		out = j->message + j->msg_pos;
		n = (int)(j->message_len - j->msg_pos);
		j->msg_pos = j->message_len;
	} else {
		int64_t now = email_mono_ms();
		long left = (long)(j->deadline_ms - now), margin = email_margin_ms(j->timeout_ms);
		if (left < margin) {
			/* The relay would have less than the margin to answer:
			 * a late 250 would make an accepted message unknown. */
			abort_now = true;
			j->seen.margin_abort = true;
			j->seen.margin_left_ms = left;
			j->seen.margin_ms = margin;
		} else {
			j->seen.phase = PH_END;
			j->end_ms = now;
		}
	}
	pthread_mutex_unlock(&em->mu);
	*len = n;
	/* libesmtp drops the connection without a terminator when the
	 * callback ends the message with errno set. */
	errno = abort_now ? ECANCELED : 0;
	return out;
}

static int on_interact(auth_client_request_t req, char **result, int fields, void *arg)
{
	struct conn *c = arg;

	for (int i = 0; i < fields; i++) {
		if (req[i].flags & AUTH_USER)
			result[i] = c->em->username;
		else if (req[i].flags & AUTH_PASS)
			result[i] = c->em->password;
		else if (req[i].flags & AUTH_REALM)
			result[i] = (char *)"";
		else
			return 0;
	}
	return 1;
}

/* ---- one session --------------------------------------------------------- */

static bool conn_setup(struct conn *c)
{
	struct email *em = c->em;

	c->s = smtp_create_session();
	if (c->s == NULL)
		return false;
	if (!smtp_set_server(c->s, em->server) ||
	    (em->helo[0] && !smtp_set_hostname(c->s, em->helo)) ||
	    !smtp_starttls_enable(c->s, em->starttls) ||
	    (em->starttls != Starttls_DISABLED && !smtp_starttls_set_ctx(c->s, em->tls)) ||
	    !smtp_set_eventcb(c->s, on_event, c) || !smtp_set_monitorcb(c->s, on_monitor, c, 0))
		return false;
	if (em->username) {
		/* Plain-text mechanisms stay off until TLS is up (on_event);
		 * challenge-response ones may run anyway. */
		c->auth = auth_create_context();
		if (c->auth == NULL || !auth_set_mechanism_flags(c->auth, 0, AUTH_PLUGIN_PLAIN) ||
		    !auth_set_interact_cb(c->auth, on_interact, c) || !smtp_auth_set_context(c->s, c->auth))
			return false;
	}
	return true;
}

static void conn_teardown(struct conn *c)
{
	if (c->s)
		smtp_destroy_session(c->s);
	if (c->auth)
		auth_destroy_context(c->auth);
	c->s = NULL;
	c->auth = NULL;
}

/* A message that joined a reused session and lost it before any of its
 * content: it gets one fresh connection, with the budget it has left. */
static bool run_again_locked(const struct email *em, const struct email_job *j)
{
	return j->reused && !j->reported && !j->cancel && !em->stopping && j->seen.phase < PH_DATA &&
	       !j->seen.margin_abort && (j->seen.mail.code == 0 || j->seen.mail.code == 421);
}

/* Sessions until `first` and whatever joined them are answered. */
static void conn_run(struct email *em, struct email_job *first)
{
	struct email_job *j = first;

	while (j) {
		struct conn c = { .em = em, .wline_start = true };
		char lib_err[128] = "";

		if (!conn_setup(&c) || !conn_add(&c, j)) {
			conn_teardown(&c);
			finish_not_sent(em, j, "cannot set up the session");
			return;
		}
		if (!smtp_start_session(c.s))
			smtp_strerror(smtp_errno(), lib_err, sizeof(lib_err));
		pthread_mutex_lock(&em->mu);
		j = c.job;
		if (j && run_again_locked(em, j)) {
			j->reused = false;
			j->seen.phase = PH_STARTED;
			j->started_ms = email_mono_ms();   /* connect timeout; deadline kept */
			j->arm_pending = true;
			email_wake_loop(em);
		} else if (j) {
			email_job_classify(j, false, lib_err, email_mono_ms(), &j->result);
			finish_locked(em, j);
			j = NULL;
		}
		pthread_mutex_unlock(&em->mu);
		conn_teardown(&c);
	}
}

void *email_thread_main(void *arg)
{
	struct email *em = arg;

	pthread_mutex_lock(&em->mu);
	for (;;) {
		while (!em->stopping && TAILQ_EMPTY(&em->queue))
			pthread_cond_wait(&em->cv, &em->mu);
		if (em->stopping)
			break;
		struct email_job *j = take_locked(em);
		pthread_mutex_unlock(&em->mu);
		conn_run(em, j);
		pthread_mutex_lock(&em->mu);
	}
	pthread_mutex_unlock(&em->mu);
	email_unref(em);
	return NULL;
}

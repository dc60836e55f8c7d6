/* SPDX-License-Identifier: ISC */
/*
 * email.c: the `email` provider's interface to the dispatcher: its config
 * keys, init (relay, TLS context, credentials, the thread pool), validate,
 * send and shutdown.  One message per effect over SMTP with libesmtp.
 *
 *   message.c  validation and the message text (pure)
 *   reply.c    what a transaction saw -> outcome class, provider ids (pure)
 *   session.c  the SMTP threads: sessions reused for several messages
 *   pool.c     the loop half: queue, timers, results, thread start/stop
 *
 * send() validates and builds the complete RFC 5322 message on the loop
 * thread, queues a job and returns; a pool thread sends it in its session;
 * the result comes back to the loop through a pipe and `done` is called
 * there.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>
#include <auth-client.h>

#include "email.h"
#include "text.h"
#include "message.h"

static const struct outbox_conf_key email_keys[] = {
	{ "server", CONF_STR, "127.0.0.1:25", 0, 0, "SMTP relay as host:port" },
	{ "starttls", CONF_STR, "optional", 0, 0, "required, optional or off" },
	{ "username", CONF_STR, "", 0, 0, "AUTH user name; empty: no AUTH" },
	{ "password", CONF_SECRET, "", 0, 0, "AUTH password (file:/path or env:NAME)" },
	{ "helo_name", CONF_STR, "", 0, 0, "name sent in EHLO; empty: the host name" },
	{ "ca_file", CONF_STR, "", 0, 0, "PEM CA bundle the relay's certificate must chain to; "
	  "empty: the system's CAs" },
	/* 8: a message costs 3 round trips on a reused session (MAIL FROM;
	 * RCPT TO; DATA's content or, with CHUNKING, the BDAT chunks, which
	 * wait for RCPT TO's reply: session.c), so sessions, not SMTP, set
	 * the rate against a distant relay (bench/email_bench.py against
	 * Postfix at RTT 40 ms: 2.3x the per-message client at 4 threads,
	 * 3.2x at 6, 5.0x at 8). */
	{ "threads", CONF_INT, "8", 1, EMAIL_MAX_THREADS, "SMTP sessions at once" },
	/* A common key with email's own default.  Sends beyond `threads` wait
	 * in the provider's queue, bounded by queue_timeout_ms and never
	 * counted against timeout_ms, so a queue costs no SMTP budget; what
	 * it buys is the worker's database cycle: a worker leases and records
	 * outcomes in batches of at most this many sends, and at 8 (twice the
	 * threads) the round trips per email, not SMTP, bounded throughput
	 * (bench/email_bench.py: PostgreSQL CPU per email about halved at 32).
	 * EMAIL_QUEUE_NOTE_RATIO x threads is where the note below starts. */
	{ "max_in_flight", CONF_INT, "32", 1, 100000, "sends in flight for this provider" },
	{ "queue_timeout_ms", CONF_INT, "10000", 10, 3600000,
	  "longest wait for a free SMTP thread; a send not started by then is not_sent" },
	{ "session_idle_ms", CONF_INT, "2000", 0, 300000,
	  "keep an idle SMTP session open this long for the next message; 0: one session per message" },
	{ "session_max_messages", CONF_INT, "100", 1, 100000,
	  "messages per SMTP session before it is closed and a new one opened" },
	{ "message_id_domain", CONF_STR, "outbox-dispatcher.invalid", 0, 0,
	  "right-hand side of Message-ID: <effect key@domain>" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

static bool valid_server(const char *s, char *host_err, size_t errlen)
{
	const char *colon = strchr(s, ':');
	char *end;
	long port;

	if (colon == NULL || colon == s)
		return email_fail(host_err, errlen, "must be host:port (e.g. 127.0.0.1:25)");
	if (strchr(colon + 1, ':') || s[0] == '[')
		return email_fail(host_err, errlen,
		            "IPv6 literals are not supported by libesmtp: use a host name");
	for (const char *p = s; p < colon; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
		      *p == '.' || *p == '-' || *p == '_'))
			return email_fail(host_err, errlen, "host name contains characters outside [A-Za-z0-9._-]");
	errno = 0;
	port = strtol(colon + 1, &end, 10);
	if (errno || end == colon + 1 || *end != '\0' || port < 1 || port > 65535)
		return email_fail(host_err, errlen, "port must be 1..65535");
	return true;
}

static void email_shutdown(void *self);

static pthread_once_t auth_once = PTHREAD_ONCE_INIT;

/* The relay: server (host:port) and the STARTTLS policy. */
static bool read_relay(struct email *em, const struct outbox_conf *conf, char *err, size_t errlen)
{
	const struct outbox_host *host = em->host;
	const char *server = host->conf_str(conf, "server");
	const char *tls = host->conf_str(conf, "starttls");
	char why[160];

	if (!valid_server(server, why, sizeof(why))) {
		snprintf(err, errlen, "%s: \"%.64s\": %s", host->conf_where(conf, "server"), server, why);
		return false;
	}
	text_copy(em->server, server, sizeof(em->server));
	if (strcmp(tls, "required") == 0)
		em->starttls = Starttls_REQUIRED;
	else if (strcmp(tls, "optional") == 0)
		em->starttls = Starttls_ENABLED;
	else if (strcmp(tls, "off") == 0)
		em->starttls = Starttls_DISABLED;
	else {
		snprintf(err, errlen, "%s: must be required, optional or off (got \"%.32s\")",
		         host->conf_where(conf, "starttls"), tls);
		return false;
	}
	return true;
}

/* AUTH: a user name and a password together, or neither. */
static bool read_auth(struct email *em, const struct outbox_conf *conf, char *err, size_t errlen)
{
	const struct outbox_host *host = em->host;
	const char *user = host->conf_str(conf, "username");
	const char *pass = host->conf_str(conf, "password");

	if (email_has_injection(user, strlen(user)) || email_has_control(user)) {
		snprintf(err, errlen, "%s: contains control characters", host->conf_where(conf, "username"));
		return false;
	}
	if (user[0] && pass[0] == '\0') {
		snprintf(err, errlen, "%s: username is set but the password is empty",
		         host->conf_where(conf, "password"));
		return false;
	}
	if (user[0] == '\0' && pass[0]) {
		snprintf(err, errlen, "%s: a password without a username", host->conf_where(conf, "username"));
		return false;
	}
	if (user[0]) {
		em->username = text_strdup(user);
		em->password = text_strdup(pass);
	}
	return true;
}

/* The names this host writes: EHLO's and the Message-ID's domain. */
static bool read_names(struct email *em, const struct outbox_conf *conf, char *err, size_t errlen)
{
	const struct outbox_host *host = em->host;
	const char *helo = host->conf_str(conf, "helo_name");
	const char *domain = host->conf_str(conf, "message_id_domain");

	if (helo[0] && !email_valid_domain(helo, strlen(helo))) {
		snprintf(err, errlen, "%s: not a valid host name or [address]",
		         host->conf_where(conf, "helo_name"));
		return false;
	}
	text_copy(em->helo, helo, sizeof(em->helo));
	if (!email_valid_domain(domain, strlen(domain)) || domain[0] == '[') {
		snprintf(err, errlen, "%s: not a valid domain name", host->conf_where(conf, "message_id_domain"));
		return false;
	}
	text_copy(em->msgid_domain, domain, sizeof(em->msgid_domain));
	return true;
}

/* Built (and ca_file checked) even with starttls = off: a broken setting
 * is refused now, not when someone turns TLS on.  Our own context rather
 * than libesmtp's default: it trusts the system's CAs (or ca_file), and it
 * stops at TLS 1.2.  libesmtp 1.1 polls for the EHLO reply before flushing
 * EHLO; a TLS 1.3 relay's post-handshake NewSessionTicket makes that poll
 * succeed early and the session stalls until its timeout. */
static bool make_tls_context(struct email *em, const struct outbox_conf *conf, char *err,
                             size_t errlen)
{
	const char *ca = em->host->conf_str(conf, "ca_file");

	em->tls = SSL_CTX_new(TLS_client_method());
	if (em->tls == NULL || !SSL_CTX_set_min_proto_version(em->tls, TLS1_2_VERSION) ||
	    !SSL_CTX_set_max_proto_version(em->tls, TLS1_2_VERSION)) {
		snprintf(err, errlen, "email: cannot create a TLS context");
		return false;
	}
	if (ca[0] ? SSL_CTX_load_verify_locations(em->tls, ca, NULL) != 1
	          : SSL_CTX_set_default_verify_paths(em->tls) != 1) {
		snprintf(err, errlen, "%s: cannot load CA certificates from \"%.200s\"",
		         em->host->conf_where(conf, "ca_file"), ca[0] ? ca : "the system store");
		return false;
	}
	return true;
}

/* At start: a note on a deep queue, a warning on a timeout too short for
 * the margin, and the settings in one line (the password never). */
static void log_settings(const struct email *em, const struct outbox_conf *conf)
{
	const struct outbox_host *host = em->host;
	long max_in_flight = host->conf_int(conf, "max_in_flight");
	long timeout_ms = host->conf_int(conf, "timeout_ms");

	if (max_in_flight > (long)EMAIL_QUEUE_NOTE_RATIO * em->nthreads)
		host->log(OLOG_INFO, EMAIL_NAME,
		          "max_in_flight (%ld) is more than %d times threads (%d): sends beyond %d wait "
		          "in a queue (up to queue_timeout_ms, %ld ms, then not_sent)",
		          max_in_flight, EMAIL_QUEUE_NOTE_RATIO, em->nthreads,
		          em->nthreads, em->queue_timeout_ms);
	if (timeout_ms < 2 * email_margin_ms(timeout_ms))
		host->log(OLOG_WARN, EMAIL_NAME,
		          "timeout_ms (%ld) leaves less than the %ld ms margin before the end of data is "
		          "sent: slow sessions end not_sent before their terminator",
		          timeout_ms, email_margin_ms(timeout_ms));
	host->log(OLOG_INFO, EMAIL_NAME,
	          "relay %s, starttls %s, auth %s, %d threads, max_in_flight %ld, timeout %ld ms, "
	          "connect timeout %ld ms, queue timeout %ld ms, sessions kept idle %ld ms for up to "
	          "%ld messages",
	          em->server, host->conf_str(conf, "starttls"),
	          em->username ? "on (password: ********)" : "off", em->nthreads, max_in_flight,
	          timeout_ms, host->conf_int(conf, "connect_timeout_ms"),
	          em->queue_timeout_ms, em->idle_ms, em->max_per_session);
}

static struct email *email_new(const struct outbox_host *host)
{
	struct email *em = text_alloc(sizeof(*em));
	pthread_condattr_t mono;

	em->host = host;
	em->base = host->base;
	em->wake[0] = em->wake[1] = -1;
	em->refs = 1;
	pthread_mutex_init(&em->mu, NULL);
	pthread_cond_init(&em->cv, NULL);
	/* The idle wait's deadline is on the monotonic clock (session.c):
	 * a condition variable on the default realtime clock would take it
	 * for a time long past and return at once. */
	pthread_condattr_init(&mono);
	pthread_condattr_setclock(&mono, CLOCK_MONOTONIC);
	pthread_cond_init(&em->cv_session, &mono);
	pthread_condattr_destroy(&mono);
	TAILQ_INIT(&em->queue);
	TAILQ_INIT(&em->running);
	TAILQ_INIT(&em->finished);
	return em;
}

static void *email_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                        size_t errlen)
{
	struct email *em = email_new(host);
	char why[160];

	if (!read_relay(em, conf, err, errlen) || !read_auth(em, conf, err, errlen) ||
	    !read_names(em, conf, err, errlen) || !make_tls_context(em, conf, err, errlen))
		goto fail;
	em->conf = conf;
	em->nthreads = (int)host->conf_int(conf, "threads");
	em->queue_timeout_ms = host->conf_int(conf, "queue_timeout_ms");
	em->idle_ms = host->conf_int(conf, "session_idle_ms");
	em->max_per_session = host->conf_int(conf, "session_max_messages");
	pthread_once(&auth_once, auth_client_init);
	if (!email_pool_start(em, why, sizeof(why))) {
		snprintf(err, errlen, "%s: %s", host->conf_where(conf, "threads"), why);
		goto fail;
	}
	log_settings(em, conf);
	return em;

fail:
	email_shutdown(em);
	return NULL;
}

static bool email_validate(void *self, const struct outbox_effect *e, char *host_key,
                           size_t host_keylen, char *err, size_t errlen)
{
	struct email *em = self;
	struct email_msg m;

	if (!email_parse(e, &m, err, errlen))
		return false;
	text_copy(host_key, em->server, host_keylen);
	return true;
}

static bool email_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
                       char *err, size_t errlen)
{
	struct email *em = self;
	struct email_msg m;
	struct email_job *j;

	if (!email_parse(e, &m, err, errlen))
		return false;
	j = text_alloc(sizeof(*j));
	j->em = em;
	j->done = done;
	j->token = token;
	/* Timeouts are common keys: a SIGHUP reload changes them for the
	 * sends that start afterwards. */
	j->timeout_ms = em->host->conf_int(em->conf, "timeout_ms");
	j->connect_timeout_ms = em->host->conf_int(em->conf, "connect_timeout_ms");
	if (j->connect_timeout_ms > j->timeout_ms)
		j->connect_timeout_ms = j->timeout_ms;
	text_copy(j->effect_id, e->effect_id, sizeof(j->effect_id));
	j->attempt = e->attempt;
	j->from_addr = text_strdup(m.from_addr);
	j->rcpt = text_strdup(e->target);
	j->message = email_build(e, &m, em->msgid_domain, &j->message_len);
	if (!email_enqueue(em, j, err, errlen)) {
		email_job_free(j);
		return false;
	}
	return true;
}

static void email_shutdown(void *self)
{
	struct email *em = self;

	if (em == NULL)
		return;
	email_pool_stop(em);
	email_unref(em);
}

/* Every message goes to the one relay. */
static const char *email_one_host(void *self)
{
	const struct email *em = self;

	return em->server;
}

static const struct outbox_provider email_provider = {
	.abi = OUTBOX_PROVIDER_ABI,
	.name = EMAIL_NAME,
	.caps = 0,   /* SMTP has no idempotency keys and cannot be asked later */
	.keys = email_keys,
	.init = email_init,
	.validate = email_validate,
	.send = email_send,
	.reconcile = NULL,
	.shutdown = email_shutdown,
	.one_host = email_one_host,
};

const struct outbox_provider *outbox_provider_entry(void)
{
	return &email_provider;
}

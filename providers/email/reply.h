/* SPDX-License-Identifier: ISC */
/*
 * reply.h: what one SMTP transaction saw, and the outcome class it means
 * (reply.c).  Pure: the session code records, this file judges; both the
 * classification and the provider-id formats are unit-tested from tables
 * (tests/unit/test_email_reply.c).
 */
#ifndef OUTBOX_EMAIL_REPLY_H
#define OUTBOX_EMAIL_REPLY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "provider.h"

#define EMAIL_REPLY_MAX 200

/* How far one message got, by what was written.  The commit point is
 * PH_END: the end of the content follows (DATA's "\r\n.\r\n", or with
 * CHUNKING "BDAT 0 LAST"); before it the relay cannot have accepted the
 * message, after it any missing reply is ambiguous (reply.c). */
enum email_phase {
	PH_QUEUED,      /* waiting for a thread */
	PH_STARTED,     /* a thread is resolving / connecting for it */
	PH_CONNECTED,   /* TCP up (or the message joined a live session) */
	PH_ENVELOPE,    /* MAIL FROM written */
	PH_DATA,        /* the content is being handed over (DATA: after the 354;
	                   BDAT: right behind RCPT TO, before its reply) */
	PH_END,         /* the end of the content is being written: committed */
	PH_REPLIED,     /* the relay answered the end of data */
};

struct email_reply {
	int code;                       /* 0: none */
	char text[EMAIL_REPLY_MAX];
};

/* Everything the classification needs, recorded during the session. */
struct email_seen {
	enum email_phase phase;
	struct email_reply mail, rcpt, data_cmd, final, session, auth;
	bool auth_required;             /* username configured */
	bool auth_ok, starttls_sent, tls_ok, tls_refused, starttls_missing;
	bool margin_abort;              /* too little time left for the terminator */
	long margin_left_ms;            /* with margin_abort: what was left */
	long margin_ms;                 /* with margin_abort: the margin */
	char tls_why[160];
	char last_cmd[12];              /* last command verb written */
	bool bdat;                      /* the content goes as BDAT (CHUNKING) */
};

/* The context a reason names. */
struct email_ctx {
	const char *server;
	int nthreads;
	long queue_timeout_ms;
};

/* The outcome for the (one) recipient.  abandoned: the loop gave up on a
 * message still in the queue or in a session (waited_ms since it started,
 * or since it was queued); lib_err: libesmtp's error when the session
 * ended by itself; since_end_ms: time since the terminator. */
void email_classify(const struct email_seen *s, const struct email_ctx *c, bool abandoned,
                    const char *lib_err, int64_t waited_ms, int64_t since_end_ms,
                    struct outbox_result *r);

/* 4xx: retry; 5xx: terminal; anything else (a broken relay): retry. */
enum outbox_outcome email_class_of(int code);

/* The provider id of an accepted message from the text of the relay's
 * 250 (without the code): the queue id in the formats of Postfix, Exim,
 * OpenSMTPD, Sendmail, Microsoft, Amazon SES and Gmail, else the whole
 * text ("250" when empty). */
void email_provider_id(const char *text, char *out, size_t size);

/* A reply line "DDD text" into r (printable copy). */
void email_reply_set(struct email_reply *r, int code, const char *text, size_t len);

#endif

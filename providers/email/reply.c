/* SPDX-License-Identifier: ISC */
/*
 * reply.c: from what an SMTP transaction saw to an outcome class, and the
 * provider id from an accepted reply (reply.h).
 *
 * The one question behind every class: could the relay have taken
 * responsibility for the message?  Only once the end of the content was
 * written (PH_END: DATA's "." or BDAT's LAST follows).  The class is read
 * from what was written, never from which reply is missing: with CHUNKING
 * (BDAT) and PIPELINING, RCPT TO and the whole content go in one write, so
 * a missing RCPT reply may stand in front of a message the relay queued.
 * One rule for DATA and BDAT:
 *
 *   connect refused, DNS, TLS handshake/verification failure  not sent
 *   too little time left for the terminator (margin)          not sent
 *   greeting/EHLO/AUTH 4xx, MAIL/RCPT/DATA 4xx, 4xx after data  retry
 *   5xx anywhere; STARTTLS required but not offered           terminal
 *   content not ended, any reply missing (timeout, closed)      retry
 *   content ended, any reply missing (MAIL, RCPT, BDAT, ".") ambiguous
 *   250 after the end of the content                          accepted
 *
 * A refusal (4xx/5xx) of MAIL or of the one RCPT outranks a missing
 * later reply: the relay took no transaction for the recipient.
 */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "text.h"
#include "reply.h"

static void result_set(struct outbox_result *r, enum outbox_outcome o, int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void result_set(struct outbox_result *r, enum outbox_outcome o, int status, const char *fmt, ...)
{
	va_list ap;

	r->outcome = o;
	r->status = status;
	r->retry_after_ms = -1;
	va_start(ap, fmt);
	vsnprintf(r->error, sizeof(r->error), fmt, ap);
	va_end(ap);
}

enum outbox_outcome email_class_of(int code)
{
	return code >= 500 && code < 600 ? OUTCOME_TERMINAL : OUTCOME_RETRY;
}

void email_reply_set(struct email_reply *r, int code, const char *text, size_t len)
{
	r->code = code;
	text_copy_printable(r->text, text ? text : "", text ? len : 0, sizeof(r->text));
}

/* ---- provider ids ------------------------------------------------------- */

/* Characters that end an id token. */
#define ID_END " \t;,)>]["

static bool put_token(const char *p, char *out, size_t size)
{
	size_t n = strcspn(p, ID_END);

	if (n == 0 || n >= size)
		return false;
	memcpy(out, p, n);
	out[n] = '\0';
	return true;
}

/* The text after a leading enhanced status code ("2.0.0 "), if any. */
static const char *skip_enhanced(const char *t)
{
	const char *p = t;

	if (!isdigit((unsigned char)p[0]) || p[1] != '.')
		return t;
	p += 2;
	while (isdigit((unsigned char)*p))
		p++;
	if (*p++ != '.')
		return t;
	while (isdigit((unsigned char)*p))
		p++;
	if (*p != ' ' && *p != '\0')
		return t;
	while (*p == ' ')
		p++;
	return p;
}

/* `mark` where a word starts (so Microsoft's "InternalId=" is no "id="). */
static const char *find_word(const char *t, const char *mark)
{
	for (const char *p = strcasestr(t, mark); p; p = strcasestr(p + 1, mark))
		if (p == t || !isalnum((unsigned char)p[-1]))
			return p + strlen(mark);
	return NULL;
}

/* The n-th (0-based) space-separated token, its length in *len. */
static const char *token_at(const char *t, int n, size_t *len)
{
	const char *p = t;

	for (int i = 0;; i++) {
		while (*p == ' ')
			p++;
		if (*p == '\0')
			return NULL;
		size_t l = strcspn(p, " ");
		if (i == n) {
			*len = l;
			return p;
		}
		p += l;
	}
}

static bool id_from(const char *text, char *out, size_t size)
{
	const char *t = skip_enhanced(text), *p;
	size_t len, len2;

	/* Postfix and many others: "Ok: queued as 4F2A91C3B2". */
	if ((p = find_word(t, "queued as ")) != NULL)
		return put_token(p, out, size);
	/* Microsoft: "<DM6PR...@...outlook.com> [InternalId=..] Queued mail for delivery". */
	if (t[0] == '<' && strchr(t, '>') != NULL)
		return put_token(t + 1, out, size);
	/* Exim: "OK id=1rXyZa-000123-AB". */
	if ((p = find_word(t, "id=")) != NULL)
		return put_token(p, out, size);
	/* Gmail: "OK  1700000000 a1b2c3.12 - gsmtp": the token before "- gsmtp". */
	if ((p = strstr(t, " - gsmtp")) != NULL) {
		const char *q = p;
		while (q > t && q[-1] != ' ')
			q--;
		if (q < p && (size_t)(p - q) < size) {
			memcpy(out, q, (size_t)(p - q));
			out[p - q] = '\0';
			return true;
		}
		return false;
	}
	/* OpenSMTPD, Sendmail: "9a4ed0e1 Message accepted for delivery". */
	if ((p = token_at(t, 0, &len)) != NULL && strcasestr(t, "message accepted") == p + len + 1)
		return put_token(p, out, size);
	/* Amazon SES: "Ok 0100018c5b7a1e2f-...-000000": exactly two tokens. */
	if ((p = token_at(t, 0, &len)) != NULL && len == 2 && strncasecmp(p, "ok", 2) == 0 &&
	    (p = token_at(t, 1, &len2)) != NULL && token_at(t, 2, &len) == NULL && len2 >= 8)
		return put_token(p, out, size);
	return false;
}

void email_provider_id(const char *text, char *out, size_t size)
{
	if (size == 0)
		return;
	if (!id_from(text, out, size))
		text_copy(out, text[0] ? text : "250", size);
}

/* ---- classification ----------------------------------------------------- */

/* Before MAIL FROM had an answer: connecting, TLS, AUTH, the greeting. */
static bool before_mail(const struct email_seen *s, const struct email_ctx *c, bool abandoned,
                        const char *why, int64_t waited, struct outbox_result *r)
{
	const char *cmd = s->last_cmd[0] ? s->last_cmd : "the greeting";

	if (s->phase < PH_CONNECTED) {
		if (abandoned && s->phase < PH_STARTED)
			result_set(r, OUTCOME_NOT_SENT, 0,
			           "not started within queue_timeout_ms (%ld ms): all %d SMTP threads busy",
			           c->queue_timeout_ms, c->nthreads);
		else if (abandoned)
			result_set(r, OUTCOME_NOT_SENT, 0, "connect to relay %s timed out after %lld ms",
			           c->server, (long long)waited);
		else
			result_set(r, OUTCOME_NOT_SENT, 0, "cannot connect to relay %s: %s", c->server, why);
		return true;
	}
	if (s->auth.code >= 400 && !s->auth_ok) {
		result_set(r, email_class_of(s->auth.code), s->auth.code,
		           "relay %s refused AUTH: %d %s; nothing sent", c->server, s->auth.code,
		           s->auth.text);
		return true;
	}
	if (s->auth_required && !s->auth_ok && s->phase >= PH_ENVELOPE) {
		/* AUTH is configured but did not happen: whatever the relay
		 * said to MAIL/RCPT, the message was not handed over. */
		result_set(r, OUTCOME_TERMINAL, 0,
		           "relay %s offered no usable AUTH mechanism for username (PLAIN and LOGIN "
		           "are only used inside TLS); nothing sent", c->server);
		return true;
	}
	if (s->mail.code != 0 || s->phase >= PH_DATA)
		return false;
	if (s->phase >= PH_ENVELOPE)
		result_set(r, OUTCOME_RETRY, 0, "no reply to MAIL FROM: %s; nothing sent", why);
	else if (s->session.code >= 400)
		result_set(r, email_class_of(s->session.code), s->session.code,
		           "relay %s refused the session after %s: %d %s; nothing sent", c->server, cmd,
		           s->session.code, s->session.text);
	else if (s->starttls_sent && !s->tls_ok)
		result_set(r, OUTCOME_NOT_SENT, 0, "TLS handshake with relay %s failed: %s; nothing sent",
		           c->server, why);
	else
		result_set(r, OUTCOME_NOT_SENT, 0,
		           "session with relay %s ended before MAIL FROM (after %s): %s; nothing sent",
		           c->server, cmd, why);
	return true;
}

void email_classify(const struct email_seen *s, const struct email_ctx *c, bool abandoned,
                    const char *lib_err, int64_t waited_ms, int64_t since_end_ms,
                    struct outbox_result *r)
{
	char why[160];

	memset(r, 0, sizeof(*r));
	if (abandoned)
		snprintf(why, sizeof(why), "no answer within %lld ms", (long long)waited_ms);
	else
		snprintf(why, sizeof(why), "%s", lib_err && lib_err[0] ? lib_err : "connection closed");

	if (s->tls_refused) {
		result_set(r, OUTCOME_NOT_SENT, 0, "TLS with relay %s refused: %s; nothing sent", c->server,
		           s->tls_why);
		return;
	}
	if (s->starttls_missing) {
		result_set(r, OUTCOME_TERMINAL, 0,
		           "relay %s does not offer STARTTLS and starttls = required; nothing sent",
		           c->server);
		return;
	}
	if (before_mail(s, c, abandoned, why, waited_ms, r))
		return;
	/* Refusals first: each ends the transaction for the one recipient
	 * (an email effect has exactly one: its target), whatever came after. */
	if (s->mail.code != 0 && s->mail.code / 100 != 2) {
		result_set(r, email_class_of(s->mail.code), s->mail.code, "MAIL FROM refused: %d %s",
		           s->mail.code, s->mail.text);
		return;
	}
	if (s->rcpt.code != 0 && s->rcpt.code / 100 != 2) {
		result_set(r, email_class_of(s->rcpt.code), s->rcpt.code, "RCPT TO refused: %d %s",
		           s->rcpt.code, s->rcpt.text);
		return;
	}
	if (s->phase < PH_DATA && s->data_cmd.code >= 400) {
		result_set(r, email_class_of(s->data_cmd.code), s->data_cmd.code, "DATA refused: %d %s",
		           s->data_cmd.code, s->data_cmd.text);
		return;
	}
	if (s->phase < PH_END) {
		/* The end of the content was not written: whatever reply is
		 * missing, the relay cannot have accepted the message. */
		if (s->margin_abort)
			result_set(r, OUTCOME_NOT_SENT, 0,
			           "aborted before the end-of-data terminator: %ld ms of timeout_ms left, "
			           "less than the %ld ms margin for the relay's answer; the relay cannot "
			           "have accepted it", s->margin_left_ms, s->margin_ms);
		else if (s->phase >= PH_DATA)
			result_set(r, OUTCOME_RETRY, 0,
			           "transfer aborted before the end of data (%s, %s); the relay cannot "
			           "have accepted it", s->rcpt.code == 0 ? "no reply to RCPT TO" : "after RCPT TO",
			           abandoned ? why : "connection lost");
		else if (s->rcpt.code == 0)
			result_set(r, OUTCOME_RETRY, 0, "no reply to RCPT TO: %s; nothing sent", why);
		else
			result_set(r, OUTCOME_RETRY, 0, "no reply to DATA: %s; nothing sent", why);
		return;
	}
	if (s->final.code / 100 == 2) {
		result_set(r, OUTCOME_ACCEPTED, s->final.code, "%s", "");
		email_provider_id(s->final.text, r->provider_id, sizeof(r->provider_id));
		return;
	}
	if (s->final.code >= 400) {
		result_set(r, email_class_of(s->final.code), s->final.code,
		           "message refused after the end of data: %d %s", s->final.code, s->final.text);
		return;
	}
	result_set(r, OUTCOME_AMBIGUOUS, 0,
	           "no reply after the end of data (%s, %lld ms after the terminator%s): the relay "
	           "may have queued the message",
	           abandoned ? "timed out" : why, (long long)since_end_ms,
	           s->mail.code == 0 ? "; no reply to MAIL FROM either"
	           : s->rcpt.code == 0 ? "; no reply to RCPT TO either" : "");
}

/* SPDX-License-Identifier: ISC */
/*
 * test_email_reply.c: providers/email/reply.c from tables: the provider id
 * in the 250 replies of common MTAs, and the outcome class of what an SMTP
 * transaction saw (the commit point is the terminator).
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "email/reply.h"

/* ---- provider ids ---------------------------------------------------------- */

static const struct {
	const char *mta, *text, *id;
} id_cases[] = {
	{ "postfix", "2.0.0 Ok: queued as 4F2A91C3B2", "4F2A91C3B2" },
	{ "postfix, no enhanced code", "Ok: queued as 4Xyz1k2L3mN4", "4Xyz1k2L3mN4" },
	{ "postfix, long id", "2.0.0 Ok: queued as 4VhGq93mKXz8Zmp", "4VhGq93mKXz8Zmp" },
	{ "exim", "OK id=1rXyZa-000123-AB", "1rXyZa-000123-AB" },
	{ "opensmtpd", "2.0.0 9a4ed0e1 Message accepted for delivery", "9a4ed0e1" },
	{ "sendmail", "2.0.0 4BK1abcD012345 Message accepted for delivery", "4BK1abcD012345" },
	{ "microsoft",
	  "2.6.0 <DM6PR11MB4154A1B2C3@DM6PR11MB4154.namprd11.prod.outlook.com> "
	  "[InternalId=1236950581346, Hostname=DM6PR11MB4154.namprd11.prod.outlook.com] "
	  "9154 bytes in 0.112, 79.489 KB/sec Queued mail for delivery",
	  "DM6PR11MB4154A1B2C3@DM6PR11MB4154.namprd11.prod.outlook.com" },
	{ "amazon ses", "Ok 0100018c5b7a1e2f-3c4d5e6f-1a2b-4c3d-9e8f-0a1b2c3d4e5f-000000",
	  "0100018c5b7a1e2f-3c4d5e6f-1a2b-4c3d-9e8f-0a1b2c3d4e5f-000000" },
	{ "gmail", "2.0.0 OK  1700000000 a640c23a62f3a-a9e6f1c8e3bsi123456.12 - gsmtp",
	  "a640c23a62f3a-a9e6f1c8e3bsi123456.12" },
	{ "unknown: whole text", "2.0.0 Thanks, got it", "2.0.0 Thanks, got it" },
	{ "ok alone: whole text", "Ok", "Ok" },
	{ "empty", "", "250" },
	{ "id= inside a word is no exim id", "queued [InternalId=77] fine", "queued [InternalId=77] fine" },
};

static void test_provider_ids(void **state)
{
	(void)state;
	for (size_t i = 0; i < sizeof(id_cases) / sizeof(id_cases[0]); i++) {
		char out[OUTBOX_PROVIDER_ID_MAX];
		email_provider_id(id_cases[i].text, out, sizeof(out));
		if (strcmp(out, id_cases[i].id) != 0)
			fail_msg("%s: \"%s\" -> \"%s\", expected \"%s\"", id_cases[i].mta, id_cases[i].text,
			         out, id_cases[i].id);
	}
}

static void test_provider_id_too_long_falls_back_cut(void **state)
{
	char out[8];

	(void)state;
	email_provider_id("2.0.0 Ok: queued as 0123456789ABCDEF", out, sizeof(out));
	assert_string_equal(out, "2.0.0 O");
}

/* ---- classification ------------------------------------------------------------ */

static struct email_reply R(int code, const char *text)
{
	struct email_reply r = { .code = code };
	snprintf(r.text, sizeof(r.text), "%s", text);
	return r;
}

struct case_ {
	const char *name;
	struct email_seen seen;
	bool abandoned;
	enum outbox_outcome outcome;
	int status;
	const char *words;
};

#define OK250 R(250, "2.1.0 Ok")

static const struct case_ *cases(size_t *n)
{
	static struct case_ c[] = {
		{ "queued, never started", { .phase = PH_QUEUED }, true, OUTCOME_NOT_SENT, 0,
		  "not started within queue_timeout_ms" },
		{ "connect timed out", { .phase = PH_STARTED }, true, OUTCOME_NOT_SENT, 0,
		  "connect to relay" },
		{ "connect refused", { .phase = PH_STARTED }, false, OUTCOME_NOT_SENT, 0,
		  "cannot connect" },
		{ "greeting 421", { .phase = PH_CONNECTED }, false, OUTCOME_RETRY, 421,
		  "refused the session" },
		{ "greeting 554", { .phase = PH_CONNECTED }, false, OUTCOME_TERMINAL, 554,
		  "refused the session" },
		{ "slow greeting: closed before MAIL", { .phase = PH_CONNECTED }, true, OUTCOME_NOT_SENT, 0,
		  "before MAIL FROM" },
		{ "tls refused", { .phase = PH_CONNECTED, .tls_refused = true }, false, OUTCOME_NOT_SENT, 0,
		  "TLS with relay" },
		{ "starttls missing", { .phase = PH_CONNECTED, .starttls_missing = true }, false,
		  OUTCOME_TERMINAL, 0, "does not offer STARTTLS" },
		{ "auth 535", { .phase = PH_CONNECTED }, false, OUTCOME_TERMINAL, 535, "refused AUTH" },
		{ "auth needed, none usable", { .phase = PH_ENVELOPE, .auth_required = true }, false,
		  OUTCOME_TERMINAL, 0, "no usable AUTH" },
		{ "no reply to MAIL", { .phase = PH_ENVELOPE }, false, OUTCOME_RETRY, 0, "no reply to MAIL FROM" },
		{ "MAIL 451", { .phase = PH_ENVELOPE }, false, OUTCOME_RETRY, 451, "MAIL FROM refused" },
		{ "MAIL 553", { .phase = PH_ENVELOPE }, false, OUTCOME_TERMINAL, 553, "MAIL FROM refused" },
		{ "no reply to RCPT", { .phase = PH_ENVELOPE }, true, OUTCOME_RETRY, 0, "no reply to RCPT TO" },
		{ "RCPT 450", { .phase = PH_ENVELOPE }, false, OUTCOME_RETRY, 450, "RCPT TO refused" },
		{ "RCPT 550", { .phase = PH_ENVELOPE }, false, OUTCOME_TERMINAL, 550, "RCPT TO refused" },
		{ "DATA 451", { .phase = PH_ENVELOPE }, false, OUTCOME_RETRY, 451, "DATA refused" },
		{ "no reply to DATA", { .phase = PH_ENVELOPE }, false, OUTCOME_RETRY, 0, "no reply to DATA" },
		{ "lost while copying", { .phase = PH_DATA }, false, OUTCOME_RETRY, 0,
		  "before the end of data" },
		{ "margin: aborted before the terminator", { .phase = PH_DATA, .margin_abort = true,
		  .margin_left_ms = 400, .margin_ms = 1000 }, false, OUTCOME_NOT_SENT, 0,
		  "400 ms of timeout_ms left, less than the 1000 ms margin" },
		{ "lost after the terminator", { .phase = PH_END }, false, OUTCOME_AMBIGUOUS, 0,
		  "no reply after the end of data" },
		{ "timed out after the terminator", { .phase = PH_END }, true, OUTCOME_AMBIGUOUS, 0,
		  "timed out" },
		{ "451 after data", { .phase = PH_REPLIED }, false, OUTCOME_RETRY, 451, "after the end of data" },
		{ "554 after data", { .phase = PH_REPLIED }, false, OUTCOME_TERMINAL, 554, "after the end of data" },
		{ "250 after data", { .phase = PH_REPLIED }, false, OUTCOME_ACCEPTED, 250, "" },
	};
	/* Replies that designated initialisers cannot hold in a static table. */
	for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
		struct email_seen *s = &c[i].seen;
		const char *nm = c[i].name;
		if (strncmp(nm, "greeting", 8) == 0)
			s->session = R(c[i].status, "go away");
		if (strncmp(nm, "auth 535", 8) == 0)
			s->auth = R(535, "5.7.8 bad credentials");
		if (strncmp(nm, "MAIL 4", 6) == 0 || strncmp(nm, "MAIL 5", 6) == 0)
			s->mail = R(c[i].status, "no");
		if (s->phase >= PH_ENVELOPE && s->mail.code == 0 && strstr(nm, "MAIL") == NULL &&
		    strstr(nm, "auth") == NULL)
			s->mail = OK250;
		if (strncmp(nm, "RCPT 4", 6) == 0 || strncmp(nm, "RCPT 5", 6) == 0)
			s->rcpt = R(c[i].status, "no");
		else if (s->mail.code == 250 && strstr(nm, "no reply to RCPT") == NULL)
			s->rcpt = R(250, "2.1.5 Ok");
		if (strncmp(nm, "DATA 4", 6) == 0)
			s->data_cmd = R(451, "later");
		if (s->phase == PH_REPLIED)
			s->final = R(c[i].status, c[i].status == 250 ? "2.0.0 Ok: queued as ABC123" : "no");
	}
	*n = sizeof(c) / sizeof(c[0]);
	return c;
}

static void test_classification_table(void **state)
{
	struct email_ctx ctx = { "relay.test:25", 4, 10000 };
	size_t n;
	const struct case_ *c = cases(&n);

	(void)state;
	for (size_t i = 0; i < n; i++) {
		struct outbox_result r;
		email_classify(&c[i].seen, &ctx, c[i].abandoned, "connection refused", 1234, 56, &r);
		if (r.outcome != c[i].outcome || r.status != c[i].status || strstr(r.error, c[i].words) == NULL)
			fail_msg("%s: outcome %d status %d \"%s\"; expected %d %d \"%s\"", c[i].name,
			         (int)r.outcome, r.status, r.error, (int)c[i].outcome, c[i].status, c[i].words);
	}
}

/* ---- the commit point: by what was written, DATA and BDAT alike ---------------- */

/* One row: what was written (phase), the replies seen (0: none), and the
 * class.  With CHUNKING and PIPELINING libesmtp writes RCPT TO and the whole
 * content (BDAT n ... BDAT 0 LAST) in one write, so any reply may be missing
 * in front of an ended content; with DATA, the 354 comes first. */
static const struct commit_case {
	const char *name;
	enum email_phase phase;
	int mail, rcpt, data_cmd, final;
	bool margin, abandoned;
	enum outbox_outcome outcome;
	int status;
	const char *words;
} commit_cases[] = {
	/* before the content: nothing sent, whatever is missing */
	{ "DATA: no MAIL reply", PH_ENVELOPE, 0, 0, 0, 0, false, false, OUTCOME_RETRY, 0,
	  "no reply to MAIL FROM" },
	{ "DATA: no RCPT reply", PH_ENVELOPE, 250, 0, 0, 0, false, false, OUTCOME_RETRY, 0,
	  "no reply to RCPT TO" },
	{ "DATA: no 354", PH_ENVELOPE, 250, 250, 0, 0, false, true, OUTCOME_RETRY, 0,
	  "no reply to DATA" },
	{ "DATA: cut while copying", PH_DATA, 250, 250, 0, 0, false, false, OUTCOME_RETRY, 0,
	  "before the end of data" },
	{ "BDAT: cut while chunking, no RCPT reply", PH_DATA, 250, 0, 0, 0, false, false,
	  OUTCOME_RETRY, 0, "before the end of data (no reply to RCPT TO" },
	{ "BDAT: stall while chunking", PH_DATA, 250, 250, 0, 0, false, true, OUTCOME_RETRY, 0,
	  "before the end of data" },
	{ "DATA: margin abort", PH_DATA, 250, 250, 0, 0, true, false, OUTCOME_NOT_SENT, 0,
	  "margin" },
	{ "BDAT: margin abort, RCPT unanswered", PH_DATA, 250, 0, 0, 0, true, false,
	  OUTCOME_NOT_SENT, 0, "margin" },
	{ "BDAT: margin abort, nothing answered", PH_DATA, 0, 0, 0, 0, true, false,
	  OUTCOME_NOT_SENT, 0, "margin" },
	/* the content ended: any missing reply is ambiguous */
	{ "DATA: no final reply", PH_END, 250, 250, 0, 0, false, false, OUTCOME_AMBIGUOUS, 0,
	  "no reply after the end of data" },
	{ "DATA: final reply timed out", PH_END, 250, 250, 0, 0, false, true, OUTCOME_AMBIGUOUS, 0,
	  "timed out" },
	{ "BDAT: no final reply", PH_END, 250, 250, 0, 0, false, false, OUTCOME_AMBIGUOUS, 0,
	  "no reply after the end of data" },
	{ "BDAT: no RCPT reply (one write)", PH_END, 250, 0, 0, 0, false, false, OUTCOME_AMBIGUOUS,
	  0, "no reply to RCPT TO either" },
	{ "BDAT: stalled after the write", PH_END, 250, 0, 0, 0, false, true, OUTCOME_AMBIGUOUS, 0,
	  "may have queued" },
	{ "BDAT: no MAIL reply either", PH_END, 0, 0, 0, 0, false, false, OUTCOME_AMBIGUOUS, 0,
	  "no reply to MAIL FROM either" },
	/* refusals outrank a later missing reply */
	{ "BDAT: RCPT 550, no final reply", PH_END, 250, 550, 0, 0, false, false, OUTCOME_TERMINAL,
	  550, "RCPT TO refused" },
	{ "BDAT: RCPT 450, no final reply", PH_END, 250, 450, 0, 0, false, true, OUTCOME_RETRY, 450,
	  "RCPT TO refused" },
	{ "BDAT: MAIL 451, nothing after", PH_END, 451, 0, 0, 0, false, false, OUTCOME_RETRY, 451,
	  "MAIL FROM refused" },
	{ "DATA: 354 refused 554", PH_ENVELOPE, 250, 250, 554, 0, false, false, OUTCOME_TERMINAL, 554,
	  "DATA refused" },
	/* answered */
	{ "BDAT: LAST 451", PH_REPLIED, 250, 250, 0, 451, false, false, OUTCOME_RETRY, 451,
	  "after the end of data" },
	{ "BDAT: LAST 250", PH_REPLIED, 250, 250, 0, 250, false, false, OUTCOME_ACCEPTED, 250, "" },
	{ "DATA: 250", PH_REPLIED, 250, 250, 0, 250, false, false, OUTCOME_ACCEPTED, 250, "" },
};

static void test_commit_point_table(void **state)
{
	struct email_ctx ctx = { "relay.test:25", 4, 10000 };

	(void)state;
	for (size_t i = 0; i < sizeof(commit_cases) / sizeof(commit_cases[0]); i++) {
		const struct commit_case *k = &commit_cases[i];
		struct email_seen s = { .phase = k->phase, .margin_abort = k->margin,
		                        .margin_left_ms = 400, .margin_ms = 1000,
		                        .bdat = strncmp(k->name, "BDAT", 4) == 0 };
		struct outbox_result r;

		if (k->mail)
			s.mail = R(k->mail, "mail");
		if (k->rcpt)
			s.rcpt = R(k->rcpt, "rcpt");
		if (k->data_cmd)
			s.data_cmd = R(k->data_cmd, "data");
		if (k->final)
			s.final = R(k->final, k->final == 250 ? "2.0.0 Ok: queued as ABC123" : "no");
		email_classify(&s, &ctx, k->abandoned, "connection closed", 1234, 56, &r);
		if (r.outcome != k->outcome || r.status != k->status || strstr(r.error, k->words) == NULL)
			fail_msg("%s: outcome %d status %d \"%s\"; expected %d %d \"%s\"", k->name,
			         (int)r.outcome, r.status, r.error, (int)k->outcome, k->status, k->words);
	}
}

static void test_accepted_carries_the_queue_id(void **state)
{
	struct email_ctx ctx = { "relay.test:25", 4, 10000 };
	struct email_seen s = { .phase = PH_REPLIED };
	struct outbox_result r;

	(void)state;
	s.mail = R(250, "ok");
	s.rcpt = R(250, "ok");
	s.final = R(250, "OK id=1rXyZa-000123-AB");
	email_classify(&s, &ctx, false, NULL, 0, 0, &r);
	assert_int_equal(r.outcome, OUTCOME_ACCEPTED);
	assert_string_equal(r.provider_id, "1rXyZa-000123-AB");
}

static void test_class_of(void **state)
{
	(void)state;
	assert_int_equal(email_class_of(421), OUTCOME_RETRY);
	assert_int_equal(email_class_of(550), OUTCOME_TERMINAL);
	assert_int_equal(email_class_of(354), OUTCOME_RETRY);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_provider_ids),
		cmocka_unit_test(test_provider_id_too_long_falls_back_cut),
		cmocka_unit_test(test_classification_table),
		cmocka_unit_test(test_commit_point_table),
		cmocka_unit_test(test_accepted_carries_the_queue_id),
		cmocka_unit_test(test_class_of),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

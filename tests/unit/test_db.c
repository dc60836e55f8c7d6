/* SPDX-License-Identifier: ISC */
/*
 * test_db.c: lib/db.c against the suite's PostgreSQL (libpq's
 * environment: tests/run.sh exports PGHOST, PGPORT, PGUSER, PGDATABASE).
 *
 * What the worker relies on: queries answer in queue order, except that
 * an urgent query goes ahead of queued ones that are not (never ahead of
 * the one on the wire or of earlier urgent ones); the next query is on the
 * wire while the previous one's callback runs; db_head_sent_mono() in a
 * callback is that query's send time; the application name reaches
 * pg_stat_activity; a send that fails after an answer still delivers that
 * answer, then the connection is lost.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "db.h"
#include "log.h"
#include "util.h"

#define MAX_SEEN 16

struct fixture {
	struct event_base *base;
	struct db *db;
	bool up;
	int seen[MAX_SEEN];           /* the answers' first column, in callback order */
	int n_seen;
	int nulls;                    /* callbacks with res == NULL */
	double cb_start, cb_end;      /* wall clock around the slow callback */
	int64_t cb_end_mono;          /* and when it ended */
	double next_ran_at;           /* the server's clock_timestamp() of the next query */
	int64_t sent_in_cb[MAX_SEEN]; /* db_head_sent_mono() seen by each callback */
	int64_t cb_entered_mono[MAX_SEEN];
	char app_name[128];
	bool lost_after_answer;       /* the connection was down when the callback ran */
};

static double wall_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void on_state(struct db *db, bool up, void *arg)
{
	struct fixture *f = arg;

	(void)db;
	f->up = up;
	event_base_loopbreak(f->base);
}

static int setup(void **state)
{
	struct fixture *f = text_alloc(sizeof(*f));

	log_init("test_db", NULL);
	log_set_min_level(OLOG_ERROR);
	f->base = event_base_new();
	f->db = db_new(f->base, "", 10, 100, NULL);
	db_set_application_name(f->db, "outbox test_db");
	db_set_callbacks(f->db, on_state, NULL, f);
	db_start(f->db);
	{
		/* until on_state, or 10 s: the tests then fail on f->up */
		struct timeval tv = { 10, 0 };
		event_base_loopexit(f->base, &tv);
		event_base_loop(f->base, 0);
	}
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;

	db_free(f->db);
	event_base_free(f->base);
	free(f);
	return 0;
}

/* Run the loop until `n` callbacks have been seen (or 10 s). */
static void run_until(struct fixture *f, int n)
{
	double deadline = wall_now() + 10;

	while (f->n_seen + f->nulls < n && wall_now() < deadline)
		event_base_loop(f->base, EVLOOP_ONCE);
}

static void on_int(struct db *db, PGresult *r, void *arg)
{
	struct fixture *f = arg;

	if (r == NULL || PQresultStatus(r) != PGRES_TUPLES_OK) {
		f->nulls++;
		return;
	}
	f->sent_in_cb[f->n_seen] = db_head_sent_mono(db);
	f->cb_entered_mono[f->n_seen] = now_mono_ms();
	f->seen[f->n_seen++] = atoi(PQgetvalue(r, 0, 0));
}

static void test_urgent_queries_pass_queued_ones_but_not_the_one_on_the_wire(void **state)
{
	struct fixture *f = *state;

	assert_true(f->up);
	db_query(f->db, "SELECT 1 FROM pg_sleep(0.05)", 0, NULL, on_int, f, 0);   /* on the wire */
	db_query(f->db, "SELECT 2", 0, NULL, on_int, f, 0);
	db_query(f->db, "SELECT 3", 0, NULL, on_int, f, DBQ_URGENT);
	db_query(f->db, "SELECT 4", 0, NULL, on_int, f, 0);
	db_query(f->db, "SELECT 5", 0, NULL, on_int, f, DBQ_URGENT);
	assert_int_equal(db_queue_len(f->db), 5);
	run_until(f, 5);
	assert_int_equal(f->nulls, 0);
	assert_int_equal(f->n_seen, 5);
	assert_int_equal(f->seen[0], 1);
	assert_int_equal(f->seen[1], 3);
	assert_int_equal(f->seen[2], 5);
	assert_int_equal(f->seen[3], 2);
	assert_int_equal(f->seen[4], 4);
	assert_int_equal(db_queue_len(f->db), 0);
}

static void on_slow(struct db *db, PGresult *r, void *arg)
{
	struct fixture *f = arg;

	on_int(db, r, arg);
	f->cb_start = wall_now();
	usleep(200 * 1000);
	f->cb_end = wall_now();
	f->cb_end_mono = now_mono_ms();
}

static void on_clock(struct db *db, PGresult *r, void *arg)
{
	struct fixture *f = arg;

	if (r == NULL || PQresultStatus(r) != PGRES_TUPLES_OK) {
		f->nulls++;
		return;
	}
	f->next_ran_at = atof(PQgetvalue(r, 0, 0));
	f->sent_in_cb[f->n_seen] = db_head_sent_mono(db);
	f->seen[f->n_seen++] = -1;
}

static void test_the_next_query_runs_while_the_previous_callback_does(void **state)
{
	struct fixture *f = *state;

	assert_true(f->up);
	db_query(f->db, "SELECT 1 FROM pg_sleep(0.1)", 0, NULL, on_slow, f, 0);
	db_query(f->db, "SELECT extract(epoch FROM clock_timestamp())", 0, NULL, on_clock, f, 0);
	run_until(f, 2);
	assert_int_equal(f->n_seen, 2);
	/* The server ran the second query before the first one's 200 ms
	 * callback ended (without the lookahead it would run after). */
	assert_true(f->next_ran_at < f->cb_end);
	assert_true(f->next_ran_at > f->cb_start - 1.0);
	/* Each callback's db_head_sent_mono(): the first, its own send time
	 * (at least its 100 ms sleep before the answer; the second query's,
	 * written just before the callback, would be ~0 ms); the second, not
	 * before the first callback ended (it was written ahead, and its
	 * answer waited for that callback, which is not its own time).  Half
	 * the sleep: the send time is read after the write returns, which on a
	 * loaded machine may be a while after the server got the query. */
	assert_true(f->cb_entered_mono[0] - f->sent_in_cb[0] >= 50);
	assert_true(f->sent_in_cb[1] >= f->cb_end_mono);
}

static void on_app_name(struct db *db, PGresult *r, void *arg)
{
	struct fixture *f = arg;

	(void)db;
	if (r == NULL || PQresultStatus(r) != PGRES_TUPLES_OK) {
		f->nulls++;
		return;
	}
	snprintf(f->app_name, sizeof(f->app_name), "%s", PQgetvalue(r, 0, 0));
	f->seen[f->n_seen++] = 0;
}

static void test_the_application_name_reaches_pg_stat_activity(void **state)
{
	struct fixture *f = *state;

	assert_true(f->up);
	db_query(f->db, "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()",
	         0, NULL, on_app_name, f, 0);
	run_until(f, 1);
	assert_string_equal(f->app_name, "outbox test_db");
}

static void on_answer_then_lost(struct db *db, PGresult *r, void *arg)
{
	struct fixture *f = arg;

	on_int(db, r, arg);
	/* Still up: the failed send is handled after this callback. */
	f->lost_after_answer = !db_is_up(db);
}

static void test_a_failed_lookahead_send_delivers_the_answer_then_loses_the_connection(void **state)
{
	struct fixture *f = *state;
	/* libpq refuses more than 65535 parameters before writing anything:
	 * the send fails as a broken connection's would. */
	enum { TOO_MANY = 70000 };
	const char **params = text_array(TOO_MANY, sizeof(*params));

	assert_true(f->up);
	for (int i = 0; i < TOO_MANY; i++)
		params[i] = "1";
	db_query(f->db, "SELECT 7", 0, NULL, on_answer_then_lost, f, 0);
	db_query(f->db, "SELECT $1", TOO_MANY, params, on_int, f, 0);
	free(params);
	run_until(f, 1);
	assert_int_equal(f->n_seen, 1);
	assert_int_equal(f->seen[0], 7);
	assert_false(f->lost_after_answer);
	assert_false(db_is_up(f->db));
	assert_false(f->up);
	assert_non_null(strstr(db_last_error(f->db), "65535"));
	/* The query that cannot be sent is still queued (it would be sent
	 * again after the reconnect); dropping it answers NULL. */
	assert_int_equal(db_queue_len(f->db), 1);
	db_cancel_queued(f->db);
	assert_int_equal(f->nulls, 1);
	assert_int_equal(db_queue_len(f->db), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_urgent_queries_pass_queued_ones_but_not_the_one_on_the_wire,
		                                setup, teardown),
		cmocka_unit_test_setup_teardown(test_the_next_query_runs_while_the_previous_callback_does,
		                                setup, teardown),
		cmocka_unit_test_setup_teardown(test_the_application_name_reaches_pg_stat_activity, setup,
		                                teardown),
		cmocka_unit_test_setup_teardown(
			test_a_failed_lookahead_send_delivers_the_answer_then_loses_the_connection, setup,
			teardown),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}

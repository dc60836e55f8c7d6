/* SPDX-License-Identifier: ISC */
/*
 * test_effect.c: dispatcher/effect.c, effect_set_phase(): every allowed
 * move keeps the worker's lists and counters right, every impossible one
 * is refused and changes nothing, and freeing takes an effect off its list
 * and out of the held set.  Effects come from real PGresults built with
 * libpq's own constructors (no server needed).
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "log.h"
#include "util.h"
#include "worker_internal.h"

static const char *const row_values[] = {
	"0b9a4f0e-1d43-4f51-9f1a-1f3c0c9f2a01", "run-1", "http", "https://example.test/",
	"{\"a\":1}", "hash", "key-1", "0", NULL, NULL, "0", "2026-01-01 00:00:00+00",
};
#define ROW_COLUMNS ((int)(sizeof(row_values) / sizeof(row_values[0])))

/* A result of SQL_LEASE's columns with one row per id. */
static PGresult *lease_result(const char *const *ids, int n)
{
	PGresAttDesc attrs[ROW_COLUMNS];
	PGresult *r = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);

	memset(attrs, 0, sizeof(attrs));
	for (int c = 0; c < ROW_COLUMNS; c++) {
		attrs[c].name = (char *)"col";
		attrs[c].format = 0;
	}
	assert_true(PQsetResultAttrs(r, ROW_COLUMNS, attrs));
	for (int row = 0; row < n; row++)
		for (int c = 0; c < ROW_COLUMNS; c++) {
			const char *v = c == 0 ? ids[row] : row_values[c];
			assert_true(PQsetvalue(r, row, c, (char *)v, v ? (int)strlen(v) : -1));
		}
	return r;
}

static struct worker *worker_empty(void)
{
	struct worker *w = text_alloc(sizeof(*w));

	TAILQ_INIT(&w->fx.waiting);
	TAILQ_INIT(&w->fx.sending);
	TAILQ_INIT(&w->fx.done_q);
	TAILQ_INIT(&w->fx.recon_q);
	return w;
}

static int list_len(struct effect_list *l)
{
	struct effect *e;
	int n = 0;

	TAILQ_FOREACH(e, l, link) {
		n++;
	}
	return n;
}

static void test_send_path_moves_lists_and_counters(void **state)
{
	const char *ids[] = { "11111111-1111-4111-8111-111111111111" };
	PGresult *r = lease_result(ids, 1);
	struct worker *w = worker_empty();
	struct effect *e = effect_from_row(w, r, 0, true);

	(void)state;
	assert_int_equal(e->phase, PH_NEW);
	assert_int_equal(w->fx.n_active, 1);
	assert_ptr_equal(held_find(w, ids[0]), e);
	assert_true(effect_set_phase(w, e, PH_WAITING));
	assert_int_equal(list_len(&w->fx.waiting), 1);
	assert_true(effect_set_phase(w, e, PH_MARKING));
	assert_int_equal(list_len(&w->fx.waiting), 0);
	assert_true(effect_set_phase(w, e, PH_SENDING));
	assert_int_equal(list_len(&w->fx.sending), 1);
	assert_int_equal(w->fx.n_sending, 1);
	assert_true(effect_set_phase(w, e, PH_DONE));
	assert_int_equal(list_len(&w->fx.sending), 0);
	assert_int_equal(w->fx.n_sending, 0);
	assert_int_equal(list_len(&w->fx.done_q), 1);
	assert_true(effect_set_phase(w, e, PH_RECORDING));
	assert_int_equal(list_len(&w->fx.done_q), 0);
	effect_free(e);
	assert_int_equal(w->fx.n_active, 0);
	assert_null(held_find(w, ids[0]));
	PQclear(r);
	free(w);
}

static void test_reconcile_path(void **state)
{
	const char *ids[] = { "22222222-2222-4222-8222-222222222222" };
	PGresult *r = lease_result(ids, 1);
	struct worker *w = worker_empty();
	struct effect *e = effect_from_row(w, r, 0, false);

	(void)state;
	assert_true(effect_set_phase(w, e, PH_RECONCILING));
	assert_int_equal(w->fx.n_reconciling, 1);
	assert_true(effect_set_phase(w, e, PH_RECONCILED));
	assert_int_equal(w->fx.n_reconciling, 0);
	assert_int_equal(list_len(&w->fx.recon_q), 1);
	assert_true(effect_set_phase(w, e, PH_RECORDING_VERDICT));
	assert_int_equal(list_len(&w->fx.recon_q), 0);
	effect_free(e);
	assert_int_equal(w->fx.n_active, 0);
	PQclear(r);
	free(w);
}

/* Impossible moves are refused and leave lists and counters alone. */
static void test_impossible_moves_refused(void **state)
{
	const char *ids[] = { "33333333-3333-4333-8333-333333333333" };
	PGresult *r = lease_result(ids, 1);
	struct worker *w = worker_empty();
	struct effect *e = effect_from_row(w, r, 0, true);

	(void)state;
	assert_false(effect_set_phase(w, e, PH_SENDING));     /* never marked */
	assert_false(effect_set_phase(w, e, PH_DONE));
	assert_int_equal(e->phase, PH_NEW);
	assert_true(effect_set_phase(w, e, PH_WAITING));
	assert_false(effect_set_phase(w, e, PH_SENDING));     /* the commit point is not skipped */
	assert_false(effect_set_phase(w, e, PH_WAITING));     /* no second copy on the list */
	assert_false(effect_set_phase(w, e, PH_RECONCILING));
	assert_int_equal(e->phase, PH_WAITING);
	assert_int_equal(list_len(&w->fx.waiting), 1);
	assert_int_equal(w->fx.n_sending, 0);
	assert_int_equal(w->fx.n_reconciling, 0);
	effect_free(e);   /* off the waiting list */
	assert_int_equal(list_len(&w->fx.waiting), 0);
	assert_int_equal(w->fx.n_active, 0);
	PQclear(r);
	free(w);
}

/* A refused outbox_complete() puts its batch back at the head of the
 * queue in the batch's order (on_complete() walks it backwards). */
static void test_recording_back_to_done_keeps_order(void **state)
{
	const char *ids[] = { "44444444-4444-4444-8444-444444444441",
	                      "44444444-4444-4444-8444-444444444442",
	                      "44444444-4444-4444-8444-444444444443" };
	PGresult *r = lease_result(ids, 3);
	struct worker *w = worker_empty();
	struct effect *e[3], *later;

	(void)state;
	for (int i = 0; i < 3; i++) {
		e[i] = effect_from_row(w, r, i, true);
		assert_true(effect_set_phase(w, e[i], PH_WAITING));
		assert_true(effect_set_phase(w, e[i], PH_MARKING));
		assert_true(effect_set_phase(w, e[i], PH_SENDING));
		assert_true(effect_set_phase(w, e[i], PH_DONE));
	}
	/* The first two go to a batch; the third stays queued. */
	assert_true(effect_set_phase(w, e[0], PH_RECORDING));
	assert_true(effect_set_phase(w, e[1], PH_RECORDING));
	later = e[2];
	for (int i = 2; i-- > 0;)
		assert_true(effect_set_phase(w, e[i], PH_DONE));
	assert_ptr_equal(TAILQ_FIRST(&w->fx.done_q), e[0]);
	assert_ptr_equal(TAILQ_NEXT(e[0], link), e[1]);
	assert_ptr_equal(TAILQ_NEXT(e[1], link), later);
	effects_free_all(w);
	assert_int_equal(w->fx.n_active, 0);
	PQclear(r);
	free(w);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_send_path_moves_lists_and_counters),
		cmocka_unit_test(test_reconcile_path),
		cmocka_unit_test(test_impossible_moves_refused),
		cmocka_unit_test(test_recording_back_to_done_keeps_order),
	};

	/* The refused moves are logged (on stderr) as they would be in a worker. */
	log_init("test_effect", NULL);
	return cmocka_run_group_tests(tests, NULL, NULL);
}

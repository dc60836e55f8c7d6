# SPDX-License-Identifier: ISC
"""effect_history_failed_idx (sql/114_history_failed_index.sql): the
history's failing rows by effect id, made ON ONLY the parent under the
migration's locks and, for each partition there, built CONCURRENTLY and
attached by `outboxctl migrate` after its commit (lib/migrate.c).

- The upgrade from the last release: every partition gets its part, the
  parent index is valid, and the console's failed filter reads it.
- A build cut short (an invalid index of the part's name) is dropped and
  built again; a part built but not attached is attached as it is.
- A month made after the migration gets its part as it is created, and the
  parent stays valid.
"""
import os
import re
import subprocess

import psycopg2

from outbox_test import BUILD_DIR, dsn_for, plans_of, query, scalar
from releases import release_build

# A part of effect_history_failed_idx, walked newest first (the name
# PostgreSQL gives a part it makes itself, for a month made later).
FAILED_WALK = re.compile(r"Index (Only )?Scan Backward using effect_history_(\d{6}|default)_effect_id_idx")
PARTS = ("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
         "WHERE i.inhparent = 'effect_history'::regclass ORDER BY 1")
ATTACHED = ("SELECT c.relname, x.indisvalid, pg_get_indexdef(x.indexrelid) "
            "FROM pg_inherits i JOIN pg_index x ON x.indexrelid = i.inhrelid "
            "JOIN pg_class c ON c.oid = x.indrelid "
            "WHERE i.inhparent = 'effect_history_failed_idx'::regclass ORDER BY 1")


def migrate(dsn, exe):
    return subprocess.run([exe, "--db", dsn, "migrate"], capture_output=True, text=True,
                          timeout=600)


def old_release_db(unmigrated_db):
    dsn = dsn_for(unmigrated_db)
    r = migrate(dsn, os.path.join(release_build("71088d8"), "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    c = psycopg2.connect(dsn)
    c.autocommit = True
    assert scalar(c, "SELECT to_regclass('effect_history_failed_idx')") is None
    return dsn, c


def finish(c, key, n, state):
    """n effects of run `key`, finished in `state` (one history row each)."""
    query(c, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
             "VALUES (%s, 'processing', 'h')", (key,))
    query(c, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
             "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, %s) g",
          (key, n))
    query(c, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
             "outcome_class, state) SELECT b.effect_id, b.created_at, 1, 'w', now(), "
             "CASE WHEN %s = 'failed' THEN 'terminal' ELSE 'accepted' END, %s "
             "FROM effect_outbox b WHERE b.idempotency_key = %s", (state, state, key))
    query(c, "DELETE FROM effect_live l USING effect_outbox b "
             "WHERE b.effect_id = l.effect_id AND b.idempotency_key = %s", (key,))
    return sorted(r[0] for r in query(c, "SELECT effect_id::text FROM effect_outbox "
                                         "WHERE idempotency_key = %s", (key,)))


def assert_whole(c):
    parts = [r[0] for r in query(c, PARTS)]
    attached = query(c, ATTACHED)
    assert [a[0] for a in attached] == parts, (parts, attached)
    for name, valid, definition in attached:
        assert valid, name
        assert definition.endswith("(effect_id) WHERE (state = 'failed'::text)"), definition
    assert scalar(c, "SELECT indisvalid FROM pg_index "
                     "WHERE indexrelid = 'effect_history_failed_idx'::regclass") is True
    assert query(c, "SELECT * FROM outbox_history_index_pending()") == []


def test_upgrade_from_the_last_release_builds_each_part_and_the_failed_filter_reads_it(unmigrated_db):
    dsn, c = old_release_db(unmigrated_db)
    failed = finish(c, "fi-failed", 30, "failed")
    finish(c, "fi-done", 200, "completed")

    r = migrate(dsn, os.path.join(BUILD_DIR, "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    parts = len(query(c, PARTS))
    assert parts >= 2
    assert f"built effect_history_failed_idx on {parts} partitions\n" in r.stdout, r.stdout
    assert_whole(c)
    sql = ("SELECT effect_id::text FROM outbox_console_effects(now() - interval '1 hour', "
           "now() + interval '1 minute', 'failed', NULL, NULL, NULL, NULL, NULL, NULL, 200, 20000)")
    assert sorted(r[0] for r in query(c, sql)) == failed
    plans = plans_of(c, sql, None)
    assert FAILED_WALK.search(plans), plans
    # Nothing left: migrate again builds nothing and says nothing of it.
    r = migrate(dsn, os.path.join(BUILD_DIR, "outboxctl"))
    assert r.returncode == 0 and "built" not in r.stdout, r.stdout + r.stderr
    c.close()


def test_a_build_cut_short_is_built_again_and_one_not_attached_is_attached(unmigrated_db):
    dsn, c = old_release_db(unmigrated_db)
    finish(c, "fi-failed", 3, "failed")
    parts = [r[0] for r in query(c, PARTS)]
    current = scalar(c, "SELECT tableoid::regclass::text FROM effect_history LIMIT 1")
    other = next(p for p in parts if p != current)
    # A concurrent build cut short leaves its index behind, invalid: here
    # its wait for a writer of the partition runs out of lock_timeout.
    writer = psycopg2.connect(dsn)
    writer.autocommit = False
    with writer.cursor() as cur:
        cur.execute(f"INSERT INTO {current} SELECT * FROM {current} LIMIT 0")
        cur.execute(f"LOCK TABLE {current} IN ROW EXCLUSIVE MODE")
        query(c, "SET lock_timeout = '200ms'")
        try:
            query(c, f"CREATE INDEX CONCURRENTLY cut_short ON {current} (effect_id) "
                     "WHERE state = 'failed'")
            raise AssertionError("the build should have been cut short")
        except psycopg2.errors.LockNotAvailable:
            pass
        query(c, "RESET lock_timeout")
    writer.rollback()
    writer.close()
    assert scalar(c, "SELECT indisvalid FROM pg_index WHERE indexrelid = 'cut_short'::regclass") \
        is False
    # A part built (by hand, or by a migrate stopped before its attach),
    # under a name of its own: found by what it indexes.
    query(c, f"CREATE INDEX by_hand ON {other} (effect_id) WHERE state = 'failed'")
    before = scalar(c, "SELECT 'by_hand'::regclass::oid")
    # Another index of the partition that is not one: left alone.
    query(c, f"CREATE INDEX not_a_part ON {current} (effect_id) WHERE state = 'completed'")

    r = migrate(dsn, os.path.join(BUILD_DIR, "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert_whole(c)
    assert scalar(c, "SELECT to_regclass('cut_short')") is None
    assert scalar(c, "SELECT 'by_hand'::regclass::oid") == before
    assert scalar(c, "SELECT to_regclass('not_a_part') IS NOT NULL") is True
    c.close()


def test_a_month_made_later_gets_its_part_and_the_index_stays_valid(db):
    c = psycopg2.connect(dsn_for(db))
    c.autocommit = True
    assert_whole(c)
    made = scalar(c, "SELECT outbox_history_months(now() + interval '5 months', "
                     "now() + interval '7 months')")
    assert made >= 1
    assert_whole(c)
    c.close()

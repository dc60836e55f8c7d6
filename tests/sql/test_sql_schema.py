# SPDX-License-Identifier: ISC
"""The schema as files: sql/100_baseline.sql (tables, indexes, roles) and
sql/functions/ (each function, trigger and view defined once, re-applied
when its file changes).  A fresh database and one created by the release
before the baseline (migrations 001..014) reach the same schema."""
import glob
import hashlib
import os
import re
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import ROOT, admin_dsn, dsn_for, query, run_ctl

SQUASHED = ["001_schema", "002_producer", "003_dispatcher", "004_roles", "005_operator",
            "006_reconcile", "007_lease_cursor", "008_lease_plans", "009_hot_lease",
            "010_sending_index", "011_inflight_list", "012_lease_room",
            "013_sweep_reads_no_table", "014_weekly_this_week"]


@pytest.fixture
def new_db():
    """Factory of new, empty databases, dropped at the end."""
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    made = []

    def make():
        name = "s_" + uuid.uuid4().hex[:12]
        query(admin, f"CREATE DATABASE {name}")
        made.append(name)
        return name
    yield make
    for name in made:
        query(admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()


def previous_release_sql(name):
    """The file as the release before the baseline shipped it."""
    with open(os.path.join(ROOT, "tests", "fixtures", "sql-before-baseline", name + ".sql")) as f:
        return f.read()


def migrate_like_previous_release(dsn, names):
    """What `outboxctl migrate` of the previous release did: each file in
    one transaction, recorded with the SHA-256 of its text."""
    c = psycopg2.connect(dsn)
    try:
        with c:
            query(c, "SET LOCAL client_min_messages = warning")
            query(c, "CREATE TABLE IF NOT EXISTS schema_migrations ("
                     " version integer PRIMARY KEY, name text NOT NULL,"
                     " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
            for n in names:
                text = previous_release_sql(n)
                query(c, text)
                query(c, "INSERT INTO schema_migrations (version, name, checksum) "
                         "VALUES (%s, %s, %s)",
                      (int(n[:3]), n, hashlib.sha256(text.encode()).hexdigest()))
    finally:
        c.close()


def schema_dump(dbname):
    env = dict(os.environ)
    r = subprocess.run(["pg_dump", "--schema-only", "--no-owner", "-d", dsn_for(dbname)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    # pg_dump lists an object's grants in the order they were given: sort
    # each run of GRANT/REVOKE lines; drop its random \restrict keys.
    out, run = [], []
    for line in r.stdout.splitlines():
        if line.startswith(("\\restrict", "\\unrestrict")):
            continue
        if line.startswith(("GRANT ", "REVOKE ")):
            run.append(line)
            continue
        out.extend(sorted(run))
        run = []
        out.append(line)
    out.extend(sorted(run))
    return out


def test_fresh_and_upgraded_databases_have_the_same_schema(new_db):
    fresh, old = new_db(), new_db()
    r = run_ctl(["--db", dsn_for(fresh), "migrate"])
    assert r.returncode == 0, r.stderr
    migrate_like_previous_release(dsn_for(old), SQUASHED)
    r = run_ctl(["--db", dsn_for(old), "migrate"])
    assert r.returncode == 0, r.stderr
    assert "recorded 100_baseline" in r.stdout, r.stdout
    assert "applied 100_baseline" not in r.stdout, r.stdout
    a, b = schema_dump(fresh), schema_dump(old)
    diff = [ln for ln in set(a) ^ set(b)]
    assert a == b, "schemas differ:\n" + "\n".join(sorted(diff)[:40])
    # The upgraded database keeps its history.
    c = psycopg2.connect(dsn_for(old))
    try:
        names = [x[0] for x in query(c, "SELECT name FROM schema_migrations ORDER BY version")]
    finally:
        c.close()
    assert names[:len(SQUASHED)] == SQUASHED and "100_baseline" in names


def test_a_partly_migrated_previous_release_is_refused(new_db):
    old = new_db()
    migrate_like_previous_release(dsn_for(old), SQUASHED[:4])
    r = run_ctl(["--db", dsn_for(old), "migrate"])
    assert r.returncode != 0
    assert "4 of the 14 migrations the baseline replaces" in r.stderr, r.stderr


def test_a_changed_function_file_is_applied_again_and_only_it(new_db):
    db = new_db()
    assert run_ctl(["--db", dsn_for(db), "migrate"]).returncode == 0
    c = psycopg2.connect(dsn_for(db))
    c.autocommit = True
    try:
        query(c, "UPDATE schema_functions SET checksum = 'stale' "
                 "WHERE name = 'functions/40_operator.sql'")
        # A function dropped by hand comes back with its file.
        query(c, "DROP FUNCTION outbox_requeue(uuid, text, text)")
        r = run_ctl(["--db", dsn_for(db), "migrate"])
        assert r.returncode == 0, r.stderr
        assert re.findall(r"^applied (\S+)", r.stdout, re.M) == ["functions/40_operator.sql"]
        assert query(c, "SELECT count(*) FROM pg_proc WHERE proname = 'outbox_requeue'") == [(1,)]
    finally:
        c.close()


def test_every_function_is_defined_once_in_the_tree():
    defined = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "sql", "**", "*.sql"), recursive=True)):
        text = open(path).read()
        for name, args in re.findall(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(\w+)\(([^)]*)\)",
                                     text, re.M | re.I):
            # Overloads are different functions: name and argument count.
            key = f"{name}/{len([a for a in args.split(',') if a.strip()])}"
            defined.setdefault(key, []).append(os.path.relpath(path, ROOT))
    assert defined, "no function found under sql/"
    # A migration may replace a function an earlier migration made (it
    # cannot edit an applied one): the last one's is the function.
    # Nothing else is defined twice.
    twice = {n: p for n, p in defined.items()
             if len(p) > 1 and not all(x.startswith("sql/1") for x in p)}
    assert not twice, twice
    # Functions live in sql/functions/, but for what a migration itself
    # needs before the functions are applied: the hash behind two generated
    # columns and the effect id's default (a column's expression must exist
    # before its table), the history's partition maker (the migration makes
    # the months its rows go to), the history's append-only trigger (and
    # the source derivation it allows the backfill by), and the read view's
    # lease-owner column (a view's functions must exist before it).
    outside = {n: p for n, p in defined.items() if not p[0].startswith("sql/functions/")}
    assert outside == {"outbox_sha256_hex/1": ["sql/100_baseline.sql"],
                       "outbox_new_effect_id/0": ["sql/105_live_queue.sql"],
                       "outbox_effect_lease_owner/1": ["sql/105_live_queue.sql"],
                       "outbox_history_partitions/2": ["sql/105_live_queue.sql"],
                       "effect_history_append_only/0": ["sql/105_live_queue.sql",
                                                         "sql/112_history_source.sql"],
                       "outbox_history_source_of/5": ["sql/112_history_source.sql"]}, outside

# SPDX-License-Identifier: ISC
"""`outboxctl migrate` on fresh and migrated databases, concurrently from
several processes, and what a fresh database starts with."""
import os
import re
import select
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import (BUILD_DIR, admin_dsn, dsn_for, make_run, query, run_ctl, scalar,
                         wait_for)


@pytest.fixture
def empty_db():
    """A new, empty (unmigrated) database; dropped at the end."""
    name = "m_" + uuid.uuid4().hex[:12]
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    query(admin, f"CREATE DATABASE {name}")
    yield dsn_for(name)
    query(admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()


def applied_lines(out):
    return re.findall(r"^applied (\S+)", out, re.M)


def migrations(dsn):
    c = psycopg2.connect(dsn)
    try:
        return query(c, "SELECT version, name, checksum, applied_at FROM schema_migrations "
                        "ORDER BY version")
    finally:
        c.close()


def test_migrate_twice_applies_nothing_the_second_time(empty_db):
    r1 = run_ctl(["--db", empty_db, "migrate"])
    assert r1.returncode == 0, r1.stderr
    first = applied_lines(r1.stdout)
    assert first, r1.stdout
    recorded = migrations(empty_db)
    # Numbered migrations are recorded by version, function files by name.
    assert [r[1] for r in recorded] == [n for n in first if not n.startswith("functions/")]
    assert function_files(empty_db) == sorted(n for n in first if n.startswith("functions/"))
    assert len({r[0] for r in recorded}) == len(recorded)

    r2 = run_ctl(["--db", empty_db, "migrate"])
    assert r2.returncode == 0, r2.stderr
    assert applied_lines(r2.stdout) == []
    assert "(0 migrations applied)" in r2.stdout, r2.stdout
    assert migrations(empty_db) == recorded


def function_files(dsn):
    c = psycopg2.connect(dsn)
    try:
        return [r[0] for r in query(c, "SELECT name FROM schema_functions ORDER BY name")]
    finally:
        c.close()


def test_migrate_on_the_test_template_applies_nothing(db):
    before = migrations(db)
    r = run_ctl(["--db", db, "migrate"])
    assert r.returncode == 0, r.stderr
    assert applied_lines(r.stdout) == []
    assert migrations(db) == before


def test_migrate_from_four_processes_at_once(empty_db):
    exe = os.path.join(BUILD_DIR, "outboxctl")
    procs = [subprocess.Popen([exe, "--db", empty_db, "migrate"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    recorded = migrations(empty_db)
    names = [r[1] for r in recorded]
    assert names and len(set(names)) == len(names)
    assert len({r[0] for r in recorded}) == len(recorded)
    # Each migration and function file was applied by exactly one of the four.
    all_applied = [n for out, _ in outs for n in applied_lines(out)]
    assert sorted(all_applied) == sorted(names + function_files(empty_db))
    # And the schema works.
    c = psycopg2.connect(empty_db)
    try:
        assert scalar(c, "SELECT count(*) FROM outbox_control") == 1
    finally:
        c.close()


def test_fresh_database_starts_with_sends_disabled(empty_db):
    r = run_ctl(["--db", empty_db, "migrate"])
    assert r.returncode == 0, r.stderr
    c = psycopg2.connect(empty_db)
    try:
        assert query(c, "SELECT id, enabled FROM outbox_control") == [(1, False)]
        assert query(c, "SELECT enabled FROM outbox_control_history") == [(False,)]
        # Only one control row can ever exist.
        with pytest.raises(psycopg2.errors.CheckViolation):
            query(c, "INSERT INTO outbox_control (id, enabled, changed_by, reason) "
                     "VALUES (2, true, 'x', 'y')")
    finally:
        c.close()
    # outboxctl agrees.
    s = run_ctl(["--db", empty_db, "kill-switch", "status"])
    if s.returncode == 0:
        assert re.search(r"\b(off|disabled)\b", s.stdout, re.I), s.stdout


def drain(listener):
    listener.poll()
    got = list(listener.notifies)
    listener.notifies.clear()
    return got


def wait_notify(listener, what):
    def cond():
        select.select([listener], [], [], 0.05)
        return drain(listener)
    return wait_for(cond, timeout=10, what=what)


def test_insert_notifies_listeners(db, conn):
    listener = psycopg2.connect(db)
    listener.autocommit = True
    try:
        query(listener, "LISTEN effect_outbox")
        key = make_run(conn)
        drain(listener)
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "VALUES (%s, 'http', 'https://x.example/a', '{}')", (key,))
        got = wait_notify(listener, "NOTIFY after a plain INSERT")
        assert all(n.channel == "effect_outbox" for n in got)
        # The producer function's insert wakes workers too.
        query(conn, "SELECT * FROM outbox_enqueue(%s, 'http', 'https://x.example/b', '{}')", (key,))
        assert wait_notify(listener, "NOTIFY after outbox_enqueue")
    finally:
        listener.close()

#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/insert_cost.py: what the producer's plain insert costs PostgreSQL
per effect, this tree's schema against a baseline commit's (run by
bench/insert_cost.sh, which starts the server and builds the baseline).

    INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) VALUES (...)

It runs as a producer login made the way docs/n8n.md and
docs/running-a-fleet.md make one (CREATE ROLE ... LOGIN PASSWORD ... IN
ROLE outbox_producer): no superuser, no BYPASSRLS, so the row policies and
the run check are paid as a producer pays them.  Each row's run is claimed
first by that login through outbox_claim_run (the docs' step 2: a run
belongs to the login that claimed it), outside the measurement.

Two ways a producer commits it:
  single  one row per statement, each its own transaction (autocommit), the
          values as literals (what a producer without prepared statements
          sends; n8n's node does the same)
  bulk    INSERT_BULK rows per statement from a VALUES list, one transaction each
Per round and way, each variant gets a fresh copy of its migrated template
database; the runs are claimed, the database is vacuumed and analyzed, and
then the variants take turns, a chunk of INSERT_CHUNK single-row
transactions or one bulk statement at a time, in alternating order, so they
share the same minutes of a shared machine.  Per turn, the producer
backend's own CPU (/proc/PID/schedstat, ns: parse, plan, policies,
triggers, the indexes, the commit) and the WAL written are added to its
variant.  One row is inserted unmeasured before the turns (the warm-up
run's), so a new connection's first look at the catalogs counts on neither
side.

Environment: INSERT_VARIANTS (NAME=OUTBOXCTL ..., the first the reference,
as bench/levers.py reads LEVERS_VARIANTS), INSERT_N (effects per round and
way, 20000), INSERT_ROUNDS (3), INSERT_BULK (rows per bulk statement,
1000), INSERT_CHUNK (single-row transactions per turn, 250),
INSERT_DB_PREFIX (databases and the login are named after it, "ins"),
PGHOST/PGPORT/PGUSER (a superuser: it migrates and creates the login).
"""
import json
import os
import statistics
import subprocess
import sys

import psycopg2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from levers import parse_variants  # noqa: E402

N = int(os.environ.get("INSERT_N", "20000"))
ROUNDS = int(os.environ.get("INSERT_ROUNDS", "3"))
BULK = int(os.environ.get("INSERT_BULK", "1000"))
CHUNK = int(os.environ.get("INSERT_CHUNK", "250"))
PREFIX = os.environ.get("INSERT_DB_PREFIX", "ins")
LOGIN = PREFIX + "_producer"
PASSWORD = "bench-producer"
PAYLOAD = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                      "body": {"event": "invoice.paid", "invoice": "INV-000123",
                               "amount_cents": 129900, "currency": "EUR",
                               "customer": {"id": "cus_42", "email": "a@example.com"},
                               "note": "bench payload of a typical webhook size"}})
TARGET = "http://127.0.0.1:9/hook"
EXECUTION = "00000000-0000-4000-8000-0000000000aa"
INSERT = "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) VALUES "


def connect(db, user=None, password=None):
    c = psycopg2.connect(host=os.environ["PGHOST"], port=os.environ["PGPORT"],
                         user=user or os.environ.get("PGUSER", "postgres"), password=password, dbname=db)
    c.autocommit = True
    return c


def schedstat_ns(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0])


class Side:
    """One variant's database for one round and way, with its producer connection."""

    def __init__(self, admin, name, template, way, rnd):
        self.name, self.admin = name, admin
        self.db = "%s_%s_%s%d" % (PREFIX, name, way, rnd)
        self.prefix = "%s%d-" % (way[0], rnd)
        admin.execute("CREATE DATABASE %s TEMPLATE %s" % (self.db, template))
        self.conn = connect(self.db, LOGIN, PASSWORD)
        self.cur = self.conn.cursor()
        self.cur.execute("SELECT r.rolsuper, r.rolbypassrls, pg_has_role(current_user, 'outbox_producer', 'MEMBER')"
                         " FROM pg_roles r WHERE r.rolname = current_user")
        if self.cur.fetchone() != (False, False, True):
            sys.exit("insert_cost: %s is not a plain member of outbox_producer" % LOGIN)
        # The policy is in force: a row whose run this login has not claimed is refused.
        try:
            self.cur.execute(INSERT + "('no-such-run', 'http', %s, %s)", (TARGET, PAYLOAD))
            sys.exit("insert_cost: %s: a producer's row without its run was accepted" % name)
        except psycopg2.Error as e:
            self.refused = e.pgcode
        self.cur.execute("SELECT count(*) FILTER (WHERE c.status = 'claimed') FROM generate_series(1, %s) g,"
                         " LATERAL outbox_claim_run(%s || g, 'h', %s::uuid, 3600) c", (N, self.prefix, EXECUTION))
        if self.cur.fetchone()[0] != N:
            sys.exit("insert_cost: %s: the producer did not claim %d runs" % (name, N))
        # One row unmeasured first: the connection's caches of the table, its
        # policies and triggers are loaded before the turns, on both sides.
        self.cur.execute("SELECT outbox_claim_run('warm-up', 'h', %s::uuid, 3600)", (EXECUTION,))
        self.cur.execute(INSERT + "('warm-up', 'http', %s, %s)", (TARGET, PAYLOAD))
        owner = connect(self.db)
        owner.cursor().execute("VACUUM ANALYZE")
        owner.close()
        self.pid = self.conn.get_backend_pid()
        self.ns = self.wal = self.rows = 0

    def lsn(self):
        self.admin.execute("SELECT pg_current_wal_insert_lsn()")
        return self.admin.fetchone()[0]

    def turn(self, statements):
        """Run the statements on the producer's connection, adding their CPU and WAL."""
        w0 = self.lsn()
        t0 = schedstat_ns(self.pid)
        for sql, args in statements:
            self.cur.execute(sql, args)
        t1 = schedstat_ns(self.pid)
        self.admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (w0,))
        self.wal += int(self.admin.fetchone()[0])
        self.ns += t1 - t0

    def rows_in_outbox(self):
        owner = connect(self.db)
        cur = owner.cursor()
        cur.execute("SELECT count(*) FROM effect_outbox WHERE idempotency_key LIKE %s", (self.prefix + "%",))
        n = cur.fetchone()[0]
        owner.close()
        return n

    def close(self):
        self.conn.close()
        self.admin.execute("DROP DATABASE %s" % self.db)


def single_turns(side):
    for start in range(1, N + 1, CHUNK):
        yield [(INSERT + "(%s, 'http', %s, %s)", ("%s%d" % (side.prefix, i), TARGET, PAYLOAD))
               for i in range(start, min(N, start + CHUNK - 1) + 1)]


def bulk_turns(side):
    for start in range(1, N + 1, BULK):
        values = ",".join(side.cur.mogrify("(%s, 'http', %s, %s)", ("%s%d" % (side.prefix, i), TARGET, PAYLOAD))
                          .decode() for i in range(start, min(N, start + BULK - 1) + 1))
        yield [(INSERT + values, None)]


WAYS = (("single", single_turns), ("bulk", bulk_turns))


def make_template(admin, name, ctl):
    db = "%s_%s_tpl" % (PREFIX, name)
    admin.execute("CREATE DATABASE %s" % db)
    ci = "host=%s port=%s user=%s dbname=%s" % (os.environ["PGHOST"], os.environ["PGPORT"],
                                                 os.environ.get("PGUSER", "postgres"), db)
    subprocess.run([ctl, "--db", ci, "migrate"], check=True, stdout=subprocess.DEVNULL)
    # The producer login, as the docs create it (once for the cluster: roles are global).
    admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (LOGIN,))
    if not admin.fetchone():
        admin.execute("CREATE ROLE %s LOGIN PASSWORD %%s IN ROLE outbox_producer" % LOGIN, (PASSWORD,))
    return db


def main():
    variants = parse_variants(os.environ.get("INSERT_VARIANTS", ""))
    ref = variants[0][0]
    print("insert_cost: %d effects per round and way, %d rounds, bulk %d rows per statement, as %s;"
          " variants: %s" % (N, ROUNDS, BULK, LOGIN, ", ".join("%s=%s" % (n, c) for n, c, _ in variants)),
          flush=True)
    admin_conn = connect("postgres")
    admin = admin_conn.cursor()
    templates = {}
    res = {(name, way): [] for name, _, _ in variants for way, _ in WAYS}
    wal = {(name, way): [] for name, _, _ in variants for way, _ in WAYS}
    try:
        for name, ctl, extra in variants:
            if extra:
                sys.exit("insert_cost: variant %s: extra SQL is for bench/levers.py only" % name)
            templates[name] = make_template(admin, name, ctl)
        for rnd in range(1, ROUNDS + 1):
            for way, turns_of in WAYS:
                sides = [Side(admin, name, templates[name], way, rnd) for name, _, _ in variants]
                admin.execute("CHECKPOINT")
                gens = [turns_of(s) for s in sides]
                k, live = 0, list(zip(sides, gens))
                while live:
                    order = live if k % 2 == 0 else list(reversed(live))
                    for s, g in order:
                        stmts = next(g, None)
                        if stmts is None:
                            live.remove((s, g))
                        else:
                            s.turn(stmts)
                    k += 1
                line = []
                for s in sides:
                    got = s.rows_in_outbox()
                    if got != N:
                        sys.exit("insert_cost: %s %s round %d: %d rows, want %d" % (s.name, way, rnd, got, N))
                    res[(s.name, way)].append(s.ns / 1000.0 / N)
                    wal[(s.name, way)].append(s.wal / N)
                    line.append("%s %.1f µs, %.0f B" % (s.name, s.ns / 1000.0 / N, s.wal / N))
                    refused = s.refused
                    s.close()
                print("%s round %d: %s per row (a row without its run refused: SQLSTATE %s)" % (
                    way, rnd, "; ".join(line), refused), flush=True)
    finally:
        # Every database of this run, also those a failure left behind, then the login.
        admin.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                      (PREFIX.replace("_", "\\_") + "\\_%",))
        for (db,) in admin.fetchall():
            admin.execute("DROP DATABASE %s WITH (FORCE)" % db)
        admin.execute("DROP ROLE IF EXISTS %s" % LOGIN)
    print()
    print("| insert | variant | rows | producer backend CPU µs/row (median; min-max) | vs %s | WAL B/row |" % ref)
    print("|---|---|---|---|---|---|")
    for way, _ in WAYS:
        base = statistics.median(res[(ref, way)])
        for name, _, _ in variants:
            v = res[(name, way)]
            print("| %s | %s | %d x %d | %.1f (%.1f-%.1f) | %.2f | %.0f |" % (
                way if way == "single" else "bulk, %d rows per statement" % BULK, name, ROUNDS, N,
                statistics.median(v), min(v), max(v), statistics.median(v) / base,
                statistics.median(wal[(name, way)])))
    for name, _, _ in variants[1:]:
        print("insert ratio %s/%s: %s (the rounds': %s)" % (name, ref, " ".join(
            "%s: %.2f" % (way, statistics.median(res[(name, way)]) / statistics.median(res[(ref, way)]))
            for way, _ in WAYS), "; ".join(
            "%s %s" % (way, " ".join("%.2f" % (c / b) for c, b in zip(res[(name, way)], res[(ref, way)])))
            for way, _ in WAYS)))
    with open("/proc/loadavg") as f:
        print("load average: %s" % " ".join(f.read().split()[:3]))
    admin_conn.close()


if __name__ == "__main__":
    main()

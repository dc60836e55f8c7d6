# SPDX-License-Identifier: ISC
"""bench/levers.py: the database's cost per effect of one schema against
another, claim and completion (run by bench/levers.sh, which starts the
server and builds the baseline's outboxctl).

Each variant is an outboxctl: its migrations and functions are compiled
into it, so a database it migrates has that commit's schema.  Per variant a
template database is migrated (kill switch on) and loaded with the same
backlog: LEVERS_N runs, claimed through outbox_claim_run as a producer does,
and one `http` effect each with a ~270-byte webhook payload, due a
microsecond apart in the order written (the backlog make bench loads).
It is vacuumed and analyzed, so both sides are planned on true sizes.

Then, per batch size (LEVERS_BATCHES), each variant gets a copy of its
template (CREATE DATABASE ... TEMPLATE), analyzed again, and one connection
per variant claims a batch and records it as accepted (outbox_claim,
outbox_complete (outbox_complete_sending where the schema has it, as its
workers call): what a worker does for a batch, without the provider),
variant after variant, batch after batch, in alternating order, until every
backlog is empty.  Per call, the backend's own CPU time
(/proc/PID/schedstat, nanoseconds) and the WAL it wrote
(pg_current_wal_insert_lsn around the call) are added to its variant; at the
end a VACUUM of every table of the variant's database is measured the same
way (autovacuum is off, so the cleanup each variant leaves is charged to
it).  Interleaving call by call is what makes a 5-10 % difference visible
on a shared machine, where whole runs of the same build move by 15-40 %
(docs/performance.md).

Variants: LEVERS_VARIANTS, space-separated NAME=OUTBOXCTL or
NAME=OUTBOXCTL:EXTRA.sql (SQL run in the template after migrating, e.g. a
CREATE OR REPLACE FUNCTION to try).  The first is the reference of the
ratios.  bench/levers.sh passes baseline=... current=...; add a variant by
appending one more NAME=... to that list.
"""
import json
import os
import subprocess
import sys

import psycopg2

N = int(os.environ.get("LEVERS_N", "30000"))
BATCHES = [int(b) for b in os.environ.get("LEVERS_BATCHES", "16 64 128").split()]
PAYLOAD = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                      "body": {"event": "invoice.paid", "invoice": "INV-000123",
                               "amount_cents": 129900, "currency": "EUR",
                               "customer": {"id": "cus_42", "email": "a@example.com"},
                               "note": "bench payload of a typical webhook size"}})
OWNER = "00000000-0000-4000-8000-000000000001"
# Databases are named PREFIX_variant... (the suite runs this on its shared server).
PREFIX = os.environ.get("LEVERS_DB_PREFIX", "lever")
USER_TABLES = ("SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
               " WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
               " AND n.nspname NOT LIKE 'pg\\_toast%' ORDER BY 1")


def parse_variants(text):
    """[(name, outboxctl, extra sql file or None)] from NAME=CTL[:FILE] words."""
    out = []
    for word in text.split():
        name, eq, rest = word.partition("=")
        if not eq or not name.isidentifier() or not rest:
            sys.exit("levers: variant %r is not NAME=OUTBOXCTL[:EXTRA.sql]" % word)
        ctl, _, sql = rest.partition(":")
        if not os.access(ctl, os.X_OK):
            sys.exit("levers: variant %s: %s is not an executable outboxctl" % (name, ctl))
        if sql and not os.path.isfile(sql):
            sys.exit("levers: variant %s: no file %s" % (name, sql))
        if name in (n for n, _, _ in out):
            sys.exit("levers: variant %s named twice" % name)
        out.append((name, ctl, sql or None))
    if not out:
        sys.exit("levers: no variant (LEVERS_VARIANTS)")
    return out


def connect(db):
    c = psycopg2.connect(host=os.environ["PGHOST"], port=os.environ["PGPORT"],
                         user=os.environ.get("PGUSER", "postgres"), dbname=db)
    c.autocommit = True
    return c


def admin(sql):
    c = connect("postgres")
    c.cursor().execute(sql)
    c.close()


def drop_databases():
    """Every database of this run, also those a failure left behind."""
    c = connect("postgres")
    cur = c.cursor()
    cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (PREFIX.replace("_", "\\_") + "\\_%",))
    for (db,) in cur.fetchall():
        cur.execute("DROP DATABASE %s WITH (FORCE)" % db)
    c.close()


def cpu_ns(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0])


def count(cur, sql):
    """A figure for the check column, '-' where this schema has no such relation."""
    try:
        cur.execute(sql)
        return str(cur.fetchone()[0])
    except psycopg2.Error:
        return "-"


def make_template(name, ctl, extra):
    db = "%s_%s_tpl" % (PREFIX, name)
    admin("CREATE DATABASE %s" % db)
    ci = "host=%s port=%s user=%s dbname=%s" % (os.environ["PGHOST"], os.environ["PGPORT"],
                                                 os.environ.get("PGUSER", "postgres"), db)
    for args in (["migrate"], ["kill-switch", "on", "--operator", "levers", "--reason", "levers"]):
        subprocess.run([ctl, "--db", ci] + args, check=True, stdout=subprocess.DEVNULL)
    conn = connect(db)
    cur = conn.cursor()
    if extra:
        cur.execute(open(extra).read())
    cur.execute(USER_TABLES)
    for (t,) in cur.fetchall():
        cur.execute("ALTER TABLE %s SET (autovacuum_enabled = false)" % t)
    # The runs as a producer creates them (the docs' step 2), then the backlog.
    cur.execute("SELECT count(*) FILTER (WHERE c.status = 'claimed') FROM generate_series(1, %s) g,"
                " LATERAL outbox_claim_run('t' || g, 'h', %s::uuid, 86400) c", (N, OWNER))
    if cur.fetchone()[0] != N:
        sys.exit("levers: %s: outbox_claim_run did not claim %d runs" % (name, N))
    # Due a microsecond apart, in order (as the table's owner: a producer
    # cannot set the due time).
    cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, available_at)"
                " SELECT 't' || g, 'http', 'http://127.0.0.1:9/x', %s::jsonb,"
                " now() - interval '1 hour' + g * interval '1 microsecond'"
                " FROM generate_series(1, %s) g", (PAYLOAD, N))
    cur.execute("VACUUM ANALYZE")
    conn.close()
    return db


class Variant:
    def __init__(self, name, template, batch):
        self.name, self.batch_size = name, batch
        self.db = "%s_%s_b%d" % (PREFIX, name, batch)
        admin("CREATE DATABASE %s TEMPLATE %s" % (self.db, template))
        self.conn = connect(self.db)
        self.cur = self.conn.cursor()
        # Fresh statistics in the copy, so the plans are made on true sizes.
        self.cur.execute("ANALYZE")
        self.cur.execute("SELECT pg_backend_pid()")
        self.pid = self.cur.fetchone()[0]
        self.claim_ns = self.complete_ns = self.vacuum_ns = 0
        self.claim_wal = self.complete_wal = self.vacuum_wal = 0
        self.effects = self.calls = 0
        self.after_at = self.after_id = None
        # What a worker of the variant's tree calls for a batch: since the
        # completion was split, outbox_complete_sending (it answers the
        # rows it applied, all of them here); before, outbox_complete.
        self.cur.execute("SELECT to_regproc('outbox_complete_sending') IS NOT NULL")
        self.complete_sql = ("SELECT count(*) FROM outbox_complete_sending(%s, 'levers', %s::jsonb)"
                             if self.cur.fetchone()[0] else
                             "SELECT count(*) FILTER (WHERE applied) FROM"
                             " outbox_complete(%s, 'levers', %s::jsonb)")

    def wal(self):
        self.cur.execute("SELECT pg_current_wal_insert_lsn()")
        return self.cur.fetchone()[0]

    def wal_diff(self, a, b):
        self.cur.execute("SELECT pg_wal_lsn_diff(%s, %s)", (b, a))
        return int(self.cur.fetchone()[0])

    def measured(self, sql, args=None):
        """Run sql; its CPU ns, WAL bytes and rows."""
        w0 = self.wal()
        t0 = cpu_ns(self.pid)
        self.cur.execute(sql, args)
        rows = self.cur.fetchall() if self.cur.description else []
        t1 = cpu_ns(self.pid)
        return t1 - t0, self.wal_diff(w0, self.wal()), rows

    def batch(self):
        """Claim a batch and record it accepted; False once the backlog is empty."""
        # From the position after the last row claimed, as a worker does in
        # a backlog (from the head, each claim would step over every row
        # claimed before it that VACUUM has not yet taken out of the index).
        ns, wal, rows = self.measured(
            "SELECT effect_id, attempts, available_at FROM outbox_claim(%s, 'levers', %s, 30, '{http}', true,"
            " '{http}', gen_random_uuid(), %s, %s)", (OWNER, self.batch_size, self.after_at, self.after_id))
        if not rows:
            return False
        self.after_id, self.after_at = rows[-1][0], rows[-1][2]
        self.claim_ns += ns
        self.claim_wal += wal
        results = json.dumps([{"effect_id": r[0], "attempt": r[1] + 1, "started_ms_ago": 1,
                               "outcome": "accepted", "next_state": "completed", "retry_delay_ms": 0,
                               "status": 200, "provider_id": "x"} for r in rows])
        ns, wal, done = self.measured(self.complete_sql, (OWNER, results))
        if done[0][0] != len(rows):
            sys.exit("levers: %s recorded %d of %d outcomes" % (self.name, done[0][0], len(rows)))
        self.complete_ns += ns
        self.complete_wal += wal
        self.effects += len(rows)
        self.calls += 1
        return True

    def vacuum(self):
        self.cur.execute(USER_TABLES)
        for (t,) in self.cur.fetchall():
            ns, wal, _ = self.measured("VACUUM %s" % t)
            self.vacuum_ns += ns
            self.vacuum_wal += wal

    def total_us(self):
        return (self.claim_ns + self.complete_ns + self.vacuum_ns) / self.effects / 1000.0

    def wal_per_effect(self):
        return (self.claim_wal + self.complete_wal + self.vacuum_wal) / self.effects

    def check(self):
        cur = self.cur
        # Completed effects: the finishing history rows where the schema
        # keeps finished effects apart (effect_history), else the state
        # column of the one table.
        # A run's state follows from its effects on read there: settled
        # first (after the measurement), as every bulk reader does.
        cur.execute("SELECT to_regclass('effect_history') IS NOT NULL")
        if cur.fetchone()[0]:
            done = "SELECT count(*) FROM effect_history WHERE state = 'completed'"
            cur.execute("SELECT outbox_settle_runs(NULL)")
        else:
            done = "SELECT count(*) FROM effect_outbox WHERE state = 'completed'"
        return [count(cur, done),
                count(cur, "SELECT count(*) FROM workflow_runs WHERE state = 'completed'"),
                count(cur, "SELECT count(*) FROM effect_attempts")]

    def close(self):
        self.conn.close()
        admin("DROP DATABASE %s" % self.db)


def run_batch_size(variants, templates, batch, index):
    vs = [Variant(name, templates[name], batch) for name, _, _ in variants]
    live, rnd = list(vs), 0
    while live:
        order = live if rnd % 2 == 0 else list(reversed(live))
        done = [v for v in order if not v.batch()]
        live = [v for v in live if v not in done]
        rnd += 1
    # The vacuums too in an order that alternates from one batch size to the next.
    for v in (vs if index % 2 == 0 else list(reversed(vs))):
        v.vacuum()
    rows = []
    for v in vs:
        checks = v.check()
        if v.effects != N or checks[0] not in (str(N), "-"):
            sys.exit("levers: %s at %d rows per call delivered %d of %d (completed rows: %s)"
                     % (v.name, batch, v.effects, N, checks[0]))
        per = lambda x: x / v.effects / 1000.0
        rows.append({"variant": v.name, "batch": batch, "claim_us": per(v.claim_ns),
                     "complete_us": per(v.complete_ns), "vacuum_us": per(v.vacuum_ns),
                     "total_us": v.total_us(), "wal": v.wal_per_effect(), "calls": v.calls,
                     "check": checks})
        v.close()
    return rows


def main():
    variants = parse_variants(os.environ.get("LEVERS_VARIANTS", ""))
    print("levers: %d effects per variant, %s rows per call, variants: %s" % (
        N, "/".join(map(str, BATCHES)), ", ".join("%s=%s%s" % (n, c, ":" + s if s else "")
                                                  for n, c, s in variants)), flush=True)
    templates = {name: make_template(name, ctl, extra) for name, ctl, extra in variants}
    ref = variants[0][0]
    results = []
    try:
        for index, batch in enumerate(BATCHES):
            rows = run_batch_size(variants, templates, batch, index)
            results += rows
            base = rows[0]["total_us"]
            print()
            print("rows per call: %d (%d calls per variant); load average %s" % (
                batch, rows[0]["calls"], " ".join(open("/proc/loadavg").read().split()[:3])))
            print("| variant | claim µs | complete µs | vacuum µs | **total µs per effect** | vs %s "
                  "| WAL B per effect | completed / runs / attempts rows |" % ref)
            print("|---|---|---|---|---|---|---|---|")
            for r in rows:
                print("| %s | %.1f | %.1f | %.1f | **%.1f** | %.2f | %.0f | %s |" % (
                    r["variant"], r["claim_us"], r["complete_us"], r["vacuum_us"], r["total_us"],
                    r["total_us"] / base, r["wal"], " / ".join(r["check"])), flush=True)
    finally:
        drop_databases()
    print()
    print("summary: total µs per effect (WAL B per effect), %s" % " | ".join(
        "%s: %s" % (name, ", ".join("%d: %.1f (%.0f)" % (r["batch"], r["total_us"], r["wal"])
                                    for r in results if r["variant"] == name))
        for name, _, _ in variants))
    for name, _, _ in variants[1:]:
        ratios = [(r["batch"], r["total_us"] / b["total_us"], r["wal"] / b["wal"])
                  for r in results if r["variant"] == name
                  for b in results if b["variant"] == ref and b["batch"] == r["batch"]]
        print("ratio %s/%s: %s (WAL %s)" % (name, ref, " ".join("%d: %.2f" % (b, c) for b, c, _ in ratios),
                                           " ".join("%d: %.2f" % (b, w) for b, _, w in ratios)))
    if os.environ.get("LEVERS_RESULTS"):
        with open(os.environ["LEVERS_RESULTS"], "w") as f:
            json.dump({"n": N, "variants": [{"name": n, "outboxctl": c, "extra_sql": s} for n, c, s in variants],
                       "results": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: ISC
"""bench/levers.py: the database's cost per effect, lever by lever (run by
bench/levers.sh, which starts the server).

Each variant is a database: the shipped schema and functions (migrated by
this tree's outboxctl) with one change, or a prototype schema of its own.
The same backlog is loaded into each; then one connection per variant
claims a batch and records it as accepted (outbox_claim, outbox_complete:
what a worker does for a batch, without the provider), variant after
variant, batch after batch, in alternating order, until every backlog is
empty.  Per call, the backend's own CPU time (/proc/PID/schedstat,
nanoseconds) and the WAL it wrote (pg_current_wal_insert_lsn around the
call) are added to its variant; at the end a VACUUM of the variant's tables
is measured the same way (autovacuum is off for them, so the cleanup each
variant leaves is charged to it).  Interleaving call by call is what makes
a 5-10 % difference visible on a shared machine, where whole runs of the
same build move by 15-40 % (docs/performance.md).

The bounds (no_runs, no_log) are not shippable: they drop a guarantee, and
show what that guarantee costs.
"""
import json
import os
import re
import subprocess
import sys

import psycopg2

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
N = int(os.environ.get("LEVERS_N", "30000"))
BATCH = int(os.environ.get("LEVERS_BATCH", "64"))
OUTBOXCTL = os.environ["LEVERS_OUTBOXCTL"]
PAYLOAD = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                      "body": {"event": "invoice.paid", "invoice": "INV-000123",
                               "amount_cents": 129900, "currency": "EUR",
                               "customer": {"id": "cus_42", "email": "a@example.com"},
                               "note": "bench payload of a typical webhook size"}})
OWNER = "00000000-0000-4000-8000-000000000001"
# Databases are named PREFIX_variant (the suite runs this on its shared server).
PREFIX = os.environ.get("LEVERS_DB_PREFIX", "lever")


def function_source(name):
    """The CREATE OR REPLACE FUNCTION statement of a shipped function."""
    for fn in sorted(os.listdir(os.path.join(ROOT, "sql", "functions"))):
        text = open(os.path.join(ROOT, "sql", "functions", fn)).read()
        start = text.find("CREATE OR REPLACE FUNCTION %s(" % name)
        if start >= 0:
            return text[start:text.index("END $$;", start) + len("END $$;")]
    sys.exit("levers: no function %s in sql/functions" % name)


def rewrite(name, old, new):
    """The shipped function with one passage replaced; fails loudly when the
    passage is gone (the variant no longer measures what it says)."""
    src = function_source(name)
    if old not in src:
        sys.exit("levers: the passage this variant changes is no longer in %s:\n%s" % (name, old))
    return src.replace(old, new)


def no_runs():
    return ["CREATE OR REPLACE FUNCTION outbox_advance_runs(p_failed text[], p_completed text[])"
            " RETURNS void LANGUAGE sql AS $$ SELECT $$"]


def no_log():
    src = function_source("outbox_complete")
    m = re.search(r",\n    logged AS \(.*?DO NOTHING\)\n", src, re.S)
    if not m:
        sys.exit("levers: outbox_complete's attempts insert (logged AS ...) is gone")
    return [src[:m.start()] + "\n" + src[m.end():]]


def generic_plans():
    return ["ALTER FUNCTION outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,"
            " timestamptz, uuid, boolean, integer) RESET plan_cache_mode",
            "ALTER FUNCTION outbox_complete(uuid, text, jsonb) RESET plan_cache_mode",
            "ALTER FUNCTION outbox_advance_runs(text[], text[]) RESET plan_cache_mode"]


def hot_claim():
    schema = open(os.path.join(ROOT, "bench", "levers", "hot_claim.sql")).read()
    return [schema, rewrite("outbox_claim", "         WHERE o.state = 'pending'\n",
                            "         WHERE o.stage = 'open' AND o.state = 'pending'\n")]


# name: (kind, SQL after migrating, claim function, complete function)
VARIANTS = {
    "main": ("shipped", lambda: [], "outbox_claim", "outbox_complete"),
    "no_runs": ("shipped", no_runs, "outbox_claim", "outbox_complete"),
    "no_log": ("shipped", no_log, "outbox_claim", "outbox_complete"),
    "no_runs_no_log": ("shipped", lambda: no_runs() + no_log(), "outbox_claim", "outbox_complete"),
    "generic_plans": ("shipped", generic_plans, "outbox_claim", "outbox_complete"),
    "hot_claim": ("shipped", hot_claim, "outbox_claim", "outbox_complete"),
    "narrow_queue": ("narrow", lambda: [open(os.path.join(ROOT, "bench", "levers",
                                                          "narrow_queue.sql")).read()],
                     "narrow_claim", "narrow_complete"),
}


def connect(db):
    c = psycopg2.connect(host=os.environ["PGHOST"], port=os.environ["PGPORT"],
                         user=os.environ["PGUSER"], dbname=db)
    c.autocommit = True
    return c


def cpu_ns(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0])


class Variant:
    def __init__(self, name):
        self.name = name
        self.kind, sql_fn, self.claim_fn, self.complete_fn = VARIANTS[name]
        admin = connect("postgres")
        db = "%s_%s" % (PREFIX, name)
        admin.cursor().execute("CREATE DATABASE %s" % db)
        admin.close()
        if self.kind == "shipped":
            ci = "host=%s port=%s user=%s dbname=%s" % (os.environ["PGHOST"], os.environ["PGPORT"],
                                                         os.environ["PGUSER"], db)
            for args in (["migrate"], ["kill-switch", "on", "--operator", "levers", "--reason", "levers"]):
                subprocess.run([OUTBOXCTL, "--db", ci] + args, check=True, stdout=subprocess.DEVNULL)
        self.conn = connect(db)
        self.cur = self.conn.cursor()
        for stmt in sql_fn():
            self.cur.execute(stmt)
        self.cur.execute("SELECT pg_backend_pid()")
        self.pid = self.cur.fetchone()[0]
        self.tables = (["effect_outbox"] if self.kind == "shipped" else ["effect_state", "effect_rows"]) + \
            ["effect_attempts", "workflow_runs"]
        self.claim_ns = self.complete_ns = self.vacuum_ns = 0
        self.claim_wal = self.complete_wal = self.vacuum_wal = 0
        self.effects = self.calls = 0
        self.after_at = self.after_id = None

    def load(self):
        cur = self.cur
        for t in self.tables:
            cur.execute("ALTER TABLE %s SET (autovacuum_enabled = false)" % t)
        cur.execute("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
                    " SELECT 't' || g, 'processing', 'h' FROM generate_series(1, %s) g", (N,))
        # Due a microsecond apart, in the order written: the bench's backlog.
        due = "now() - interval '1 hour' + g * interval '1 microsecond'"
        if self.kind == "shipped":
            cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, available_at)"
                        " SELECT 't' || g, 'http', 'http://127.0.0.1:9/x', %s::jsonb, " + due +
                        " FROM generate_series(1, %s) g", (PAYLOAD, N))
        else:
            cur.execute("INSERT INTO effect_rows (idempotency_key, effect_type, target, payload)"
                        " SELECT 't' || g, 'http', 'http://127.0.0.1:9/x', %s::jsonb"
                        " FROM generate_series(1, %s) g", (PAYLOAD, N))
            cur.execute("INSERT INTO effect_state (effect_id, effect_type, available_at)"
                        " SELECT effect_id, effect_type, now() - interval '1 hour'"
                        " + row_number() OVER (ORDER BY idempotency_key) * interval '1 microsecond'"
                        " FROM effect_rows")
        cur.execute("VACUUM ANALYZE")
        cur.execute("CHECKPOINT")

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
        # From the position after the last row claimed, as a worker does
        # (from the head, each claim would step over every row claimed
        # before it that VACUUM has not yet taken out of the due index).
        ns, wal, rows = self.measured(
            "SELECT effect_id, attempts, available_at FROM %s(%%s, 'levers', %%s, 30, '{http}', true,"
            " '{http}', gen_random_uuid(), %%s, %%s)" % self.claim_fn,
            (OWNER, BATCH, self.after_at, self.after_id))
        if not rows:
            return False
        self.after_id, self.after_at = rows[-1][0], rows[-1][2]
        self.claim_ns += ns
        self.claim_wal += wal
        results = json.dumps([{"effect_id": r[0], "attempt": r[1] + 1,
                               "started_at": "2026-12-01T08:00:00Z", "outcome": "accepted",
                               "next_state": "completed", "retry_delay_ms": 0, "status": 200,
                               "provider_id": "x"} for r in rows])
        ns, wal, done = self.measured("SELECT count(*) FILTER (WHERE applied) FROM %s(%%s, 'levers', %%s::jsonb)"
                                      % self.complete_fn, (OWNER, results))
        if done[0][0] != len(rows):
            sys.exit("levers: %s recorded %d of %d outcomes" % (self.name, done[0][0], len(rows)))
        self.complete_ns += ns
        self.complete_wal += wal
        self.effects += len(rows)
        self.calls += 1
        return True

    def vacuum(self):
        for t in self.tables:
            ns, wal, _ = self.measured("VACUUM %s" % t)
            self.vacuum_ns += ns
            self.vacuum_wal += wal

    def check(self):
        table = "effect_outbox" if self.kind == "shipped" else "effect_state"
        self.cur.execute("SELECT count(*) FROM %s WHERE state = 'completed'" % table)
        completed = self.cur.fetchone()[0]
        self.cur.execute("SELECT count(*) FROM workflow_runs WHERE state = 'completed'")
        runs = self.cur.fetchone()[0]
        self.cur.execute("SELECT count(*) FROM effect_attempts")
        attempts = self.cur.fetchone()[0]
        return completed, runs, attempts


def main():
    names = os.environ.get("LEVERS_VARIANTS", " ".join(VARIANTS)).split()
    for n in names:
        if n not in VARIANTS:
            sys.exit("levers: unknown variant %r (known: %s)" % (n, ", ".join(VARIANTS)))
    print("levers: %d effects per variant, batches of %d, variants: %s" % (N, BATCH, ", ".join(names)),
          flush=True)
    variants = [Variant(n) for n in names]
    for v in variants:
        v.load()
    live, rnd = list(variants), 0
    while live:
        order = live if rnd % 2 == 0 else list(reversed(live))
        done = [v for v in order if not v.batch()]
        live = [v for v in live if v not in done]
        rnd += 1
    for v in variants:
        v.vacuum()
    base = None
    for v in variants:
        if v.name == "main" and v.effects:
            base = (v.claim_ns + v.complete_ns + v.vacuum_ns) / v.effects / 1000.0
    print("| variant | claim µs | complete µs | vacuum µs | **total µs per effect** | vs main "
          "| WAL B per effect | completed / runs / attempts rows |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        if v.effects != N:
            sys.exit("levers: %s delivered %d of %d" % (v.name, v.effects, N))
        per = lambda x: x / v.effects / 1000.0
        total = per(v.claim_ns + v.complete_ns + v.vacuum_ns)
        wal = (v.claim_wal + v.complete_wal + v.vacuum_wal) / v.effects
        print("| %s | %.1f | %.1f | %.1f | **%.1f** | %s | %.0f | %s |" % (
            v.name, per(v.claim_ns), per(v.complete_ns), per(v.vacuum_ns), total,
            "%.2f" % (total / base) if base else "-", wal, " / ".join(str(x) for x in v.check())))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

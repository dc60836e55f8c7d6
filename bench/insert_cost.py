#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/insert_cost.py: what the producer's plain insert costs PostgreSQL
per effect (run by bench/insert_cost.sh, which starts the server).

    INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) VALUES (...)

Two ways a producer commits it, in alternating rounds on one connection:
  single  one row per statement, each its own transaction (autocommit), the
          values as literals (what a producer without prepared statements
          sends; n8n's node does the same)
  bulk    INSERT_BULK rows per statement from a VALUES list, one transaction each
The runs the effects belong to exist before a round starts (their insert is
the producer's own business, not measured).  Per round: the backend's own
CPU (/proc/PID/schedstat, ns: parse, plan, execute, the generated hashes,
the indexes, the commit) and the cluster's (utime + stime of every process,
bench.py's way), and WAL bytes, per effect.  Each round starts on an empty
outbox, vacuumed and analyzed.

Environment: INSERT_N (effects per round, 20000), INSERT_ROUNDS (rounds per
way, 3), INSERT_BULK (rows per bulk statement, 500), INSERT_DB (bench),
INSERT_PGDATA (the server's data folder, for the cluster's CPU; optional),
PGHOST/PGPORT/PGUSER.
"""
import json
import os
import statistics
import sys
import time

import psycopg2

N = int(os.environ.get("INSERT_N", "20000"))
ROUNDS = int(os.environ.get("INSERT_ROUNDS", "3"))
BULK = int(os.environ.get("INSERT_BULK", "500"))
DB = os.environ.get("INSERT_DB", "bench")
PGDATA = os.environ.get("INSERT_PGDATA", "")
PAYLOAD = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                      "body": {"event": "invoice.paid", "invoice": "INV-000123",
                               "amount_cents": 129900, "currency": "EUR",
                               "customer": {"id": "cus_42", "email": "a@example.com"},
                               "note": "bench payload of a typical webhook size"}})
TARGET = "http://127.0.0.1:9/hook"
CLK = os.sysconf("SC_CLK_TCK")


def connect():
    c = psycopg2.connect(host=os.environ["PGHOST"], port=os.environ["PGPORT"],
                         user=os.environ.get("PGUSER", "postgres"), dbname=DB)
    c.autocommit = True
    return c


def schedstat_ns(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0])


def cluster_cpu():
    """utime + stime of the postmaster's children, seconds (0 without INSERT_PGDATA)."""
    if not PGDATA:
        return 0.0
    with open(os.path.join(PGDATA, "postmaster.pid")) as f:
        pm = int(f.readline())
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pm or int(d) == pm:
            total += (int(fields[11]) + int(fields[12])) / CLK
    return total


def prepare(cur, prefix):
    cur.execute("TRUNCATE effect_outbox, effect_attempts, workflow_runs, approvals, run_claims CASCADE")
    cur.execute("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
                " SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (prefix, N))
    cur.execute("VACUUM ANALYZE effect_outbox")
    cur.execute("VACUUM ANALYZE workflow_runs")
    cur.execute("CHECKPOINT")


def insert_single(cur, prefix):
    for i in range(1, N + 1):
        cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload)"
                    " VALUES (%s, 'http', %s, %s)", ("%s%d" % (prefix, i), TARGET, PAYLOAD))


def insert_bulk(cur, prefix):
    for start in range(1, N + 1, BULK):
        keys = range(start, min(N, start + BULK - 1) + 1)
        values = ",".join(cur.mogrify("(%s, 'http', %s, %s)", ("%s%d" % (prefix, i), TARGET, PAYLOAD)).decode()
                          for i in keys)
        cur.execute("BEGIN")
        cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) VALUES " + values)
        cur.execute("COMMIT")


WAYS = (("single", insert_single), ("bulk", insert_bulk))


def main():
    conn = connect()
    cur = conn.cursor()
    pid = conn.get_backend_pid()
    res = {name: [] for name, _ in WAYS}
    for r in range(1, ROUNDS + 1):
        for name, fn in WAYS:
            prefix = "%s%d-" % (name[0], r)
            prepare(cur, prefix)
            cur.execute("SELECT pg_current_wal_insert_lsn()::text")
            lsn = cur.fetchone()[0]
            b0, c0, t0 = schedstat_ns(pid), cluster_cpu(), time.time()
            fn(cur, prefix)
            b1, c1, t1 = schedstat_ns(pid), cluster_cpu(), time.time()
            cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn),"
                        " (SELECT count(*) FROM effect_outbox WHERE state = 'pending')", (lsn,))
            wal, rows = cur.fetchone()
            if rows != N:
                sys.exit("insert_cost: %s round %d: %d rows, want %d" % (name, r, rows, N))
            row = {"backend_us": (b1 - b0) / 1000.0 / N, "cluster_us": (c1 - c0) * 1e6 / N,
                   "wal": float(wal) / N, "per_s": N / (t1 - t0)}
            res[name].append(row)
            print("%s round %d: backend %.1f µs, cluster %.1f µs, WAL %.0f B per effect; %.0f effects/s" % (
                name, r, row["backend_us"], row["cluster_us"], row["wal"], row["per_s"]), flush=True)
    print()
    print("| insert | effects | backend CPU µs/effect (median; min-max) | cluster CPU µs/effect (median)"
          " | WAL B/effect |")
    print("|---|---|---|---|---|")
    for name, _ in WAYS:
        rows = res[name]
        b = [x["backend_us"] for x in rows]
        print("| %s | %d x %d | %.1f (%.1f-%.1f) | %.1f | %.0f |" % (
            name if name == "single" else "bulk, %d rows per statement" % BULK, ROUNDS, N,
            statistics.median(b), min(b), max(b), statistics.median(x["cluster_us"] for x in rows),
            statistics.median(x["wal"] for x in rows)))
    with open("/proc/loadavg") as f:
        print("load average: %s" % " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: ISC
"""bench/levers.py (make bench-levers) measures each lever of the database's cost on
variants of the shipped SQL, made by rewriting passages of the functions in
sql/functions.  This checks, at a small scale, that every variant still
applies to today's functions and delivers the whole backlog, and that the
bounds drop exactly what they say (no_runs: no run advanced; no_log: no
attempts row) and the others drop nothing; so a figure in
docs/performance.md cannot silently come from a variant that no longer
does what its name says.
"""
import os
import re
import subprocess
import uuid

import psycopg2

from outbox_test import BUILD_DIR, admin_dsn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
N = 256


def test_every_lever_variant_applies_and_drops_only_what_it_names():
    prefix = "lev_%s" % uuid.uuid4().hex[:8]
    env = dict(os.environ, LEVERS_N=str(N), LEVERS_BATCH="64", LEVERS_DB_PREFIX=prefix,
               LEVERS_OUTBOXCTL=os.path.join(BUILD_DIR, "outboxctl"))
    try:
        out = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "bench", "levers.py")],
                             env=env, capture_output=True, text=True, timeout=300)
    finally:
        conn = psycopg2.connect(admin_dsn())
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (prefix + "\\_%",))
            for (db,) in cur.fetchall():
                cur.execute("DROP DATABASE %s WITH (FORCE)" % db)
        conn.close()
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (\w+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \*\*[\d.]+\*\* \| [\d.-]+ \| \d+ "
                     r"\| (\d+) / (\d+) / (\d+) \|$", line)
        if m:
            rows[m.group(1)] = tuple(int(x) for x in m.groups()[1:])
    full = (N, N, N)
    assert rows == {"main": full, "no_runs": (N, 0, N), "no_log": (N, N, 0),
                    "no_runs_no_log": (N, 0, 0), "generic_plans": full, "hot_claim": full,
                    "narrow_queue": full}, out.stdout

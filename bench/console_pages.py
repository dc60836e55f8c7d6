# SPDX-License-Identifier: ISC
"""The console's pages over HTTP on a real history (bench/console_pages.sh
starts the server): CONSOLE_BENCH_HISTORY finished effects (default
1,000,000) created over 60 days, each with its attempt and finishing row,
one in 50 failed, spread over 1,000 runs; a fifth as many open ones of the
last day (one in 1,000 unknown), written without triggers as
tests/sql/test_plans_reads_at_scale.py writes them.  Then outbox-console
(its own login, a member of outbox_viewer) serves each page three times;
the best time of each is printed, in ms."""
import http.client
import os
import socket
import subprocess
import time

import psycopg2

HISTORY = int(os.environ.get("CONSOLE_BENCH_HISTORY", "1000000"))
LIVE = HISTORY // 5
BUILD, WORK = os.environ["BUILD_DIR"], os.environ["WORK"]
DSN = f"host={os.environ['PGHOST']} port={os.environ['PGPORT']} user=postgres dbname=outbox_bench"


def run(cur, sql, args=None):
    cur.execute(sql, args)


def load(cur):
    run(cur, "SELECT outbox_history_partitions(now() - interval '3 months', now() + interval '1 month')")
    run(cur, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
             "SELECT 'big-' || g, 'processing', 'h' FROM generate_series(1, 1000) g")
    run(cur, "SET session_replication_role = replica")
    run(cur, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, created_at, "
             "available_at) SELECT 'big-' || (1 + g %% 1000), CASE WHEN g %% 3 = 0 THEN 'email' "
             "ELSE 'http' END, 'http://h' || (g %% 7) || '.example/' || g, '{\"n\": 1}', t, t "
             "FROM (SELECT g, now() - interval '60 days' + (g * (interval '60 days' / %s)) AS t "
             "FROM generate_series(1, %s) g) s", (HISTORY, HISTORY))
    run(cur, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
             "started_at, ended_at, outcome_class, provider_status, provider_id, state, "
             "last_provider_id, retry_base) SELECT effect_id, created_at, 1, gen_random_uuid(), "
             "'w', created_at, created_at + interval '1 second', 'accepted', 200, 'p', "
             "CASE WHEN right(target, 2) = '50' THEN 'failed' ELSE 'completed' END, 'p', 0 "
             "FROM effect_outbox")
    run(cur, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, created_at, "
             "available_at) SELECT 'big-' || (1 + g %% 1000), 'http', 'http://live.example/' || g, "
             "'{}', now() - interval '1 day' + g * (interval '1 day' / %s), now() "
             "FROM generate_series(1, %s) g", (LIVE, LIVE))
    run(cur, "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at, state) "
             "SELECT b.effect_id, b.effect_type, b.created_at, CASE WHEN right(b.target, 3) = "
             "'000' THEN 'infinity' ELSE b.available_at END, CASE WHEN right(b.target, 3) = '000' "
             "THEN 'unknown' ELSE 'pending' END FROM effect_outbox b "
             "WHERE b.target LIKE 'http://live.example/%%'")
    run(cur, "RESET session_replication_role")
    run(cur, "VACUUM ANALYZE workflow_runs, effect_outbox, effect_live, effect_history")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t = time.monotonic()
    c.request("GET", path)
    r = c.getresponse()
    r.read()
    ms = (time.monotonic() - t) * 1000
    c.close()
    assert r.status == 200, (path, r.status)
    return ms


def main():
    conn = psycopg2.connect(DSN)
    conn.autocommit = True
    cur = conn.cursor()
    t = time.monotonic()
    load(cur)
    print(f"loaded {HISTORY} finished and {LIVE} open effects in {time.monotonic() - t:.0f} s; "
          f"load average {os.getloadavg()[0]:.2f}")
    run(cur, "CREATE ROLE bench_console LOGIN NOINHERIT IN ROLE outbox_viewer")
    cur.execute("SELECT effect_id::text FROM effect_outbox ORDER BY created_at OFFSET %s LIMIT 1",
                (HISTORY // 2,))
    some = cur.fetchone()[0]
    port = free_port()
    cfg = os.path.join(WORK, "console.ini")
    with open(cfg, "w") as f:
        f.write(f"[database]\nconninfo = {DSN.replace('user=postgres', 'user=bench_console')}\n"
                f"[console]\nlisten = 127.0.0.1:{port}\nrefresh_seconds = 0\n")
    os.chmod(cfg, 0o600)
    p = subprocess.Popen([os.path.join(BUILD, "outbox-console"), "--config", cfg],
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                get(port, "/static/console.css")
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        pages = ["/", "/effects", "/effects?state=failed", "/effects?host=h3.example",
                 "/effects?host=none.example", "/effects?error=timeout",
                 "/effects?run=big-7", f"/effect?id={some}", "/unknown", "/approvals", "/runs",
                 "/runs?state=failed_terminal", "/runs?key=big-7", "/audit", "/controls"]
        print("page\tms (best of 3)")
        for path in pages:
            print(f"{path}\t{min(get(port, path) for _ in range(3)):.1f}")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        p.terminate()
        p.wait(20)


main()

#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/scaling.py: the scaling curve, started by bench/scaling.sh.

For each configuration, the bench's throughput run (bench.py: N pending
effects in a fresh table, K workers with the default config draining them
to nginx): effects/s, and CPU per effect of PostgreSQL (every process of
the cluster), of the workers, of nginx and of PgBouncer, WAL per effect,
and how many of the machine's cores PostgreSQL kept busy.

Configurations: K workers connected directly (SCALING_WORKERS, "1 2 4 8"),
then K workers through PgBouncer in transaction mode with `poll_only =
true` (SCALING_BOUNCER, "2 4 8"), with default_pool_size = pool-per-worker
x K for each of SCALING_POOL_PER_WORKER ("2 1").  SCALING_N effects per
run (100000).  The table goes to stdout and, as JSON, to SCALING_RESULTS
if set.
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
os.environ.setdefault("BENCH_N", os.environ.get("SCALING_N", "100000"))

import bench  # noqa: E402  (reads BENCH_WORK, BENCH_N at import)
from ha import PgBouncer  # noqa: E402

WORKERS = [int(x) for x in os.environ.get("SCALING_WORKERS", "1 2 4 8").split()]
BOUNCER = [int(x) for x in os.environ.get("SCALING_BOUNCER", "2 4 8").split()]
POOL_PER_WORKER = [int(x) for x in os.environ.get("SCALING_POOL_PER_WORKER", "2 1").split()]


def uptime():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def one_run(sink, k, label, bouncer=None):
    bench.reset()
    bench.load(bench.N, sink.url("ok"))
    bench.settle()
    if bouncer:
        os.environ["BENCH_WORKER_CONNINFO"] = bouncer.via(bench.conninfo())
        os.environ["BENCH_DATABASE_CONF"] = "poll_only = true"
        bcpu = bench.CpuTracker(lambda: [bouncer.proc.pid])
    else:
        os.environ.pop("BENCH_WORKER_CONNINFO", None)
        os.environ.pop("BENCH_DATABASE_CONF", None)
    load = uptime()
    r = bench.throughput(k, label)
    r["bouncer_cpu_per_1k"] = bcpu.total() / r["effects"] * 1000 if bouncer and r["effects"] else 0.0
    r["label"], r["load"] = label, load
    # What did not end completed, and why (a loaded machine times sends out).
    # Open effects are in the live queue; finished ones in their finishing
    # history row.
    r["not_completed"] = bench.q(
        "SELECT state, last_error_class, left(last_error, 120), count(*)"
        " FROM (SELECT state, last_error_class, last_error FROM effect_live"
        "       UNION ALL SELECT state, last_error_class, last_error FROM effect_history"
        "        WHERE state IS NOT NULL AND state <> 'completed') x"
        " GROUP BY 1, 2, 3 ORDER BY 4 DESC")
    if r["not_completed"]:
        bench.log("  %s: not completed: %s" % (label, r["not_completed"]))
    # PostgreSQL CPU seconds per wall second of the run: cores kept busy.
    r["pg_cores"] = r["pg_cpu_per_1k"] / 1000 * r["rate"]
    return r


def main():
    bench.DB = bench.connect()
    bench.POLL = bench.connect()
    bench.POLL.cursor().execute("SET enable_seqscan = off")
    bench.log("scaling: N=%d, workers %s, through PgBouncer %s (pool per worker %s); %s; load %s" % (
        bench.N, WORKERS, BOUNCER, POOL_PER_WORKER, bench.machine(), uptime()))
    sink = bench.Nginx()
    bench.SINK_PID = sink.proc.pid
    runs = []
    try:
        for k in WORKERS:
            runs.append(one_run(sink, k, "direct-%d" % k))
        for per in POOL_PER_WORKER:
            for k in BOUNCER:
                b = PgBouncer((os.environ["PGHOST"], os.environ["PGPORT"]),
                              [os.environ.get("PGUSER", "postgres")], pool_size=per * k).start()
                bench.PROCS.append(b.proc)
                try:
                    runs.append(one_run(sink, k, "pgbouncer-%d-pool%d" % (k, per * k), b))
                finally:
                    b.stop()
    finally:
        sink.stop()
    print()
    print("| run | effects/s | PostgreSQL CPU ms/effect | cores PostgreSQL kept busy | workers ms/effect "
          "| nginx ms/effect | PgBouncer ms/effect | WAL bytes/effect | load before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print("| %s | %.0f | %.3f | %.2f | %.3f | %.3f | %.3f | %.0f | %s |" % (
            r["label"], r["rate"], r["pg_cpu_per_1k"], r["pg_cores"], r["worker_cpu_per_1k"],
            r["sink_cpu_per_1k"], r["bouncer_cpu_per_1k"], r["wal_per_effect"], r["load"]))
    print("load average at the end: %s" % uptime())
    out = os.environ.get("SCALING_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(runs, f, indent=1, default=str)


if __name__ == "__main__":
    t0 = time.time()
    main()
    bench.log("scaling: done in %.0f s" % (time.time() - t0))

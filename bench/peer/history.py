#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/peer/history.py: `make bench-history`, PostgreSQL CPU per effect as
the history grows and while a reader holds its snapshot (bench/README.md,
"History and a held snapshot").

The dispatcher side of bench-peer (two workers, default config, the same
HTTP work to the same nginx, one bulk INSERT per round, every table
analyzed in its transaction), with the finished effects of every earlier
round kept.  Cases, in order:
  empty       no finished effect before the rounds
  held        the same, while a READ ONLY REPEATABLE READ transaction (as
              pg_dump takes) holds the snapshot it took before the first
              round, for HISTORY_HOLD_SECONDS (600) of rounds at least
  <size>      HISTORY_SIZES (default "1000000 10000000") finished effects
              in the history (a body, an attempt row and a finishing row
              each, written in one statement per table), then the rounds
Each case runs HISTORY_ROUNDS (3) rounds of HISTORY_N (20000) items and
reports the mean PostgreSQL CPU per effect (every process of the
cluster, as bench-peer counts it) against the empty case's.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer as P  # noqa: E402
B = P.B

N = int(os.environ.get("HISTORY_N") or 20000)
ROUNDS = int(os.environ.get("HISTORY_ROUNDS") or 3)
HOLD = float(os.environ.get("HISTORY_HOLD_SECONDS") or 600)
SIZES = [int(x) for x in (os.environ.get("HISTORY_SIZES") or "1000000 10000000").split()]


class Side(P.DispatcherSide):
    """The dispatcher side, the finished effects kept between rounds."""

    def reset(self):
        pass

    def check_db(self, prefix, n):
        done, open_ = B.q(
            "SELECT (SELECT count(*) FROM effect_outbox b JOIN effect_history h"
            "         ON h.created_at = b.created_at AND h.effect_id = b.effect_id"
            "        WHERE h.state = 'completed' AND b.idempotency_key LIKE %s),"
            " (SELECT count(*) FROM effect_live)", (prefix + "%",))[0]
        if (done, open_) != (n, 0):
            P.fail("dispatcher %s: %d of %d effects completed, %d still open" % (prefix, done, n, open_))


def fill(side, total, have):
    """Finished effects up to total: bodies, attempt rows and finishing rows."""
    n = total - have
    if n <= 0:
        return have
    t0 = time.time()
    with side.db.cursor() as cur:
        cur.execute("SELECT outbox_history_partitions(now() - interval '1 month', now() + interval '3 months')")
        cur.execute("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
                    " SELECT 'hist-' || g, 'completed', 'h' FROM generate_series(%s, %s) g"
                    " ON CONFLICT DO NOTHING", (have // 1000 + 1, total // 1000 + 1))
        cur.execute("SET session_replication_role = replica")
        cur.execute("CREATE TEMP TABLE IF NOT EXISTS fill (effect_id uuid, created_at timestamptz)")
        cur.execute("TRUNCATE fill")
        cur.execute("WITH b AS (INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload,"
                    " created_at, available_at)"
                    " SELECT 'hist-' || (g / 1000 + 1), 'http', 'http://127.0.0.1:9/h' || g, %s::jsonb,"
                    " now() - interval '20 days' + g * interval '100 microseconds',"
                    " now() - interval '20 days' + g * interval '100 microseconds'"
                    " FROM generate_series(%s, %s) g RETURNING effect_id, created_at)"
                    " INSERT INTO fill SELECT * FROM b", (B.PAYLOAD, have + 1, total))
        cur.execute("INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker,"
                    " started_at, ended_at, outcome_class, provider_status, provider_id)"
                    " SELECT effect_id, created_at, 1, gen_random_uuid(), 'w', created_at, created_at,"
                    " 'accepted', 200, 'p' FROM fill")
        cur.execute("INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at,"
                    " ended_at, state, last_provider_id, provider_status, retry_base)"
                    " SELECT effect_id, created_at, 1, 'w', created_at, created_at, 'completed', 'p', 200, 0"
                    " FROM fill")
        cur.execute("RESET session_replication_role")
    P.log("history: %d finished effects written in %.0f s" % (n, time.time() - t0))
    return total


def rounds_of(side, sink, case, until=0.0):
    rs = []
    while len(rs) < ROUNDS or time.time() < until:
        i = len(rs) + 1
        r = P.round_of(side, sink, "history-%s-%d" % (case, i), "h%s%d-" % (case[:3], i), N, "all")
        r["load"] = open("/proc/loadavg").read().split()[:3]
        rs.append(r)
    return rs


def main():
    sink = P.Sink()
    out = []
    try:
        side = Side(sink)
        P.one(side.db, "TRUNCATE effect_outbox, effect_live, effect_history, effect_calls,"
                       " workflow_runs, approvals, run_claims CASCADE")
        out.append(("empty", 0, rounds_of(side, sink, "empty")))
        reader = P.connect("bench")
        with reader.cursor() as cur:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur.execute("SELECT count(*) FROM effect_outbox")     # the snapshot, taken now
        t_hold = time.time()
        rs = rounds_of(side, sink, "held", t_hold + HOLD)
        held_for = time.time() - t_hold
        reader.cursor().execute("COMMIT")
        reader.close()
        out.append(("held %.0f s" % held_for, 0, rs))
        have = 0
        for size in SIZES:
            have = fill(side, size, have)
            P.settle(side)
            out.append(("history", have, rounds_of(side, sink, "h%d" % size)))
        if os.environ.get("HISTORY_STATEMENTS"):
            # With pg_stat_statements preloaded (PG_EXTRA_OPTS): where the time went.
            P.one(side.db, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            for row in B.q("SELECT round(total_exec_time)::bigint, calls, rows,"
                           " left(regexp_replace(query, '\\s+', ' ', 'g'), 110)"
                           " FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 15"):
                print("statement: %s ms, %s calls, %s rows: %s" % row)
    finally:
        sink.stop()
    base = sum(r["pg_cpu_ms"] for r in out[0][2]) / len(out[0][2])
    print()
    print("== bench-history: PostgreSQL CPU per effect, dispatcher (%d workers, default config),"
          " %d items per round" % (P.DISPATCHER_WORKERS, N))
    print()
    print("| case | finished effects before | rounds | effects/s (mean) | PG CPU ms/effect (mean)"
          " | vs empty | load avg (last round) |")
    print("|---|---|---|---|---|---|---|")
    for case, have, rs in out:
        cpu = sum(r["pg_cpu_ms"] for r in rs) / len(rs)
        print("| %s | %d | %d | %.0f | %.4f | %.2f | %s |" % (
            case, have, len(rs), sum(r["rate"] for r in rs) / len(rs), cpu, cpu / base,
            " ".join(rs[-1]["load"])))


if __name__ == "__main__":
    main()

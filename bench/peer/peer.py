#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/peer/peer.py: the rounds of `make bench-peer` (bench/peer/peer.sh
starts the server and calls this once per fsync setting, then once more
with PEER_PHASE=summary for the table).

A round is one side draining N items of the same HTTP work: a POST of the
same ~190-byte JSON body with the same headers and an Idempotency-Key to
the same nginx on loopback, which answers 200 {"id":"x"} from memory and
logs `$msec key content-length status` per request.
  dispatcher  two outbox-dispatcher workers with the default config (the
              way bench/bench.py starts them), the items one bulk INSERT
              into effect_outbox (the producer's columns only) after one
              of their runs into workflow_runs, in one transaction.
  graphile    two graphile-worker processes x 24 concurrent jobs
              (bench/peer/graphile_worker.js), the items one call of
              graphile_worker.add_jobs.
The workers are started and idle (listening) before the insert, which
ends with an ANALYZE of some of the side's tables in its own transaction (see
CASES below); the
clock and the PostgreSQL CPU count start when its COMMIT returns, and stop
when the sink has logged N requests and the side's queue is empty in the
database (its completions committed).  PostgreSQL CPU is the time on a
CPU of every process of the cluster (bench.py's CpuTracker read from
/proc/PID/schedstat: backends, walwriter, checkpointer, autovacuum, for
both sides alike).  Sides alternate within a
setting: dispatcher, graphile, dispatcher, graphile...

Every round checks that each of its N keys reached the sink exactly once
with a 200 and that its side's database agrees (dispatcher: N effects
completed, N attempts rows; graphile: no job left), and exits non-zero
otherwise.
"""
import hashlib
import json
import os
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench as B  # noqa: E402  (the sinks, workers and CPU accounting of make bench)

QUICK = os.environ.get("QUICK", "") not in ("", "0")
N = int(os.environ.get("PEER_N") or (2000 if QUICK else 100000))
ROUNDS = int(os.environ.get("PEER_ROUNDS") or (1 if QUICK else 2))
WARMUP = int(os.environ.get("PEER_WARMUP") or (0 if QUICK else 5000))
GRAPHILE_PROCS = int(os.environ.get("PEER_GRAPHILE_PROCS") or 2)
DISPATCHER_WORKERS = int(os.environ.get("PEER_DISPATCHER_WORKERS") or 2)
# What the statistics say when the workers meet the backlog.  Each round
# starts from an emptied, vacuumed table, whose statistics say empty; the
# insert's transaction then ANALYZEs (it samples its own new rows):
#   all       every table the side's claim reads (as autovacuum would once
#             it has seen every table)
#   producer  only the producer's table (effect_outbox; graphile its jobs
#             table): autovacuum reached it first, the worker's table
#             still says empty
#   none      nothing: every plan is made from the emptied tables
#   scoped    as all, with one rate limit set on a host the run does not
#             touch (the dispatcher's claims while a scope is set)
# PEER_CASES lists the cases to run (default: all four, interleaved round
# by round).  PEER_ANALYZE=0 is PEER_CASES=none, PEER_ANALYZE=1 is all.
CASES = (os.environ.get("PEER_CASES")
         or {"0": "none", "1": "all"}.get(os.environ.get("PEER_ANALYZE", ""), "")
         or "all producer none scoped").split()
for _c in CASES:
    if _c not in ("all", "producer", "none", "scoped"):
        print("bench-peer: PEER_CASES takes all, producer, none and scoped, not %s" % _c,
              file=sys.stderr)
        sys.exit(1)
ANALYZE_TABLES = {
    "dispatcher": {"all": "workflow_runs, effect_outbox, effect_live, effect_calls",
                   "producer": "effect_outbox", "none": None},
    "graphile": {"all": "graphile_worker._private_jobs, graphile_worker._private_tasks,"
                        " graphile_worker._private_job_queues",
                 "producer": "graphile_worker._private_jobs", "none": None},
}
ANALYZE_TABLES["dispatcher"]["scoped"] = ANALYZE_TABLES["dispatcher"]["all"]
ANALYZE_TABLES["graphile"]["scoped"] = ANALYZE_TABLES["graphile"]["all"]
SCOPE_HOST = "unrelated.invalid"     # the scoped case's limit: a host no item goes to
STALL_SECONDS = 120          # no request at the sink for this long: the round failed
RESULTS = os.path.join(B.WORK, "peer-results.json")

PAYLOAD = json.loads(B.PAYLOAD)          # {"method", "headers", "body"}: make bench's webhook


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def fail(msg):
    print("bench-peer: FAILED: %s" % msg, file=sys.stderr, flush=True)
    sys.exit(1)


def graphile_dsn():
    return "postgres://%s@%s:%s/graphile" % (os.environ.get("PGUSER", "postgres"),
                                              os.environ["PGHOST"], os.environ["PGPORT"])


def connect(db):
    c = B.psycopg2.connect(B.conninfo(db))
    c.autocommit = True
    c.cursor().execute("SET max_parallel_workers_per_gather = 0")
    return c


def one(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchone()[0] if cur.description else None


class Sink:
    """nginx on loopback, one access-log line per request."""

    def __init__(self):
        self.dir = os.path.join(B.WORK, "peer-nginx")
        os.makedirs(self.dir, exist_ok=True)
        self.port = B.free_port()
        self.log_path = os.path.join(self.dir, "requests.log")
        open(self.log_path, "w").close()
        conf = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    log_format peer '$msec $http_idempotency_key $content_length $status';
    access_log {log} peer;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    default_type application/json;
    server {{
        listen 127.0.0.1:{p} backlog=4096;
        location /peer {{ return 200 '{{"id":"x"}}'; }}
    }}
}}
""".format(d=self.dir, p=self.port, log=self.log_path)
        with open(os.path.join(self.dir, "nginx.conf"), "w") as f:
            f.write(conf)
        self.proc = subprocess.Popen(["nginx", "-p", self.dir, "-c", "nginx.conf", "-e",
                                      os.path.join(self.dir, "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        B.PROCS.append(self.proc)
        B.wait_port(self.port, self.proc, "nginx")
        self.offset = 0

    def url(self):
        return "http://127.0.0.1:%d/peer" % self.port

    def mark(self):
        self.offset = os.path.getsize(self.log_path)
        self.read_to, self.lines = self.offset, 0

    def lines_since_mark(self):
        """Whole lines logged since mark() (nginx writes each line in one write())."""
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        return data[:data.rfind(b"\n") + 1].decode().splitlines()

    def count_since_mark(self):
        """Lines logged since mark(), read incrementally."""
        with open(self.log_path, "rb") as f:
            f.seek(self.read_to)
            data = f.read()
        self.read_to += len(data)
        self.lines += data.count(b"\n")
        return self.lines

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def check_sink(sink, prefix, want):
    """Every key of want (the Idempotency-Key values of the round's items)
    exactly once, each answered 200; returns the body length seen (one
    value for all), the time of the last request and their count."""
    seen = {}
    lengths, last = set(), 0.0
    for line in sink.lines_since_mark():
        msec, key, clen, status = line.split(" ")
        if status != "200":
            fail("%s answered %s" % (key, status))
        seen[key] = seen.get(key, 0) + 1
        lengths.add(clen)
        last = max(last, float(msec))
    dup = sorted(k for k, c in seen.items() if c > 1)
    missing = want - set(seen)
    extra = set(seen) - want
    if dup or missing or extra:
        fail("%s: not exactly once at the sink: %d keys twice or more (e.g. %s), %d missing (e.g. %s),"
             " %d unexpected" % (prefix, len(dup), dup[:3], len(missing), sorted(missing)[:3], len(extra)))
    if len(lengths) != 1:
        fail("%s: bodies of different lengths at the sink: %s" % (prefix, sorted(lengths)))
    return int(lengths.pop()), last, sum(seen.values())


# ---- the two sides ---------------------------------------------------------

class DispatcherSide:
    name = "dispatcher"

    def __init__(self, sink):
        self.db = connect("bench")
        self.poll = connect("bench")
        self.poll.cursor().execute("SET enable_seqscan = off")
        B.DB = self.db            # bench.py's helpers (wait_listening) use it
        self.sink = sink
        self.procs = []

    def scope(self, on):
        """The scoped case's limit, set or cleared with outboxctl."""
        args = ["limit", "set", "--host", SCOPE_HOST, "--rate", "100/s"] if on else \
               ["limit", "clear", "--host", SCOPE_HOST]
        r = subprocess.run([os.path.join(B.BUILD, "outboxctl"), "--db", B.conninfo("bench")] + args
                           + ["--operator", "bench", "--reason", "bench-peer scoped case"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0 and on:
            fail("outboxctl %s: %s" % (" ".join(args), r.stdout))

    def reset(self):
        one(self.db, "TRUNCATE effect_outbox, effect_live, effect_history, effect_calls, workflow_runs,"
                     " approvals, run_claims CASCADE")

    def start(self, label):
        self.workers = [B.Worker("%s-w%d" % (label, i + 1)) for i in range(DISPATCHER_WORKERS)]
        # Until every worker's session sits idle in LISTEN (bench.py's
        # wait_listening would count this side's polling session too).
        end = time.time() + 30
        while B.q1("SELECT count(*) FROM pg_stat_activity WHERE datname = 'bench' AND state = 'idle'"
                   " AND backend_type = 'client backend' AND pid <> ALL (%s)",
                   ([self.db.get_backend_pid(), self.poll.get_backend_pid()],)) < DISPATCHER_WORKERS:
            if time.time() > end:
                fail("the dispatcher workers did not reach LISTEN in 30 s")
            self.alive()
            time.sleep(0.05)
        time.sleep(0.3)
        for w in self.workers:
            w.sample()

    def insert(self, prefix, n):
        """One bulk INSERT of the effects, the producer's columns only, after
        the one of their runs (an effect's idempotency_key references
        workflow_runs: a producer records the run it acts for), in one
        transaction; returns when its COMMIT has."""
        with self.db.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
                        " SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (prefix, n))
            cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload)"
                        " SELECT %s || g, 'http', %s, %s::jsonb FROM generate_series(1, %s) g",
                        (prefix, self.sink.url(), B.PAYLOAD, n))
            if ANALYZE_TABLES["dispatcher"][self.case]:
                cur.execute("ANALYZE " + ANALYZE_TABLES["dispatcher"][self.case])
            cur.execute("COMMIT")

    def drained(self):
        with self.poll.cursor() as cur:
            # Pending and sending rows are the live queue's finite due
            # times (an `unknown` one is due at 'infinity'): one index probe.
            cur.execute("SELECT NOT EXISTS (SELECT 1 FROM effect_live WHERE available_at < 'infinity')")
            return cur.fetchone()[0]

    def alive(self):
        for w in self.workers:
            w.sample()        # exits the bench with the worker's log if it died

    def client_cpu(self):
        return sum(B.proc_cpu(w.pid) for w in self.workers)

    def stop(self):
        for w in self.workers:
            w.stop()

    def keys(self, prefix, n):
        """What the HTTP provider sends as Idempotency-Key: effect_key, a
        hash the table generates from the effect's identity."""
        keys = {r[0] for r in B.q("SELECT effect_key FROM effect_outbox WHERE idempotency_key LIKE %s",
                                  (prefix + "%",))}
        if len(keys) != n:
            fail("dispatcher %s: %d distinct effect keys for %d effects" % (prefix, len(keys), n))
        return keys

    def check_db(self, prefix, n):
        # Completed: the effect's finishing history row says so (one per
        # effect here); open ones are still in the live queue.
        done, total, open_, attempts = B.q(
            "SELECT (SELECT count(*) FROM effect_outbox b JOIN effect_history h"
            "         ON h.created_at = b.created_at AND h.effect_id = b.effect_id"
            "        WHERE h.state = 'completed' AND b.idempotency_key LIKE %s),"
            " (SELECT count(*) FROM effect_outbox), (SELECT count(*) FROM effect_live),"
            " (SELECT count(*) FROM effect_history WHERE outcome_class IS NOT NULL)", (prefix + "%",))[0]
        if (done, total, open_, attempts) != (n, n, 0, n):
            fail("dispatcher %s: %d of %d effects completed, %d still open, %d attempts rows"
                 " (want %d, %d, 0, %d)" % (prefix, done, total, open_, attempts, n, n, n))


class GraphileSide:
    name = "graphile"

    def __init__(self, sink):
        self.db = connect("graphile")
        self.sink = sink
        self.procs = []

    def reset(self):
        left = one(self.db, "SELECT count(*) FROM graphile_worker._private_jobs")
        if left:
            fail("graphile: %d jobs left over from an earlier round" % left)

    def start(self, label):
        env = dict(os.environ, NODE_PATH=os.environ["PEER_NODE_PATH"], PEER_GRAPHILE_DSN=graphile_dsn())
        self.procs, self.logs = [], []
        for i in range(GRAPHILE_PROCS):
            logf = open(os.path.join(B.WORK, "%s-g%d.log" % (label, i + 1)), "w")
            p = subprocess.Popen(["node", os.path.join(ROOT, "bench", "peer", "graphile_worker.js"), "run"],
                                 stdout=subprocess.PIPE, stderr=logf, env=env)
            B.PROCS.append(p)
            self.procs.append(p)
            self.logs.append(logf)
        for p, logf in zip(self.procs, self.logs):
            r, _, _ = select.select([p.stdout], [], [], 60)
            line = p.stdout.readline() if r else b""
            if line.strip() != b"ready":
                fail("graphile-worker did not start (%r); see %s:\n%s" % (line, logf.name, B.tail(logf.name)))

    def insert(self, prefix, n):
        """One call of graphile_worker.add_jobs with n job specs: its SQL API
        for adding jobs in bulk; returns when its COMMIT has."""
        with self.db.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(
                "SELECT count(*) FROM graphile_worker.add_jobs(ARRAY("
                " SELECT ROW('post', json_build_object('key', encode(sha256(convert_to(%s || g, 'UTF8')), 'hex'), 'target', %s::text,"
                "  'headers', %s::json, 'body', %s::json), NULL, NULL, NULL, NULL, NULL, NULL)"
                "::graphile_worker.job_spec FROM generate_series(1, %s) g))",
                (prefix, self.sink.url(), json.dumps(PAYLOAD["headers"]), json.dumps(PAYLOAD["body"]), n))
            if ANALYZE_TABLES["graphile"][self.case]:
                cur.execute("ANALYZE " + ANALYZE_TABLES["graphile"][self.case])
            cur.execute("COMMIT")

    def drained(self):
        return one(self.db, "SELECT NOT EXISTS (SELECT 1 FROM graphile_worker._private_jobs)")

    def alive(self):
        for p, logf in zip(self.procs, self.logs):
            if p.poll() is not None:
                fail("graphile-worker exited (rc %s); see %s:\n%s" % (p.returncode, logf.name, B.tail(logf.name)))

    def client_cpu(self):
        return sum(B.proc_cpu(p.pid) for p in self.procs)

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p, logf in zip(self.procs, self.logs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logf.close()
            if "graphile error" in open(logf.name).read():
                fail("graphile-worker logged errors; see %s:\n%s" % (logf.name, B.tail(logf.name)))

    def keys(self, prefix, n):
        return {graphile_key(prefix, i) for i in range(1, n + 1)}

    def check_db(self, prefix, n):
        left = one(self.db, "SELECT count(*) FROM graphile_worker._private_jobs")
        if left:
            fail("graphile %s: %d jobs left (failed or not done)" % (prefix, left))


def graphile_key(prefix, i):
    """A job's Idempotency-Key: a SHA-256 in hex, as long as the dispatcher's."""
    return hashlib.sha256(("%s%d" % (prefix, i)).encode()).hexdigest()


def schedstat_s(pid):
    """A single-threaded process's time on a CPU, in seconds at ns
    resolution (/proc/PID/stat's utime + stime count 10 ms ticks: too
    coarse for the few ms a small round costs graphile's database)."""
    try:
        with open("/proc/%d/schedstat" % pid) as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class ClusterCpu(B.CpuTracker):
    """bench.py's CpuTracker over every process of the cluster, read from
    schedstat (PostgreSQL's processes are single-threaded)."""

    def __init__(self):
        self.pids_fn = B.postgres_pids
        self.base = {p: schedstat_s(p) for p in self.pids_fn()}
        self.last = {}

    def sample(self):
        for p in self.pids_fn():
            c = schedstat_s(p)
            if c:
                self.last[p] = c


def settle(side):
    with side.db.cursor() as cur:
        cur.execute("VACUUM ANALYZE")
        cur.execute("CHECKPOINT")
    os.sync()


def wal_lsn(conn):
    return one(conn, "SELECT pg_current_wal_insert_lsn()::text")


def round_of(side, sink, label, prefix, n, case="all"):
    side.case = case
    if side.name == "dispatcher":
        side.scope(case == "scoped")
    side.reset()
    settle(side)
    side.start(label)
    sink.mark()
    lsn0 = wal_lsn(side.db)
    client0 = side.client_cpu()
    side.insert(prefix, n)
    t0 = time.time()
    pgcpu = ClusterCpu()
    # The sink's log says when all N arrived (no query charged to the
    # database meanwhile); then the database says when all N are done.
    last_size, last_change = 0, t0
    last_sample = t0
    while True:
        time.sleep(0.02)
        if time.time() - last_sample >= 0.25:
            # Often enough to see short-lived processes (autovacuum
            # workers), rarely enough to cost the measured work nothing.
            pgcpu.sample()
            last_sample = time.time()
        size = sink.count_since_mark()
        now = time.time()
        if size != last_size:
            last_size, last_change = size, now
        elif now - last_change > STALL_SECONDS:
            fail("%s: nothing reached the sink for %d s (%d of %d requests)" % (label, STALL_SECONDS, size, n))
        side.alive()
        if size >= n and side.drained():
            break
    t_done = time.time()
    pg_cpu = pgcpu.total()
    wal = float(one(side.db, "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (lsn0,)))
    client = side.client_cpu() - client0
    side.stop()
    body, t_last, requests = check_sink(sink, prefix, side.keys(prefix, n))
    side.check_db(prefix, n)
    r = {"side": side.name, "n": n, "seconds": t_done - t0, "rate": n / (t_done - t0),
         "pg_cpu_ms": pg_cpu / n * 1000, "client_cpu_ms": client / n * 1000, "wal_bytes": wal / n,
         "body_bytes": body, "requests": requests, "sink_last_s": t_last - t0}
    log("  %s: %d items in %.2f s = %.0f items/s; PostgreSQL CPU %.4f ms/item, workers %.4f ms/item,"
        " WAL %.0f B/item; at the sink: %d requests, %d keys once each, body %d B" % (
            label, n, r["seconds"], r["rate"], r["pg_cpu_ms"], r["client_cpu_ms"], r["wal_bytes"],
            requests, n, body))
    return r


def run_setting(fsync):
    setting = {"fsync": fsync}
    sink = Sink()
    try:
        sides = [DispatcherSide(sink), GraphileSide(sink)]
        setting["server"] = {k: one(sides[0].db, "SHOW %s" % k)
                             for k in ("fsync", "synchronous_commit", "full_page_writes", "server_version")}
        log("fsync %s: server %s; %d rounds of %d items per side, alternating" % (
            fsync, setting["server"], ROUNDS, N))
        if WARMUP:
            for side in sides:
                round_of(side, sink, "warmup-%s-%s" % (fsync, side.name), "w%s%s-" % (fsync, side.name[0]), WARMUP)
        rounds = []
        for i in range(1, ROUNDS + 1):
            for case in CASES:
                pair = {"case": case}
                for side in sides:
                    pair[side.name] = round_of(side, sink, "%s-%s-%s-%d" % (side.name, fsync, case, i),
                                               "%s%s%s%d-" % (side.name[0], fsync, case[0], i), N, case)
                pair["load"] = open("/proc/loadavg").read().split()[:3]
                rounds.append(pair)
        sides[0].scope(False)
        setting["rounds"] = rounds
        setting["load"] = open("/proc/loadavg").read().split()[:3]
    finally:
        sink.stop()
    results = load_results()
    results.setdefault("settings", {})[fsync] = setting
    results["machine"] = machine_text()
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


def load_results():
    try:
        with open(RESULTS) as f:
            return json.load(f)
    except OSError:
        return {}


def machine_text():
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return "%d CPU (%s), %.0f GiB RAM" % (os.cpu_count(), cpu, B.proc_meminfo() / 1048576.0)


def summary():
    res = load_results()
    settings = res.get("settings", {})
    if not settings:
        fail("no results")
    print()
    print("== bench-peer: outbox-dispatcher (%d workers, default config) beside graphile-worker"
          " (%d processes x 24), %d items per round" % (DISPATCHER_WORKERS, GRAPHILE_PROCS, N))
    print("machine: %s; load average now %s" % (res.get("machine", ""), " ".join(
        open("/proc/loadavg").read().split()[:3])))
    print()
    print("| fsync | statistics | round | dispatcher items/s | graphile items/s | throughput d/g"
          " | dispatcher PG CPU ms/item | graphile PG CPU ms/item | PG CPU d/g | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = None
    for fsync, s in settings.items():
        seen = {}
        for pair in s["rounds"]:
            seen[pair.get("case", "all")] = i = seen.get(pair.get("case", "all"), 0) + 1
            d, g = pair["dispatcher"], pair["graphile"]
            tr, cr = d["rate"] / g["rate"], d["pg_cpu_ms"] / g["pg_cpu_ms"]
            if worst is None or tr / cr < worst[0]:
                worst = (tr / cr, fsync, pair.get("case", "all"), tr, cr)
            print("| %s | %s | %d | %.0f | %.0f | %.2f | %.4f | %.4f | %.2f | %s |" % (
                fsync, pair.get("case", "all"), i, d["rate"], g["rate"], tr, d["pg_cpu_ms"],
                g["pg_cpu_ms"], cr, " ".join(pair.get("load", []))))
    print()
    print("worst round: fsync %s, statistics %s: throughput %.2fx graphile's at %.2fx its"
          " PostgreSQL CPU per item" % (worst[1], worst[2], worst[3], worst[4]))
    print()
    print("| fsync, statistics | side | items/s (mean) | PG CPU ms/item (mean) | worker CPU ms/item | WAL B/item"
          " | body B | exactly once |")
    print("|---|---|---|---|---|---|---|---|")
    for fsync, s in settings.items():
        for case in sorted({p.get("case", "all") for p in s["rounds"]}):
          for name in ("dispatcher", "graphile"):
            rs = [p[name] for p in s["rounds"] if p.get("case", "all") == case]
            mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            print("| %s | %s | %.0f | %.4f | %.4f | %.0f | %d | %d/%d |" % (
                fsync + " " + case, name, mean("rate"), mean("pg_cpu_ms"), mean("client_cpu_ms"), mean("wal_bytes"),
                rs[0]["body_bytes"], sum(r["requests"] for r in rs), sum(r["n"] for r in rs)))
    print()
    for fsync, s in settings.items():
        print("fsync %s: server %s; load average after %s" % (fsync, json.dumps(s["server"]), " ".join(s["load"])))
    keep = os.environ.get("PEER_RESULTS")
    if keep:
        with open(keep, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    phase = os.environ.get("PEER_PHASE", "summary")
    if phase == "summary":
        summary()
    elif phase in ("off", "on"):
        run_setting(phase)
    else:
        fail("PEER_PHASE: off, on or summary")

#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/bench.py: the measurements behind `make bench` (see bench/README.md).

Started by bench/run.sh, which installs what is missing, starts a throwaway
PostgreSQL and exports PGHOST/PGPORT/PGUSER, BUILD_DIR and BENCH_WORK (a
scratch folder).  Everything else (the sinks, the workers, the load) is
started and stopped here.

Environment:
  QUICK=1          small scale (10,000 effects, short latency runs)
  BENCH_N          effects per throughput run (default 200000; QUICK 10000)
  BENCH_WORKERS    worker counts, e.g. "1 2 4"
  BENCH_CLIENTS    pgbench client counts for the ceiling, e.g. "1 2 4 8"
  BENCH_RATE       offered load of the fixed-rate latency run (default 1000/s)
  BENCH_RATE_SECONDS   its length (default 120; QUICK 5)
  BENCH_IDLE       effects inserted one at a time for the idle figure (500; QUICK 40)
  BENCH_INFLIGHT   sends held in flight for the memory figure (1000)
  BENCH_VARIANTS   1 = also the 2M-completed-rows, held-vacuum and one-rate-limit runs
                   (full run default)
  BENCH_BIG        completed rows for that variant (2000000)
  BENCH_LOG_LEVEL  the workers' [log] level (default warn: see README)
  BENCH_DURABLE    1 = the latency runs again on a server with fsync, synchronous_commit
                   and full_page_writes on (run.sh restarts it; full run default)
  PROFILE=1        perf record -g the 1-worker throughput run (worker + PostgreSQL)
  BENCH_PGSS=1     pg_stat_statements on: the top statements of each throughput and ceiling run
  BENCH_EXTRA_SQL  a SQL file run after the migrations (to measure a SQL change)
  BENCH_HTTP_CONF, BENCH_DISPATCHER_CONF  extra lines for the workers' [provider.http]
                   and [dispatcher] sections ("key = value; key = value"), to
                   measure a config change
  BENCH_REPEAT     runs of the best worker and client counts; the ratio uses their means (2; QUICK 1)
  BENCH_WORKER_CONNINFO, BENCH_DATABASE_CONF  the workers' conninfo (default: the
                   server's) and extra [database] lines: workers through PgBouncer
                   (bench/scaling.py)
  BENCH_ONLY       the parts to run: throughput ceiling latency inflight variants durable
                   (variants = big held limited unrelated otherhost; each alone needs
                   throughput, for its baseline; unrelated: a type limit on email, which
                   the run's workers do not serve; otherhost: a limit on a host the run
                   does not send to)
"""
import atexit
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import psycopg2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, os.environ.get("BUILD_DIR", "build"))
WORK = os.environ["BENCH_WORK"]
QUICK = os.environ.get("QUICK", "") not in ("", "0")


def env_int(name, full, quick):
    return int(os.environ.get(name, quick if QUICK else full))


N = env_int("BENCH_N", 200000, 8000)
WORKERS = [int(x) for x in os.environ.get("BENCH_WORKERS", "1 2 4").split()]
CLIENTS = [int(x) for x in os.environ.get("BENCH_CLIENTS", "1 2 4" if QUICK else "1 2 4 8").split()]
RATE = env_int("BENCH_RATE", 1000, 1000)
RATE_SECONDS = env_int("BENCH_RATE_SECONDS", 120, 4)
IDLE = env_int("BENCH_IDLE", 500, 40)
INFLIGHT = env_int("BENCH_INFLIGHT", 1000, 1000)
SLOW_MS = env_int("BENCH_SLOW_MS", 4000, 2000)   # the slow sink's answer delay
VARIANTS = env_int("BENCH_VARIANTS", 1, 0)
BIG = env_int("BENCH_BIG", 2000000, 200000)
LIMIT_RATE = 1000000.0   # the "limited" variant's rate: above any run's
REPEAT = env_int("BENCH_REPEAT", 2, 1)                # runs of the best configurations
HOLD = env_int("BENCH_HOLD_SECONDS", 60, 10)     # how long the snapshot is held
LOG_LEVEL = os.environ.get("BENCH_LOG_LEVEL", "warn")
PROFILE = env_int("PROFILE", 0, 0)
PGSS = env_int("BENCH_PGSS", 0, 0)
ONLY = os.environ.get("BENCH_ONLY", "throughput ceiling latency inflight variants durable").split()
BATCH = 64          # [dispatcher] batch_size default; the ceiling script uses the same

PAYLOAD = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                      "body": {"event": "invoice.paid", "invoice": "INV-000123",
                               "amount_cents": 129900, "currency": "EUR",
                               "customer": {"id": "cus_42", "email": "a@example.com"},
                               "note": "bench payload of a typical webhook size"}})

T0 = time.time()
results = {}
PROCS = []          # every process started here, stopped on any exit


def _cleanup():
    for p in PROCS:
        if p.poll() is None:
            p.terminate()
    for p in PROCS:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


atexit.register(_cleanup)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))


def log(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def conninfo(db="bench"):
    return "host=%s port=%s user=%s dbname=%s" % (
        os.environ["PGHOST"], os.environ["PGPORT"], os.environ.get("PGUSER", "postgres"), db)


def connect():
    c = psycopg2.connect(conninfo())
    c.autocommit = True
    # The bench's own queries stay on one core, out of the measured work's way.
    c.cursor().execute("SET max_parallel_workers_per_gather = 0")
    return c


def q(sql, args=None, fetch=True):
    with DB.cursor() as cur:
        cur.execute(sql, args)
        if fetch and cur.description:
            return cur.fetchall()
    return None


def q1(sql, args=None):
    return q(sql, args)[0][0]


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(math.ceil(p / 100.0 * len(s))) - 1))
    return s[k]


def proc_status(pid, key):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])   # kB
    except OSError:
        pass
    return None


def proc_cpu(pid):
    """utime + stime of a live process, in seconds."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class CpuTracker:
    """CPU seconds used from now on by a set of processes that changes as
    it runs (backends and autovacuum workers come and go): every process
    counts from its start, minus what the ones already running had used
    at the start.  sample() must run often enough to see short-lived ones
    before they exit (the polling loops run it every 0.25 s)."""

    def __init__(self, pids_fn):
        self.pids_fn = pids_fn
        self.base = {p: proc_cpu(p) for p in pids_fn()}
        self.last = {}

    def sample(self):
        for p in self.pids_fn():
            c = proc_cpu(p)
            if c:
                self.last[p] = c

    def total(self):
        self.sample()
        return sum(c - self.base.get(p, 0.0) for p, c in self.last.items())


def children_of(ppid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def postgres_pids():
    """The PostgreSQL cluster: the postmaster and all its children."""
    with open(os.path.join(WORK, "pg", "data", "postmaster.pid")) as f:
        pm = int(f.readline())
    return [pm] + children_of(pm)


# ---- sinks -----------------------------------------------------------------

class Nginx:
    """The fast sink: nginx answering 200 {"id":"x"} from memory.  /ok logs
    nothing; /lat logs `$msec $http_idempotency_key` per request (the
    receipt time the latency figures use)."""

    def __init__(self):
        self.dir = os.path.join(WORK, "nginx")
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.lat_log = os.path.join(self.dir, "lat.log")
        conf = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    log_format lat '$msec $http_idempotency_key';
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
        location /ok  {{ return 200 '{{"id":"x"}}'; }}
        location /lat {{ access_log {lat} lat; return 200 '{{"id":"x"}}'; }}
    }}
}}
""".format(d=self.dir, p=self.port, lat=self.lat_log)
        with open(os.path.join(self.dir, "nginx.conf"), "w") as f:
            f.write(conf)
        self.proc = subprocess.Popen(["nginx", "-p", self.dir, "-c", "nginx.conf", "-e",
                                      os.path.join(self.dir, "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        PROCS.append(self.proc)
        wait_port(self.port, self.proc, "nginx")

    def url(self, path):
        return "http://127.0.0.1:%d/%s" % (self.port, path)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class SlowSink:
    def __init__(self, delay_ms):
        self.port = free_port()
        self.stats = os.path.join(WORK, "slow_sink.json")
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "slow_sink.py"),
                                      str(self.port), str(delay_ms), self.stats])
        PROCS.append(self.proc)
        wait_port(self.port, self.proc, "slow sink")

    def url(self):
        return "http://127.0.0.1:%d/slow" % self.port

    def read(self):
        try:
            with open(self.stats) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"peak": 0, "in_progress": 0, "served": 0}

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def wait_port(port, proc, what):
    for _ in range(200):
        if proc.poll() is not None:
            sys.exit("bench: %s exited at start (rc %s)" % (what, proc.returncode))
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit("bench: %s did not listen on %d" % (what, port))


# ---- workers ---------------------------------------------------------------

class Worker:
    def __init__(self, name, http="", dispatcher=""):
        http = "\n".join(x.strip() for x in [http] + os.environ.get("BENCH_HTTP_CONF", "").split(";") if x.strip())
        dispatcher = "\n".join(x.strip() for x in [dispatcher] + os.environ.get(
            "BENCH_DISPATCHER_CONF", "").split(";") if x.strip())
        self.name = name
        self.ini = os.path.join(WORK, "%s.ini" % name)
        self.logf = os.path.join(WORK, "%s.log" % name)
        with open(self.ini, "w") as f:
            f.write("""[database]
conninfo = {ci}
{dbconf}
[dispatcher]
worker_name = {name}
provider_dir = {prov}
{disp}
[metrics]
listen =
[log]
level = {lvl}
[provider.http]
allow_hosts = 127.0.0.1
{http}
""".format(ci=os.environ.get("BENCH_WORKER_CONNINFO") or conninfo(), name=name,
           dbconf="\n".join(x.strip() for x in os.environ.get("BENCH_DATABASE_CONF", "").split(";")),
           prov=os.path.join(BUILD, "providers"), lvl=LOG_LEVEL,
           http=http, disp=dispatcher))
        env = dict(os.environ, AI_ACTIONS_ENABLED="true")
        self.err = open(self.logf, "w")
        self.proc = subprocess.Popen([os.path.join(BUILD, "outbox-dispatcher"), "--config", self.ini],
                                     stdout=subprocess.DEVNULL, stderr=self.err, env=env)
        PROCS.append(self.proc)
        self.pid = self.proc.pid
        self.hwm_kb = None
        self.anon_kb = None
        self.cpu = 0.0

    def sample(self):
        if self.proc.poll() is not None:
            sys.exit("bench: worker %s exited (rc %s); see %s:\n%s" % (
                self.name, self.proc.returncode, self.logf, tail(self.logf)))
        self.hwm_kb = proc_status(self.pid, "VmHWM")
        self.anon_kb = max(self.anon_kb or 0, proc_status(self.pid, "RssAnon") or 0)
        self.cpu = proc_cpu(self.pid)
        return proc_status(self.pid, "VmRSS")

    def stop(self):
        if self.proc.poll() is None:
            self.sample()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def tail(path, n=15):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def wait_listening(k, timeout=10):
    """Until k worker connections sit in LISTEN (idle, NOTIFY-driven)."""
    end = time.time() + timeout
    while time.time() < end:
        n = q1("SELECT count(*) FROM pg_stat_activity WHERE datname = 'bench' AND pid <> pg_backend_pid()"
               " AND state = 'idle' AND backend_type = 'client backend'")
        if n >= k:
            time.sleep(0.3)
            return
        time.sleep(0.1)


def pg_backend_pids():
    return [r[0] for r in q("SELECT pid FROM pg_stat_activity WHERE datname = 'bench'"
                            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'")]


# ---- data ------------------------------------------------------------------

def reset():
    q("TRUNCATE effect_outbox, effect_live, effect_history, effect_calls, workflow_runs, approvals,"
      " run_claims CASCADE", fetch=False)
    q("DROP SEQUENCE IF EXISTS bench_seq", fetch=False)


def load(n, target, prefix="t"):
    """n runs and one pending effect each, in one statement each (what many
    producers would have committed).  Each effect is due a microsecond after
    the one inserted before it, as a backlog that built up over time is:
    leases then walk the table in the order its rows were written, a batch
    takes every row of the pages it touches, and a lease is HOT only if the
    page kept room for all of them (sql/100_baseline.sql).  With one due time for all
    leases would go in effect_id order, i.e. at random over
    the pages, which hides that: at fillfactor 80, WAL 2,377 bytes per effect
    with one due time, 3,240 in insertion order (1 worker 6,000-7,100 vs
    5,430-5,470 effects/s)."""
    q("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
      " SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (prefix, n), fetch=False)
    q("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, available_at)"
      " SELECT %s || g, 'http', %s, %s::jsonb, now() - interval '1 hour' + g * interval '1 microsecond'"
      " FROM generate_series(1, %s) g",
      (prefix, target, PAYLOAD, n), fetch=False)


def settle():
    q("VACUUM ANALYZE", fetch=False)
    q("CHECKPOINT", fetch=False)
    # The server runs with fsync off, so the previous run's writes (up to
    # ~1 GB) sit in the page cache and the kernel writes them back over the
    # next half minute: during that, idle latency p99 went 5 -> 11-12 ms.
    # Each run starts with nothing left to write.
    os.sync()


def queue_empty():
    """No pending or sending effect left.  Cheap: one probe of the live
    queue's due index, whose finite due times are exactly the pending and
    sending rows (an `unknown` row is due at 'infinity'), never a scan of
    a table (a separate session with seq scans off, so the poll costs the
    database next to nothing while it measures)."""
    with POLL.cursor() as cur:
        cur.execute("SELECT NOT EXISTS (SELECT 1 FROM effect_live WHERE available_at < 'infinity')")
        return cur.fetchone()[0]


def finished_in(state):
    """Effects finished in state: their finishing history row (state set;
    the benchmarks finish each effect once)."""
    return q1("SELECT count(*) FROM effect_history WHERE state = %s", (state,))


def not_completed():
    """Effects still open or finished otherwise than completed."""
    return q1("SELECT (SELECT count(*) FROM effect_live)"
              " + (SELECT count(*) FROM effect_history WHERE state IS NOT NULL AND state <> 'completed')")


def drained_rate(prefix):
    """Effects per second from the database's own clock: effects completed
    between the first lease and the last completion."""
    # The completion writes one history row per effect: the provider call
    # (started when the row went to sending) that finished it.
    n, span = q("SELECT count(*), extract(epoch FROM max(h.ended_at) - min(h.started_at))"
                " FROM effect_outbox b JOIN effect_history h"
                " ON h.created_at = b.created_at AND h.effect_id = b.effect_id"
                " WHERE h.state = 'completed' AND b.idempotency_key LIKE %s",
                (prefix + "%",))[0]
    return n, float(span or 0), (n / float(span) if span else 0.0)


# ---- throughput ------------------------------------------------------------

def attempts_logged():
    """The history's last id handed out: a read of its sequence, whatever
    the state of the live queue's due index (under a held snapshot
    queue_empty() walks its dead entries, which would charge the bench's
    own polling to the database) and however many history rows there are
    (history_id carries no index)."""
    return history_seq()


def history_seq():
    with POLL.cursor() as cur:
        cur.execute("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
                    " FROM effect_history_id_seq")
        return cur.fetchone()[0]


def throughput(k, label, prefix="t", hold_xmin=False, profile=False):
    # Where the attempt ids start (the table was truncated; its sequence
    # was not).
    a0 = history_seq()
    tab0 = table_writes()
    workers = [Worker("%s-w%d" % (label, i + 1)) for i in range(k)]
    holder = None
    held_done = None
    if hold_xmin:
        # A transaction with a snapshot open for the whole run: vacuum can
        # remove nothing that died after it started.
        holder = psycopg2.connect(conninfo())
        hc = holder.cursor()
        hc.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        hc.execute("SELECT count(*) FROM outbox_control")
    perf = None
    if PGSS:
        q("SELECT pg_stat_statements_reset()")
    held = None
    wal0 = wal_lsn()
    pgcpu = CpuTracker(postgres_pids)
    sinkcpu = CpuTracker(lambda: [SINK_PID])
    t_start = time.time()
    backends = []
    peak_rss = 0
    last_log = t_start
    while True:
        time.sleep(0.25)
        for w in workers:
            peak_rss = max(peak_rss, w.sample() or 0)
        pgcpu.sample()
        if not backends or len(backends) < k:
            backends = pg_backend_pids()
        if profile and perf is None and time.time() - t_start > 1.0:
            perf = start_perf([w.pid for w in workers] + backends)
        if holder and time.time() - t_start >= HOLD:
            held_done = finished_in("completed")
            held = time.time() - t_start
            holder.rollback()
            holder.close()
            holder = None
            log("  %s: snapshot released after %.0f s: %d effects completed while it was held" % (
                label, held, held_done))
        # N attempts logged (ids may have gaps, so this can come early),
        # then the exact test.
        logged = attempts_logged() - a0
        if logged >= N and queue_empty():
            break
        # Progress from the attempts log's last id, not a count over
        # the history: with 2,000,000 completed effects in it that
        # count read them all (1.5-3 s of CPU every 10 s, charged to the run).
        if time.time() - last_log > 10:
            last_log = time.time()
            log("  %s: ~%d/%d attempts logged" % (label, logged, N))
        if time.time() - t_start > 1800:
            sys.exit("bench: %s did not drain in 30 min" % label)
    wall = time.time() - t_start
    if perf:
        stop_perf(perf)
    pg_cpu = pgcpu.total()
    sink_cpu = sinkcpu.total()
    for w in workers:
        w.sample()
    if holder:
        held_done = finished_in("completed")
        held = time.time() - t_start
        holder.rollback()
        holder.close()
    for w in workers:
        w.stop()
    wal = wal_since(wal0)
    n, span, rate = drained_rate(prefix)
    writes = table_writes_per_effect(tab0, n)
    if PGSS:
        top_statements(label)
    bad = not_completed()
    if bad:
        log("  WARNING: %d effects not completed" % bad)
    # The provider calls this run logged (effect_attempts' rows).
    attempts = q1("SELECT count(*) FROM effect_history WHERE outcome_class IS NOT NULL"
                  " AND history_id > %s", (a0,))
    # What the run left on disk (heaps, without indexes): the live queue
    # pays its fillfactor and the versions a held snapshot keeps
    # (sql/105_live_queue.sql); the body and the history grow by what
    # the run wrote.
    heaps = dict(q("SELECT t, sum(pg_relation_size(p.relid)) / 1048576.0"
                   " FROM unnest(ARRAY['effect_outbox', 'effect_live', 'effect_history']) t"
                   " CROSS JOIN LATERAL " + RELATION_AND_PARTITIONS + " GROUP BY t"))
    heap_mib = float(sum(heaps.values()))
    r = {"workers": k, "heap_mib": heap_mib, "heap_live_mib": float(heaps["effect_live"]),
         "heap_body_mib": float(heaps["effect_outbox"]), "heap_history_mib": float(heaps["effect_history"]),
         "effects": n, "seconds": span, "wall": wall, "rate": rate,
         "rss_kb": [w.hwm_kb for w in workers],
         "worker_cpu_per_1k": sum(w.cpu for w in workers) / n * 1000 if n else 0,
         "pg_cpu_per_1k": pg_cpu / n * 1000 if n else 0, "attempt_rows": attempts,
         "sink_cpu_per_1k": sink_cpu / n * 1000 if n else 0,
         "wal_per_effect": wal / n if n else 0, "writes_per_effect": writes,
         "held_seconds": held, "held_done": held_done,
         "held_rate": held_done / held if held else None}
    log("  %s: %d effects in %.1f s = %.0f effects/s (CPU s per 1000 effects: workers %.3f,"
        " PostgreSQL %.3f, sink %.3f; peak RSS %s MiB; WAL %.0f bytes/effect; heap %.0f MiB:"
        " live %.1f, body %.0f, history %.0f)" % (
            label, n, span, rate, r["worker_cpu_per_1k"], r["pg_cpu_per_1k"], r["sink_cpu_per_1k"],
            "/".join("%.1f" % (x / 1024.0) for x in r["rss_kb"] if x), r["wal_per_effect"], heap_mib,
            r["heap_live_mib"], r["heap_body_mib"], r["heap_history_mib"]))
    log("  %s: per effect: %s" % (label, writes_text(writes)))
    return r


# effect_history's counts are its partitions', summed under its name.
# The relation t and its partitions, if any (pg_partition_tree returns no
# row for a table that is not partitioned).
RELATION_AND_PARTITIONS = ("(SELECT t::regclass AS relid"
                           " UNION SELECT relid FROM pg_partition_tree(t::regclass)) p")
WRITE_TABLES = ("effect_outbox", "effect_live", "effect_history", "effect_calls", "workflow_runs")


def table_writes():
    """Row versions written so far to the hot-path tables (inserted,
    updated, of which HOT) and the size of their indexes.  The workers'
    backends report their counts when they exit, so this is read after
    the workers have stopped and their sessions are gone."""
    deadline = time.time() + 10
    while set(pg_backend_pids()) - {POLL.get_backend_pid()} and time.time() < deadline:
        time.sleep(0.05)
    q("SELECT pg_stat_force_next_flush()")     # this session's own counts (the load)
    q("SELECT pg_stat_clear_snapshot()")
    rows = q("SELECT t, sum(s.n_tup_ins), sum(s.n_tup_upd), sum(s.n_tup_hot_upd),"
             " sum(pg_indexes_size(s.relid))"
             " FROM unnest(%s::text[]) t CROSS JOIN LATERAL " + RELATION_AND_PARTITIONS +
             " JOIN pg_stat_user_tables s ON s.relid = p.relid GROUP BY t",
             (list(WRITE_TABLES),))
    return {r[0]: [int(x) for x in r[1:]] for r in rows}


def table_writes_per_effect(before, n):
    """Per effect of the run: rows inserted, row versions from updates, how
    many of those were HOT (no new index entries), per table; and index
    bytes added.  A non-HOT update adds an entry to every index whose
    predicate the new version satisfies."""
    after = table_writes()
    out = {}
    for t in WRITE_TABLES:
        if t not in before or t not in after or not n:
            continue
        b, a = before[t], after[t]
        out[t] = {"ins": (a[0] - b[0]) / float(n), "upd": (a[1] - b[1]) / float(n),
                  "hot": (a[2] - b[2]) / float(n), "index_bytes": (a[3] - b[3]) / float(n)}
    return out


def writes_text(w):
    return "; ".join("%s ins %.2f upd %.2f (HOT %.2f) index +%.0f B" % (
        t, v["ins"], v["upd"], v["hot"], v["index_bytes"]) for t, v in w.items())


def wal_lsn():
    return q1("SELECT pg_current_wal_insert_lsn()::text")


def wal_since(lsn):
    """WAL bytes written since lsn: the database's work per effect in a
    figure that does not move with the machine's load."""
    return float(q1("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (lsn,)))


def top_statements(label):
    rows = q("SELECT calls, total_exec_time, rows, regexp_replace(query, '\\s+', ' ', 'g')"
             " FROM pg_stat_statements WHERE toplevel ORDER BY total_exec_time DESC LIMIT 10")
    log("  %s: top statements (calls, total ms, mean ms, rows):" % label)
    for calls, tot, nrows, text in rows:
        log("    %7d %9.0f %7.3f %8d  %s" % (calls, tot, tot / max(calls, 1), nrows, text[:90]))
    rows = q("SELECT calls, total_exec_time, rows, regexp_replace(query, '\\s+', ' ', 'g')"
             " FROM pg_stat_statements WHERE NOT toplevel ORDER BY total_exec_time DESC LIMIT 14")
    log("  %s: inside the functions:" % label)
    for calls, tot, nrows, text in rows:
        log("    %7d %9.0f %7.3f %8d  %s" % (calls, tot, tot / max(calls, 1), nrows, text[:110]))


def start_perf(pids):
    out = os.path.join(WORK, "perf.data")
    log("  perf record -g on pids %s" % pids)
    return subprocess.Popen(["perf", "record", "-g", "-F", "999", "-o", out, "-p",
                             ",".join(str(p) for p in pids)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_perf(p):
    p.send_signal(signal.SIGINT)
    p.wait()
    out = os.path.join(WORK, "perf.data")
    rep = subprocess.run(["perf", "report", "-i", out, "--no-children", "--sort", "comm,dso,sym",
                          "--stdio", "-g", "none", "--percent-limit", "0.7"],
                         capture_output=True, text=True).stdout
    keep = os.environ.get("PROFILE_OUT", os.path.join(ROOT, "bench", "profile.txt"))
    with open(keep, "w") as f:
        f.write(rep)
    log("  profile written to %s" % keep)


# ---- the database ceiling --------------------------------------------------

def mean_of_runs(runs):
    """One result from repeated runs of one configuration: the mean of each
    figure, and the single rates kept as `samples`."""
    out = dict(runs[0])
    for key in ("rate", "worker_cpu_per_1k", "pg_cpu_per_1k", "sink_cpu_per_1k",
                "pgbench_cpu_per_1k", "wal_per_effect"):
        if key in out:
            out[key] = sum(r[key] for r in runs) / len(runs)
    out["samples"] = [r["rate"] for r in runs]
    log("  mean of %d runs: %.0f effects/s (%s)" % (
        len(runs), out["rate"], ", ".join("%.0f" % r for r in out["samples"])))
    return out


def ceiling(clients):
    reset()
    load(N, "http://127.0.0.1:9/none", "c")
    settle()
    per_client = int(math.ceil(N / float(BATCH * clients))) + 1
    if PGSS:
        q("SELECT pg_stat_statements_reset()")
    wal0 = wal_lsn()
    pgcpu = CpuTracker(postgres_pids)
    p = subprocess.Popen(["pgbench", "-n", "-c", str(clients), "-j", str(min(clients, 4)),
                          "-t", str(per_client), "-f", os.path.join(ROOT, "bench", "ceiling.sql"),
                          "bench"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bench_cpu = CpuTracker(lambda: [p.pid])
    # pgbench's backends live only as long as the run (a fraction of a
    # second at QUICK scale), and a backend that exits between two samples
    # takes its CPU with it: sampled far more often than the workers' runs.
    while p.poll() is None:
        pgcpu.sample()
        bench_cpu.sample()
        time.sleep(0.02)
    so, se = p.communicate()
    if p.returncode != 0:
        sys.exit("bench: pgbench failed:\n" + so + se)
    wal = wal_since(wal0)
    n, span, rate = drained_rate("c")
    if PGSS:
        top_statements("ceiling-%d" % clients)
    pg_cpu, pgb_cpu = pgcpu.total(), bench_cpu.total()
    left = not_completed()
    r = {"clients": clients, "effects": n, "seconds": span, "rate": rate,
         "pg_cpu_per_1k": pg_cpu / n * 1000 if n else 0, "pgbench_cpu_per_1k": pgb_cpu / n * 1000 if n else 0,
         "wal_per_effect": wal / n if n else 0}
    log("  ceiling, %d client(s): %d effects in %.1f s = %.0f effects/s (CPU s per 1000 effects:"
        " PostgreSQL %.3f, pgbench %.3f; WAL %.0f bytes/effect)%s" % (
            clients, n, span, rate, r["pg_cpu_per_1k"], r["pgbench_cpu_per_1k"], r["wal_per_effect"],
            " (%d left!)" % left if left else ""))
    return r


# ---- latency ---------------------------------------------------------------

def latency_runs(sink, durable_note=""):
    """Idle (one effect at a time) then RATE/s for RATE_SECONDS, one worker,
    default config.  Latency = the sink's receipt ($msec, nginx) minus the
    row's created_at (the producer's statement start)."""
    reset()
    total = IDLE + RATE * RATE_SECONDS * 2 + 1000
    q("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
      " SELECT 'lat-' || g, 'processing', 'h' FROM generate_series(1, %s) g", (total,), fetch=False)
    q("CREATE SEQUENCE bench_seq", fetch=False)
    settle()
    open(sink.lat_log, "w").close()
    w = Worker("lat-w1")
    wait_listening(1)
    out = {}
    target = sink.url("lat")

    # The first effect of a fresh worker is reported apart: its lease and
    # mark are the session's first calls of those functions (catalog
    # caches, plans) and its send opens the connection to the sink.
    # Then idle: one insert, then a pause far longer than the latency.
    for n, label in ((1, "first"), (IDLE, "idle")):
        r = subprocess.run(["pgbench", "-n", "-c", "1", "-t", str(n), "-D", "target=" + target,
                            "-f", os.path.join(ROOT, "bench", "idle.sql"), "bench"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit("bench: pgbench (%s) failed:\n" % label + r.stdout + r.stderr)
        wait_drained(30)
    out["first"] = latencies(sink, "first effect after start", 0, 1)
    out["idle"] = latencies(sink, "idle", 1, IDLE + 1)

    # Fixed offered load: pgbench --rate schedules Poisson arrivals.
    w.sample()
    rss0 = None
    samples = []
    p = subprocess.Popen(["pgbench", "-n", "-c", "4", "-j", "2", "-R", str(RATE), "-T", str(RATE_SECONDS),
                          "-D", "target=" + target, "-f", os.path.join(ROOT, "bench", "insert.sql"),
                          "bench"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = time.time()
    rss_minute = None
    while p.poll() is None:
        rss = w.sample()
        if rss0 is None and time.time() - t > min(5, RATE_SECONDS / 3.0):
            rss0 = rss
        # The heap grows to the run's peak concurrency in its first minute
        # or so; "flat" is about what happens after that.
        if rss_minute is None and RATE_SECONDS >= 120 and time.time() - t > 60:
            rss_minute = rss
        samples.append(rss)
        time.sleep(0.5)
    so, se = p.communicate()
    if p.returncode != 0:
        sys.exit("bench: pgbench (rate) failed:\n" + so + se)
    wait_drained(60)
    rss1 = w.sample()
    n_rate = q1("SELECT last_value FROM bench_seq") - IDLE - 1
    out["rate"] = latencies(sink, "%d/s" % RATE, IDLE + 1, IDLE + 1 + n_rate)
    out["rate"]["offered_per_s"] = n_rate / float(RATE_SECONDS)
    out["rss_start_kb"], out["rss_end_kb"] = rss0, rss1
    out["rss_minute_kb"] = rss_minute
    out["hwm_kb"] = w.hwm_kb
    w.stop()
    log("  worker RSS during the %d/s run: %.1f MiB after warm-up, %s at 60 s, %.1f MiB at the end,"
        " peak %.1f MiB" % (RATE, (rss0 or 0) / 1024.0,
                            "%.1f MiB" % (rss_minute / 1024.0) if rss_minute else "-",
                            (rss1 or 0) / 1024.0, (w.hwm_kb or 0) / 1024.0))
    return out


def wait_drained(timeout):
    end = time.time() + timeout
    while time.time() < end:
        if queue_empty():
            return
        time.sleep(0.2)
    log("  WARNING: queue not drained after %d s" % timeout)


def latencies(sink, label, lo, hi):
    """Match the sink's log to created_at by the Idempotency-Key (effect_key);
    effects whose sequence number is in (lo, hi]."""
    time.sleep(0.3)
    recv = {}
    with open(sink.lat_log) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                recv.setdefault(parts[1], float(parts[0]))   # first delivery
    rows = q("SELECT effect_key, extract(epoch FROM created_at)::float8 FROM effect_outbox"
             " WHERE idempotency_key LIKE 'lat-%%'"
             " AND substr(idempotency_key, 5)::bigint > %s AND substr(idempotency_key, 5)::bigint <= %s",
             (lo, hi))
    lat = [(recv[k] - c) * 1000.0 for k, c in rows if k in recv]
    missing = len(rows) - len(lat)
    r = {"n": len(lat), "missing": missing, "p50": pct(lat, 50), "p95": pct(lat, 95),
         "p99": pct(lat, 99), "max": max(lat) if lat else float("nan")}
    log("  latency %s: n=%d p50 %.1f ms, p95 %.1f ms, p99 %.1f ms, max %.1f ms%s" % (
        label, r["n"], r["p50"], r["p95"], r["p99"], r["max"],
        " (%d not received!)" % missing if missing else ""))
    return r


# ---- memory with many sends in flight ----------------------------------------

def inflight_run():
    sink = SlowSink(SLOW_MS)
    try:
        reset()
        settle()
        n = INFLIGHT
        w = Worker("inflight-w1", http="max_in_flight = %d\nmax_per_host = %d" % (n, n),
                   dispatcher="max_in_flight = %d" % n)
        wait_listening(1)
        w.sample()
        idle_hwm = w.hwm_kb
        load(n, sink.url(), "s")      # one statement: one NOTIFY wakes the worker
        peak_sending = 0
        rss_at_peak = 0
        end = time.time() + 60
        while time.time() < end:
            rss = w.sample()
            st = sink.read()
            if st["in_progress"] >= peak_sending:
                peak_sending = st["in_progress"]
                rss_at_peak = max(rss_at_peak, rss or 0)
            if st["served"] >= n:
                break
            time.sleep(0.2)
        wait_drained(30)
        w.sample()
        w.stop()
        st = sink.read()
        r = {"in_flight_peak": st["peak"], "rss_at_peak_kb": rss_at_peak, "hwm_kb": w.hwm_kb,
             "anon_kb": w.anon_kb, "idle_hwm_kb": idle_hwm}
        log("  %d sends in flight at most (sink); worker peak RSS %.1f MiB (VmHWM; %.1f MiB before"
            " the sends; its own memory, RssAnon, peaked at %.1f MiB, the rest is shared libraries)" % (
                st["peak"], (w.hwm_kb or 0) / 1024.0, (idle_hwm or 0) / 1024.0, (w.anon_kb or 0) / 1024.0))
        return r
    finally:
        sink.stop()


# ---- variants --------------------------------------------------------------

def load_completed(n):
    """n completed effects (and their runs), as if dispatched long ago: the
    body row and the one history row a completion writes (the accepted
    call that finished the effect), no live row.  The triggers are skipped
    for speed (session_replication_role): the foreign keys hold anyway,
    and the body's statement trigger would queue the effects again."""
    q("SELECT outbox_history_partitions(now() - interval '1 day', now())")
    q("SET session_replication_role = replica", fetch=False)
    step = 500000
    for lo in range(1, n + 1, step):
        hi = min(n, lo + step - 1)
        q("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
          " SELECT 'old' || g, 'completed', 'h' FROM generate_series(%s, %s) g", (lo, hi), fetch=False)
        q("WITH body AS ("
          "  INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, created_at,"
          "                           available_at)"
          "  SELECT 'old' || g, 'http', 'http://127.0.0.1:9/old', %s::jsonb,"
          "         now() - interval '1 day', now() - interval '1 day'"
          "    FROM generate_series(%s, %s) g"
          "  RETURNING effect_id, created_at)"
          " INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, ended_at,"
          "                             outcome_class, provider_status, provider_id, state,"
          "                             last_provider_id, retry_base)"
          " SELECT effect_id, created_at, 1, 'old', created_at, created_at, 'accepted', 200, 'x',"
          "        'completed', 'x', 0 FROM body", (PAYLOAD, lo, hi), fetch=False)
    q("SET session_replication_role = origin", fetch=False)


# ---- main ------------------------------------------------------------------

def mib(kb):
    return "%.1f" % (kb / 1024.0) if kb else "-"


def main():
    global DB, POLL
    DB = connect()
    POLL = connect()
    POLL.cursor().execute("SET enable_seqscan = off")
    log("bench: %s, N=%d, workers %s, pgbench clients %s, log level %s, build %s" % (
        "QUICK" if QUICK else "full", N, WORKERS, CLIENTS, LOG_LEVEL, BUILD))
    global LOAD0, MACHINE
    LOAD0 = loadavg()
    MACHINE = machine()
    log("machine: %s; load average at start %.2f" % (MACHINE, LOAD0))
    sink = Nginx()
    global SINK_PID
    SINK_PID = sink.proc.pid
    try:
        # Dispatcher and ceiling runs alternate (1 worker, 1 client, 2
        # workers, ...) so that a change in the machine's load during the
        # bench affects both sides of the ratio alike.
        tp, ceil = {}, []
        for k in sorted(set(WORKERS) | set(CLIENTS)):
            if k in WORKERS and "throughput" in ONLY:
                reset()
                load(N, sink.url("ok"))
                settle()
                tp[k] = throughput(k, "fresh-%d" % k, profile=bool(PROFILE) and k == 1)
            if k in CLIENTS and "ceiling" in ONLY:
                ceil.append(ceiling(k))
        # The best worker count and the best client count again, alternating
        # (BENCH_REPEAT runs of each in all): effects/s move by +-15 % from
        # run to run, and the best of three single runs is the luckiest.
        # The ratio and the variants use the mean of the repeats.
        if REPEAT > 1 and tp and ceil:
            best_k = max(tp, key=lambda k: tp[k]["rate"])
            best_c = max(ceil, key=lambda c: c["rate"])
            runs_k, runs_c = [tp[best_k]], [best_c]
            for i in range(REPEAT - 1):
                reset()
                load(N, sink.url("ok"))
                settle()
                runs_k.append(throughput(best_k, "fresh-%d (again)" % best_k))
                runs_c.append(ceiling(best_c["clients"]))
            tp[best_k] = mean_of_runs(runs_k)
            ceil[ceil.index(best_c)] = mean_of_runs(runs_c)
            results["ratio_workers"], results["ratio_clients"] = best_k, best_c["clients"]
        results["throughput"] = tp
        results["ceiling"] = ceil

        if "latency" in ONLY:
            results["latency"] = latency_runs(sink)
        if "inflight" in ONLY:
            results["inflight"] = inflight_run()

        if VARIANTS and tp and ("variants" in ONLY or "big" in ONLY or "held" in ONLY
                                or "limited" in ONLY or "unrelated" in ONLY
                                or "otherhost" in ONLY):
            # Each variant is compared with a fresh-table run of the same
            # worker count made just before it: the machine's speed drifts
            # by 10-20 % over a quarter of an hour (the same work took 0.19
            # and 0.25 ms of PostgreSQL CPU per effect in one full run), and
            # the variants run last.
            best_k = results.get("ratio_workers") or max(tp, key=lambda k: tp[k]["rate"])
            for name, big, hold in (("big", True, False), ("held", False, True),
                                    ("limited", False, False), ("unrelated", False, False),
                                    ("otherhost", False, False)):
                if "variants" not in ONLY and name not in ONLY:
                    continue
                reset()
                load(N, sink.url("ok"))
                settle()
                results[name + "_base"] = throughput(best_k, "fresh-%d (before %s)" % (best_k, name))
                reset()
                if big:
                    log("  loading %d completed effects ..." % BIG)
                    load_completed(BIG)
                if name == "limited":
                    # One rate limit on the sink's host, far above what the
                    # run reaches: the cost of the scopes' path (the claim
                    # leases, the mark draws on the bucket), not a throttle.
                    q("SELECT outbox_scope_limit('host', '127.0.0.1', %s::float8, %s::integer, "
                      "'bench', 'the cost of one limit')", (LIMIT_RATE, int(LIMIT_RATE)), fetch=False)
                if name == "unrelated":
                    # A limit on a type the run's workers do not serve (they
                    # serve http): their claims stay one statement.
                    q("INSERT INTO outbox_providers (name) VALUES ('email') ON CONFLICT DO NOTHING",
                      fetch=False)
                    q("SELECT outbox_scope_limit('type', 'email', 10::float8, 10, "
                      "'bench', 'a limit the run does not meet')", fetch=False)
                if name == "otherhost":
                    # A limit on a host the run does not send to: the
                    # claims stay one statement, the worker checks hosts.
                    q("SELECT outbox_scope_limit('host', '127.0.0.9', 10::float8, 10, "
                      "'bench', 'a host the run does not touch')", fetch=False)
                load(N, sink.url("ok"))
                settle()
                results[name] = throughput(best_k, "%s-%d" % (name, best_k), hold_xmin=hold)
                if name == "otherhost":
                    q("SELECT outbox_scope_limit('host', '127.0.0.9', NULL::float8, NULL::integer, "
                      "'bench', 'done')", fetch=False)
                if name == "unrelated":
                    q("SELECT outbox_scope_limit('type', 'email', NULL::float8, NULL::integer, "
                      "'bench', 'done')", fetch=False)
                if name == "limited":
                    q("SELECT outbox_scope_limit('host', '127.0.0.1', NULL::float8, NULL::integer, "
                      "'bench', 'done')", fetch=False)
            results["variant_workers"] = best_k

    finally:
        sink.stop()
    save()


def durable_phase():
    """BENCH_PHASE=durable: run.sh restarted the server with fsync,
    synchronous_commit and full_page_writes on; the latency runs again
    (each commit now waits for the disk)."""
    global DB, POLL, RATE_SECONDS
    load_results()
    DB = connect()
    POLL = connect()
    POLL.cursor().execute("SET enable_seqscan = off")
    log("durable: fsync=%s synchronous_commit=%s full_page_writes=%s" % (
        q1("SHOW fsync"), q1("SHOW synchronous_commit"), q1("SHOW full_page_writes")))
    RATE_SECONDS = min(RATE_SECONDS, 30)
    sink = Nginx()
    try:
        results["durable"] = latency_runs(sink)
        results["durable"]["seconds"] = RATE_SECONDS
    finally:
        sink.stop()
    save()


RESULTS = None


def results_path():
    return os.path.join(WORK, "results.json")


def save():
    old = results.get("meta", {})
    results["meta"] = {"quick": QUICK, "n": N, "log_level": LOG_LEVEL, "rate": RATE,
                       "rate_seconds": RATE_SECONDS, "inflight": INFLIGHT, "slow_ms": SLOW_MS,
                       "big": BIG, "t0": T0, "load0": LOAD0 if "LOAD0" in globals() else loadavg(),
                       "machine": MACHINE if "MACHINE" in globals() else old.get("machine", "")}
    with open(results_path(), "w") as f:
        json.dump(results, f, indent=1, default=str)


def load_results():
    global T0, LOAD0
    with open(results_path()) as f:
        results.update(json.load(f))
    # JSON object keys are strings: worker counts back to int.
    if "throughput" in results:
        results["throughput"] = {int(k): v for k, v in results["throughput"].items()}
    T0 = results["meta"]["t0"]
    LOAD0 = results["meta"]["load0"]


def machine():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = proc_meminfo()
    pgv = q1("SHOW server_version")
    return "%d CPU (%s), %.0f GiB RAM, PostgreSQL %s" % (os.cpu_count(), cpu, mem / 1048576.0, pgv)


def proc_meminfo():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


def missed(r):
    """Effects not at the sink when the figures were taken (the worker fell
    behind by more than the wait): their latency is larger still."""
    return "; %d not yet sent 60 s after the last insert (not counted)" % r["missing"] if r.get("missing") else ""


def lat_cell(r):
    return "p50 %.1f / p95 %.1f / p99 %.1f ms" % (r["p50"], r["p95"], r["p99"])


def headline():
    """The headline figures: effects/s, PostgreSQL CPU and WAL per effect
    of the best worker count (the one the ratio uses)."""
    tp = results.get("throughput", {})
    if not tp:
        return None
    k = results.get("ratio_workers") or max(tp, key=lambda x: tp[x]["rate"])
    return {"workers": k, "effects_per_s": tp[k]["rate"],
            "pg_cpu_ms_per_effect": tp[k]["pg_cpu_per_1k"], "wal_bytes_per_effect": tp[k]["wal_per_effect"]}


def summary():
    tp, ceil = results.get("throughput", {}), results.get("ceiling", [])
    rows = []

    def samples(r):
        return "; mean of %s" % " and ".join("%.0f" % x for x in r["samples"]) if r.get("samples") else ""
    head = headline()
    if head:
        rows.append(("effects/s, best worker count (%d)" % head["workers"],
                     "%.0f effects/s" % head["effects_per_s"], "the dispatcher's throughput%s" % samples(tp[head["workers"]])))
        rows.append(("PostgreSQL CPU per effect", "%.3f ms" % head["pg_cpu_ms_per_effect"],
                     "every PostgreSQL process, %d workers: what the outbox takes from the database's cores" % head["workers"]))
        rows.append(("WAL per effect", "%.0f bytes" % head["wal_bytes_per_effect"],
                     "%d workers; row versions per effect: %s" % (head["workers"], writes_text(
                         tp[head["workers"]].get("writes_per_effect", {})) or "n/a")))
    for k in sorted(tp):
        rows.append(("throughput, %d worker%s" % (k, "s" if k > 1 else ""), "%.0f effects/s" % tp[k]["rate"],
                     "CPU s/1000 effects: workers %.2f, PostgreSQL %.2f, sink %.2f; peak RSS %s MiB/worker%s" % (
                         tp[k]["worker_cpu_per_1k"], tp[k]["pg_cpu_per_1k"], tp[k]["sink_cpu_per_1k"],
                         "/".join(mib(x) for x in tp[k]["rss_kb"]), samples(tp[k]))))
    for c in ceil:
        rows.append(("ceiling (pgbench), %d client%s" % (c["clients"], "s" if c["clients"] > 1 else ""),
                     "%.0f effects/s" % c["rate"], "CPU s/1000 effects: PostgreSQL %.2f, pgbench %.2f%s" % (
                         c["pg_cpu_per_1k"], c["pgbench_cpu_per_1k"], samples(c))))
    lat = results.get("latency")
    if lat:
        rows.append(("latency idle (one at a time)", lat_cell(lat["idle"]),
                     "n=%d, max %.1f ms" % (lat["idle"]["n"], lat["idle"]["max"])))
        if lat.get("first"):
            rows.append(("latency of a fresh worker's first effect", "%.1f ms" % lat["first"]["max"],
                         "its first lease, mark and connection to the sink; not in the idle figures"))
        rows.append(("latency at %d/s" % RATE, lat_cell(lat["rate"]),
                     "n=%d in %d s (%.0f/s offered), max %.1f ms%s" % (
                         lat["rate"]["n"], RATE_SECONDS, lat["rate"]["offered_per_s"], lat["rate"]["max"],
                         missed(lat["rate"]))))
        if lat.get("rss_minute_kb"):
            rows.append(("worker RSS during the %d/s run" % RATE, "%s -> %s -> %s MiB" % (
                mib(lat["rss_start_kb"]), mib(lat["rss_minute_kb"]), mib(lat["rss_end_kb"])),
                "at 5 s -> 60 s -> end of %d s; peak %s MiB" % (RATE_SECONDS, mib(lat["hwm_kb"]))))
        else:
            rows.append(("worker RSS during the %d/s run" % RATE, "%s -> %s MiB" % (
                mib(lat["rss_start_kb"]), mib(lat["rss_end_kb"])), "after warm-up -> end of %d s; peak %s MiB" % (
                RATE_SECONDS, mib(lat["hwm_kb"]))))
    inf = results.get("inflight")
    if inf:
        rows.append(("peak RSS, %d sends in flight" % inf["in_flight_peak"], "%s MiB" % mib(inf["hwm_kb"]),
                     "1 worker, max_in_flight=%d, sink answers after %.0f s; RSS %s MiB before, own (RssAnon) %s MiB" % (
                         INFLIGHT, SLOW_MS / 1000.0, mib(inf.get("idle_hwm_kb")), mib(inf.get("anon_kb")))))
    def base_of(name):
        """The fresh-table run just before the variant (older results: the
        main run of that worker count)."""
        return results.get(name + "_base") or tp[results["variant_workers"]]
    if "big" in results:
        k = results["variant_workers"]
        r, b = results["big"], base_of("big")
        rows.append(("throughput, %d workers, %d completed rows in the table" % (k, BIG),
                     "%.0f effects/s" % r["rate"],
                     "%+.0f%% vs a fresh table just before (%.0f effects/s); PostgreSQL CPU s/1000 %.2f vs %.2f" % (
                         (r["rate"] / b["rate"] - 1) * 100, b["rate"], r["pg_cpu_per_1k"], b["pg_cpu_per_1k"])))
    if "held" in results:
        k = results["variant_workers"]
        r, b = results["held"], base_of("held")
        rows.append(("throughput, %d workers, while a snapshot is held %.0f s" % (k, r["held_seconds"] or 0),
                     "%.0f effects/s" % (r["held_rate"] or 0),
                     "%+.0f%% vs a fresh table just before (%.0f effects/s); whole run, snapshot then released:"
                     " %.0f effects/s, PostgreSQL CPU s/1000 %.2f vs %.2f" % (
                         ((r["held_rate"] or 0) / b["rate"] - 1) * 100, b["rate"], r["rate"],
                         r["pg_cpu_per_1k"], b["pg_cpu_per_1k"])))
    if "limited" in results:
        k = results["variant_workers"]
        r, b = results["limited"], base_of("limited")
        rows.append(("throughput, %d workers, one rate limit active (%.0f/s, not reached)" % (k, LIMIT_RATE),
                     "%.0f effects/s" % r["rate"],
                     "%+.0f%% vs no scope just before (%.0f effects/s); PostgreSQL CPU s/1000 %.2f vs %.2f"
                     " (%.2fx)" % ((r["rate"] / b["rate"] - 1) * 100, b["rate"], r["pg_cpu_per_1k"],
                                   b["pg_cpu_per_1k"], r["pg_cpu_per_1k"] / b["pg_cpu_per_1k"])))
    if "unrelated" in results:
        k = results["variant_workers"]
        r, b = results["unrelated"], base_of("unrelated")
        rows.append(("throughput, %d workers, a rate limit on a type the run does not serve" % k,
                     "%.0f effects/s" % r["rate"],
                     "%+.0f%% vs no scope just before (%.0f effects/s); PostgreSQL CPU s/1000 %.2f vs %.2f"
                     " (%.2fx)" % ((r["rate"] / b["rate"] - 1) * 100, b["rate"], r["pg_cpu_per_1k"],
                                   b["pg_cpu_per_1k"], r["pg_cpu_per_1k"] / b["pg_cpu_per_1k"])))
    if "otherhost" in results:
        k = results["variant_workers"]
        r, b = results["otherhost"], base_of("otherhost")
        rows.append(("throughput, %d workers, a rate limit on a host the run does not send to" % k,
                     "%.0f effects/s" % r["rate"],
                     "%+.0f%% vs no scope just before (%.0f effects/s); PostgreSQL CPU s/1000 %.2f vs %.2f"
                     " (%.2fx)" % ((r["rate"] / b["rate"] - 1) * 100, b["rate"], r["pg_cpu_per_1k"],
                                   b["pg_cpu_per_1k"], r["pg_cpu_per_1k"] / b["pg_cpu_per_1k"])))
    if "durable" in results:
        d = results["durable"]
        rows.append(("latency idle, fsync + synchronous_commit on", lat_cell(d["idle"]), "n=%d" % d["idle"]["n"]))
        rows.append(("latency at %d/s, fsync + synchronous_commit on" % RATE, lat_cell(d["rate"]),
                     "n=%d in %d s%s" % (d["rate"]["n"], d.get("seconds", 30), missed(d["rate"]))))
    print()
    print("== outbox-dispatcher bench (%s, N=%d, [log] level=%s, %.0f s, load average %.2f at start, %.2f now)" % (
        "QUICK" if QUICK else "full", N, LOG_LEVEL, time.time() - T0, LOAD0, loadavg()))
    print("machine: %s" % results.get("meta", {}).get("machine", ""))
    if rows:
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        print("| %-*s | %-*s | %s |" % (w0, "measure", w1, "result", "notes"))
        print("|-%s-|-%s-|-------|" % ("-" * w0, "-" * w1))
        for a, b, c in rows:
            print("| %-*s | %-*s | %s |" % (w0, a, w1, b, c))
        print()
    if tp and ceil:
        best_k = results.get("ratio_workers") or max(tp, key=lambda k: tp[k]["rate"])
        best_c = ([c for c in ceil if c["clients"] == results.get("ratio_clients")]
                  or [max(ceil, key=lambda c: c["rate"])])[0]
        ratio = tp[best_k]["rate"] / best_c["rate"] if best_c["rate"] else 0.0
        print("dispatcher best: %.0f effects/s with %d worker%s; ceiling: %.0f effects/s with %d pgbench client%s" % (
            tp[best_k]["rate"], best_k, "s" if best_k > 1 else "", best_c["rate"], best_c["clients"],
            "s" if best_c["clients"] > 1 else ""))
        print("ratio: %.2f" % ratio)
        # Where the ratio's gap comes from: the ceiling's cores run only
        # PostgreSQL, the dispatcher's also run the worker and the sink.
        # When both are CPU-bound the ratio is about ceiling CPU per effect
        # / dispatcher CPU per effect (docs/performance-log.md,
        # "What 0.7 needs (the analysis up to 3983071)"); the database's own share is what a primary on its own
        # host would see.
        d = tp[best_k]
        if d["pg_cpu_per_1k"] and best_c["pg_cpu_per_1k"]:
            print("CPU ms per effect: dispatcher %.3f (PostgreSQL %.3f, workers %.3f, sink %.3f), ceiling %.3f"
                  " (PostgreSQL); database work ceiling / dispatcher: %.2f (WAL %.0f / %.0f bytes per effect)" % (
                      d["pg_cpu_per_1k"] + d["worker_cpu_per_1k"] + d["sink_cpu_per_1k"], d["pg_cpu_per_1k"],
                      d["worker_cpu_per_1k"], d["sink_cpu_per_1k"], best_c["pg_cpu_per_1k"],
                      best_c["pg_cpu_per_1k"] / d["pg_cpu_per_1k"], best_c.get("wal_per_effect", 0),
                      d.get("wal_per_effect", 0)))
            # The same ratio from CPU per effect: what both sides cost, not
            # how fast the machine happened to be during each run (the same
            # work has taken 0.17 to 0.28 ms of PostgreSQL CPU per effect
            # within one bench).
            print("ratio by CPU per effect: %.2f (ceiling %.3f ms incl. pgbench / dispatcher %.3f ms)" % (
                (best_c["pg_cpu_per_1k"] + best_c.get("pgbench_cpu_per_1k", 0))
                / (d["pg_cpu_per_1k"] + d["worker_cpu_per_1k"] + d["sink_cpu_per_1k"]),
                best_c["pg_cpu_per_1k"] + best_c.get("pgbench_cpu_per_1k", 0),
                d["pg_cpu_per_1k"] + d["worker_cpu_per_1k"] + d["sink_cpu_per_1k"]))
    keep = os.environ.get("BENCH_RESULTS")
    if head:
        results["headline"] = head
    if keep:
        with open(keep, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    phase = os.environ.get("BENCH_PHASE", "main")
    if phase == "main":
        main()
    elif phase == "durable":
        durable_phase()
    else:
        load_results()
        summary()

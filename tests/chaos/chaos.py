#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""The chaos run: a fleet of real workers delivers many effects of
every kind to fault-injecting servers (tests/chaos/fault_servers.py) while
this harness SIGKILLs and restarts workers, SIGSTOPs one past its lease,
restarts PostgreSQL, terminates backends, flips the kill switch, sends
SIGHUP with a broken config and steps a worker's wall clock back or ahead
(CLOCK_STEP_S, then back again: every worker runs under libfaketime with a
clock file of its own; the monotonic clock is left alone, as a real step
leaves it).  It stops by itself, lets the fleet drain,
then checks the invariants and prints each with its count.

tests/chaos/run.sh starts the throwaway PostgreSQL and runs this.

Environment:
  BUILD_DIR        binaries (default build)
  CHAOS_WORKERS    workers at a time (4)
  CHAOS_EFFECTS    effects (50000; CHAOS_QUICK=1: 5000)
  CHAOS_SECONDS    time bound of the whole run (1080; quick: 150)
  CHAOS_SEED       seed of the schedule and of the servers' faults (random)
  CHAOS_KINDS      comma-separated effect types (http,email,crm: those built)
  CHAOS_DIR        working directory (logs, receipts, report.json)
  CHAOS_LOOKUP     1 (default): http effects' unknowns are looked up at the
                   server (reconcile_url); 0: no lookup

`unknown` effects are resolved automatically where evidence exists (outbox_complete:
a late acceptance or a late not-sent of the attempt the reaper gave up on;
the http lookup).  After the drain the harness asks the fleet for one
reconciliation pass (outboxctl reconcile, as the workers' own 60 s pass
would) once the youngest unknown is past the lookup's minimum age, and the
report splits what stays unknown by cause: never reached the provider,
reached it, plus how many were resolved automatically and how.

Exit status 0 only when every invariant holds.  The last line is
"N passed, N failed".
"""
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psycopg2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
from outbox_test import BUILD_DIR, admin_dsn, pg_restart, write_config  # noqa: E402

QUICK = os.environ.get("CHAOS_QUICK") == "1"
N_WORKERS = int(os.environ.get("CHAOS_WORKERS", "4"))
N_EFFECTS = int(os.environ.get("CHAOS_EFFECTS", "5000" if QUICK else "50000"))
SECONDS = float(os.environ.get("CHAOS_SECONDS", "150" if QUICK else "1080"))
SEED = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 10 ** 9))
WORK = os.environ.get("CHAOS_DIR") or f"/tmp/outbox-chaos-{os.getpid()}"
TOKEN = "00Dchaos!AQ4AQChaosTokenForTheFaultServer"
DOMAIN = "outbox-dispatcher.invalid"
LEASE_SECONDS = 5
MAINT_MS = 500
EMAIL_TIMEOUT_MS = 3000
LOOKUP = os.environ.get("CHAOS_LOOKUP", "1") == "1"
# Longer than the longest SIGSTOP (4 leases, act_stop): a frozen worker's
# request still on its way is never taken for "not found".
LOOKUP_MIN_AGE_S = 25
RECONCILE_CLASSES = ("reconciled_sent", "reconciled_not_sent", "reconcile_unknown")
# A clock step, well past the lookup's minimum age: a worker whose wall
# clock decided an attempt's age would have its lookups requeue effects
# still on their way (sent twice), or wait that much longer.
CLOCK_STEP_S = 4 * LOOKUP_MIN_AGE_S


def libfaketime():
    import glob
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        raise RuntimeError("libfaketime is missing: scripts/install-deps.sh installs it")
    return found[0]

T0 = time.time()


def say(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def available_kinds():
    want = os.environ.get("CHAOS_KINDS", "http,email,crm").split(",")
    have = []
    for k in want:
        k = k.strip()
        if os.path.exists(os.path.join(BUILD_DIR, "providers", f"outbox_{k}.so")):
            have.append(k)
        else:
            say(f"kind {k}: no plugin in {BUILD_DIR}/providers, left out")
    return have


# -- the database ------------------------------------------------------------------

DB_NAME = "chaos"
DSN = None


class Db:
    """An autocommit connection that reconnects (the harness survives its own
    PostgreSQL restarts and backend terminations)."""

    def __init__(self, dsn, app):
        self.dsn = dsn + f" application_name={app}"
        self.c = None

    def q(self, sql, args=None, tries=60):
        last = None
        for _ in range(tries):
            try:
                if self.c is None or self.c.closed:
                    self.c = psycopg2.connect(self.dsn, connect_timeout=5)
                    self.c.autocommit = True
                with self.c.cursor() as cur:
                    cur.execute(sql, args)
                    return cur.fetchall() if cur.description else None
            except psycopg2.Error as e:
                last = e
                try:
                    self.c.close()
                except Exception:
                    pass
                self.c = None
                time.sleep(0.25)
        raise RuntimeError(f"database unreachable: {last}")


def ctl(*args, timeout=60):
    return subprocess.run([os.path.join(BUILD_DIR, "outboxctl"), "--db", DSN] + list(args),
                          capture_output=True, text=True, timeout=timeout)


# -- workers -------------------------------------------------------------------------

class Worker:
    seq = 0

    def __init__(self, cfg_base):
        Worker.seq += 1
        self.name = f"cw{Worker.seq:03d}"
        self.port = free_port()
        self.cfg_path = os.path.join(WORK, f"{self.name}.ini")
        self.log_path = os.path.join(WORK, f"{self.name}.log")
        self.clock_path = os.path.join(WORK, f"{self.name}.clock")
        self.set_clock(0)
        self.sections = json.loads(json.dumps(cfg_base))
        self.sections["dispatcher"]["worker_name"] = self.name
        self.sections["metrics"] = {"listen": f"127.0.0.1:{self.port}"}
        write_config(self.cfg_path, self.sections)
        self.proc = None
        self.killed = False
        self.stopped = False
        self.busy = False
        self.offset = 0
        self.events = []
        self.lock = threading.Lock()

    def set_clock(self, offset_s):
        """The worker's wall clock offset_s seconds off (libfaketime reads
        the file again within a second)."""
        # Off the clock this run has: a suite run at another date
        # (scripts/test-at.sh) moves the worker's as well.
        base = int(os.environ.get("OUTBOX_TEST_CLOCK_OFFSET", "0"))
        with open(self.clock_path + ".tmp", "w") as f:
            f.write(f"{offset_s + base:+d}\n")
        os.replace(self.clock_path + ".tmp", self.clock_path)

    def start(self):
        asan = os.environ.get("ASAN_OPTIONS", "")
        env = dict(os.environ, AI_ACTIONS_ENABLED="true", LD_PRELOAD=libfaketime(),
                   FAKETIME_TIMESTAMP_FILE=self.clock_path, FAKETIME_CACHE_DURATION="1",
                   FAKETIME_DONT_FAKE_MONOTONIC="1",
                   # libfaketime is preloaded ahead of ASan's runtime.
                   ASAN_OPTIONS=(asan + ":" if asan else "") + "verify_asan_link_order=0")
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config",
                                      self.cfg_path], stdout=self.logf, stderr=self.logf, env=env)
        wait_for(lambda: self.seen("ready") or self.proc.poll() is not None, 30, f"{self.name} ready")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited at start: {open(self.log_path).read()[-2000:]}")
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def read_events(self):
        with self.lock:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                return self.events
            end = data.rfind(b"\n")
            if end < 0:
                return self.events
            self.offset += end + 1
            for line in data[:end].split(b"\n"):
                if b'"event":"attempt"' in line:
                    continue
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass
            return self.events

    def seen(self, event, since=0):
        return [e for e in self.read_events()[since:] if e.get("event") == event]

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return parse_metrics(r.read().decode())


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$', line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def wait_for(cond, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


# -- the run -------------------------------------------------------------------------

class Chaos:
    def __init__(self):
        self.rng = random.Random(SEED)
        self.kinds = available_kinds()
        self.workers = []
        self.wlock = threading.Lock()
        self.dblock = threading.Lock()      # PG restart, backend kills and outboxctl: one at a time
        self.stop_chaos = threading.Event()
        self.stop_producer = threading.Event()
        self.enqueued = 0
        self.counts = collections.Counter()
        self.off_windows = []               # {t_before, t_after, t_on, listed: set(effect ids)}
        self.stop_windows = collections.defaultdict(list)   # worker -> [(t_stop, t_cont)]
        self.kill_times = {}                # worker -> t
        self.errors = []

    # -- setup ---------------------------------------------------------------------
    def setup(self):
        global DSN
        os.makedirs(WORK, exist_ok=True)
        c = psycopg2.connect(admin_dsn())
        c.autocommit = True
        with c.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
            cur.execute(f"CREATE DATABASE {DB_NAME}")
        c.close()
        DSN = admin_dsn(DB_NAME)
        r = ctl("migrate")
        if r.returncode != 0:
            raise RuntimeError("migrate failed: " + r.stderr)
        self.db = Db(DSN, "chaos-harness")
        self.note_sending_commits()
        tok = os.path.join(WORK, "crm_token")
        with open(tok, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(tok, 0o600)
        self.servers = subprocess.Popen(
            ["/usr/bin/python3", os.path.join(HERE, "fault_servers.py"), "--dir", WORK,
             "--seed", str(SEED), "--token", TOKEN, "--hang-ms", "4000"],
            stdout=subprocess.PIPE, stderr=open(os.path.join(WORK, "servers.log"), "ab"), text=True)
        ports = json.loads(self.servers.stdout.readline())
        self.ports = ports
        common = {"max_attempts": 10, "backoff_base_ms": 50, "backoff_cap_ms": 1000,
                  "retry_after_max_ms": 1500, "connect_timeout_ms": 1000, "timeout_ms": 2500,
                  "breaker_failures": 50, "breaker_open_ms": 500, "max_per_host": 32}
        self.cfg = {
            "database": {"conninfo": DSN, "reconnect_min_ms": 50, "reconnect_max_ms": 1000},
            "dispatcher": {"provider_dir": os.path.join(BUILD_DIR, "providers"),
                           "providers": ",".join(self.kinds), "lease_seconds": LEASE_SECONDS,
                           "poll_interval_ms": 500, "maintenance_interval_ms": MAINT_MS,
                           "batch_size": 32, "max_in_flight": 128, "shutdown_grace_ms": 5000},
            "log": {"level": "info"},
        }
        if "http" in self.kinds:
            self.cfg["provider.http"] = dict(common, allow_hosts="127.0.0.1")
            if LOOKUP:
                base = f"http://127.0.0.1:{ports['http']}"
                self.cfg["provider.http"].update(
                    reconcile_url=base + "/lookup?key={key}", reconcile_targets=base + "/hook/",
                    reconcile_id_json="/data/id", reconcile_min_age_seconds=LOOKUP_MIN_AGE_S,
                    reconcile_timeout_ms=2000)
        if "email" in self.kinds:
            self.cfg["provider.email"] = dict(common, server=f"127.0.0.1:{ports['smtp']}",
                                              starttls="off", threads=16, timeout_ms=EMAIL_TIMEOUT_MS,
                                              message_id_domain=DOMAIN)
        if "crm" in self.kinds:
            self.cfg["provider.crm"] = dict(common, instance_url=f"http://127.0.0.1:{ports['crm']}",
                                            access_token=f"file:{tok}")
        self.db.q("SELECT outbox_kill_switch_set(true, 'chaos', 'chaos run starts')")
        for _ in range(N_WORKERS):
            self.spawn()
        say(f"seed {SEED}; {N_EFFECTS} effects of {','.join(self.kinds)}; {N_WORKERS} workers; "
            f"bound {SECONDS:.0f}s; servers {ports}; work dir {WORK}")

    def spawn(self):
        w = Worker(self.cfg)
        w.start()
        with self.wlock:
            self.workers.append(w)
        return w

    def live(self, idle_only=True):
        with self.wlock:
            return [w for w in self.workers if w.alive() and not w.killed and
                    (not idle_only or (not w.busy and not w.stopped))]

    def pick(self):
        with self.wlock:
            cands = [w for w in self.workers if w.alive() and not w.killed and not w.busy
                     and not w.stopped]
            if not cands:
                return None
            w = self.rng.choice(cands)
            w.busy = True
            return w

    # -- the producer ------------------------------------------------------------------
    def effect_row(self, i):
        kind = self.kinds[[0, 0, 1, 2][i % 4] % len(self.kinds)] if len(self.kinds) == 3 else \
            self.kinds[i % len(self.kinds)]
        if kind == "http":
            return kind, f"http://127.0.0.1:{self.ports['http']}/hook/{i}", \
                {"body": {"i": i, "note": "chaos"}}
        if kind == "email":
            return kind, f"user{i}@chaos.example.com", \
                {"from": "Chaos <chaos@example.com>", "subject": f"Chaos {i}",
                 "text": f"Effect {i}.\n"}
        return kind, "Task/Outbox_Key__c", {"Subject": f"chaos {i}", "Priority": "Normal"}

    def producer(self, until):
        db = Db(DSN, "chaos-producer")
        rate = N_EFFECTS / max(1.0, until - time.time())
        i = 0
        while i < N_EFFECTS and not self.stop_producer.is_set():
            due = min(N_EFFECTS, int((time.time() - self.t_start) * rate) + 1)
            if due <= i:
                time.sleep(0.1)
                continue
            hi = min(due, i + 500)
            rows = [self.effect_row(j) for j in range(i, hi)]
            args = []
            for j, (k, t, p) in zip(range(i, hi), rows):
                args.append((f"chaos-{j}", k, t, json.dumps(p)))
            sql_runs = "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) VALUES " + \
                ",".join(["(%s, 'processing', 'h')"] * len(args)) + " ON CONFLICT DO NOTHING"
            sql_eff = "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) VALUES " + \
                ",".join(["(%s, %s, %s, %s)"] * len(args)) + " ON CONFLICT DO NOTHING"
            db.q(sql_runs, [a[0] for a in args])
            db.q(sql_eff, [x for a in args for x in a])
            i = hi
            self.enqueued = i
        say(f"producer: {self.enqueued} effects enqueued")

    # -- chaos actions -----------------------------------------------------------------
    def every(self, lo, hi, fn, name):
        while not self.stop_chaos.wait(self.rng.uniform(lo, hi)):
            try:
                fn()
            except Exception as e:   # recorded, the run goes on
                self.errors.append(f"{name}: {e!r}")
                say(f"chaos {name} error: {e!r}")

    def act_kill(self):
        w = self.pick()
        if w is None:
            return
        try:
            w.proc.send_signal(signal.SIGKILL)
        except OSError as e:
            # Seen once as EPERM: the worker had exited by itself and another
            # thread's poll() reaped it between send_signal's own check and
            # its kill(), so the pid was someone else's.  Say what exited.
            rc = w.proc.poll()
            size = os.path.getsize(w.log_path) if os.path.exists(w.log_path) else -1
            raise RuntimeError(f"{w.name}: {e!r}; the worker had {'exited with ' + str(rc) if rc is not None else 'not exited'}"
                               f" before the SIGKILL; its log has {size} bytes") from e
        w.proc.wait()
        w.killed = True
        self.kill_times[w.name] = time.time()
        self.counts["sigkill"] += 1
        n = self.spawn()
        say(f"SIGKILL {w.name}; started {n.name}")

    def act_stop(self):
        w = self.pick()
        if w is None:
            return
        try:
            held = self.db.q("SELECT effect_id FROM outbox_effects WHERE lease_worker = %s "
                             "AND state = 'sending'", (w.name,))
            t0 = time.time()
            w.stopped = True
            w.proc.send_signal(signal.SIGSTOP)
            self.counts["sigstop"] += 1
            # Past its lease: until the reaper has taken every row it was
            # sending (or a lease and two reaper periods, whichever is later).
            ids = [str(r[0]) for r in held]
            floor = t0 + LEASE_SECONDS + 2 * MAINT_MS / 1000.0 + self.rng.uniform(0.2, 1.5)
            deadline = t0 + LEASE_SECONDS * 4
            while time.time() < deadline and not self.stop_chaos.is_set():
                left = self.db.q("SELECT count(*) FROM outbox_effects WHERE lease_worker = %s "
                                 "AND state = 'sending'", (w.name,))[0][0]
                if time.time() >= floor and left == 0:
                    break
                time.sleep(0.2)
            w.proc.send_signal(signal.SIGCONT)
            t1 = time.time()
            self.stop_windows[w.name].append((t0, t1))
            say(f"SIGSTOP {w.name} for {t1 - t0:.1f}s ({len(ids)} sends in flight at stop)")
        finally:
            w.stopped = False
            w.busy = False

    def note_sending_commits(self):
        """The kill-switch check orders commits, not arrival times: the
        harness's own table gets one row per transition to `sending` (a mark
        or a claim), written in that transaction, so that its commit
        timestamp (track_commit_timestamp, set by run.sh) is the commit's."""
        if self.db.q("SHOW track_commit_timestamp")[0][0] != "on":
            raise RuntimeError("track_commit_timestamp is off (tests/chaos/run.sh sets it)")
        self.db.q("""
            CREATE TABLE chaos_sending (effect_id uuid NOT NULL,
                                        xid xid8 NOT NULL DEFAULT pg_current_xact_id());
            CREATE FUNCTION chaos_note_sending() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
            BEGIN
                INSERT INTO chaos_sending (effect_id) VALUES (NEW.effect_id);
                RETURN NULL;
            END $$;
            CREATE TRIGGER chaos_note_sending AFTER UPDATE ON effect_live FOR EACH ROW
                WHEN (NEW.state = 'sending' AND OLD.state IS DISTINCT FROM 'sending')
                EXECUTE FUNCTION chaos_note_sending();""")

    def act_pg_restart(self):
        with self.dblock:
            t0 = time.time()
            pg_restart()
            self.counts["pg_restart"] += 1
            say(f"PostgreSQL restarted ({time.time() - t0:.1f}s)")

    def act_terminate(self):
        with self.dblock:
            n = self.db.q("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                          "WHERE datname = %s AND pid <> pg_backend_pid() "
                          "AND application_name <> 'chaos-harness'", (DB_NAME,))[0][0]
            self.counts["terminate"] += 1
            self.counts["backends_terminated"] += n
            say(f"pg_terminate_backend: {n} backends")

    def act_kill_switch(self):
        with self.dblock:
            t_before = time.time()
            r = ctl("kill-switch", "off", "--operator", "chaos", "--reason",
                    f"chaos flip {self.counts['kill_switch_off'] + 1}")
            t_after = time.time()
        if r.returncode != 0:
            raise RuntimeError(f"kill-switch off failed: {r.stderr.strip()}")
        listed = set(re.findall(r"^\s+([0-9a-f-]{36}) key=", r.stdout, re.M))
        win = {"t_before": t_before, "t_after": t_after, "listed": listed, "t_on": None}
        self.off_windows.append(win)
        self.counts["kill_switch_off"] += 1
        # Held off for a while (the fleet keeps polling, nothing may start).
        self.stop_chaos.wait(self.rng.uniform(0.8, 3.0))
        with self.dblock:
            win["t_on"] = time.time()
            r = ctl("kill-switch", "on", "--operator", "chaos", "--reason", "chaos flip back")
        if r.returncode != 0:
            raise RuntimeError(f"kill-switch on failed: {r.stderr.strip()}")
        say(f"kill switch off for {win['t_on'] - t_after:.1f}s; {len(listed)} listed in flight")

    BROKEN = [
        "[dispatcher]\nlease_seconds = many\n",
        "[dispatcher]\nno_such_key = 1\n",
        "[nonsense]\na = 1\n",
        "this is not ini\n",
        "[provider.http]\ntimeout_ms = -5\n",
    ]

    def act_sighup(self):
        w = self.pick()
        if w is None:
            return
        try:
            good = open(w.cfg_path).read()
            mark = len(w.read_events())
            with open(w.cfg_path, "w") as f:
                f.write(good + "\n" + self.rng.choice(self.BROKEN))
            w.proc.send_signal(signal.SIGHUP)
            ev = wait_for(lambda: w.seen("reload_failed", mark), 15, f"{w.name} reload_failed")
            with open(w.cfg_path, "w") as f:
                f.write(good)
            mark = len(w.read_events())
            w.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: w.seen("reloaded", mark), 15, f"{w.name} reloaded")
            self.counts["sighup_broken"] += 1
            say(f"SIGHUP {w.name} with a broken config: refused ({ev[0].get('msg', '')[:90]}); restored")
        finally:
            w.busy = False

    def act_clock_step(self):
        """One worker's wall clock steps back or ahead, stays so for a few
        seconds (sends start, outcomes are recorded), then steps back."""
        w = self.pick()
        if w is None:
            return
        try:
            step = self.rng.choice((-CLOCK_STEP_S, CLOCK_STEP_S))
            w.set_clock(step)
            held = self.rng.uniform(2.0, 6.0)
            self.stop_chaos.wait(held)
            w.set_clock(0)
            self.counts["clock_step"] += 1
            say(f"clock of {w.name} stepped {step:+d}s for {held:.1f}s, then back")
        finally:
            w.busy = False

    # -- progress ------------------------------------------------------------------------
    def states(self):
        return dict(self.db.q("SELECT state, count(*) FROM outbox_effects GROUP BY state"))

    def run(self):
        self.t_start = time.time()
        end = self.t_start + SECONDS
        produce_until = self.t_start + SECONDS * 0.55
        chaos_until = self.t_start + SECONDS * 0.75
        drain_until = self.t_start + SECONDS * 0.95
        threads = [threading.Thread(target=self.producer, args=(produce_until,), daemon=True)]
        sched = [(6, 15, self.act_kill, "sigkill"), (10, 20, self.act_stop, "sigstop"),
                 (25, 50, self.act_pg_restart, "pg_restart"), (8, 20, self.act_terminate, "terminate"),
                 (8, 20, self.act_kill_switch, "kill_switch"), (8, 20, self.act_sighup, "sighup"),
                 (8, 20, self.act_clock_step, "clock_step")]
        if QUICK:
            sched = [(lo * 0.6, hi * 0.6, fn, n) for lo, hi, fn, n in sched]
        for lo, hi, fn, name in sched:
            threads.append(threading.Thread(target=self.every, args=(lo, hi, fn, name), daemon=True))
        for t in threads:
            t.start()
        last = 0
        while time.time() < chaos_until:
            time.sleep(0.5)
            if time.time() - last >= 10:
                last = time.time()
                say(f"enqueued {self.enqueued}; {self.states()}; workers {len(self.live(False))}")
            if self.enqueued >= N_EFFECTS:
                st = self.states()
                if st.get("pending", 0) + st.get("sending", 0) == 0:
                    break
        say(f"chaos stops: {dict(self.counts)}")
        self.stop_chaos.set()
        for t in threads[1:]:
            t.join(60)
        self.stop_producer.set()
        threads[0].join(60)
        # Drain: every worker running, the switch on, enough workers alive.
        for w in self.live(False):
            w.proc.send_signal(signal.SIGCONT)
        self.db.q("SELECT outbox_kill_switch_set(true, 'chaos', 'drain')")
        while len(self.live(False)) < N_WORKERS:
            self.spawn()
        try:
            wait_for(lambda: (lambda s: s.get("pending", 0) + s.get("sending", 0) == 0)(self.states()),
                     max(10, drain_until - time.time()), "every effect to settle", interval=0.5)
            say(f"drained: {self.states()}")
        except TimeoutError as e:
            say(f"drain incomplete: {e}")
        if LOOKUP and "http" in self.kinds:
            self.reconcile_pass()
        # Survivors: idle, every outcome recorded and a maintenance pass done.
        self.survivors = [w for w in self.live(False) if w.name not in self.kill_times]
        for w in self.survivors:
            try:
                wait_for(lambda: self.metrics_settled(w), max(5, end - time.time()),
                         f"{w.name} metrics to settle", interval=0.5)
            except TimeoutError as e:
                say(str(e))
        self.scraped = {}
        for w in self.survivors:
            try:
                self.scraped[w.name] = w.metrics()
            except OSError as e:
                say(f"scrape {w.name}: {e}")

    def reconcile_pass(self):
        """What the workers' periodic pass does, once, when the youngest http
        unknown is past the lookup's minimum age; then the requeued ones drain."""
        age = self.db.q("SELECT coalesce(min(extract(epoch FROM now() - o.updated_at)), 1e9) "
                        "FROM outbox_effects o WHERE o.state = 'unknown' AND o.effect_type = 'http'")[0][0]
        if age >= 1e9:
            return
        wait_s = max(0.0, LOOKUP_MIN_AGE_S + 1 - float(age))
        say(f"reconciliation pass in {wait_s:.0f}s (lookup minimum age {LOOKUP_MIN_AGE_S}s)")
        time.sleep(wait_s)
        with self.dblock:
            r = ctl("reconcile", "--wait", "90", timeout=120)
        tail = [ln for ln in r.stdout.splitlines() if ln.strip()][-1:] or [r.stderr.strip()]
        say(f"outboxctl reconcile: exit {r.returncode}: {tail[0][:200]}")
        self.counts["reconcile_passes"] += 1
        try:
            wait_for(lambda: (lambda s: s.get("pending", 0) + s.get("sending", 0) == 0)(self.states()),
                     60, "requeued effects to settle", interval=0.5)
        except TimeoutError as e:
            say(f"drain after reconciliation incomplete: {e}")

    def metrics_settled(self, w):
        m = w.metrics()
        inflight = m.get(("outbox_sends_in_flight", ()), -1)
        sends = sum(v for (k, _), v in m.items() if k == "outbox_sends_total")
        rows = self.db.q("SELECT count(*) FROM effect_attempts WHERE worker = %s "
                         "AND outcome_class <> ALL (%s)", (w.name, list(RECONCILE_CLASSES)))[0][0]
        unknown_gauge = m.get(("outbox_unknown_effects", ()), -1)
        unknown = self.db.q("SELECT count(*) FROM outbox_effects WHERE state = 'unknown'")[0][0]
        return inflight == 0 and sends == rows and unknown_gauge == unknown

    def shutdown(self):
        self.stop_chaos.set()
        self.stop_producer.set()
        for w in self.live(False):
            w.proc.send_signal(signal.SIGCONT)
            w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            if w.proc and w.proc.poll() is None:
                try:
                    w.proc.wait(20)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
        if getattr(self, "servers", None) is not None:
            self.servers.send_signal(signal.SIGTERM)
            self.servers.wait(20)


# -- the invariants ---------------------------------------------------------------------

def gave_up_by(a, t):
    """The worker had given up on attempt a by time t: it logged the outcome
    (ended_at, the database's clock, a little late) or the whole-call
    timeout of the email provider had run out."""
    return a["ended"] <= t + 1 or t >= a["started"] + EMAIL_TIMEOUT_MS / 1000.0 - 0.05


class Checks:
    def __init__(self, ch):
        self.ch = ch
        self.results = []
        self.db = ch.db

    def record(self, name, ok, detail):
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    def load(self):
        db = self.db
        self.effects = {}
        for r in db.q("SELECT effect_id::text, effect_type, target, effect_key, state, provider_id, "
                      "attempts, last_error_class, last_error, lease_expires_at < now() "
                      "FROM outbox_effects"):
            self.effects[r[0]] = dict(zip(("id", "type", "target", "key", "state", "provider_id",
                                           "attempts", "err_class", "err", "expired"), r))
        self.by_key = {e["key"]: e for e in self.effects.values()}
        self.by_target = {e["target"]: e for e in self.effects.values() if e["type"] == "email"}
        self.attempts = collections.defaultdict(list)
        for r in db.q("SELECT effect_id::text, attempt, worker, outcome_class, provider_status, "
                      "provider_id, error_text, cas_applied, "
                      "extract(epoch FROM started_at)::float8, lease_owner::text, "
                      "extract(epoch FROM ended_at)::float8, "
                      + ("resolution" if self.has_resolution() else "NULL") +
                      " FROM effect_attempts ORDER BY attempt_id"):
            self.attempts[r[0]].append(dict(zip(("attempt", "worker", "outcome", "status", "provider_id",
                                                 "error", "cas", "started", "owner", "ended",
                                                 "resolution"), r[1:])))
        self.receipts = collections.defaultdict(list)   # effect id -> receipts
        self.stray = []
        with open(os.path.join(WORK, "receipts.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                if r["kind"] == "smtp":
                    e = self.by_target.get(r["key"])
                else:
                    e = self.by_key.get(r["key"])
                if e is None:
                    self.stray.append(r)
                    continue
                self.receipts[e["id"]].append(r)
        with open(os.path.join(WORK, "crm_records.json")) as f:
            self.crm_records = json.load(f)

    def has_resolution(self):
        return bool(self.db.q("SELECT 1 FROM information_schema.columns WHERE "
                              "table_name = 'effect_attempts' AND column_name = 'resolution'"))

    @staticmethod
    def sends(rs):
        """Receipts that are provider calls (SMTP: one per RCPT; CRM: PATCH)."""
        return [r for r in rs if r["kind"] in ("http", "crm") or
                (r["kind"] == "smtp" and r.get("stage") == "rcpt")]

    def run(self):
        self.load()
        E = self.effects
        st = collections.Counter(e["state"] for e in E.values())
        by_kind = collections.Counter((e["type"], e["state"]) for e in E.values())
        print("\n== figures", flush=True)
        print(f"effects {len(E)}: " + ", ".join(f"{k} {v}" for k, v in sorted(st.items())))
        for kind in self.ch.kinds:
            print(f"  {kind}: " + ", ".join(f"{s} {by_kind[(kind, s)]}"
                                              for s in ("completed", "failed", "unknown", "pending", "sending")))
        print(f"chaos: {dict(self.ch.counts)}")
        faults = collections.Counter()
        for rs in self.receipts.values():
            for r in rs:
                if r["kind"] in ("http", "crm") or (r["kind"] == "smtp" and
                                                    (r.get("stage") == "data" or r["fault"].endswith("rcpt"))):
                    faults[(r["kind"], r["fault"])] += 1
        self.faults = {f"{k}/{f}": v for (k, f), v in sorted(faults.items())}
        print("faults injected (requests): " + ", ".join(f"{k} {v}" for k, v in self.faults.items()))
        print("\n== invariants", flush=True)

        # 1. every effect settled; none lost
        unsettled = [e for e in E.values() if e["state"] not in ("completed", "failed", "unknown")]
        stale = [e for e in E.values() if e["state"] == "sending" and e["expired"]]
        self.record("every effect completed, failed or unknown (none lost)",
                    len(E) == N_EFFECTS and not unsettled,
                    f"{len(E)}/{N_EFFECTS} effects in the table; {len(unsettled)} not settled "
                    f"({collections.Counter(e['state'] for e in unsettled)})")
        self.record("no effect left sending with an expired lease", not stale,
                    f"{len(stale)} sending with an expired lease")

        # 2. no duplicate delivery of a provider that does not honour keys
        dups = []
        idem_repeat = 0
        for eid, rs in self.receipts.items():
            kind = E[eid]["type"]
            processed = [r for r in rs if r.get("processed")]
            if kind in ("http", "email") and len(processed) > 1:
                dups.append((eid, kind, [(r["fault"], r["n"]) for r in processed]))
            if kind == "crm" and len(processed) > 1:
                idem_repeat += 1
        by_kind_dups = collections.Counter(d[1] for d in dups)
        self.record("no effect of a provider that does not honour keys processed twice by its server",
                    not dups, f"{len(dups)} duplicated ({dict(by_kind_dups)}); "
                    f"e.g. {dups[:3]}" if dups else "0 duplicated (http, email)")
        if "crm" in self.ch.kinds:
            crm = [e for e in E.values() if e["type"] == "crm"]
            wrong = [e for e in crm if e["state"] == "completed" and
                     self.crm_records.get(e["key"]) != e["provider_id"]]
            self.record("crm (honours keys): one record per external id, and it is the completed "
                        "effect's provider id", not wrong,
                        f"{len(self.crm_records)} records for {len(crm)} effects; {idem_repeat} keys "
                        f"upserted more than once (same key, same record); {len(wrong)} mismatched")

        # 3. every unknown has an ambiguous attempt
        no_amb = [e for e in E.values() if e["state"] == "unknown" and
                  not any(a["outcome"] == "ambiguous" for a in self.attempts[e["id"]])]
        self.record("every unknown effect has an ambiguous attempt in the log", not no_amb,
                    f"{st['unknown']} unknown, {len(no_amb)} without an ambiguous attempt")

        # 3b. no effect stays unknown when the log holds definitive evidence
        # about the attempt the reaper gave up on: that attempt's own late
        # outcome (same owner, same attempt) was an acceptance or not-sent
        held = []
        for e in E.values():
            if e["state"] != "unknown":
                continue
            atts = self.attempts[e["id"]]
            given_up = {(a["attempt"], a["owner"]) for a in atts
                        if (a["worker"] or "").startswith("reaper:")}
            ev = [a for a in atts if not (a["worker"] or "").startswith("reaper:")
                  and a["outcome"] in ("accepted", "not_sent") and a["attempt"] == e["attempts"]
                  and (a["attempt"], a["owner"]) in given_up]
            if ev:
                held.append((e["id"], [(a["outcome"], a["attempt"]) for a in ev]))
        self.record("no effect stays unknown while the log holds its attempt's late acceptance "
                    "or not-sent", not held,
                    f"{st['unknown']} unknown; {len(held)} with such evidence {held[:3] if held else ''}")

        # 4. every completed effect: provider id and exactly one accepted attempt that
        # applied (a late outcome after a lost lease is logged with cas_applied=false)
        bad = []
        late = 0
        for e in E.values():
            if e["state"] != "completed":
                continue
            acc = [a for a in self.attempts[e["id"]] if a["outcome"] == "accepted" and a["cas"]]
            rec = [a for a in self.attempts[e["id"]] if a["outcome"] in ("reconciled_sent", "operator_sent")]
            late += sum(1 for a in self.attempts[e["id"]] if a["outcome"] == "accepted" and not a["cas"])
            ok = bool(e["provider_id"]) and (
                (len(acc) == 1 and acc[0]["provider_id"] == e["provider_id"]) or
                (not acc and len(rec) >= 1))
            if not ok:
                bad.append((e["id"], e["provider_id"], [(a["outcome"], a["cas"]) for a in self.attempts[e["id"]]]))
        n_rec = sum(1 for e in E.values() if e["state"] == "completed" and
                    any(a["outcome"] == "reconciled_sent" for a in self.attempts[e["id"]]))
        self.record("every completed effect has a provider id and exactly one applied accepted attempt "
                    "(or a reconciliation verdict)", not bad,
                    f"{st['completed']} completed ({n_rec} by reconciliation); {late} late accepted "
                    f"outcomes logged with cas_applied=false; {len(bad)} bad {bad[:3] if bad else ''}")
        late_unknown = sum(1 for e in E.values() if e["state"] == "unknown" and
                           any(a["outcome"] == "accepted" for a in self.attempts[e["id"]]))

        # 5. database, attempts log, servers and metrics agree
        self.check_agreement()
        self.check_metrics()

        # 6. kill switch
        self.check_kill_switch()

        # 7. every chaos action did what it should (a broken config refused and
        # the good one taken back, every kill-switch flip committed, ...)
        self.record("every chaos action completed as expected (broken SIGHUP refused, flips "
                    "committed, workers restarted)", not self.ch.errors,
                    f"{sum(v for k, v in self.ch.counts.items() if k != 'backends_terminated')} actions, {len(self.ch.errors)} errors "
                    f"{self.ch.errors[:3] if self.ch.errors else ''}")

        # causes of unknown
        self.unknown_causes(late_unknown)
        passed = sum(1 for r in self.results if r[1])
        failed = len(self.results) - passed
        report = {"seed": SEED, "effects": len(E), "states": dict(st),
                  "by_kind": {f"{k}/{s}": v for (k, s), v in by_kind.items()},
                  "chaos": dict(self.ch.counts), "invariants": [(n, ok, d) for n, ok, d in self.results],
                  "unknown_causes": self.causes, "unknown_split": self.split,
                  "elapsed_s": round(time.time() - T0, 1),
                  "faults": self.faults, "off_windows": [
                      {k: (sorted(v) if isinstance(v, set) else v) for k, v in w.items() if k != "listed"}
                      | {"listed": len(w["listed"])} for w in self.ch.off_windows],
                  "t0": T0, "stop_windows": dict(self.ch.stop_windows),
                  "kill_times": self.ch.kill_times,
                  "workers_started": Worker.seq, "errors": self.ch.errors}
        with open(os.path.join(WORK, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        if self.ch.errors:
            print(f"harness errors: {self.ch.errors[:10]}")
        return passed, failed

    def check_agreement(self):
        E = self.effects
        # a. the accepted answer the database holds is one the server gave
        mism = []
        for e in E.values():
            if e["state"] != "completed" or not e["provider_id"]:
                continue
            if any(a["outcome"] == "reconciled_sent" for a in self.attempts[e["id"]]):
                continue
            ids = {r.get("reply_id") for r in self.receipts[e["id"]] if r.get("processed")}
            if e["provider_id"] not in ids:
                mism.append((e["id"], e["type"], e["provider_id"], sorted(i for i in ids if i)))
        self.record("database and servers agree on every accepted call (provider id = the id the "
                    "server answered)", not mism,
                    f"{sum(1 for e in E.values() if e['state'] == 'completed')} checked, {len(mism)} "
                    f"mismatched {mism[:3] if mism else ''}")
        # b. calls in the attempts log vs requests the servers saw, per effect:
        #    answered calls <= requests <= calls that may have left the host
        #    (logged calls that were not 'not_sent', plus reaper rows for calls
        #    whose worker died or froze before it could log them).
        off = []
        tot_req = tot_ans = abandoned = 0
        for e in E.values():
            rs = self.sends(self.receipts[e["id"]])
            atts = self.attempts[e["id"]]
            calls = [a for a in atts if a["worker"] and not a["worker"].startswith("reaper:")
                     and a["outcome"] in ("accepted", "retry", "terminal", "ambiguous", "not_sent")]
            answered = [a for a in calls if a["status"]]
            may = [a for a in calls if a["outcome"] != "not_sent"]
            reaped = [a for a in atts if a["worker"] and a["worker"].startswith("reaper:")]
            tot_req += len(rs)
            tot_ans += len(answered)
            extra = len(rs) - len(may) - len(reaped)
            if extra > 0 and e["type"] == "email":
                # An SMTP session the worker gave up on (whole-call timeout,
                # queue wait included) goes on talking to the relay until the
                # end of data, where it is aborted: a call logged not_sent can
                # still reach RCPT.  Counted apart (see RELIABILITY.md).
                gave_up = [a for a in calls if a["outcome"] == "not_sent"]
                late = [r for r in rs if any(a["started"] <= r["t"] and gave_up_by(a, r["t"])
                                             for a in gave_up)]
                n = min(extra, len(gave_up), len(late))
                abandoned += n
                extra -= n
            if not (len(answered) <= len(rs)) or extra > 0:
                off.append((e["id"], e["type"], len(answered), len(rs), len(may), len(reaped)))
        self.record("attempts log and servers' request counts agree per effect (answered calls <= "
                    "requests received <= calls that may have left)", not off,
                    f"{tot_req} requests received, {tot_ans} answered calls logged, "
                    f"{len(self.stray)} stray requests, {abandoned} SMTP sessions that reached the "
                    f"relay after the worker logged them not_sent (aborted before the end of data); "
                    f"{len(off)} effects off {dict(collections.Counter(o[1] for o in off))} "
                    f"{off[:3] if off else ''}")
        # c. the database's counts vs outboxctl status
        r = ctl("status", "--json")
        counts = json.loads(r.stdout)["counts"] if r.returncode == 0 else {}
        st = collections.Counter(e["state"] for e in E.values())
        same = all(counts.get(s, -1) == st.get(s, 0) for s in ("pending", "sending", "completed",
                                                                "unknown", "failed"))
        self.record("outboxctl status agrees with the table", same, f"status {counts}")

    def check_metrics(self):
        """Per surviving worker (never SIGKILLed: a killed worker's counters die
        with it): outbox_sends_total{provider,outcome} == its rows in the
        attempts log; reaped counters == its reaper rows; the unknown gauge ==
        the table."""
        rows = collections.Counter()
        reaped = collections.Counter()
        for eid, atts in self.attempts.items():
            t = self.effects[eid]["type"] if eid in self.effects else "?"
            for a in atts:
                w = a["worker"] or ""
                if w.startswith("reaper:"):
                    reaped[w[7:]] += 1
                elif a["outcome"] not in RECONCILE_CLASSES:
                    rows[(w, t, a["outcome"])] += 1
        bad = []
        n_sends = 0
        unknown = sum(1 for e in self.effects.values() if e["state"] == "unknown")
        for w in self.ch.survivors:
            m = self.ch.scraped.get(w.name)
            if m is None:
                bad.append((w.name, "not scraped"))
                continue
            got = collections.Counter()
            for (k, labels), v in m.items():
                if k == "outbox_sends_total":
                    d = dict(labels)
                    got[(w.name, d["provider"], d["outcome"])] = int(v)
                    n_sends += int(v)
            want = {k: v for k, v in rows.items() if k[0] == w.name}
            if {k: v for k, v in got.items() if v} != want:
                bad.append((w.name, "sends", dict(got), want))
            mr = m.get(("outbox_reaped_unknown_total", ()), 0) + m.get(("outbox_reaped_pending_total", ()), 0)
            if int(mr) != reaped[w.name]:
                bad.append((w.name, "reaped", mr, reaped[w.name]))
            if int(m.get(("outbox_unknown_effects", ()), -1)) != unknown:
                bad.append((w.name, "unknown gauge", m.get(("outbox_unknown_effects", ()))))
        self.record("metrics of the surviving workers agree with the attempts log",
                    not bad and bool(self.ch.survivors),
                    f"{len(self.ch.survivors)} survivors ({', '.join(w.name for w in self.ch.survivors)}), "
                    f"{n_sends} sends counted = their attempt rows; {len(bad)} disagreements {bad[:2] if bad else ''}")

    def off_windows_committed(self):
        """The switch's off periods as the database ordered them: from the
        commit of each flip to off (outbox_control_history, the row written
        with the flip) to the commit of the next flip to on, or for ever."""
        flips = self.db.q("SELECT enabled, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8 "
                          "FROM outbox_control_history ORDER BY change_id")
        wins = []
        for enabled, t in flips:
            t = float("-inf") if t is None else t     # committed before the server recorded times
            if not enabled and (not wins or wins[-1][1] is not None):
                wins.append([t, None])
            elif enabled and wins and wins[-1][1] is None:
                wins[-1][1] = t
        return [(t_off, float("inf") if t_on is None else t_on) for t_off, t_on in wins]

    def sending_commits(self):
        """effect id -> commit times of its transitions to `sending`, in order."""
        out = collections.defaultdict(list)
        for eid, t in self.db.q(
                "SELECT effect_id::text, extract(epoch FROM pg_xact_commit_timestamp("
                "(xid::text::bigint % 4294967296)::text::xid))::float8 FROM chaos_sending"):
            out[eid].append(t)
        for ts in out.values():
            ts.sort()
        return out

    def check_kill_switch(self):
        """No send may start while the switch is off: every request a server
        received and every provider call the log says started goes back to
        the transition to `sending` that let it go (its effect's last one
        committed before it; the worker sends only once that commit is
        answered), and no such transition may have committed after a flip to
        off and before the next flip to on.  Commit timestamps order the
        flips and the transitions, so a send marked just before the off and
        arriving after it (in flight, on a loaded machine, or from a worker
        SIGSTOPped in between) is not counted inside the window."""
        E = self.effects
        wins = self.off_windows_committed()
        commits = self.sending_commits()
        viol = []
        in_window = marked_before = 0

        events = []
        for eid, rs in self.receipts.items():
            for r in self.sends(rs):
                events.append((r["t"], eid, "request"))
        for eid, atts in self.attempts.items():
            for a in atts:
                # Not reconciliation answers: a lookup is a read (GET, no
                # body), allowed while the switch is off, like crm's.
                if a["worker"] and not a["worker"].startswith("reaper:") and \
                        a["outcome"] != "not_sent" and a["outcome"] not in RECONCILE_CLASSES:
                    # started_at is in whole milliseconds: a send started
                    # in the millisecond of its commit reads as before it.
                    events.append((a["started"] + 0.001, eid, "call"))
        for t, eid, what in events:
            before = [c for c in commits.get(eid, []) if c is not None and c <= t]
            if not before:
                viol.append((what, eid, E[eid]["type"], "no transition to sending before it"))
                continue
            mark = before[-1]
            for t_off, t_on in wins:
                if t_off < mark < t_on:
                    viol.append((what, eid, E[eid]["type"], f"marked {mark - t_off:.3f}s after the off"))
                elif t_off < t < t_on:
                    in_window += 1
                    marked_before += mark <= t_off
        closed = [(a, b) for a, b in wins if b != float("inf") and a != float("-inf")]
        total = sum(b - a for a, b in closed)
        self.record("no send started while the kill switch was off",
                    not viol and len(closed) >= self.ch.counts["kill_switch_off"],
                    f"{len(closed)} off windows by commit time ({total:.1f}s in all; "
                    f"{self.ch.counts['kill_switch_off']} flips made), "
                    f"{sum(len(v) for v in commits.values())} transitions to sending; inside the windows "
                    f"{in_window} requests/calls, {marked_before} of them marked before the off; "
                    f"{len(viol)} violations {viol[:3] if viol else ''}")

    def unknown_split(self):
        """What stays unknown, by whether the provider was reached (the
        servers' receipts: a request processed), and what was resolved
        automatically, by how (the attempts log)."""
        split = collections.Counter()
        for e in self.effects.values():
            if e["state"] != "unknown":
                continue
            reached = any(r.get("processed") for r in self.receipts[e["id"]])
            split[f"{e['type']}/{'reached the provider' if reached else 'never reached the provider'}"] += 1
        resolved = collections.Counter()
        for e in self.effects.values():
            for a in self.attempts[e["id"]]:
                if a["resolution"] and a["cas"]:
                    resolved[f"{e['type']}/{a['resolution']}"] += 1
                elif a["outcome"] in ("reconciled_sent", "reconciled_not_sent") and a["cas"] \
                        and not (a["worker"] or "").startswith("operator"):
                    resolved[f"{e['type']}/lookup_{a['outcome'].split('_', 1)[1]}"] += 1
        n = len(self.effects) or 1
        unknown = sum(split.values())
        auto = sum(resolved.values())
        self.split = {"unknown": unknown, "unknown_by_cause": dict(split),
                      "resolved_automatically": auto, "resolved_by_how": dict(resolved),
                      "unknown_share": round(unknown / n, 5),
                      "unknown_share_without_resolution": round((unknown + auto) / n, 5)}
        print("\n== unknown: what stays, and what was resolved automatically")
        for k, v in sorted(split.items()):
            print(f"  {v:6d}  stays unknown: {k}")
        for k, v in sorted(resolved.items()):
            print(f"  {v:6d}  resolved automatically: {k}")
        print(f"  unknown {unknown}/{n} = {100.0 * unknown / n:.2f} %; without the automatic "
              f"resolutions {unknown + auto}/{n} = {100.0 * (unknown + auto) / n:.2f} %")

    def unknown_causes(self, late_unknown):
        self.unknown_split()
        causes = collections.Counter()
        killed = set(self.ch.kill_times)
        stopped = set(self.ch.stop_windows)
        for e in self.effects.values():
            if e["state"] != "unknown":
                continue
            amb = [a for a in self.attempts[e["id"]] if a["outcome"] == "ambiguous"]
            reaped = [a for a in amb if (a["worker"] or "").startswith("reaper:")]
            a = reaped[-1] if reaped else (amb[-1] if amb else None)
            if a is None:
                causes["(no ambiguous attempt)"] += 1
            elif (a["worker"] or "").startswith("reaper:"):
                lost = re.search(r"worker (\S+) lost", a["error"] or "")
                who = lost.group(1) if lost else "?"
                causes["lease expired: worker SIGKILLed mid-send" if who in killed else
                       "lease expired: worker SIGSTOPped mid-send" if who in stopped else
                       "lease expired: worker alive (database outage)"] += 1
            else:
                faults = [r["fault"] for r in self.sends(self.receipts[e["id"]])]
                last = faults[-1] if faults else "no request received"
                err = re.split(r"[(:]", a["error"] or "")[0].strip()[:50]
                if err.startswith("sent, no answer"):
                    err = "sent, no answer: " + (a["error"] or "").split(": ", 1)[-1][:30]
                causes[f"{e['type']} ambiguous ({err}); server fault {last}"] += 1
        self.causes = dict(causes)
        print("\n== unknown effects by cause")
        for k, v in causes.most_common():
            print(f"  {v:6d}  {k}")
        print(f"  ({late_unknown} unknown effects have a late 'accepted' outcome in the log: "
              f"delivered, for the operator to resolve)")


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    # Stopped from outside (run.sh's caller timing out): stop the fleet and
    # the servers before going.  SIGINT too, even where the shell that
    # started us in the background set it to be ignored.
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    ch = Chaos()
    try:
        ch.setup()
        ch.run()
    except KeyboardInterrupt as e:
        say(f"interrupted ({e}): stopping the fleet, no checks")
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ch.shutdown()
    passed, failed = Checks(ch).run()
    print(f"\nwork dir {WORK}; seed {SEED}; {time.time() - T0:.0f}s")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

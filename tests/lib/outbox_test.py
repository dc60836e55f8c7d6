# SPDX-License-Identifier: ISC
"""Helpers shared by the integration suites: connection strings, running
outboxctl and workers, seeding runs and effects, waiting for conditions.

Nothing here sleeps for a fixed time to "let things happen": wait_for()
polls a condition with a deadline and fails with what it last saw.
"""
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid

import psycopg2

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_DIR = os.path.join(ROOT, os.environ.get("BUILD_DIR", "build"))


def admin_dsn(dbname="postgres"):
    return (f"host={os.environ['PGHOST']} port={os.environ['PGPORT']} "
            f"user={os.environ.get('PGUSER', 'postgres')} dbname={dbname}")


def dsn_for(dbname):
    return admin_dsn(dbname)


# Least privilege, as the docs deploy it: workers, outboxctl and producers
# log in as roles that are members of one group role each (sql/100_baseline.sql), so a
# missing grant fails a test.  Roles are cluster-wide: made once per
# cluster (ensure_test_roles, from conftest).  Inspection and setup queries
# of the tests themselves stay superuser.
WORKER_ROLE = "outbox_test_worker"       # member of outbox_dispatcher only
OPERATOR_ROLE = "outbox_test_operator"   # member of outbox_operator (outboxctl except migrate)
PRODUCER_ROLE = "outbox_test_producer"   # member of outbox_producer
TEST_ROLES = ((WORKER_ROLE, "outbox_dispatcher"), (OPERATOR_ROLE, "outbox_operator"),
              (PRODUCER_ROLE, "outbox_producer"))


def ensure_test_roles(conn):
    """Create the login roles once per cluster (the group roles exist once
    a database was migrated)."""
    with conn.cursor() as cur:
        for role, group in TEST_ROLES:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            if not cur.fetchone():
                cur.execute(f"CREATE ROLE {role} LOGIN IN ROLE {group}")


def dsn_as(dsn, role):
    """The same key=value conninfo, logging in as `role`, if it logs in as
    the admin user now (a conninfo naming another user, or a URL, is kept)."""
    admin = os.environ.get("PGUSER", "postgres")
    m = re.search(r"(^|\s)user=(\S+)", dsn)
    if "://" in dsn or (m and m.group(2) != admin):
        return dsn
    if m:
        return dsn[:m.start(2)] + role + dsn[m.end(2):]
    return f"{dsn} user={role}"


def worker_dsn(dsn):
    return dsn_as(dsn, WORKER_ROLE)


def operator_dsn(dsn):
    return dsn_as(dsn, OPERATOR_ROLE)


def producer_dsn(dsn):
    return dsn_as(dsn, PRODUCER_ROLE)


def run_ctl(args, env=None, timeout=60, input=None):
    """outboxctl as the operator role (migrate as the owner, the admin)."""
    args = list(args)
    e = dict(os.environ)
    if "migrate" not in args:
        for i in range(len(args) - 1):
            if args[i] == "--db":
                args[i + 1] = operator_dsn(args[i + 1])
        e["PGUSER"] = OPERATOR_ROLE
    if env:
        e.update(env)
    return subprocess.run([os.path.join(BUILD_DIR, "outboxctl")] + args,
                          capture_output=True, text=True, env=e, timeout=timeout,
                          input=input)


def ctl(db, *args):
    """outboxctl --db db ARGS."""
    return run_ctl(["--db", db] + list(args))


def ok(r):
    """r (a finished outboxctl) exited 0; else its output in the failure."""
    assert r.returncode == 0, f"rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    return r


def fails(r, code, *words):
    """r exited with code and its stderr names every one of words."""
    assert r.returncode == code, f"rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    for w in words:
        assert w in r.stderr, f"{w!r} not in stderr: {r.stderr}"
    return r


@contextlib.contextmanager
def machine_lock(name):
    """Held while a test uses something the whole machine shares (the
    shipped config's port 9464): two suite runs side by side (two clones,
    a cold run beside another) take turns instead of meeting there.  The
    lock lives in /run/lock, not under TMPDIR, which is each run's own."""
    path = os.path.join("/run/lock" if os.access("/run/lock", os.W_OK) else "/var/tmp",
                        f"outbox-test-{name}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def wait_for(cond, timeout=30.0, interval=0.02, what="condition"):
    """Poll cond() until it returns a truthy value; return that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def query(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        if cur.description is None:
            return None
        return cur.fetchall()


def scalar(conn, sql, args=None):
    rows = query(conn, sql, args)
    return rows[0][0] if rows else None


def make_run(conn, key=None, state="processing"):
    """Create a workflow run directly, in `processing` (the state in which
    effects may be added: the approval gate)."""
    key = key or "run-" + uuid.uuid4().hex[:10]
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "VALUES (%s, %s, 'h')", (key, state))
    return key


def as_producer(conn, sql, args=None):
    """Run one statement on conn as the producer role (SET ROLE: the same
    privilege checks as its login, on the caller's connection and
    transaction); returns its first column of the first row."""
    with conn.cursor() as cur:
        if conn.autocommit:
            # Its own transaction with SET LOCAL: nothing outlives it, even
            # on a server connection that PgBouncer hands to someone else.
            cur.execute("BEGIN")
            try:
                cur.execute(f"SET LOCAL ROLE {PRODUCER_ROLE}")
                cur.execute(sql, args)
                row = cur.fetchone() if cur.description else None
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            return row[0] if row else None
        cur.execute(f"SET ROLE {PRODUCER_ROLE}")
        try:
            cur.execute(sql, args)
            row = cur.fetchone() if cur.description else None
        finally:
            if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_INERROR:
                cur.execute("RESET ROLE")
    return row[0] if row else None


def enqueue(conn, effect_type, target, payload, key=None, metadata=None):
    """Create a run and one effect with the plain four-column INSERT path,
    as the producer role; returns the effect id."""
    key = key or make_run(conn)
    if metadata is None:
        return as_producer(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                                 "VALUES (%s, %s, %s, %s) RETURNING effect_id",
                           (key, effect_type, target, json.dumps(payload)))
    return as_producer(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
                             "VALUES (%s, %s, %s, %s, %s) RETURNING effect_id",
                       (key, effect_type, target, json.dumps(payload), json.dumps(metadata)))


def kill_switch(conn, enabled, operator="test", reason="test"):
    return query(conn, "SELECT * FROM outbox_kill_switch_set(%s, %s, %s)",
                 (enabled, operator, reason))


def effect(conn, effect_id):
    rows = query(conn, "SELECT state, attempts, provider_id, last_error_class, last_error, "
                       "last_status FROM outbox_effects WHERE effect_id = %s", (effect_id,))
    if not rows:
        return None
    k = ("state", "attempts", "provider_id", "last_error_class", "last_error", "last_status")
    return dict(zip(k, rows[0]))


def attempts(conn, effect_id):
    rows = query(conn, "SELECT attempt, outcome_class, provider_status, provider_id, error_text, "
                       "cas_applied, worker FROM effect_attempts WHERE effect_id = %s "
                       "ORDER BY attempt_id", (effect_id,))
    k = ("attempt", "outcome_class", "provider_status", "provider_id", "error_text",
         "cas_applied", "worker")
    return [dict(zip(k, r)) for r in rows]


def run_state(conn, key):
    """A run's state as a reader gets it: settled first from its effects
    (outbox_settle_runs), as every function that reads a run does."""
    query(conn, "SELECT outbox_settle_runs(ARRAY[%s])", (key,))
    return scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,))


def states(conn):
    return dict(query(conn, "SELECT state, count(*) FROM outbox_effects GROUP BY state"))


def write_config(path, sections):
    """sections: {"dispatcher": {"lease_seconds": 5}, "provider.http": {...}}"""
    with open(path, "w") as f:
        for sec, kv in sections.items():
            f.write(f"[{sec}]\n")
            for k, v in kv.items():
                if isinstance(v, bool):
                    v = "true" if v else "false"
                f.write(f"{k} = {v}\n")
            f.write("\n")
    return path


class Dispatcher:
    """One outbox-dispatcher process with a generated config.

    config: {"section": {"key": value}} merged over test defaults (fast
    polling, metrics off, short leases, the loopback sink allowed); the
    worker logs in as WORKER_ROLE.  args: extra command-line arguments."""

    def __init__(self, dsn, tmp_path, config, env=None, name="w1", args=()):
        self.dsn = dsn
        self.name = name
        self.tmp = tmp_path
        self.config_path = str(tmp_path / f"{name}.ini")
        self.log_path = str(tmp_path / f"{name}.log")
        sections = {
            "database": {"conninfo": worker_dsn(dsn)},
            "dispatcher": {"worker_name": name, "provider_dir": os.path.join(BUILD_DIR, "providers"),
                           "poll_interval_ms": 200, "lease_seconds": 10},
            "metrics": {"listen": ""},
            "provider.http": {"allow_hosts": "127.0.0.1,localhost", "timeout_ms": 3000,
                              "backoff_base_ms": 10, "backoff_cap_ms": 100},
        }
        for sec, kv in config.items():
            if kv is None:
                sections.pop(sec, None)
                continue
            sections.setdefault(sec, {}).update(kv)
        self.sections = sections
        write_config(self.config_path, sections)
        self.env = dict(os.environ)
        self.env["AI_ACTIONS_ENABLED"] = "true"
        if env:
            for k, v in env.items():
                if v is None:
                    self.env.pop(k, None)
                else:
                    self.env[k] = v
        self.args = list(args)
        self.proc = None
        # The test took the exit status itself (wait()) or chose how the
        # worker dies (kill()): stop() then does not judge it.
        self.exit_seen = False

    def start(self, wait_ready=True):
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", self.config_path] + self.args,
            stdout=self.logf, stderr=self.logf, env=self.env)
        if wait_ready:
            wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout=30,
                     what=f"{self.name} ready")
            assert self.proc.poll() is None, f"{self.name} exited: {self.log()}"
        return self

    def ready(self):
        return any(e.get("event") == "ready" for e in self.events())

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def events(self):
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def signal(self, sig):
        self.proc.send_signal(sig)

    def wait(self, timeout=30):
        rc = self.proc.wait(timeout=timeout)
        self.exit_seen = True
        return rc

    def stop(self, timeout=20):
        """SIGTERM and wait; the worker must exit 0 (a graceful stop), so
        that a sanitizer's report at exit (a leak, a use after free in
        teardown: exit 1 or 23) fails the test.  A worker that already
        exited must have exited 0 too, unless the test took its status
        (wait()) or killed it (kill())."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} did not stop on SIGTERM within {timeout}s")
            finally:
                self.logf.close()
        else:
            if not self.logf.closed:
                self.logf.close()
            if self.exit_seen:
                return self.proc.returncode
        rc = self.proc.returncode
        self.exit_seen = True
        assert rc == 0, f"{self.name} exited {rc}:\n{self.log()[-4000:]}"
        return rc

    def kill(self):
        """SIGKILL: the test's choice, so stop() does not judge the status."""
        self.exit_seen = True
        self.proc.kill()
        self.proc.wait()
        self.logf.close()


def connect(dsn):
    c = psycopg2.connect(dsn)
    c.autocommit = True
    return c


def pg_restart():
    """Restart the test PostgreSQL server in place (same port), as root
    through the postgres user like tests/lib/pg.sh does."""
    d = os.environ["PG_TEST_DIR"]
    pg_ctl = os.path.join(os.environ["PG_BIN"], "pg_ctl")
    cmd = f"'{pg_ctl}' -D '{d}/data' -m fast -w -t 60 restart -l '{d}/server.log'"
    if os.geteuid() == 0:
        subprocess.run(["su", "-s", "/bin/sh", "postgres", "-c", cmd], check=True,
                       capture_output=True)
    else:
        subprocess.run(["sh", "-c", cmd], check=True, capture_output=True)


# -- the http provider with fast retries, and rows arranged by SQL -------

FAST = {"backoff_base_ms": 10, "backoff_cap_ms": 50, "max_attempts": 3}


def http_cfg(**kw):
    c = dict(FAST)
    c.update(kw)
    return {"provider.http": c}


def final(conn, eid, timeout=20):
    return wait_for(lambda: (lambda e: e if e["state"] not in ("pending", "sending") else None)(
        effect(conn, eid)), timeout=timeout, what=f"effect {eid} to settle")


def free_port():
    """A loopback port nothing listens on right now: for a server to bind
    next, or left alone, a port that refuses connections."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def add_due(conn, n, at="now() - interval '1 minute'"):
    """n pending http effects of one run, all due at the same instant."""
    key = make_run(conn)
    ids = [str(r[0]) for r in query(
        conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
              "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, %s) g "
              "RETURNING effect_id", (key, n))]
    query(conn, f"UPDATE effect_live SET available_at = {at} WHERE effect_id = ANY(%s::uuid[])",
          (ids,))
    return ids


def expire_sending(conn, ids, ago="1 second"):
    """`sending` effects whose lease ran out `ago` (their worker died
    mid-send), as time would make them: the live rows' leases and the
    deadlines of the calls that moved them."""
    query(conn, "UPDATE effect_live SET lease_expires_at = now() - %s::interval "
                "WHERE effect_id = ANY (%s::uuid[]) AND state = 'sending'", (ago, list(ids)))
    query(conn, "UPDATE effect_calls SET deadline = now() - %s::interval "
                "WHERE ids && %s::uuid[]", (ago, list(ids)))


def finish_as(conn, ids, state, error_class=None, error=None, provider_id=None):
    """Open effects finished in `state` (completed or failed) the way a
    test arranges it, as the table owner: the live rows deleted and, in the
    same statement, their finishing history rows (docs/design.md, "State
    changes")."""
    query(conn, "WITH gone AS (DELETE FROM effect_live WHERE effect_id = ANY (%s::uuid[]) "
                "RETURNING *) "
                "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "state, last_error_class, last_error, last_provider_id, provider_status, "
                "retry_base) "
                "SELECT effect_id, created_at, attempts, 'test', now(), %s, "
                "coalesce(%s, last_error_class), coalesce(%s, last_error), "
                "coalesce(%s, provider_id), last_status, retry_base FROM gone",
          (list(ids), state, error_class, error, provider_id))


# -- query plans -----------------------------------------------------------

def plans_of(conn, sql, args):
    """The plans auto_explain reports for the statements sql runs,
    nested ones included."""
    query(conn, "LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "auto_explain.log_level = notice", "client_min_messages = notice"):
        query(conn, "SET " + setting)
    del conn.notices[:]
    query(conn, sql, args)
    query(conn, "SET auto_explain.log_min_duration = -1")
    return "\n".join(conn.notices)


def finished_rows_and_some_in_flight(conn, owner, pending, in_flight):
    """A queue of some size: 20,000 completed effects, `pending` new ones of
    which `in_flight` are leased by owner and moved to `sending`.  Returns
    the ids in flight."""
    key = make_run(conn)
    done = [r[0] for r in query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, "
                                      "target, payload) SELECT %s, 'http', "
                                      "'http://127.0.0.1:9/done' || g, '{}' "
                                      "FROM generate_series(1, 20000) g RETURNING effect_id::text",
                                (key,))]
    finish_as(conn, done, "completed")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, %s) g",
          (key, pending))
    ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                     "'{http}', true)", (owner, in_flight))]
    query(conn, "SELECT * FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)",
          (owner, ids, str(uuid.uuid4())))
    return ids


def scrape(port):
    """A worker's /metrics as {sample name with its labels: value}."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def unknown_resolved(port, how):
    """outbox_unknown_resolved_total{how} from a worker's /metrics."""
    name = f'outbox_unknown_resolved_total{{how="{how}"}}'
    got = scrape(port)
    if name not in got:
        raise AssertionError(f"no {name} in /metrics")
    return int(got[name])

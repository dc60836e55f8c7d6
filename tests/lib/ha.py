# SPDX-License-Identifier: ISC
"""What the high-availability suites start besides the shared test server
a PgBouncer in transaction mode in front of a PostgreSQL, and a
primary with a streaming standby that a test can fail over.

Everything runs on loopback, on free ports, in temporary folders, and is
stopped by the test that started it.  PostgreSQL and PgBouncer refuse to run
as root, so as root they run as the `postgres` system user, like
tests/lib/pg.sh does; their folders are made readable to it.

rehost() is the one place where these suites build connection strings: it
keeps whatever a conninfo says (user, dbname, password ...) and points it at
other hosts and ports.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from outbox_test import free_port, wait_for

PG_BIN = os.environ.get("PG_BIN") or sorted(
    (os.path.join("/usr/lib/postgresql", v, "bin") for v in os.listdir("/usr/lib/postgresql")),
    key=lambda p: int(p.split("/")[-2]))[-1]
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def rehost(dsn, hosts, **extra):
    """dsn (keyword = value form) pointed at hosts [(host, port), ...];
    extra keywords are added or replaced (target_session_attrs=...)."""
    kv = dict(re.findall(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn))
    kv["host"] = ",".join(h for h, _ in hosts)
    kv["port"] = ",".join(str(p) for _, p in hosts)
    kv.update({k: str(v) for k, v in extra.items()})
    return " ".join(f"{k}={v}" for k, v in kv.items())


def dsn_dbname(dsn):
    return re.search(r"\bdbname\s*=\s*(\S+)", dsn).group(1)


def as_postgres(cmd, check=True, **kw):
    """Run a shell command as the cluster's owner (postgres when root)."""
    if os.geteuid() == 0:
        argv = ["su", "-s", "/bin/sh", "postgres", "-c", cmd]
    else:
        argv = ["sh", "-c", cmd]
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd}: rc {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def scratch_dir(prefix):
    """A temporary folder the postgres user can write to."""
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)
    if os.geteuid() == 0:
        shutil.chown(d, "postgres")
    return d


class PgBouncer:
    """pgbouncer in transaction pooling mode on a free loopback port,
    in front of server (host, port).  Every login role of that server may
    connect (auth_type trust, the test server's own trust rules behind it);
    pools are per database and user, default_pool_size each."""

    def __init__(self, server, roles, pool_size=4, admin="postgres"):
        self.dir = scratch_dir("outbox-pgbouncer.")
        self.port = free_port()
        self.pool_size = pool_size
        self.admin = admin
        with open(os.path.join(self.dir, "users.txt"), "w") as f:
            for r in roles:
                f.write(f'"{r}" ""\n')
        self.ini = os.path.join(self.dir, "pgbouncer.ini")
        with open(self.ini, "w") as f:
            f.write(f"""[databases]
* = host={server[0]} port={server[1]}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
admin_users = {admin}
stats_users = {admin}
pool_mode = transaction
default_pool_size = {pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
max_db_connections = 0
ignore_startup_parameters = extra_float_digits
logfile = {self.dir}/pgbouncer.log
pidfile = {self.dir}/pgbouncer.pid
""")
        for name in os.listdir(self.dir):
            if os.geteuid() == 0:
                shutil.chown(os.path.join(self.dir, name), "postgres")
        self.proc = None

    def start(self):
        argv = [PGBOUNCER, self.ini]
        if os.geteuid() == 0:
            argv = [PGBOUNCER, "-u", "postgres", self.ini]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"pgbouncer exited: {self.proc.stderr.read()} {self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return True
            except OSError:
                return False
        wait_for(up, timeout=20, what="pgbouncer listening")
        return self

    def log(self):
        try:
            with open(os.path.join(self.dir, "pgbouncer.log")) as f:
                return f.read()
        except OSError:
            return ""

    def via(self, dsn):
        """dsn through this pgbouncer."""
        return rehost(dsn, [("127.0.0.1", self.port)])

    def admin_dsn(self):
        return f"host=127.0.0.1 port={self.port} user={self.admin} dbname=pgbouncer"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)   # immediate shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Node:
    """One PostgreSQL server of a test cluster, in its own folder."""

    def __init__(self, root, name):
        self.dir = os.path.join(root, name)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self.port = free_port()
        os.makedirs(self.dir)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")

    def pg_ctl(self, args, check=True):
        return as_postgres(f"'{PG_BIN}/pg_ctl' -D '{self.data}' {args}", check=check)

    def start(self):
        self.pg_ctl(f"-l '{self.log}' -w -t 60 -o \"-p {self.port} -k '{self.dir}'\" start")

    def stop(self, mode="fast"):
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self.pg_ctl(f"-m {mode} -w -t 60 stop", check=False)

    def dsn(self, dbname="postgres"):
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def server_log(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


class Cluster:
    """A primary and one streaming standby made with `pg_basebackup -R`.

    synchronous: the primary waits for the standby's flush before a commit
    returns (synchronous_standby_names = '*', synchronous_commit = on);
    otherwise replication is asynchronous.  Both run with the test
    server's fast settings (fsync off: only processes die in these tests,
    never the machine, so the page cache keeps what was written)."""

    SETTINGS = """
listen_addresses = '127.0.0.1'
fsync = off
full_page_writes = off
max_connections = 100
shared_buffers = 64MB
wal_level = replica
max_wal_senders = 5
wal_keep_size = 256MB
hot_standby = on
synchronous_commit = on
"""

    def __init__(self, synchronous):
        self.root = scratch_dir("outbox-ha.")
        self.synchronous = synchronous
        self.primary = Node(self.root, "a")
        self.standby = Node(self.root, "b")

    def start(self):
        import psycopg2
        p = self.primary
        as_postgres(f"'{PG_BIN}/initdb' -D '{p.data}' -U postgres --auth=trust -E UTF8 --no-sync "
                    f">'{p.dir}/initdb.log' 2>&1")
        with open(os.path.join(p.data, "postgresql.conf"), "a") as f:
            f.write(self.SETTINGS)
        p.start()
        as_postgres(f"'{PG_BIN}/pg_basebackup' -h 127.0.0.1 -p {p.port} -U postgres "
                    f"-D '{self.standby.data}' -R -X stream -c fast --no-sync")
        self.standby.start()
        if self.synchronous:
            # On the primary only: the promoted standby has no standby of
            # its own to wait for (a failover manager turns synchronous
            # mode off on the new primary until a replica is back).
            c = psycopg2.connect(p.dsn())
            c.autocommit = True
            c.cursor().execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            c.cursor().execute("SELECT pg_reload_conf()")
            c.close()
        want = "sync" if self.synchronous else "async"
        wait_for(lambda: (self.replication() or (None, None))[:2] == ("streaming", want),
                 timeout=30, what=f"the standby streaming ({want})")
        return self

    def both(self):
        return [("127.0.0.1", self.primary.port), ("127.0.0.1", self.standby.port)]

    def replication(self):
        """(state, sync_state, replay lag in bytes) of the standby, as the
        primary sees it; None before it connects."""
        import psycopg2
        c = psycopg2.connect(self.primary.dsn())
        c.autocommit = True
        with c.cursor() as cur:
            cur.execute("SELECT state, sync_state, "
                        "pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) FROM pg_stat_replication")
            row = cur.fetchone()
        c.close()
        return row

    def fail_over(self):
        """What a failover manager does when the primary dies: the primary
        stopped hard (immediate: no shutdown checkpoint, clients cut),
        the standby promoted.  Returns how long that took (seconds)."""
        t0 = time.monotonic()
        self.primary.stop("immediate")
        self.standby.pg_ctl("-w -t 60 promote")
        return time.monotonic() - t0

    def stop(self):
        self.primary.stop("immediate")
        self.standby.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def copy_roles(src_dsn, dst_dsn):
    """The roles (and memberships) of the shared test server on another
    server: whatever roles tests/run.sh creates, the workers, producers and
    outboxctl log in the same way on a cluster a test made."""
    env = dict(os.environ)
    env.pop("PGDATABASE", None)
    dump = subprocess.run([os.path.join(PG_BIN, "pg_dumpall"), "--globals-only", "--no-tablespaces",
                           "-d", src_dsn], capture_output=True, text=True, env=env, check=True)
    # The bootstrap superuser exists already: psql goes on past that error.
    subprocess.run([os.path.join(PG_BIN, "psql"), "-q", "-d", dst_dsn], input=dump.stdout,
                   capture_output=True, text=True, env=env)

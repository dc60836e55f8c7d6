# SPDX-License-Identifier: ISC
"""Shared fixtures for the integration suites.

tests/run.sh has already started a throwaway PostgreSQL and exported
PGHOST/PGPORT/PGUSER.  Here: a template database migrated once with the
real `outboxctl migrate`, a fresh copy of it per test, and the helpers
every suite uses (running workers, waiting for conditions).
"""
import os
import subprocess
import sys
import tempfile
import uuid

import psycopg2
import pytest

# The helpers (tests/lib) and the test servers (tests/servers) import by
# name from every test folder.
for _folder in ("lib", "servers"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), _folder))

from outbox_test import (  # noqa: E402
    BUILD_DIR, ROOT, Dispatcher, admin_dsn, dsn_for, ensure_test_roles, machine_lock, query,
    run_ctl,
)

TEMPLATE = "outbox_tpl"


def pytest_configure(config):
    config.addinivalue_line("markers", "exclusive: disturbs the shared PostgreSQL server "
                            "(restarts it); tests/run.sh runs these alone, after the rest")
    config.addinivalue_line("markers", "slow: takes more than 30 seconds (runs in CI all the "
                            "same; -m 'not slow' leaves it out of a quick local run)")
    if not os.environ.get("PGPORT"):
        raise pytest.UsageError("run the suite through tests/run.sh (make test): "
                                "it starts the PostgreSQL server the tests use")


@pytest.fixture
def shipped_port():
    """Port 9464, the shipped config's [metrics] listen, held for the
    test: another suite run on the machine waits for it (machine_lock)."""
    with machine_lock("port-9464"):
        yield 9464


@pytest.fixture(scope="session")
def template_db():
    # tests/run.sh creates it before the (parallel) run; this covers a
    # pytest started by hand, serialized by a lock across xdist workers.
    conn = psycopg2.connect(admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(727)")
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (TEMPLATE,))
        if not cur.fetchone():
            cur.execute(f"CREATE DATABASE {TEMPLATE}")
            r = run_ctl(["--db", dsn_for(TEMPLATE), "migrate"])
            assert r.returncode == 0, r.stderr
        # The login roles workers, outboxctl and producers use.
        ensure_test_roles(conn)
        cur.execute("SELECT pg_advisory_unlock(727)")
    conn.close()
    return TEMPLATE


@pytest.fixture
def unmigrated_db(template_db):
    """A new empty database, not migrated (the template's fixture makes the
    test logins): for a migrate of another release, or from nothing.  Its
    name; dropped at the end."""
    name = "e_" + uuid.uuid4().hex[:12]
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    yield name
    admin.close()
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()


@pytest.fixture
def db(template_db):
    """A fresh migrated database for one test; its conninfo string."""
    name = "t_" + uuid.uuid4().hex[:12]
    conn = psycopg2.connect(admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    conn.close()
    yield dsn_for(name)
    # A fresh connection: a test may have restarted the server.
    conn = psycopg2.connect(admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    conn.close()


@pytest.fixture
def conn(db):
    """An autocommit superuser connection to the test's database."""
    c = psycopg2.connect(db)
    c.autocommit = True
    yield c
    c.close()


@pytest.fixture
def dispatchers(db, tmp_path):
    """Factory: dispatchers(n=1, **config) starts workers on the test's
    database (logged in as the worker role); all are stopped (SIGTERM,
    then SIGKILL) at teardown."""
    started = []

    def start(config=None, env=None, name=None, args=()):
        d = Dispatcher(db, tmp_path, config or {}, env=env,
                       name=name or f"w{len(started) + 1}", args=args)
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def build_dir():
    return BUILD_DIR


@pytest.fixture
def smtp():
    """The scripted SMTP peer (tests/servers/smtp_server.py) on a free
    loopback port, default options."""
    from smtp_server import SmtpServer
    s = SmtpServer()
    s.start()
    yield s
    s.stop()


@pytest.fixture
def sink():
    """A fault-injecting HTTP server on a free loopback port."""
    from http_sink import Sink
    s = Sink().start()
    yield s
    s.stop()


@pytest.fixture
def login_as(db, conn):
    """login_as(group) -> an autocommit connection as a fresh LOGIN role
    that is a member of `group` only; the roles are dropped afterwards."""
    made = []

    def make(group):
        name = f"t_{group.replace('outbox_', '')}_{uuid.uuid4().hex[:8]}"
        query(conn, f'CREATE ROLE "{name}" LOGIN IN ROLE {group}')
        c = psycopg2.connect(db, user=name)
        c.autocommit = True
        made.append((name, c))
        return c

    yield make
    for name, c in made:
        # The server drops a closed session's temporary objects after the
        # client has gone; DROP ROLE would race it.  DISCARD TEMP drops them
        # now.
        try:
            with c.cursor() as cur:
                cur.execute("DISCARD TEMP")
        except psycopg2.Error:
            pass
        c.close()
        query(conn, f'DROP ROLE IF EXISTS "{name}"')


# ---- exclusive tests leave no trace ----------------------------------------
# Exclusive tests touch the machine (a package build, a throwaway install,
# a booted systemd, the shared server): each must leave the tree and the
# host as it found them, so that no test depends on which ran before it.
# Compared before and after each one: files in the tree that git does not
# track (ignored ones too: build trees), mounts, cgroups, unit files and
# enablement links, deb-systemd-helper's state, journal files, TMPDIR,
# /etc/outbox-dispatcher and /usr/local, and child processes left running.

def _walk(path, skip_pycache=True):
    out = set()
    for d, dirs, files in os.walk(path):
        if skip_pycache:
            dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            full = os.path.join(d, f)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            out.add((full, st.st_size, st.st_mtime_ns))
    return out


def _untracked_in_tree():
    r = subprocess.run(["git", "status", "--porcelain", "--ignored", "-z"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:          # not a git checkout (a tarball): nothing to compare
        return set()
    out = set()
    for entry in filter(None, r.stdout.split("\0")):
        if entry[:2] not in ("??", "!!"):
            continue
        rel = entry[3:]
        if "__pycache__" in rel or rel.endswith(".pyc"):
            continue
        full = os.path.join(ROOT, rel)
        if os.path.isdir(full) and not os.path.islink(full):
            out |= _walk(full)
        elif os.path.lexists(full):
            st = os.lstat(full)
            out.add((full, st.st_size, st.st_mtime_ns))
    return out


def _host_state():
    from debian_package import SHARED_DIRS
    with open("/proc/self/mountinfo") as f:
        mounts = {(line.split()[4], line.split(" - ")[1].split()[0]) for line in f}
    cg = "/sys/fs/cgroup"
    tmp = tempfile.gettempdir()
    state = {
        "files in the tree git does not track": _untracked_in_tree(),
        "mounts": mounts,
        "cgroups": {c for c in os.listdir(cg) if c.startswith("sdbox")} if os.path.isdir(cg) else set(),
        "the temporary directory": {t for t in os.listdir(tmp)
                                    if not t.startswith("pytest-of-") and os.path.join(tmp, t) not in SHARED_DIRS},
        "child processes": {p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid()},
    }
    for d in ("/etc/systemd/system", "/var/lib/systemd/deb-systemd-helper-enabled",
              "/var/lib/systemd/deb-systemd-helper-masked", "/var/log/journal", "/run/log/journal",
              "/run/systemd/system", "/etc/outbox-dispatcher", "/usr/local"):
        state[d] = _walk(d, skip_pycache=False) if os.path.isdir(d) else set()
    return state


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture(autouse=True)
def exclusive_test_leaves_no_trace(request):
    if request.node.get_closest_marker("exclusive") is None:
        yield
        return
    before = _host_state()
    yield
    after = _host_state()
    changed = {}
    for what in before:
        added, removed = after[what] - before[what], before[what] - after[what]
        if added or removed:
            changed[what] = {"added": sorted(added)[:20], "removed": sorted(removed)[:20]}
    assert not changed, f"{request.node.nodeid} left traces the next test would see: {changed}"


@pytest.fixture
def trusted_tmp():
    """A fresh directory a worker trusts to hold plugins, in the build tree,
    whose parents the tests may chmod without touching /tmp; removed
    afterwards."""
    import pathlib
    import shutil
    base = os.path.join(BUILD_DIR, "trusted-tmp")
    os.makedirs(base, exist_ok=True)
    os.chmod(base, 0o755)
    d = os.path.join(base, uuid.uuid4().hex[:12])
    os.mkdir(d)
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)

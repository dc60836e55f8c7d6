# SPDX-License-Identifier: ISC
"""What the systemd tests share: a booted systemd (tests/systemd/sdbox.sh)
to run commands in, a PostgreSQL of the test's own that can be stopped
and started under the workers, and the shell blocks of the docs marked
<!-- systemd-test: NAME --> (docs/running-a-fleet.md, docs/operating.md),
which the tests run as they are written."""
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request

from outbox_test import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
SDBOX = os.path.join(HERE, "sdbox.sh")
DOCS = [os.path.join(ROOT, "docs", f) for f in ("running-a-fleet.md", "operating.md")]


def doc_blocks():
    """{name: shell text} of the blocks marked for the systemd tests in
    docs/running-a-fleet.md and docs/operating.md."""
    out = {}
    for path in DOCS:
        text = open(path).read()
        for m in re.finditer(r"<!-- systemd-test: ([a-z-]+) -->\s*```sh\n(.*?)```", text, re.S):
            assert m.group(1) not in out, f"two blocks named {m.group(1)}"
            out[m.group(1)] = m.group(2)
    return out


def box_env(env=None):
    """The environment of a command in the box: the test's, without its
    PostgreSQL and sanitizer settings (paths of the host's test run), with
    a home of the box's own."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("PG", "ASAN_", "UBSAN_", "LSAN_", "PYTEST", "BUILD_DIR"))}
    e["PATH"] = "/run/sdbox-bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    e["HOME"] = "/run/sdbox-home"
    e.update(env or {})
    return e


class Box:
    """A booted systemd; run() executes a command inside it, in the source
    tree (a copy-on-write view of it: what the docs' `make` builds stays in
    the box).  overlays: more host directories made copy-on-write (a .deb
    writes to /usr)."""

    def __init__(self, overlays=()):
        self.dir = tempfile.mkdtemp(prefix="sdbox.")
        env = dict(os.environ, SDBOX_TREE=ROOT, SDBOX_OVERLAYS=" ".join(overlays))
        r = subprocess.run(["sh", SDBOX, "start", self.dir], capture_output=True, text=True, timeout=120,
                           env=env)
        if r.returncode != 0:
            self.close()
            raise AssertionError(f"systemd did not boot: {r.stderr}")
        # The docs say sudo; the box is root already.
        self.run("mkdir -p /run/sdbox-bin /run/sdbox-home && "
                 "printf '#!/bin/sh\\nexec \"$@\"\\n' > /run/sdbox-bin/sudo && chmod 755 /run/sdbox-bin/sudo")

    def run(self, script, check=True, timeout=300, env=None, input=None):
        r = subprocess.run(["sh", SDBOX, "run", self.dir, "bash", "-eo", "pipefail", "-c", script],
                           capture_output=True, text=input is None or isinstance(input, str),
                           timeout=timeout, cwd=ROOT, env=box_env(env), input=input)
        if check:
            assert r.returncode == 0, f"{script}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def popen(self, script):
        return subprocess.Popen(["sh", SDBOX, "run", self.dir, "bash", "-eo", "pipefail", "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=box_env())

    def put(self, path, data):
        """Write bytes to a file inside the box."""
        self.run(f"mkdir -p \"$(dirname '{path}')\" && cat > '{path}'", input=data)

    def prop(self, unit, name):
        return self.run(f"systemctl show -P {name} {unit}").stdout.strip()

    def close(self):
        subprocess.run(["sh", SDBOX, "stop", self.dir], capture_output=True, timeout=60)


class Postgres:
    """A PostgreSQL of this test's own (tests/lib/pg.sh), on a fixed port
    so that it can be stopped and started again under the workers."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="outbox-sd-pg.")
        os.chmod(self.dir, 0o755)
        self.port = None
        out = self.sh("pg_start \"$D/pg\" && echo \"port=$PGPORT\"")
        self.port = int(re.search(r"port=(\d+)", out).group(1))

    def sh(self, cmd):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["D"] = self.dir
        if self.port:
            env["PGPORT_FIXED"] = str(self.port)
        r = subprocess.run(["sh", "-c", f". tests/lib/pg.sh && {cmd}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def start(self):
        self.sh("pg_start \"$D/pg\"")

    def stop(self):
        self.sh("pg_stop \"$D/pg\"")

    def dsn(self, user="postgres", db="outbox"):
        return f"host=127.0.0.1 port={self.port} dbname={db} user={user}"

    def close(self):
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def healthz(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)

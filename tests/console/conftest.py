# SPDX-License-Identifier: ISC
"""outbox-console started on the test's database: the console logs in as a
fresh login role that is a member of outbox_viewer (NOINHERIT: it reads as
the viewer only), and each person the proxy names is a role of their own,
a member of outbox_operator, granted to the console's login so that it may
SET ROLE to them for an act."""
import http.client
import os
import subprocess
import time
import urllib.parse
import uuid

import pytest

from outbox_test import BUILD_DIR, dsn_as, free_port, query, write_config


class Console:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log

    def request(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        h = dict(headers or {})
        data = None
        if body is not None:
            data = urllib.parse.urlencode(body, doseq=True)
            h.setdefault("Content-Type", "application/x-www-form-urlencoded")
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        text = r.read().decode("utf-8", "replace")
        out = (r.status, dict((k.lower(), v) for k, v in r.getheaders()), text)
        c.close()
        return out

    def get(self, path, who=None):
        return self.request("GET", path, headers={"X-Remote-User": who} if who else None)

    def post(self, path, body, who=None, origin=True, headers=None):
        h = dict(headers or {})
        if who:
            h["X-Remote-User"] = who
        if origin:
            h["Origin"] = f"http://127.0.0.1:{self.port}"
        return self.request("POST", path, body=body, headers=h)

    def csrf(self, who, path="/controls"):
        import re
        status, _, text = self.get(path, who)
        m = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
        assert m, f"no token on {path} for {who}: {text[:400]}"
        return m.group(1)


@pytest.fixture
def console_roles(db, conn):
    """(login, [people]): a console login and two people who may act."""
    tag = uuid.uuid4().hex[:8]
    login = f"t_console_{tag}"
    people = [f"t_ana_{tag}", f"t_bo_{tag}"]
    query(conn, f'CREATE ROLE "{login}" LOGIN NOINHERIT IN ROLE outbox_viewer')
    for p in people:
        query(conn, f'CREATE ROLE "{p}" NOLOGIN IN ROLE outbox_operator')
        query(conn, f'GRANT "{p}" TO "{login}"')
    yield login, people
    for r in [login] + people:
        query(conn, f'DROP OWNED BY "{r}"')
        query(conn, f'DROP ROLE IF EXISTS "{r}"')


@pytest.fixture
def console_factory(db, console_roles, tmp_path):
    started = []
    login, _ = console_roles

    def start(actions=False, trusted_proxy="127.0.0.1", extra=None):
        port = free_port()
        sec = {"listen": f"127.0.0.1:{port}", "actions": actions,
               "trusted_proxy": trusted_proxy, "refresh_seconds": 0}
        sec.update(extra or {})
        cfg = write_config(tmp_path / f"console-{port}.ini",
                           {"database": {"conninfo": dsn_as(db, login)}, "console": sec})
        os.chmod(cfg, 0o600)
        log = open(tmp_path / f"console-{port}.log", "w+")
        p = subprocess.Popen([os.path.join(BUILD_DIR, "outbox-console"), "--config", str(cfg)],
                             stdout=log, stderr=subprocess.STDOUT)
        c = Console(p, port, log)
        started.append(c)
        deadline = time.monotonic() + 20
        while True:
            try:
                if c.get("/static/console.css")[0] == 200:
                    break
            except OSError:
                pass
            assert p.poll() is None, open(log.name).read()
            assert time.monotonic() < deadline, "the console did not start"
            time.sleep(0.05)
        return c

    yield start
    bad = []
    for c in started:
        c.proc.terminate()
        try:
            c.proc.wait(20)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
        c.log.close()
        text = open(c.log.name).read()
        # SIGTERM is a clean stop; under the sanitizers, nothing found.
        if c.proc.returncode != 0 or "Sanitizer" in text or "runtime error" in text:
            bad.append((c.proc.returncode, text[-3000:]))
    assert bad == [], bad


# SPDX-License-Identifier: ISC
"""outbox-console started on the test's database: the console logs in as a
fresh login role that is a member of outbox_viewer (NOINHERIT: it reads as
the viewer only), and each person the proxy names is a role of their own,
a member of outbox_operator, granted to the console's login so that it may
SET ROLE to them for an act.  For the browser tests: nginx in front of a
console as docs/console.md configures it (`proxy`), and Debian's headless
chromium through chromium-driver (`browser`, `browser_factory`)."""
import http.client
import os
import subprocess
import time
import urllib.parse
import uuid

import pytest

from outbox_test import BUILD_DIR, dsn_as, free_port, query, write_config
from browser_lib import PASSWORD, nginx_location


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



@pytest.fixture
def proxy(tmp_path):
    """nginx in front of a console: start(console_port, person) -> port;
    person is one name or a list of them, each with the password
    browser_lib.PASSWORD."""
    procs = []

    def start(console_port, person):
        people = [person] if isinstance(person, str) else list(person)
        d = tmp_path / f"nginx-{console_port}"
        d.mkdir()
        hashed = subprocess.run(["openssl", "passwd", "-apr1", PASSWORD], capture_output=True,
                                text=True, check=True).stdout.strip()
        (d / "htpasswd").write_text("".join(f"{p}:{hashed}\n" for p in people))
        port = free_port()
        lines = (nginx_location().replace("/etc/nginx/outbox-console.htpasswd", str(d / "htpasswd"))
                 .replace("127.0.0.1:8470", f"127.0.0.1:{console_port}"))
        (d / "nginx.conf").write_text(f"""
daemon off; master_process off; worker_processes 1;
pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
{lines}
    }}
}}
""")
        p = subprocess.Popen(["nginx", "-p", str(d), "-c", "nginx.conf", "-e", str(d / "error.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        import socket
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert p.poll() is None, (d / "error.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.05)
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


@pytest.fixture
def browser_factory(tmp_path):
    """start(javascript=True) -> a headless chromium (its own profile);
    javascript=False blocks scripts on every page (the content setting a
    managed policy sets).  All are quit at teardown."""
    pytest.importorskip("selenium")
    from selenium import webdriver
    started = []

    def start(javascript=True):
        n = len(started)
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-dev-shm-usage", "--window-size=1280,900",
                  f"--user-data-dir={tmp_path / f'chromium-profile-{n}'}"):
            opts.add_argument(a)
        if not javascript:
            opts.add_experimental_option(
                "prefs", {"profile.managed_default_content_settings.javascript": 2})
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        log = str(tmp_path / f"chromedriver-{n}.log")
        service = webdriver.ChromeService(executable_path="/usr/bin/chromedriver",
                                          log_output=log) \
            if hasattr(webdriver, "ChromeService") else \
            webdriver.chrome.service.Service("/usr/bin/chromedriver", log_path=log)
        d = webdriver.Chrome(options=opts, service=service)
        started.append(d)
        d.set_page_load_timeout(60)
        return d

    yield start
    for d in started:
        d.quit()


@pytest.fixture
def browser(browser_factory):
    return browser_factory()

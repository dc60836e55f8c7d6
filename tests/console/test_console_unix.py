# SPDX-License-Identifier: ISC
"""outbox-console on `listen = unix:/PATH` with `trusted_proxy = unix`:
reached over AF_UNIX, the identity header is trusted from the socket's
peers; on an address with trusted_proxy = unix it is ignored.  The socket
is made owner and group read-write only; a stale socket left by a killed
console is replaced, a live one or a file that is no socket refuses the
start with a clear error; a clean stop removes the socket."""
import http.client
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time

import pytest

from outbox_test import BUILD_DIR, dsn_as, scalar, write_config


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


def unix_request(path, method, url, body=None, headers=None):
    c = UnixHTTP(path)
    c.request(method, url, body=body, headers=headers or {})
    r = c.getresponse()
    out = r.status, r.read().decode("utf-8", "replace")
    c.close()
    return out


def start(tmp_path, login, db, sock, actions=True, name="console-unix"):
    cfg = write_config(tmp_path / f"{name}.ini",
                       {"database": {"conninfo": dsn_as(db, login)},
                        "console": {"listen": f"unix:{sock}", "actions": actions,
                                    "trusted_proxy": "unix", "refresh_seconds": 0}})
    os.chmod(cfg, 0o600)
    log = open(tmp_path / f"{name}.log", "w+")
    return subprocess.Popen([os.path.join(BUILD_DIR, "outbox-console"), "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT), log


def wait_serving(p, log, sock):
    deadline = time.monotonic() + 20
    while True:
        try:
            if unix_request(sock, "GET", "/static/console.css")[0] == 200:
                return
        except OSError:
            pass
        assert p.poll() is None, open(log.name).read()
        assert time.monotonic() < deadline, "the console did not start"
        time.sleep(0.05)


def stop(p, log):
    p.terminate()
    assert p.wait(20) == 0
    log.close()
    text = open(log.name).read()
    assert "Sanitizer" not in text and "runtime error" not in text, text
    return text


@pytest.fixture
def sock_dir():
    """A short folder for the socket: a Unix socket's path has at most 107
    bytes, and a run's tmp_path (a cold run's TMPDIR included) can be
    longer than that."""
    d = tempfile.mkdtemp(prefix="outbox-console.", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_unix_socket_trusts_its_peers(db, conn, console_roles, tmp_path, sock_dir):
    login, people = console_roles
    sock = os.path.join(sock_dir, "c.sock")
    assert len(sock) < 100, sock
    p, log = start(tmp_path, login, db, sock)
    try:
        wait_serving(p, log, sock)
        mode = stat.S_IMODE(os.stat(sock).st_mode)
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert mode & 0o007 == 0, oct(mode)          # nothing for others
        status, body = unix_request(sock, "GET", "/controls", headers={"X-Remote-User": people[0]})
        assert status == 200 and people[0] in body and 'name="csrf"' in body, body[:500]
        tok = re.search(r'name="csrf" value="([0-9a-f]{64})"', body).group(1)
        status, body = unix_request(
            sock, "POST", "/controls/switch", body=f"to=off&reason=via+socket&csrf={tok}",
            headers={"X-Remote-User": people[0], "Origin": "http://localhost",
                     "Content-Type": "application/x-www-form-urlencoded"})
        assert status == 200, body
        assert scalar(conn, "SELECT changed_by FROM outbox_control") == people[0]
        # A second console on the same live socket: refused, the first untouched.
        p2, log2 = start(tmp_path, login, db, sock, name="second")
        assert p2.wait(20) == 1
        log2.close()
        assert "something is serving on this socket already" in open(log2.name).read()
        assert unix_request(sock, "GET", "/static/console.css")[0] == 200
    finally:
        stop(p, log)
    assert not os.path.exists(sock), "a clean stop leaves no socket behind"


def test_a_stale_socket_is_replaced_and_a_plain_file_refused(db, console_roles, tmp_path, sock_dir):
    login, people = console_roles
    sock = os.path.join(sock_dir, "s.sock")
    # A socket nobody answers on: what a killed console leaves behind.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()
    p, log = start(tmp_path, login, db, sock)
    try:
        wait_serving(p, log, sock)
    finally:
        text = stop(p, log)
    assert "removed a stale socket" in text
    # A file that is no socket is never removed.
    with open(sock, "w") as f:
        f.write("not a socket")
    p, log = start(tmp_path, login, db, sock, name="plain-file")
    assert p.wait(20) == 1
    log.close()
    assert "is not a socket" in open(log.name).read()
    assert open(sock).read() == "not a socket"


def test_trusted_proxy_unix_ignores_the_header_on_an_address(console_factory, console_roles):
    _, people = console_roles
    c = console_factory(actions=True, trusted_proxy="unix")
    _, _, body = c.get("/controls", people[0])
    assert people[0] not in body and 'name="csrf"' not in body
    status, _, body = c.post("/controls/switch", {"to": "off", "reason": "r", "csrf": "0" * 64},
                             who=people[0])
    assert status == 403 and "person" in body

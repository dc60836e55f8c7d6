# SPDX-License-Identifier: ISC
"""What outboxctl shows an operator: text from
the database or the command line never drives the terminal, --json stays
valid and faithful, and a --db password shows neither in errors nor in
`ps`.
"""
import json
import os
import socket
import subprocess

from effect_arrange import arrange
from outbox_test import BUILD_DIR, enqueue, kill_switch, make_run, query, run_ctl, wait_for

EVIL = "\x1b[2J\x1b[1;31mFAKE: all effects resolved\x1b]0;pwned\x07"
C1 = "csi\u009b31m nel\u0085"


def no_control(text):
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) < 0xa0]
    assert not bad, f"control characters reached the terminal: {bad!r} in {text!r}"


def test_unknown_list_escapes_a_hostile_run_key(db, conn):
    key = make_run(conn, key=EVIL + C1)
    eid = enqueue(conn, "http", "https://x.example/\x1b[0m", {}, key=key)
    arrange(conn, eid, "unknown", attempts=1, last_error="boom\x1b[2K\r")
    r = run_ctl(["--db", db, "unknown", "list"])
    assert r.returncode == 0, r.stderr
    no_control(r.stdout)
    assert "\\e[2J\\e[1;31mFAKE: all effects resolved\\e]0;pwned\\x07" in r.stdout
    assert "\\u009b31m" in r.stdout and "\\u0085" in r.stdout
    r = run_ctl(["--db", db, "unknown", "list", "--json"])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["idempotency_key"] == EVIL + C1


BIDI = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068",
        "\u2069", "\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u2028", "\u2029",
        "\ufeff"]


def no_invisible(text):
    bad = [c for c in text if c in BIDI]
    assert not bad, f"bidi or invisible characters reached the terminal: {bad!r}"


def test_unknown_list_escapes_bidi_and_invisible_characters(db, conn):
    """A right-to-left override in a target makes '.../<U+202E>exe.txt'
    read as '.../txt.exe'; every such character is shown as \\uNNNN in the
    run key, the target and the worker name."""
    key = make_run(conn, key="run-" + "".join(BIDI))
    eid = enqueue(conn, "http", "https://x.example/files/\u202eexe.txt", {}, key=key)
    arrange(conn, eid, "unknown", attempts=1)
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "outcome_class) SELECT effect_id, created_at, 1, %s, now(), 'ambiguous' "
                "FROM effect_outbox WHERE effect_id = %s", ("w\u2066orker\u2069\u200b", eid))
    r = run_ctl(["--db", db, "unknown", "list"])
    assert r.returncode == 0, r.stderr
    no_invisible(r.stdout)
    assert "/files/\\u202eexe.txt" in r.stdout
    assert "run-" + "".join("\\u%04x" % ord(c) for c in BIDI) in r.stdout
    assert "worker w\\u2066orker\\u2069\\u200b" in r.stdout
    rows = json.loads(run_ctl(["--db", db, "unknown", "list", "--json"]).stdout)
    assert rows[0]["target"] == "https://x.example/files/\u202eexe.txt"


def test_kill_switch_status_escapes_bidi_in_the_operator(db, conn):
    kill_switch(conn, False, operator="mallory\u202e\ufeff", reason="r\u2028x")
    r = run_ctl(["--db", db, "kill-switch", "status"])
    assert r.returncode == 0, r.stderr
    no_invisible(r.stdout)
    assert "mallory\\u202e\\ufeff" in r.stdout


def test_kill_switch_status_escapes_the_operator(db, conn):
    kill_switch(conn, False, operator="mallory\x1b]0;pwned\x07", reason="r\x1b[2J")
    r = run_ctl(["--db", db, "kill-switch", "status"])
    assert r.returncode == 0, r.stderr
    no_control(r.stdout)
    assert "mallory\\e]0;pwned\\x07" in r.stdout
    r = run_ctl(["--db", db, "kill-switch", "status", "--json"])
    assert json.loads(r.stdout)["changed_by"] == "mallory\x1b]0;pwned\x07"
    r = run_ctl(["--db", db, "kill-switch", "on", "--operator", "eve\x1b[2J", "--reason", "x\x9b"])
    assert r.returncode == 0, r.stderr
    no_control(r.stdout)


def test_errors_escape_what_they_echo(db):
    r = run_ctl(["--db", db, "unknown", "resolve", "\x1b[2Jx"])
    assert r.returncode != 0
    no_control(r.stderr)
    r = run_ctl(["--db", db, "sideways\x1b]0;x\x07"])
    no_control(r.stderr)


def test_cannot_connect_error_hides_encoded_passwords():
    for dsn in ("postgresql://worker@127.0.0.1:1/db?pass%77ord=SECRET",
                "postgresql://worker@127.0.0.1:1/db?sslmode=disable&%70assword=SECRET",
                "postgresql://worker@127.0.0.1:1/db?PASSWORD=SECRET"):
        r = run_ctl(["--db", dsn, "status"])
        assert r.returncode == 3
        assert "cannot connect" in r.stderr
        assert "SECRET" not in r.stderr, r.stderr


def test_db_password_is_not_in_ps():
    """--db's password is overwritten in argv once parsed: a server that
    accepts and never answers keeps outboxctl waiting while we look."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    dsn = f"postgresql://worker:SECRET1@127.0.0.1:{port}/db?password=SECRET2&connect_timeout=20"
    p = subprocess.Popen([os.path.join(BUILD_DIR, "outboxctl"), "--db", dsn, "status"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        conn, _ = srv.accept()          # outboxctl has parsed its arguments by now
        cmdline = wait_for(lambda: open(f"/proc/{p.pid}/cmdline", "rb").read(), what="cmdline")
        assert b"SECRET" not in cmdline, cmdline
        assert b"status" in cmdline and b"127.0.0.1" in cmdline
        conn.close()
    finally:
        p.kill()
        p.communicate()
        srv.close()


def test_worker_ready_line_hides_encoded_passwords(db, tmp_path):
    """The `ready` log line shows the conninfo with every password masked,
    however its key is spelled."""
    from outbox_test import Dispatcher
    params = dict(kv.split("=", 1) for kv in db.split())
    url = (f"postgresql://{params['user']}@{params['host']}:{params['port']}/{params['dbname']}"
           "?pass%77ord=SECRET1&%70assword=SECRET2&PASSWORD=SECRET3&application_name=w")
    w = Dispatcher(url, tmp_path, {"dispatcher": {"providers": "http"},
                                   "provider.http": {"allow_hosts": "127.0.0.1"}}, name="ready").start()
    try:
        ready = [e for e in w.events() if e.get("event") == "ready"]
        assert ready, "the worker logged ready"
    finally:
        w.stop()
    log = open(w.log_path, "rb").read()
    assert b"SECRET" not in log
    assert b"pass%77ord=********" in log

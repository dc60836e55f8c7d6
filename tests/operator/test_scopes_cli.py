# SPDX-License-Identifier: ISC
"""outboxctl's scoped controls against a real database: kill-switch off|on
with --type, --host or --crm-object, limit set|clear|list, and the scopes
that status and kill-switch status list; what they write
(outbox_scopes, outbox_scope_history), their usage errors (exit 2, naming
the bad option or value, before any connection) and who may call them.

Effects are arranged directly with SQL as the superuser
(tests/lib/effect_arrange.py), so no worker is needed.
"""
import json
import re
import uuid

import psycopg2
import pytest

from effect_arrange import arrange
from outbox_test import (OPERATOR_ROLE, PRODUCER_ROLE, WORKER_ROLE, dsn_as, enqueue, kill_switch,
                         ctl, fails, make_run, ok, producer_dsn, query, run_ctl, scalar)

DOWN = "host=127.0.0.1 port=1 connect_timeout=2"
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def new_effect(conn, effect_type, target, payload=None):
    key = make_run(conn)
    return str(enqueue(conn, effect_type, target, payload or {"body": {"n": 1}}, key=key))


def in_flight(conn, effect_type, target, worker):
    eid = new_effect(conn, effect_type, target)
    arrange(conn, eid, "sending", attempts=1, lease_owner=str(uuid.uuid4()), lease_worker=worker,
            sending_since="SQL:now()", lease_expires_at="SQL:now() + interval '30 seconds'")
    return eid


def scopes(conn):
    return query(conn, "SELECT kind, value, paused, paused_by, paused_reason, rate_per_second, "
                       "burst, limit_by, limit_reason FROM outbox_scopes ORDER BY kind, value")


def history(conn):
    return query(conn, "SELECT kind, value, action, rate_per_second, burst, changed_by, reason "
                       "FROM outbox_scope_history ORDER BY change_id")


def json_scopes(db, *cmd):
    return json.loads(ok(ctl(db, *cmd, "--json")).stdout)


# --- usage errors: exit 2 before any connection, naming what is wrong -------------

WHO = ["--operator", "ann", "--reason", "r"]
BAD_RATES = ["1000001", "60000060/min", "fast", "50/hour", "50/", "/s", "0", "0/s", "0.0/min", "-5", "+5", "1e3", "inf",
             "nan", "5.5.5", ".", "50 /s", "50/S", " 50", "0x10", ""]


@pytest.mark.parametrize("args,words", [
    (["kill-switch", "off", "--type", "email", "--host", "api.example.com"] + WHO,
     ["one scope at a time", "--type email", "--host api.example.com"]),
    (["kill-switch", "on", "--crm-object", "Task", "--type", "crm"] + WHO,
     ["one scope at a time", "--crm-object Task", "--type crm"]),
    (["kill-switch", "off", "--type", "email", "--type", "http"] + WHO,
     ["one scope at a time", "--type email", "--type http"]),
    (["kill-switch", "off", "--queue", "email"] + WHO,
     ["unexpected argument '--queue'", "a scope is --type T, --host H or --crm-object O"]),
    (["kill-switch", "off", "--crm", "Task"] + WHO, ["unexpected argument '--crm'"]),
    (["kill-switch", "off"] + WHO + ["--type"], ["--type needs a value"]),
    (["kill-switch", "off", "--type", ""] + WHO, ["--type needs a value of 1 to 255 characters"]),
    (["kill-switch", "off", "--host", "h" * 256] + WHO, ["--host needs a value of 1 to 255"]),
    # Hosts no connection can be made to: refused, not kept as a scope
    # that would never hold anything.
    (["kill-switch", "off", "--host", "127.0.0.2:80"] + WHO,
     ["kill-switch off: --host 127.0.0.2:80 is not a host name or address"]),
    (["kill-switch", "off", "--host", "::::"] + WHO, ["--host :::: is not a host name"]),
    (["kill-switch", "off", "--host", "1.2.3.4.5"] + WHO, ["--host 1.2.3.4.5 is not a host"]),
    (["limit", "set", "--host", "256.0.0.1", "--rate", "5"] + WHO, ["--host 256.0.0.1 is not"]),
    (["limit", "set", "--host", "https://api.example.com", "--rate", "5"] + WHO,
     ["--host https://api.example.com is not"]),
    (["kill-switch", "off", "--type", "email"], ["kill-switch off needs --operator NAME"]),
    (["kill-switch", "on", "--host", "api.example.com", "--operator", "ann"],
     ["kill-switch on needs --operator NAME and --reason TEXT"]),
    (["kill-switch", "status", "--type", "email"], ["kill-switch status takes no scope"]),
    (["limit"], ["limit: expected set, clear or list"]),
    (["limit", "pause", "--type", "email"], ["expected set, clear or list, not 'pause'"]),
    (["limit", "set", "--rate", "50"] + WHO, ["limit set needs a scope: --type T or --host H"]),
    (["limit", "set", "--crm-object", "Task", "--rate", "5"] + WHO,
     ["--crm-object takes no rate limit", "--type T or --host H"]),
    (["limit", "clear", "--crm-object", "Task"] + WHO, ["--crm-object takes no rate limit"]),
    (["limit", "set", "--type", "email", "--host", "relay.example", "--rate", "5"] + WHO,
     ["one scope at a time", "--type email", "--host relay.example"]),
    (["limit", "set", "--queue", "email", "--rate", "5"] + WHO,
     ["unexpected argument '--queue'", "a scope is"]),
    (["limit", "set", "--type", "email"] + WHO, ["limit set needs --rate N"]),
    (["limit", "set", "--type", "email", "--rate", "5", "--burst", "0"] + WHO, ["--burst '0'"]),
    (["limit", "set", "--type", "email", "--rate", "5", "--burst", "2.5"] + WHO, ["--burst '2.5'"]),
    (["limit", "set", "--type", "email", "--rate", "5", "--burst", "-1"] + WHO, ["--burst '-1'"]),
    (["limit", "set", "--type", "email", "--rate", "5", "--burst", "1000001"] + WHO,
     ["--burst '1000001'", "from 1 to 1000000"]),
    (["limit", "set", "--type", "email", "--rate", "5"], ["limit set needs --operator NAME"]),
    (["limit", "set", "--type", "email", "--rate", "5", "--operator", "ann"],
     ["--reason TEXT"]),
    (["limit", "clear", "--type", "email", "--rate", "5"] + WHO, ["unexpected argument '--rate'"]),
    (["limit", "clear", "--host", "relay.example"], ["limit clear needs --operator NAME"]),
    (["limit", "list", "--csv"], ["unexpected argument '--csv'"]),
] + [(["limit", "set", "--type", "email", "--rate", bad] + WHO,
      [f"--rate '{bad}' is not a rate above 0 and up to 1000000", "N, N/s or N/min"]) for bad in BAD_RATES])
def test_scope_usage_errors_exit_2_naming_the_option_or_value(args, words):
    # The database is down: every one of these is caught before connecting.
    r = fails(run_ctl(["--db", DOWN] + args), 2, *words)
    assert r.stdout == ""
    assert "cannot connect" not in r.stderr


@pytest.mark.parametrize("args,words", [
    (["kill-switch", "off", "--host", "api.example.com:8443"], ["kill-switch off: ",
                                                                "api.example.com:8443"]),
    (["kill-switch", "on", "--host", "https://api.example.com"], ["https://api.example.com"]),
    (["kill-switch", "off", "--crm-object", "Task/Subject"], ["Task/Subject"]),
    (["kill-switch", "off", "--type", "e mail"], ["e mail"]),
])
def test_a_value_the_database_refuses_is_a_usage_error_and_writes_nothing(db, conn, args, words):
    r = fails(ctl(db, *args, *WHO), 2, *words)
    assert r.stdout == ""
    assert scopes(conn) == [] and history(conn) == []


def test_a_type_no_worker_serves_is_refused_once_workers_said_what_they_serve(db, conn):
    query(conn, "INSERT INTO outbox_providers (name) VALUES ('http'), ('email')")
    fails(ctl(db, "kill-switch", "off", "--type", "emial", *WHO), 2, "emial", "email, http")
    fails(ctl(db, "limit", "set", "--type", "emial", "--rate", "5", *WHO), 2, "emial")
    assert scopes(conn) == [] and history(conn) == []
    ok(ctl(db, "kill-switch", "off", "--type", "email", *WHO))


def test_an_ipv6_host_is_stored_bare(db, conn):
    r = ok(ctl(db, "kill-switch", "off", "--host", "[::1]", *WHO))
    assert r.stdout.startswith("sends to host ::1 paused: no send to ::1 can start")
    ok(ctl(db, "limit", "set", "--host", "[FD00::1]", "--rate", "5", *WHO))
    assert [(k, v) for k, v, *_ in scopes(conn)] == [("host", "::1"), ("host", "fd00::1")]


def test_a_host_is_stored_in_the_spelling_the_workers_connect_to(db, conn):
    """A mapped or numeric spelling is the address it connects to; a name
    loses its trailing dot: one scope row, whatever the operator wrote."""
    r = ok(ctl(db, "kill-switch", "off", "--host", "::FFFF:127.0.0.2", *WHO))
    assert r.stdout.startswith("sends to host 127.0.0.2 paused: no send to 127.0.0.2 can start")
    for spelling in ("0x7f.0.0.2", "2130706434", "127.2", "0177.0.0.02", "[::ffff:7f00:2]"):
        ok(ctl(db, "kill-switch", "off", "--host", spelling, *WHO))
    ok(ctl(db, "limit", "set", "--host", "API.example.com.", "--rate", "5", *WHO))
    ok(ctl(db, "limit", "set", "--host", "2001:DB8:0:0:0:0:0:1", "--rate", "5", *WHO))
    assert [(k, v) for k, v, *_ in scopes(conn)] == [
        ("host", "127.0.0.2"), ("host", "2001:db8::1"), ("host", "api.example.com")]


def test_limit_and_scoped_kill_switch_have_help():
    r = ok(run_ctl(["limit", "--help"]))
    assert r.stdout.startswith("usage: outboxctl")
    assert "limit set (--type T | --host H) --rate N[/s|/min]" in r.stdout
    r = ok(run_ctl(["kill-switch", "--help"]))
    assert "[--type T | --host H | --crm-object O]" in r.stdout
    r = ok(run_ctl(["--help"]))
    assert "\n  limit set" in r.stdout


# --- pause and resume --------------------------------------------------------------

def test_pause_by_type_lists_its_sends_in_flight_and_status_shows_it(db, conn):
    email = in_flight(conn, "email", "ops@example.com", "host1-w1")
    http = in_flight(conn, "http", "https://api.example.com/hook", "host1-w2")
    waiting = new_effect(conn, "email", "cfo@example.com")
    ekey = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (email,))

    r = ok(ctl(db, "kill-switch", "off", "--type", "email", "--operator", "bob",
               "--reason", "drafts look wrong"))
    lines = r.stdout.splitlines()
    assert lines[0] == ("email sends paused: no email send can start anywhere in the fleet "
                        "(by bob: drafts look wrong)")
    assert lines[1] == "1 effect was already in flight (their outcome will still be recorded):"
    assert len(lines) == 3 and lines[2].startswith(f"  {email} key={ekey} type=email ")
    assert "target=ops@example.com worker=host1-w1 started=" in lines[2]
    assert http not in r.stdout and waiting not in r.stdout

    assert scopes(conn) == [("type", "email", True, "bob", "drafts look wrong", None, None,
                             None, None)]
    assert history(conn) == [("type", "email", "off", None, None, "bob", "drafts look wrong")]
    # The global switch is another row, untouched.
    assert query(conn, "SELECT count(*) FROM outbox_control_history")[0][0] == 1

    # The pending email, held by the pause as the workers park it.
    query(conn, "UPDATE effect_live SET held_by = 'type:email', available_at = 'infinity' "
                "WHERE effect_id = %s", (waiting,))

    for cmd in (["kill-switch", "status"], ["status"]):
        out = ok(ctl(db, *cmd)).stdout
        assert re.search(rf"^scope type:email: paused by bob at {TIME}: drafts look wrong$",
                         out, re.M), out
        assert re.search(r"^  rate: no limit   waiting: 1   held back in all: \d+$", out, re.M), out
        # The switch's own lines come first, as before.
        assert out.index("kill switch: off") < out.index("scope type:email")
    for cmd in (["kill-switch", "status"], ["status"]):
        got = json_scopes(db, *cmd)["scopes"]
        assert len(got) == 1, got
        s = got[0]
        assert (s["scope"], s["kind"], s["value"], s["paused"], s["paused_by"],
                s["paused_reason"]) == ("type:email", "type", "email", True, "bob",
                                        "drafts look wrong")
        assert re.fullmatch(TIME, s["paused_at"])
        assert s["rate_per_second"] is None and s["burst"] is None and s["limit_by"] is None
        assert s["waiting"] == 1 and isinstance(s["held_total"], int)

    r = ok(ctl(db, "kill-switch", "on", "--type", "email", "--operator", "ann",
               "--reason", "prompt fixed"))
    assert r.stdout.splitlines()[0] == ("email sends resumed: the ones it held are due now "
                                        "(by ann: prompt fixed)")
    # The global switch is still off (a fresh database): the command says so.
    assert "the kill switch is off: nothing is sent until 'outboxctl kill-switch on'" in r.stdout
    assert history(conn) == [("type", "email", "off", None, None, "bob", "drafts look wrong"),
                             ("type", "email", "on", None, None, "ann", "prompt fixed")]
    # Neither paused nor limited: the scope is gone, and so is its part of status.
    assert scopes(conn) == []
    assert json_scopes(db, "kill-switch", "status")["scopes"] == []
    assert "scope " not in ok(ctl(db, "status")).stdout

    kill_switch(conn, True)
    ok(ctl(db, "kill-switch", "off", "--type", "email", *WHO))
    r = ok(ctl(db, "kill-switch", "on", "--type", "email", *WHO))
    assert "the kill switch is off" not in r.stdout


def test_pause_by_host_and_by_crm_object_store_them_lower_case(db, conn):
    hooked = in_flight(conn, "http", "https://api.example.com/hook", "w1")
    other = in_flight(conn, "http", "https://other.example.org/hook", "w2")

    r = ok(ctl(db, "kill-switch", "off", "--host", "API.Example.com", "--operator", "cy",
               "--reason", "partner asked"))
    assert r.stdout.splitlines()[0] == ("sends to host api.example.com paused: no send to "
                                        "api.example.com can start anywhere in the fleet "
                                        "(by cy: partner asked)")
    assert hooked in r.stdout and other not in r.stdout
    assert "1 effect was already in flight" in r.stdout

    r = ok(ctl(db, "kill-switch", "off", "--crm-object", "Task", "--operator", "cy",
               "--reason", "bad tasks"))
    assert r.stdout.splitlines()[0] == ("crm sends to object task paused: no crm send to a task "
                                        "record can start anywhere in the fleet (by cy: bad tasks)")
    assert "0 effects were already in flight." in r.stdout

    assert [(k, v, p) for k, v, p, *_ in scopes(conn)] == \
        [("crm_object", "task", True), ("host", "api.example.com", True)]
    got = json_scopes(db, "status")["scopes"]
    assert [s["scope"] for s in got] == ["crm_object:task", "host:api.example.com"]

    ok(ctl(db, "kill-switch", "on", "--crm-object", "TASK", *WHO))
    assert [(a[0], a[1], a[2]) for a in history(conn)] == \
        [("host", "api.example.com", "off"), ("crm_object", "task", "off"),
         ("crm_object", "task", "on")]


def test_global_kill_switch_output_is_unchanged_without_scopes(db, conn):
    ok(ctl(db, "kill-switch", "off", "--operator", "bob", "--reason", "incident"))
    r = ok(ctl(db, "kill-switch", "status"))
    assert re.fullmatch(rf"kill switch: off \(sends stopped fleet-wide\)\nset by bob at {TIME}: "
                        r"incident\n", r.stdout), r.stdout
    st = json.loads(ok(ctl(db, "kill-switch", "status", "--json")).stdout)
    assert list(st) == ["state", "changed_by", "reason", "changed_at", "scopes"]
    assert st["scopes"] == []
    assert json.loads(ok(ctl(db, "status", "--json")).stdout)["scopes"] == []
    assert scopes(conn) == [] and history(conn) == []


def test_scope_text_from_the_database_is_escaped(db, conn):
    ok(ctl(db, "kill-switch", "off", "--type", "email", "--operator", "mal\x1b[2Jlory",
           "--reason", "r\x07"))
    out = ok(ctl(db, "kill-switch", "status")).stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "paused by mal\\e[2Jlory" in out
    assert json_scopes(db, "kill-switch", "status")["scopes"][0]["paused_by"] == "mal\x1b[2Jlory"


# --- rate limits -------------------------------------------------------------------

def test_limit_set_list_clear(db, conn):
    assert ok(ctl(db, "limit", "list")).stdout == "no rate limits set.\n"
    assert json.loads(ok(ctl(db, "limit", "list", "--json")).stdout) == []

    r = ok(ctl(db, "limit", "set", "--type", "email", "--rate", "3000/min", "--operator", "ann",
               "--reason", "relay quota"))
    assert r.stdout == ("email sends limited to 50 per second, burst 50, for the whole fleet "
                        "(by ann: relay quota)\n")
    r = ok(ctl(db, "limit", "set", "--host", "API.Partner.example", "--rate", "0.5/s",
               "--burst", "3", "--operator", "ann", "--reason", "partner's 30 a minute"))
    assert r.stdout.startswith("sends to host api.partner.example limited to 0.5 per second, "
                               "burst 3, for the whole fleet")
    # A pause elsewhere is no limit: limit list leaves it out, status shows both.
    ok(ctl(db, "kill-switch", "off", "--type", "http", *WHO))

    got = json.loads(ok(ctl(db, "limit", "list", "--json")).stdout)
    assert [(s["scope"], s["rate_per_second"], s["burst"], s["limit_by"], s["limit_reason"],
             s["paused"]) for s in got] == \
        [("host:api.partner.example", 0.5, 3, "ann", "partner's 30 a minute", False),
         ("type:email", 50.0, 50, "ann", "relay quota", False)]
    assert all(re.fullmatch(TIME, s["limit_at"]) for s in got)
    out = ok(ctl(db, "limit", "list")).stdout
    assert re.search(rf"^  rate: 0.5 per second, burst 3, set by ann at {TIME}: partner's 30 a "
                     r"minute   waiting: 0   held back in all: \d+$", out, re.M), out
    assert "scope type:email: not paused" in out and "type:http" not in out
    st = ok(ctl(db, "status")).stdout
    assert "scope type:http: paused by ann" in st and "rate: 50 per second, burst 50" in st
    assert [s["scope"] for s in json_scopes(db, "status")["scopes"]] == \
        ["host:api.partner.example", "type:email", "type:http"]

    r = ok(ctl(db, "limit", "clear", "--type", "email", "--operator", "bo", "--reason", "raised"))
    assert r.stdout.splitlines()[0] == ("email sends no longer rate limited: the ones it held "
                                        "are due now (by bo: raised)")
    assert [s["scope"] for s in json.loads(ok(ctl(db, "limit", "list", "--json")).stdout)] == \
        ["host:api.partner.example"]
    assert [row[:7] for row in scopes(conn)] == [
        ("host", "api.partner.example", False, None, None, 0.5, 3),
        ("type", "http", True, "ann", "r", None, None)]
    assert history(conn) == [
        ("type", "email", "limit", 50.0, 50, "ann", "relay quota"),
        ("host", "api.partner.example", "limit", 0.5, 3, "ann", "partner's 30 a minute"),
        ("type", "http", "off", None, None, "ann", "r"),
        ("type", "email", "unlimit", None, None, "bo", "raised")]


@pytest.mark.parametrize("rate,per_second,burst", [
    ("50", 50.0, 50), ("50/s", 50.0, 50), ("3000/min", 50.0, 50), ("0.5/s", 0.5, 1),
    ("90/min", 1.5, 2), ("2.5", 2.5, 3), ("1/min", 1 / 60, 1), (".5", 0.5, 1),
])
def test_limit_rate_forms_are_per_second(db, conn, rate, per_second, burst):
    ok(ctl(db, "limit", "set", "--host", "relay.example", "--rate", rate, *WHO))
    stored = query(conn, "SELECT rate_per_second, burst FROM outbox_scopes")
    assert stored == [(pytest.approx(per_second, rel=1e-12), burst)]
    assert history(conn)[-1][3] == pytest.approx(per_second, rel=1e-12)


def test_the_database_refuses_a_limit_on_a_crm_object(db, conn):
    # outboxctl refuses it before connecting (above); the function itself too.
    op = psycopg2.connect(dsn_as(db, OPERATOR_ROLE))
    op.autocommit = True
    try:
        with pytest.raises(psycopg2.errors.InvalidParameterValue):
            query(op, "SELECT outbox_scope_limit('crm_object', 'task', 5, NULL, 'ann', 'r')")
    finally:
        op.close()
    assert scopes(conn) == [] and history(conn) == []


# --- who may ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["kill-switch", "off", "--type", "email"] + WHO,
    ["kill-switch", "on", "--host", "api.example.com"] + WHO,
    ["limit", "set", "--type", "email", "--rate", "5"] + WHO,
    ["limit", "clear", "--type", "email"] + WHO,
    ["limit", "list"],
])
def test_a_producer_login_cannot_change_or_read_scopes(db, conn, args):
    r = fails(run_ctl(["--db", producer_dsn(db)] + args), 3, "permission denied")
    assert r.stdout == ""
    assert scopes(conn) == [] and history(conn) == []


@pytest.mark.parametrize("role", [PRODUCER_ROLE, WORKER_ROLE])
@pytest.mark.parametrize("sql", [
    "SELECT * FROM outbox_scope_pause('type', 'email', true, 'x', 'y')",
    "SELECT outbox_scope_limit('type', 'email', 5, NULL, 'x', 'y')",
])
def test_only_operators_may_call_the_scope_functions(db, conn, role, sql):
    c = psycopg2.connect(dsn_as(db, role))
    c.autocommit = True
    try:
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(c, sql)
    finally:
        c.close()
    assert scopes(conn) == [] and history(conn) == []

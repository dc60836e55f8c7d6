# SPDX-License-Identifier: ISC
"""`outboxctl migrate` takes a database of the release before the live
queue (sql/105_live_queue.sql) to this tree without losing a row.

The database is migrated by the outboxctl of that commit (built from the
repository's history, once, and kept in ~/.cache/outbox-test-baseline/;
the benchmarks' copy in ~/.cache/outbox-bench-baseline/ is used when it is
there), and its effects are put in every state by that version's own
functions: pending, delayed, leased, retried, `sending` under a claim and
under a mark (expired, on a provider that honours keys, within its lease),
unknown, completed, failed, cancelled, a replacement of a failed effect,
and a run waiting for its approval.  After this tree's migrate: every
effect, run, approval, operator action and attempts row reads as before;
the expired `sending` rows are reaped as before (unknown, or pending where
keys are honoured); the pending ones are claimable; the schema is a fresh
install's."""
import difflib
import json
import os
import shutil
import subprocess
import tempfile
import uuid

import psycopg2
import pytest

from outbox_test import ROOT, admin_dsn, dsn_for, query, run_ctl, scalar

BASELINE_REF = "2d13b03"        # the last commit before the live queue
CACHES = ("outbox-test-baseline", "outbox-bench-baseline")

EFFECT_COLUMNS = ("effect_id::text, idempotency_key, effect_type, target, payload::text, state, "
                  "attempts, retry_base, provider_id, last_error_class, last_error, last_status, "
                  "effect_key, payload_hash, metadata::text, approved_by, replaces_effect::text, "
                  "created_at, completed_at, lease_owner::text, lease_worker, "
                  "lease_expires_at, sending_since, sending_idempotent, "
                  # the call token of a finished effect's last send is not kept
                  "CASE WHEN state IN ('pending', 'sending', 'unknown') THEN mark_token END AS mark_token, "
                  # an unknown effect is never due now: its due time is the live row's 'infinity'
                  "CASE WHEN state <> 'unknown' THEN available_at END AS available_at")
ATTEMPT_COLUMNS = ("attempt_id, effect_id::text, attempt, lease_owner::text, worker, started_at, "
                   "ended_at, outcome_class, provider_status, provider_id, error_text, cas_applied, "
                   "metadata::text, resolution")


def baseline_outboxctl():
    """The outboxctl of BASELINE_REF, from a cache or built from `git
    archive` in a temporary folder (no checkout of the repository moves)."""
    commit = subprocess.run(["git", "rev-parse", "--verify", BASELINE_REF + "^{commit}"], cwd=ROOT,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        pytest.fail(f"{BASELINE_REF} is not in this clone's history: {commit.stderr}")
    commit = commit.stdout.strip()
    home = os.path.expanduser("~")
    for cache in CACHES:
        path = os.path.join(home, ".cache", cache, commit, "outboxctl")
        if os.access(path, os.X_OK):
            return path
    cache = os.path.join(home, ".cache", CACHES[0], commit)
    tree = tempfile.mkdtemp(prefix="outbox-baseline-")
    try:
        archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
        assert archive.wait() == 0
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        r = subprocess.run(["make", "-C", tree, "-j2", "build/outboxctl"], env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, f"building outboxctl of {commit}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        os.makedirs(cache, exist_ok=True)
        partial = os.path.join(cache, f"outboxctl.partial.{os.getpid()}")
        shutil.copy2(os.path.join(tree, "build", "outboxctl"), partial)
        os.rename(partial, os.path.join(cache, "outboxctl"))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return os.path.join(cache, "outboxctl")


@pytest.fixture
def databases():
    """Factory of new, empty databases, dropped at the end."""
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    made = []

    def make(prefix):
        name = prefix + uuid.uuid4().hex[:12]
        query(admin, f"CREATE DATABASE {name}")
        made.append(name)
        return name
    yield make
    for name in made:
        query(admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()


class OldRelease:
    """The functions of the release before, called as its workers,
    producers and operators would call them."""

    def __init__(self, conn):
        self.c = conn
        self.owner = str(uuid.uuid4())

    def run(self, key):
        query(self.c, "SELECT * FROM outbox_claim_run(%s, 'h', %s, 300)", (key, self.owner))

    def effect(self, name, delay=0):
        """A new http effect of its own run."""
        self.run("up-" + name)
        return scalar(self.c, "SELECT effect_id::text FROM outbox_enqueue(%s, 'http', %s, %s, %s, %s)",
                      ("up-" + name, f"http://127.0.0.1:9/{name}", json.dumps({"name": name}),
                       json.dumps({"workflow_version": "7"}), delay))

    def claim(self, lease=300):
        """The one due effect, claimed (moved to `sending`)."""
        call = str(uuid.uuid4())
        rows = query(self.c, "SELECT effect_id::text FROM outbox_claim(%s, 'w-old', 10, %s, '{http}', "
                             "true, '{}', %s)", (self.owner, lease, call))
        assert len(rows) == 1, rows
        return rows[0][0]

    def lease(self):
        rows = query(self.c, "SELECT effect_id::text FROM outbox_lease(%s, 'w-old', 10, 300, "
                             "'{http}', true)", (self.owner,))
        assert len(rows) == 1, rows
        return rows[0][0]

    def mark(self, eid, lease, idempotent):
        rows = query(self.c, "SELECT effect_id::text, blocked FROM outbox_mark_sending(%s, "
                             "ARRAY[%s]::uuid[], true, %s, %s, %s)",
                     (self.owner, eid, "{http}" if idempotent else "{}", lease, str(uuid.uuid4())))
        assert rows == [(eid, False)]

    def complete(self, eid, outcome, next_state, **kw):
        result = {"effect_id": eid, "attempt": 1, "outcome": outcome, "next_state": next_state,
                  "retry_delay_ms": 0, **kw}
        rows = query(self.c, "SELECT applied, state FROM outbox_complete(%s, 'w-old', %s)",
                     (self.owner, json.dumps([result])))
        assert rows == [(True, next_state)], rows


def make_every_state(conn):
    """{name: effect_id}, each effect in the state its name says."""
    old = OldRelease(conn)
    query(conn, "SELECT outbox_kill_switch_set(true, 'test', 'upgrade test')")
    e = {}
    # Claimed and finished, one at a time (each the only due effect).
    e["completed"] = old.effect("completed")
    old.complete(old.claim(), "accepted", "completed", status=201, provider_id="prov-1")
    e["failed"] = old.effect("failed")
    old.complete(old.claim(), "terminal", "failed", status=400, error="HTTP 400 bad request")
    e["unknown"] = old.effect("unknown")
    old.complete(old.claim(), "ambiguous", "unknown", error="timeout after the request was sent")
    e["retried"] = old.effect("retried")
    old.complete(old.claim(), "retry", "pending", status=503, error="HTTP 503",
                 retry_delay_ms=3_600_000)
    # `sending`: marked with a lease already over (its worker died), on a
    # provider without and with keys; claimed within its lease.
    e["sending_expired"] = old.effect("sending_expired")
    old.mark(old.lease(), 0, idempotent=False)
    e["sending_idempotent"] = old.effect("sending_idempotent")
    old.mark(old.lease(), 0, idempotent=True)
    e["sending_live"] = old.effect("sending_live")
    assert old.claim(lease=600) == e["sending_live"]
    e["leased"] = old.effect("leased")
    assert old.lease() == e["leased"]
    e["cancelled"] = old.effect("cancelled")
    assert scalar(conn, "SELECT outbox_cancel(%s, 'changed my mind', 'producer')",
                  (e["cancelled"],)) is True
    e["pending"] = old.effect("pending")
    e["delayed"] = old.effect("delayed", delay=3600)
    # An operator's replacement of the failed effect: a new run, pending.
    rows = query(conn, "SELECT status, new_effect_id::text FROM outbox_replace(%s, 'up-replacement', "
                       "'ops', 'the target moved', 'http://127.0.0.1:9/fixed')", (e["failed"],))
    assert rows[0][0] == "created", rows
    e["replacement"] = rows[0][1]
    # A run waiting for its approval.
    old.run("up-gated")
    version = scalar(conn, "SELECT version FROM workflow_runs WHERE idempotency_key = 'up-gated'")
    query(conn, "SELECT * FROM outbox_create_approval('up-gated', %s, %s, decode(repeat('ab', 32), "
                "'hex'), ARRAY['approve', 'reject'], 3600, %s)",
          (old.owner, version, json.dumps([{"effect_type": "http", "target": "http://127.0.0.1:9/g",
                                            "payload": {"name": "gated"}}])))
    states = dict(query(conn, "SELECT effect_id::text, state FROM effect_outbox"))
    expected = {"completed": "completed", "failed": "failed", "unknown": "unknown",
                "retried": "pending", "sending_expired": "sending", "sending_idempotent": "sending",
                "sending_live": "sending", "leased": "pending", "cancelled": "failed",
                "pending": "pending", "delayed": "pending", "replacement": "pending"}
    assert {n: states[i] for n, i in e.items()} == expected
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = 'up-gated'") == \
        "awaiting_human"
    return e


def snapshot(conn):
    # Every column of an effect: the one table before the live queue, the
    # read view over its tables after.
    effects = "outbox_effects" if scalar(conn, "SELECT to_regclass('outbox_effects') IS NOT NULL") \
        else "effect_outbox"
    return {
        "effects": query(conn, f"SELECT {EFFECT_COLUMNS} FROM {effects} ORDER BY effect_id"),
        "attempts": query(conn, f"SELECT {ATTEMPT_COLUMNS} FROM effect_attempts ORDER BY attempt_id"),
        "runs": query(conn, "SELECT * FROM workflow_runs ORDER BY idempotency_key"),
        "approvals": query(conn, "SELECT * FROM approvals ORDER BY approval_id"),
        "actions": query(conn, "SELECT * FROM operator_actions ORDER BY action_id"),
        "control": query(conn, "SELECT id, enabled, changed_by, reason, changed_at "
                               "FROM outbox_control"),
    }


def schema(dbname):
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "schema_dump.py"),
                        dsn_for(dbname)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_upgrade_from_the_release_before_the_live_queue_loses_nothing(databases):
    old_ctl = baseline_outboxctl()
    upgraded, fresh = databases("up_"), databases("fresh_")
    r = subprocess.run([old_ctl, "--db", dsn_for(upgraded), "migrate"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "104_producer_isolation" in r.stdout and "105_live_queue" not in r.stdout, r.stdout
    conn = psycopg2.connect(dsn_for(upgraded))
    conn.autocommit = True
    try:
        e = make_every_state(conn)
        before = snapshot(conn)
        assert len(before["attempts"]) == 4     # the four calls the old workers recorded
        conn.close()

        r = run_ctl(["--db", dsn_for(upgraded), "migrate"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert "105_live_queue" in r.stdout, r.stdout
        conn = psycopg2.connect(dsn_for(upgraded))
        conn.autocommit = True
        after = snapshot(conn)
        assert [r[0] for r in after["effects"]] == [r[0] for r in before["effects"]]
        changed = {(n, column): (was[column], now[column])
                   for n, i in e.items()
                   for was, now in [(before_state(before, i), before_state(after, i))]
                   for column in was if was[column] != now[column]}
        assert changed == {}, "effects read differently after the upgrade"
        for part in before:
            assert after[part] == before[part], part
        # Where each kind of row went.
        live = dict(query(conn, "SELECT effect_id::text, state FROM effect_live"))
        was = {i: before_state(before, i)["state"] for i in e.values()}
        assert live == {i: s for i, s in was.items() if s in ("pending", "sending", "unknown")}
        assert scalar(conn, "SELECT available_at = 'infinity' FROM effect_live WHERE effect_id = %s",
                      (e["unknown"],)) is True
        finished = dict(query(conn, "SELECT effect_id::text, state FROM effect_history "
                                    "WHERE state IS NOT NULL"))
        assert finished == {e["completed"]: "completed", e["failed"]: "failed",
                            e["cancelled"]: "failed"}
        calls = {r[0] for r in query(conn, "SELECT unnest(ids)::text FROM effect_calls")}
        assert calls == {e["sending_expired"], e["sending_idempotent"], e["sending_live"]}

        # The reaper finds the two sends whose lease is over, as before.
        reaped = dict(query(conn, "SELECT effect_id::text, state FROM outbox_reap('r', 500)"))
        assert reaped == {e["sending_expired"]: "unknown", e["sending_idempotent"]: "pending"}
        assert [a[0] for a in query(conn, "SELECT outcome_class FROM effect_attempts "
                                          "WHERE worker = 'reaper:r'")] == ["ambiguous", "ambiguous"]
        # The due pending effects are claimable; the leased, delayed and
        # retried ones wait for their lease or their time.
        call = str(uuid.uuid4())
        claimed = {r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_claim(%s, 'w-new', "
                                             "100, 30, '{http}', true, '{}', %s)",
                                       (str(uuid.uuid4()), call))}
        assert claimed == {e["pending"], e["sending_idempotent"], e["replacement"]}
        # The effect the live worker still holds is the old worker's to finish.
        old_owner = before_state(before, e["sending_live"])["lease_owner"]
        done = query(conn, "SELECT applied, state FROM outbox_complete(%s, 'w-old', %s)",
                     (old_owner, json.dumps([{"effect_id": e["sending_live"], "attempt": 1,
                                              "outcome": "accepted", "next_state": "completed",
                                              "status": 200, "provider_id": "prov-live"}])))
        assert done == [(True, "completed")]
        assert query(conn, "SELECT state, provider_id, attempts FROM outbox_effects "
                           "WHERE effect_id = %s", (e["sending_live"],)) == [
            ("completed", "prov-live", 1)]
        # The schema is a fresh install's (what the calls above did is data only).
        r = run_ctl(["--db", dsn_for(fresh), "migrate"])
        assert r.returncode == 0, r.stdout + r.stderr
        a, b = schema(upgraded).splitlines(), schema(fresh).splitlines()
        diff = list(difflib.unified_diff(b, a, "fresh", "upgraded", lineterm="", n=2))
        assert a == b, "the upgraded schema differs from a fresh install's:\n" + "\n".join(diff[:80])
    finally:
        conn.close()


def before_state(snap, eid):
    """The effect's row in a snapshot, by column name."""
    names = [c.rsplit(" AS ", 1)[-1].strip().split("::")[0] for c in EFFECT_COLUMNS.split(", ")]
    for row in snap["effects"]:
        if row[0] == eid:
            return dict(zip(names, row))
    raise KeyError(eid)

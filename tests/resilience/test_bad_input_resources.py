# SPDX-License-Identifier: ISC
"""Bad input that aims at the worker's resources rather than at a
provider: slow clients on the metrics port (descriptors), oversized
metadata and payloads (memory).  The worker must go on delivering,
reconnecting and answering /healthz, and refuse the oversized rows with
their reason.
"""
import json
import os
import re
import resource
import socket
import threading
import time
import urllib.request

import pytest

from outbox_test import (Dispatcher, free_port, http_cfg, kill_switch, make_run, query, scalar,
                         wait_for)

SLOW_CLIENTS = 300
NOFILE = 256   # the worker's soft descriptor limit at start, as outside systemd (1024), scaled down


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def healthz(port, timeout=2):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as r:
            return r.status
    except OSError:
        return None


def test_slow_metrics_clients_cannot_starve_the_worker(conn, db, tmp_path, sink):
    """300 loopback clients, each trickling a byte of a request head every
    half second, against a worker started with a soft limit of 256
    descriptors: the metrics port holds at most its cap of connections and
    closes each one after its total time, however often it sends a byte;
    meanwhile every effect is delivered, the database connections come back
    after being terminated, and /healthz answers."""
    kill_switch(conn, True)
    port = free_port()
    cfg = {"metrics": {"listen": f"127.0.0.1:{port}"},
           "database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))
    try:
        w = Dispatcher(db, tmp_path, cfg, name="fds").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    stop = threading.Event()
    clients, closed_by_server = [], []

    def trickle():
        while not stop.is_set():
            for s in list(clients):
                try:
                    s.send(b"X")
                except OSError:
                    clients.remove(s)
                    closed_by_server.append(time.monotonic())
                    s.close()
            stop.wait(0.5)

    try:
        wait_for(lambda: healthz(port) == 200, timeout=30, what="/healthz 200 before the attack")
        baseline = open_fds(w.proc.pid)
        started = time.monotonic()
        for _ in range(SLOW_CLIENTS):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.send(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            clients.append(s)
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(1)
        fds_under_attack = open_fds(w.proc.pid)
        assert fds_under_attack <= baseline + 64 + 8, (baseline, fds_under_attack)

        # Deliveries go on, each effect once, no attempt lost to EMFILE.
        key = make_run(conn)
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "SELECT %s, 'http', %s || '/ok/fd-' || g, '{}' FROM generate_series(1, 40) g",
              (key, sink.url))
        # The database connections come back while the slow clients are there.
        query(conn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND application_name LIKE 'outbox %%'")
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = %s "
                                      "AND state = 'completed'", (key,)) == 40,
                 timeout=60, what="every effect delivered")
        assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE outcome_class <> 'accepted'") == 0
        assert sink.count() == 40
        # This database's: workers of tests running beside it share the server.
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE "
                                      "datname = current_database() AND "
                                      "application_name LIKE 'outbox %%'") == 2,
                 timeout=30, what="both worker connections back")
        assert any(e.get("event") == "db_disconnected" for e in w.events())
        # /healthz answers (a slot frees once the slow ones are cut off).
        wait_for(lambda: healthz(port) == 200, timeout=30, what="/healthz 200 under the attack")
        # Every slow client was cut off by the server within its total
        # time (5 s), although it sent a byte every half second.
        wait_for(lambda: not clients, timeout=30, what="every slow client closed by the worker")
        assert max(closed_by_server) - started < 15, max(closed_by_server) - started
        assert w.proc.poll() is None
    finally:
        stop.set()
        for s in clients:
            s.close()
        w.stop()


def test_oversized_metadata_is_refused_at_the_door(conn, login_as, dispatchers, sink):
    """Four effects with 13 MB of metadata took a worker to 1.25 GB, and
    every attempts row and log line copied it.  A producer's metadata is
    bounded (64 KiB): the plain INSERT, outbox_enqueue and
    outbox_create_approval refuse more with the sizes (SQLSTATE 54000) and
    store nothing; metadata under the bound is delivered, logged with the
    attempt, and not copied into the attempts row."""
    import json
    import uuid

    import psycopg2
    import pytest
    kill_switch(conn, True)
    p = login_as("outbox_producer")
    owner = str(uuid.uuid4())
    assert scalar(p, "SELECT status FROM outbox_claim_run('meta', 'h', %s, 300)", (owner,)) == "claimed"
    huge = json.dumps({"workflow_version": "v1", "blob": "x" * (13 << 20)})
    attempts_to_refuse = [
        ("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
         "VALUES ('meta', 'http', %s, '{}', %s)", (sink.url + "/ok/huge", huge)),
        ("SELECT * FROM outbox_enqueue('meta', 'http', %s, '{}', %s)", (sink.url + "/ok/huge2", huge)),
        ("SELECT * FROM outbox_create_approval('meta', %s, 0, decode(repeat('ab', 32), 'hex'), "
         "ARRAY['approve'], 60, %s)",
         (owner, json.dumps([{"effect_type": "http", "target": sink.url + "/ok/h3", "payload": {},
                              "metadata": json.loads(huge)}]))),
    ]
    for sql, args in attempts_to_refuse:
        with pytest.raises(psycopg2.Error) as ei:
            query(p, sql, args)
        assert ei.value.pgcode == "54000", ei.value
        assert "metadata is" in str(ei.value) and "more than the 65536 allowed" in str(ei.value)
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0

    meta = {"workflow_version": "v7", "model": "m-2", "note": "y" * 60000}
    query(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
             "VALUES ('meta', 'http', %s, '{}', %s)", (sink.url + "/ok/fine", json.dumps(meta)))
    w = dispatchers(http_cfg())
    wait_for(lambda: scalar(conn, "SELECT state FROM outbox_effects") == "completed",
             what="the effect with bounded metadata delivered")
    assert query(conn, "SELECT outcome_class, metadata FROM effect_attempts") == [("accepted", None)]
    wait_for(lambda: [e for e in w.events() if e.get("event") == "attempt"], what="attempt logged")
    line = [e for e in w.events() if e.get("event") == "attempt"][0]
    assert line["metadata"]["model"] == "m-2"


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("claim", [True, False], ids=["claim", "lease"])
def test_oversized_rows_are_refused_without_being_fetched(conn, dispatchers, sink, claim):
    """A 60 MiB payload reached 385 MB of the worker before payload_check()
    refused it, and rows stored before the metadata bound (or by the
    table's owner) can carry 13 MB of metadata.  Inserted by the owner,
    past the producer's door: the claim and the lease return neither body,
    only its length, so both rows fail as invalid with the size and the
    limit while the worker's peak resident size stays far below them; the
    row beside them is delivered."""
    kill_switch(conn, True)
    run = make_run(conn)
    big_payload = json.dumps({"body": "p" * (60 << 20)})
    big_meta = json.dumps({"workflow_version": "v1", "blob": "m" * (13 << 20)})
    ids = {}
    for name, payload, meta in (("payload", big_payload, None), ("metadata", "{}", big_meta),
                                ("normal", "{}", '{"model": "m-1"}')):
        ids[name] = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                                 "payload, metadata) VALUES (%s, 'http', %s, %s, %s) "
                                 "RETURNING effect_id::text",
                           (run, f"{sink.url}/ok/{name}", payload, meta))
    del big_payload, big_meta
    w = dispatchers({"dispatcher": {"claim": claim}, **http_cfg()})

    def settled():
        rows = query(conn, "SELECT effect_id::text, state, last_error FROM outbox_effects")
        return rows if all(s not in ("pending", "sending") for _, s, _ in rows) else None
    rows = {eid: (state, err) for eid, state, err in wait_for(settled, timeout=60,
                                                                what="all three settled")}
    hwm = vm_hwm_kib(w.proc.pid)
    assert rows[ids["normal"]] == ("completed", None), rows[ids["normal"]]
    payload_text_bytes = len('{"body": ""}') + (60 << 20)    # as jsonb prints it
    assert rows[ids["payload"]] == ("failed", f"payload is {payload_text_bytes} bytes, "
                                              "over the limit of 262144"), rows[ids["payload"]]
    state, err = rows[ids["metadata"]]
    assert state == "failed" and re.fullmatch(r"metadata is \d{8} bytes, over the limit of 65536",
                                              err), (state, err)
    assert hwm < 100 << 10, f"peak resident size {hwm} KiB"
    assert w.proc.poll() is None


def test_a_probe_gets_in_past_clients_that_hold_every_metrics_connection(dispatchers):
    """64 clients (the cap) each hold a connection with half a request head
    sent: a probe that asks at once still gets /healthz, because at the
    cap a new connection closes the oldest instead of being refused."""
    port = free_port()
    w = dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"}})
    wait_for(lambda: healthz(port) == 200, timeout=30, what="/healthz 200 before")
    held = []
    try:
        for _ in range(64):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.send(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            held.append(s)
        # Every one of them is open on the worker's side.
        wait_for(lambda: open_fds(w.proc.pid) >= 64, what="the 64 connections accepted")
        assert healthz(port) == 200
    finally:
        for s in held:
            s.close()

# SPDX-License-Identifier: ISC
"""Address translation prefixes through a real worker: a target whose
address is a NAT64 (well-known 64:ff9b::/96 and local-use 64:ff9b:1::/48)
or SIIT IPv4-translated (::ffff:0:a.b.c.d) form of loopback or the cloud
metadata address, or a 6to4 relay anycast address (192.88.99.0/24), is
refused by the SSRF rules before any attempt: `failed` / `invalid`, no
attempt row, no connection.
"""
import pytest

from outbox_test import attempts, effect, enqueue, final, kill_switch

TARGETS = [
    "http://[64:ff9b::7f00:1]/x",
    "http://[64:ff9b:1::a9fe:a9fe]/latest",
    "http://[64:ff9b:1:7f00:1::]/x",
    "http://[::ffff:0:7f00:1]/x",
    "http://[::ffff:0:a9fe:a9fe]/latest",
    "http://192.88.99.1/x",
]


@pytest.mark.parametrize("target", TARGETS)
def test_translation_prefixes_refused_before_any_attempt(conn, dispatchers, target):
    kill_switch(conn, True)
    w = dispatchers()
    eid = str(enqueue(conn, "http", target, {"body": {}}))
    e = final(conn, eid)
    assert (e["state"], e["last_error_class"]) == ("failed", "invalid"), e
    assert "allow-list" in e["last_error"], e
    assert e["attempts"] == 0 and attempts(conn, eid) == []
    assert w.proc.poll() is None

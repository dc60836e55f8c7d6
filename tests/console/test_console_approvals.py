# SPDX-License-Identifier: ISC
"""The approvals page links each waiting approval out to the n8n kit's
approval page ([console] approvals_url, {id} the approval's id): the href
escaped, rel="noopener noreferrer"; no link when the key is empty; a URL
that is not http(s) stops the console's start with file:line and key."""
import os
import re
import subprocess

from outbox_test import BUILD_DIR, make_run, query, write_config


def waiting_approval(conn):
    key = make_run(conn)
    query(conn, "UPDATE workflow_runs SET state = 'awaiting_human' WHERE idempotency_key = %s",
          (key,))
    return str(query(conn, "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, "
                           "expires_at, approver_audience, proposed_effects) VALUES (%s, "
                           "sha256(gen_random_uuid()::text::bytea), ARRAY['approve','reject'], now() + interval "
                           "'1 hour', 'ops', '[{\"effect_type\": \"http\", \"target\": "
                           "\"https://sink.example/a\"}]') RETURNING approval_id", (key,))[0][0])


def test_each_waiting_approval_links_to_its_page(conn, console_factory):
    aid = waiting_approval(conn)
    c = console_factory(extra={"approvals_url": "https://n8n.example.com/approval?id={id}&from=console"})
    status, _, body = c.get("/approvals")
    assert status == 200, body
    links = re.findall(r'<a class="approval"([^>]*)>([^<]*)</a>', body)
    assert len(links) == 1, body
    attrs, text = links[0]
    assert text == aid
    assert f'href="https://n8n.example.com/approval?id={aid}&amp;from=console"' in attrs
    assert 'rel="noopener noreferrer"' in attrs


def test_no_link_without_the_setting(conn, console_factory):
    aid = waiting_approval(conn)
    c = console_factory()
    status, _, body = c.get("/approvals")
    assert status == 200 and aid in body
    assert 'class="approval"' not in body


def test_a_bad_approvals_url_stops_the_start(db, console_roles, tmp_path):
    login, _ = console_roles
    for url, why in (("javascript:alert({id})", "must begin with https:// or http://"),
                     ("https://n8n.example.com/approval", "must hold {id}")):
        cfg = write_config(tmp_path / "bad.ini", {"console": {"listen": "127.0.0.1:1",
                                                               "approvals_url": url}})
        line = next(i for i, l in enumerate(open(cfg).read().splitlines(), 1)
                    if l.startswith("approvals_url"))
        r = subprocess.run([os.path.join(BUILD_DIR, "outbox-console"), "--config", str(cfg)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, r
        assert f"{cfg}:{line}: [console] approvals_url: {why}" in r.stderr, r.stderr

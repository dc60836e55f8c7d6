# SPDX-License-Identifier: ISC
"""outbox-console over HTTP against a real database: every route answers,
with its security headers; a POST is refused in read-only mode, without the
form's token or with another's, from another Origin and without a person;
the identity header counts only from the trusted proxy; a producer's key
holding markup, quotes and bidi characters renders inert; the acts change
the database as the person's own role, recorded under the person's name."""
import re

from console_lib import new_effect, new_unknown, populate
from outbox_test import query, scalar

VIEWS = ["/", "/effects", "/unknown", "/approvals", "/controls", "/runs", "/audit"]


def test_every_view_answers_with_its_headers(conn, console_factory):
    ids = populate(conn)
    c = console_factory()
    paths = VIEWS + [f"/effect?id={ids['unknown'][0]}", f"/effect?id={ids['failed'][0]}&payload=1",
                     "/effects?state=failed", "/audit?operator=nobody", "/runs?state=approved",
                     f"/runs?key={ids['pending'][0]}", "/static/console.css", "/static/console.js"]
    for path in paths:
        status, headers, body = c.get(path)
        assert status == 200, (path, body[:300])
        csp = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp, path
        assert "'unsafe-inline'" not in csp
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["x-frame-options"] == "DENY"
        assert headers["cache-control"] == "no-store"
        if path.startswith("/static"):
            continue
        assert "<script>" not in body and " style=" not in body, path
        assert 'id="banner"' in body, path
    assert c.get("/nowhere")[0] == 404
    assert c.request("DELETE", "/")[0] == 405


def test_the_views_show_what_the_database_holds(conn, console_factory):
    ids = populate(conn)
    c = console_factory()
    _, _, body = c.get("/")
    assert 'id="counts"' in body and "<svg" in body and "polyline" in body
    for state in ("pending", "sending", "unknown", "completed", "failed"):
        assert f'class="state-{state}"' in body, state
    _, _, body = c.get("/unknown")
    for u in ids["unknown"]:
        assert u in body
    assert "gateway timeout" in body and "status 504" in body
    _, _, body = c.get(f"/effect?id={ids['unknown'][0]}")
    assert 'id="history"' in body and "ambiguous" in body and "show it" in body
    assert "body" not in body.split('id="effect"')[1].split("</table>")[0]   # payload hidden
    _, _, body = c.get(f"/effect?id={ids['unknown'][0]}&payload=1")
    assert 'id="payload"' in body
    _, _, body = c.get("/effects?state=failed")
    assert all(f in body for f in ids["failed"]) and ids["pending"][0] not in body
    _, _, body = c.get("/effects?host=failing.example")
    assert all(f in body for f in ids["failed"]) and ids["unknown"][0] not in body


def test_a_producers_key_renders_inert(conn, console_factory):
    ids = populate(conn)
    c = console_factory()
    for path in ("/effects", f"/effect?id={ids['pending'][0]}", "/runs"):
        _, _, body = c.get(path)
        assert "<script>alert(1)</script>" not in body, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body, path
        assert "\u202e" not in body and "\\u202e" in body.lower(), path
        assert "-&quot;q&#39;-" in body, path


def test_post_refused_in_read_only_mode(conn, console_factory, console_roles):
    ids = populate(conn)
    _, people = console_roles
    c = console_factory(actions=False)
    status, _, body = c.post("/unknown/resolve", {"id": ids["unknown"][0], "verdict": "sent",
                                                  "reason": "r", "csrf": "x" * 64}, who=people[0])
    assert status == 403 and "read-only" in body
    assert 'name="csrf"' not in c.get("/unknown", people[0])[2]
    assert scalar(conn, "SELECT state FROM effect_live WHERE effect_id = %s",
                  (ids["unknown"][0],)) == "unknown"


def test_post_needs_this_persons_token_and_the_consoles_origin(conn, console_factory,
                                                              console_roles):
    ids = populate(conn)
    _, people = console_roles
    c = console_factory(actions=True)
    form = {"id": ids["unknown"][0], "verdict": "sent", "reason": "r"}
    assert c.post("/unknown/resolve", form, who=people[0])[0] == 403               # none
    assert c.post("/unknown/resolve", dict(form, csrf="0" * 64), who=people[0])[0] == 403
    other = c.csrf(people[1])
    assert c.post("/unknown/resolve", dict(form, csrf=other), who=people[0])[0] == 403
    mine = c.csrf(people[0])
    status, _, body = c.post("/unknown/resolve", dict(form, csrf=mine), who=people[0],
                             origin=False)
    assert status == 403 and "Origin" in body
    status, _, body = c.post("/unknown/resolve", dict(form, csrf=mine), who=people[0],
                             origin=False, headers={"Origin": "http://evil.example"})
    assert status == 403
    assert c.post("/unknown/resolve", dict(form, csrf=mine))[0] == 403               # nobody
    assert scalar(conn, "SELECT state FROM effect_live WHERE effect_id = %s",
                  (ids["unknown"][0],)) == "unknown"
    status, _, body = c.post("/unknown/resolve", dict(form, csrf=mine), who=people[0])
    assert status == 200, body
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s",
                  (ids["unknown"][0],)) == "completed"
    act = query(conn, "SELECT operator, action FROM operator_actions ORDER BY action_id DESC LIMIT 1")
    assert act[0] == (people[0], "resolve_sent")


def test_identity_from_an_untrusted_peer_is_ignored(conn, console_factory, console_roles):
    _, people = console_roles
    c = console_factory(actions=True, trusted_proxy="127.0.0.2")
    _, _, body = c.get("/controls", people[0])
    assert people[0] not in body and "no identity from a trusted proxy" in body
    assert 'name="csrf"' not in body
    status, _, body = c.post("/controls/switch", {"to": "off", "reason": "r", "csrf": "0" * 64},
                             who=people[0])
    assert status == 403 and "person" in body
    assert scalar(conn, "SELECT count(*) FROM outbox_control_history WHERE changed_by = %s",
                  (people[0],)) == 0


def test_acts_run_as_the_persons_role(conn, db, console_factory, console_roles):
    ids = populate(conn)
    login, people = console_roles
    c = console_factory(actions=True)
    tok = c.csrf(people[0])
    # the switch off, showing the send in flight
    status, _, body = c.post("/controls/switch", {"to": "off", "reason": "incident",
                                                  "csrf": tok}, who=people[0])
    assert status == 200, body
    assert ids["sending"][0] in body and "in flight" in body
    assert scalar(conn, "SELECT enabled FROM outbox_control") is False
    assert scalar(conn, "SELECT changed_by FROM outbox_control") == people[0]
    # a scope paused, then a limit set and cleared
    status, _, body = c.post("/controls/switch", {"to": "off", "kind": "host",
                                                  "value": "failing.example", "reason": "x",
                                                  "csrf": tok}, who=people[0])
    assert status == 200, body
    assert scalar(conn, "SELECT paused FROM outbox_scopes WHERE kind = 'host' "
                        "AND value = 'failing.example'") is True
    assert "failing.example" in c.get("/")[2]
    status, _, body = c.post("/controls/limit", {"to": "set", "kind": "type", "value": "http",
                                                 "rate": "5", "reason": "slow", "csrf": tok},
                             who=people[0])
    assert status == 200, body
    assert scalar(conn, "SELECT rate_per_second FROM outbox_scopes WHERE kind = 'type' "
                        "AND value = 'http'") == 5
    # requeue by filter: a preview, then the act
    flt = {"state": "failed", "host": "failing.example", "reason": "provider back", "cap": "10",
           "csrf": tok}
    status, _, body = c.post("/effects/requeue", dict(flt, preview="1"), who=people[0])
    assert status == 200 and "2 failed effects match" in body, body
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY(%s::uuid[])",
                  (ids["failed"],)) == 0
    status, _, body = c.post("/effects/requeue", dict(flt, confirm="1"), who=people[0])
    assert status == 200 and "requeued 2 failed effects" in body, body
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY(%s::uuid[]) "
                        "AND state = 'pending'", (ids["failed"],)) == 2
    # one act refused by the database: a person who is no operator
    query(conn, f'REVOKE outbox_operator FROM "{people[1]}"')
    status, _, body = c.post("/unknown/resolve", {"id": ids["unknown"][1], "verdict": "not_sent",
                                                  "reason": "r", "csrf": c.csrf(people[1])},
                             who=people[1])
    assert status == 403 and "refused" in body, body
    assert scalar(conn, "SELECT state FROM effect_live WHERE effect_id = %s",
                  (ids["unknown"][1],)) == "unknown"
    ops = {r[0] for r in query(conn, "SELECT operator FROM operator_actions")}
    assert ops == {people[0]}, ops
    _, _, body = c.get(f"/audit?operator={people[0]}")
    assert "requeue" in body and "provider back" in body
    # the viewer's own connection never took the person's rights
    assert scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE usename = %s "
                        "AND datname = current_database()", (login,)) >= 1


def test_cancel_by_filter_stops_what_it_matches_and_nothing_else(conn, console_factory,
                                                                 console_roles):
    from console_lib import new_effect
    ids = populate(conn)
    _, people = console_roles
    doomed = [new_effect(conn, target="https://doomed.example/a"),
              new_effect(conn, target="https://doomed.example/b")]
    c = console_factory(actions=True)
    tok = c.csrf(people[0])
    flt = {"host": "doomed.example", "reason": "wrong list", "cap": "10", "csrf": tok}
    status, _, body = c.post("/effects/cancel", dict(flt, preview="1"), who=people[0])
    assert status == 200 and "2 pending effects match" in body, body
    status, _, body = c.post("/effects/cancel", dict(flt, confirm="1"), who=people[0])
    assert status == 200 and "cancelled 2 pending effects" in body, body
    for d in doomed:
        assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (d,)) == "failed"
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s",
                  (ids["pending"][0],)) == "pending"
    assert scalar(conn, "SELECT count(*) FROM operator_actions WHERE operator = %s",
                  (people[0],)) >= 2


def test_runs_page_is_bounded_and_pages_on(conn, console_factory):
    """A run's effects are counted up to 101 ("more than 100"); a state
    filter walks 1,000 runs a page and links to the next ones."""
    import re
    from outbox_test import make_run
    big = make_run(conn, key="a-big-run")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'https://sink.example/' || g, '{}' "
                "FROM generate_series(1, 120) g", (big,))
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'b-' || lpad(g::text, 6, '0'), 'completed', 'h' "
                "FROM generate_series(1, 1100) g")
    query(conn, "UPDATE workflow_runs SET state = 'failed_terminal' "
                "WHERE idempotency_key = 'b-001050'")
    c = console_factory()
    _, _, body = c.get("/runs")
    row = body.split('href="/runs?key=a-big-run"')[1].split("</tr>")[0]
    assert "more than 100" in row and "at least 120" not in row, row
    _, _, body = c.get("/runs?state=failed_terminal")
    assert "b-001050" not in body
    m = re.search(r'id="next" href="(/runs\?after=[^"]+)"', body)
    assert m and "the next 1,000 runs" in body, body[-800:]
    _, _, body = c.get(m.group(1).replace("&amp;", "&"))
    assert 'href="/runs?key=b-001050"' in body, body[-800:]
    assert 'id="next"' not in body


def overview_rows(body):
    """The overview's counts as (state, type, host, effects, held) rows."""
    import html
    table = body.split('id="counts"')[1].split("</table>")[0]
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]:
        cells = [html.unescape(re.sub(r"<[^>]+>", "", td)).strip()
                 for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        rows.append(tuple(cells))
    return rows


def test_overview_counts_by_state_type_and_host(conn, console_factory):
    ids = populate(conn)
    c = console_factory()
    _, _, body = c.get("/")
    rows = overview_rows(body)
    # The two failed effects went to failing.example, the rest to sink.example.
    assert ("failed", "http", "failing.example", "2", "0") in rows, rows
    assert ("unknown", "http", "sink.example", "2", "0") in rows, rows
    assert ("completed", "http", "sink.example", "2", "0") in rows, rows
    assert sum(int(r[3]) for r in rows) == sum(len(v) for v in ids.values()), rows
    assert 'href="/effects?state=failed&amp;type=http&amp;host=failing.example"' in body
    assert 'id="counts-capped"' not in body
    # The chart: one point a minute over 3 hours for each series, the
    # minutes with nothing on the axis (y = 160), the last minute's not.
    lines = re.findall(r'<polyline[^>]*points="([^"]*)"', body)
    assert len(lines) == 4, lines
    for points in lines:
        ys = [float(p.split(",")[1]) for p in points.split()]
        assert len(ys) == 181 and ys.count(160.0) >= 170, points
    assert any(float(p.split(",")[1]) < 160 for line in lines for p in line.split()[-12:]), lines


def test_overview_counts_stop_at_their_cap_and_say_so(conn, console_factory):
    """More open effects than a walk counts: the count shown is a lower
    bound, marked as one, and the page says why."""
    populate(conn)
    from outbox_test import make_run
    key = make_run(conn)
    query(conn, "UPDATE workflow_runs SET state = 'processing' WHERE idempotency_key = %s", (key,))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'https://many.example/' || g, '{}' "
                "FROM generate_series(1, 20005) g", (key,))
    c = console_factory()
    _, _, body = c.get("/")
    rows = overview_rows(body)
    many = [r for r in rows if r[2] == "many.example"]
    assert len(many) == 1 and many[0][0] == "pending" and many[0][3].startswith("≥ "), rows
    assert 20000 - 3 <= int(many[0][3][2:]) <= 20001, many
    assert 'id="counts-capped"' in body
    # The parked walk (unknown effects) is not capped: its counts are exact.
    assert ("unknown", "http", "sink.example", "2", "0") in rows, rows


def test_a_rare_host_filter_walks_a_bounded_part_of_the_window(conn, console_factory):
    """A host that only old effects of the window have: the first page
    reads the newest 20,000 effects, says where it stopped and links on;
    the next page finds them."""
    from outbox_test import make_run
    key = make_run(conn)
    query(conn, "UPDATE workflow_runs SET state = 'processing' WHERE idempotency_key = %s", (key,))
    old = [r[0] for r in query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, "
                                     "target, payload) SELECT %s, 'http', "
                                     "'https://rare.example/' || g, '{}' FROM generate_series(1, 3) g "
                                     "RETURNING effect_id::text", (key,))]
    # Ids begin with their creation's milliseconds: once the database's
    # clock is past the rare ones' millisecond, every later id is newer.
    last_ms = max(int(e.replace("-", "")[:12], 16) for e in old)
    while scalar(conn, "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint") <= last_ms:
        pass
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'https://common.example/' || g, '{}' "
                "FROM generate_series(1, 20010) g", (key,))
    c = console_factory()
    status, _, body = c.get("/effects?host=rare.example")
    assert status == 200
    assert not any(e in body for e in old), "the first page walked past its 20,000"
    assert 'id="walk-end"' in body and "searched the newest 20000 effects" in body
    link = re.search(r'id="next" href="([^"]+)"', body).group(1).replace("&amp;", "&")
    assert "host=rare.example" in link
    status, _, body = c.get(link)
    assert status == 200 and all(e in body for e in old), body[-2000:]
    assert 'id="walk-end"' not in body   # the window's start reached
    # A run key is its own index: no walk, every effect of the run at once
    # (the first page holds 50 of them, newest first, and links on).
    _, _, body = c.get(f"/effects?run={key}")
    assert 'id="walk-end"' not in body and 'older &rarr;' in body


def test_unknown_page_shows_the_reconcile_lookups_and_late_acceptances(conn, console_factory):
    """Each unknown effect with the evidence its history holds beyond the
    last call: how many reconcile lookups, the last one's answer and when,
    and the late acceptances (none for the other unknown)."""
    ids = populate(conn)
    u, other = ids["unknown"]
    for n, (outcome, status, err) in enumerate([("reconcile_unknown", None, "lookup timed out"),
                                                ("reconcile_unknown", 404, "no such message")]):
        query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, "
                    "worker, source, started_at, outcome_class, provider_status, error_text) "
                    "SELECT effect_id, created_at, 1, NULL, 'w2', 'reconcile', "
                    "now() - make_interval(mins => %s), %s, %s, %s "
                    "FROM effect_outbox WHERE effect_id = %s", (10 - n, outcome, status, err, u))
    c = console_factory()
    _, _, body = c.get("/unknown")
    rows = {m.group(1): m.group(0) for m in re.finditer(
        r'<tr><td>.*?href="/effect\?id=([0-9a-f-]{36})".*?</tr>', body, re.S)}
    assert set(rows) == {u, other}, body[-2000:]
    lookups = re.search(r'<td class="lookups">(.*?)</td>\s*<td[^>]*>(.*?)</td>', rows[u], re.S)
    assert lookups, rows[u]
    assert lookups.group(1).startswith("2; last ") and \
        "reconcile_unknown, status 404: no such message" in lookups.group(1), lookups.group(1)
    assert lookups.group(2) == "0", lookups.group(2)
    other_lookups = re.search(r'<td class="lookups">(.*?)</td>', rows[other], re.S).group(1)
    assert other_lookups == "0", other_lookups


def test_unknown_page_shows_the_phase_each_send_reached_and_its_point_of_no_return(
        conn, console_factory):
    """Each unknown effect with the phase its last send reached, from the
    class its worker or the reaper recorded, and the time since that send
    went `sending`: an answer that does not say (a 504), no answer at all,
    a worker gone mid-send.  A later reconcile lookup is not a send."""
    from effect_arrange import arrange
    ids = populate(conn)
    answered, _ = ids["unknown"]
    silent = new_effect(conn)
    arrange(conn, silent, "unknown", attempts=1, last_error_class="ambiguous",
            last_error="sent, no answer: timeout")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class, error_text) SELECT effect_id, created_at, 1, "
                "gen_random_uuid(), 'w1', now() - interval '300 seconds', 'ambiguous', "
                "'sent, no answer: timeout' FROM effect_outbox WHERE effect_id = %s", (silent,))
    reaped = new_unknown(conn, 1, "lease lost", "w1", None, None)
    # As the reaper writes it (outbox_reap): ambiguous, its source
    # the reaper, started when the row went `sending`.
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "source, started_at, outcome_class, error_text) SELECT effect_id, created_at, 1, "
                "gen_random_uuid(), 'reaper:w2', 'reaper', now() - interval '1 hour', "
                "'ambiguous', 'lease expired while sending' FROM effect_outbox "
                "WHERE effect_id = %s", (reaped,))
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, source, "
                "started_at, outcome_class, provider_status) SELECT effect_id, created_at, 1, "
                "'w2', 'reconcile', now(), 'reconcile_unknown', 404 FROM effect_outbox "
                "WHERE effect_id = %s", (silent,))
    c = console_factory()
    _, _, body = c.get("/unknown")
    rows = {m.group(1): m.group(0) for m in re.finditer(
        r'<tr><td>.*?href="/effect\?id=([0-9a-f-]{36})".*?</tr>', body, re.S)}

    def phase(eid):
        m = re.search(r'<td class="phase">(.*?)</td><td class="no-return">(\d+) s</td>',
                      rows[eid], re.S)
        assert m, rows[eid]
        return m.group(1), int(m.group(2))

    got, since = phase(answered)
    assert got == "sent; inconclusive 504" and since < 60
    got, since = phase(silent)
    assert got == "sent; no answer" and 300 <= since < 400, (got, since)
    got, since = phase(reaped)
    assert got == "sending; worker lost" and 3600 <= since < 3700, (got, since)


def test_the_unknown_and_effect_pages_show_the_run_as_its_effects_settle_it(conn, console_factory):
    """A run whose other effect failed is failed_terminal on the unknown
    page and on each effect's page, though its row still says approved
    (no worker or outboxctl has settled it since)."""
    from effect_arrange import arrange
    u = new_unknown(conn, 1, "timed out after the request was sent", "w1", None, None)
    key = scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (u,))
    f = new_effect(conn, key=key, run=False)
    arrange(conn, f, "failed", last_error_class="terminal", last_error="400 bad request")
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == "approved"
    c = console_factory()
    _, _, body = c.get("/unknown")
    row = re.search(r'<tr><td>.*?href="/effect\?id=' + u + r'".*?</tr>', body, re.S)
    assert row, body[-2000:]
    assert "(failed_terminal)" in row.group(0) and "(approved)" not in row.group(0), row.group(0)
    for eid in (u, f):
        _, _, body = c.get(f"/effect?id={eid}")
        shown = re.search(r"<tr><th>run state</th><td[^>]*>(.*?)</td>", body)
        assert shown and shown.group(1) == "failed_terminal", (eid, body[-3000:])

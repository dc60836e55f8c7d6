# SPDX-License-Identifier: ISC
"""Each view of the console does what docs/console.md's table of views
promises, checked in headless chromium behind nginx (basic auth naming the
person), one test per row of that table: what the page shows is compared
with what the database holds, the acts are done by clicking, and the
database is checked after each.  The last test loads every view with
JavaScript off and acts from it.  After each test the browser has logged
no error and no Content-Security-Policy violation.

Pages are read from the browser's DOM (parsed here, cell by cell, by each
table's header row, so a column added to a table moves nothing)."""
import base64
import html.parser
import re
import urllib.request
import uuid

import pytest

from browser_lib import PASSWORD, log_problems
from console_lib import new_effect, new_unknown, populate
from effect_arrange import arrange, effect_created_at
from outbox_test import make_run, query, scalar

pytest.importorskip("selenium")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

UTC = "to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"


# ---- reading pages ------------------------------------------------------------

class _Tables(html.parser.HTMLParser):
    """Every table of a page by id: rows of cells, a cell (text, hrefs)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self.open, self.row, self.cell = {}, [], None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.open.append(a.get("id"))
            self.tables.setdefault(a.get("id"), [])
        elif tag == "tr" and self.open:
            self.row = []
        elif tag in ("td", "th") and self.row is not None:
            self.cell = ["", []]
        elif tag == "a" and self.cell is not None and a.get("href"):
            self.cell[1].append(a["href"])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.row.append((" ".join(self.cell[0].split()), self.cell[1]))
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.tables[self.open[-1]].append(self.row)
            self.row = None
        elif tag == "table" and self.open:
            self.open.pop()

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[0] += data


def table(browser, tid):
    """The table #tid of the page shown: a dict per row, header -> text
    (and "HEADER href" -> the cell's first link)."""
    p = _Tables()
    p.feed(browser.page_source)
    assert tid in p.tables, f"no table #{tid} on {browser.current_url}"
    rows = p.tables[tid]
    assert rows, f"table #{tid} has no header row"
    heads = [c[0] for c in rows[0]]
    out = []
    for r in rows[1:]:
        d = {}
        for h, (text, links) in zip(heads, r):
            d[h] = text
            if links:
                d[h + " href"] = links[0]
        out.append(d)
    return out


def shown_ids(browser, tid="effects", col="effect"):
    ids = [r[col] for r in table(browser, tid)]
    assert len(ids) == len(set(ids)), ids
    return set(ids)


def left(element):
    """The element's document is gone (the browser moved to another page)."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    try:
        element.is_enabled()
        return False
    except StaleElementReferenceException:
        return True
    except WebDriverException as e:
        # chromedriver's answer while the old document is being replaced
        if "does not belong to the document" in str(e):
            return True
        raise


class Site:
    """A console with actions on behind nginx, and browsers signed in to it."""

    def __init__(self, conn, base, people, browser_factory):
        self.conn, self.base, self.people = conn, base, people
        self.factory = browser_factory
        self.browsers = []
        self.browser = self.new_browser()

    def new_browser(self, javascript=True, who=None):
        b = self.factory(javascript=javascript)
        b.execute_cdp_cmd("Network.enable", {})
        self.browsers.append(b)
        self.sign_in(who or self.people[0], b)
        return b

    def sign_in(self, who, b=None):
        """The browser's requests carry who's basic-auth credentials."""
        auth = base64.b64encode(f"{who}:{PASSWORD}".encode()).decode()
        (b or self.browser).execute_cdp_cmd("Network.setExtraHTTPHeaders",
                                            {"headers": {"Authorization": "Basic " + auth}})

    def get(self, path, expect, b=None):
        """Load path; the page names the person and has element #expect."""
        b = b or self.browser
        b.get(self.base + path)
        assert "signed in as" in b.find_element(By.TAG_NAME, "nav").text, b.page_source[:2000]
        b.find_element(By.ID, expect)
        return b

    def submit(self, element, expect, b=None):
        """Click element (a form's button or a link) and wait for the page
        it loads, which has element #expect; its text."""
        b = b or self.browser
        old = b.find_element(By.TAG_NAME, "html")
        element.click()
        WebDriverWait(b, 30).until(lambda _: left(old))
        return WebDriverWait(b, 30).until(EC.presence_of_element_located((By.ID, expect))).text

    def raw(self, path, who=None):
        """The page as the server sends it, before any script ran."""
        auth = base64.b64encode(f"{who or self.people[0]}:{PASSWORD}".encode()).decode()
        r = urllib.request.urlopen(urllib.request.Request(
            self.base + path, headers={"Authorization": "Basic " + auth}), timeout=30)
        return r.read().decode()

    def field(self, css, text, b=None):
        e = (b or self.browser).find_element(By.CSS_SELECTOR, css)
        e.clear()
        if text:
            e.send_keys(text)
        return e

    def check_logs(self):
        for b in self.browsers:
            bad = log_problems(b)
            assert bad == [], bad


@pytest.fixture
def site(conn, console_factory, console_roles, proxy, browser_factory):
    """start(extra=None) -> Site: a console (actions on, [console] extra),
    nginx letting both people in, a browser signed in as the first."""
    def start(extra=None):
        _, people = console_roles
        c = console_factory(actions=True, extra=extra)
        port = proxy(c.port, people)
        return Site(conn, f"http://127.0.0.1:{port}", people, browser_factory)
    return start


def state_of(conn, eid):
    return scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,))


def actions_of(conn, eid):
    return query(conn, "SELECT operator, action, reason FROM operator_actions "
                       "WHERE effect_id = %s ORDER BY action_id", (eid,))


def utc(conn, sql, args=None):
    """A time from the database as the pages show it."""
    return scalar(conn, f"SELECT {UTC.format('t')} FROM ({sql}) x(t)", args)


def run_of(conn, eid):
    return scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (eid,))


def pending_email(conn, ago=None, run=None):
    """A pending email effect (created `ago`, an SQL interval, before now)."""
    if ago is None and run is None:
        return new_effect(conn, effect_type="email", target="ops@example.com")
    key = run or make_run(conn)
    eid = effect_created_at(conn, key, created_at=f"now() - interval '{ago}'",
                            effect_type="email", target=f"ops+{uuid.uuid4().hex[:6]}@example.com")
    query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key = %s", (key,))
    return eid


# ---- 1. the banner ----------------------------------------------------------------

def test_banner_shows_switch_scopes_and_database_on_every_page(conn, site):
    """The kill switch and every scope's pause and limit, each with who set
    it, when and why, and the database, on every page."""
    ids = populate(conn)
    query(conn, "SELECT * FROM outbox_kill_switch_set(false, 'carol', 'deploy freeze 42')")
    query(conn, "SELECT * FROM outbox_scope_pause('host', 'failing.example', true, 'dave', "
                "'provider outage 7')")
    query(conn, "SELECT outbox_scope_limit('host', 'failing.example', 1, NULL, 'frank', 'slow api 3')")
    query(conn, "SELECT outbox_scope_limit('type', 'email', 2.5, 4, 'erin', 'relay quota 9')")
    switched = utc(conn, "SELECT changed_at FROM outbox_control")
    paused = utc(conn, "SELECT paused_at FROM outbox_scopes WHERE kind = 'host'")
    host_limit = utc(conn, "SELECT limit_at FROM outbox_scopes WHERE kind = 'host'")
    type_limit = utc(conn, "SELECT limit_at FROM outbox_scopes WHERE kind = 'type'")
    dbname = scalar(conn, "SELECT current_database()")
    want = [
        f"kill switch off (sends stopped fleet-wide): set by carol at {switched}: deploy freeze 42",
        f"scope host:failing.example: paused by dave at {paused}: provider outage 7; "
        f"limit 1/s burst 1 by frank at {host_limit}: slow api 3",
        f"scope type:email: not paused; limit 2.5/s burst 4 by erin at {type_limit}: relay quota 9",
        f"database {dbname} on ",
    ]
    s = site()
    pages = [("/", "chart"), ("/effects", "effects"), (f"/effect?id={ids['failed'][0]}", "history"),
             ("/unknown", "unknown"), ("/approvals", "approvals"), ("/controls", "control-history"),
             ("/runs", "runs"), (f"/runs?key={run_of(conn, ids['completed'][0])}", "run-effects"),
             ("/audit", "audit")]
    for path, expect in pages:
        s.get(path, expect)
        text = s.browser.find_element(By.ID, "banner").text
        for w in want:
            assert w in text, (path, w, text)
    # A change is on the next page loaded, by whoever made it.
    query(conn, "SELECT * FROM outbox_kill_switch_set(true, 'gina', 'freeze over')")
    s.get("/audit", "audit")
    text = s.browser.find_element(By.ID, "banner").text
    assert "kill switch on (sends allowed): set by gina at " in text and ": freeze over" in text, text
    s.check_logs()


# ---- 2. the overview -------------------------------------------------------------

def test_overview_counts_ages_and_server_drawn_chart(conn, site):
    """Counts by state and type (held ones apart), the oldest due pending
    age without the held effects, the held ones' own age, and the chart as
    SVG drawn by the server."""
    populate(conn)
    query(conn, "SELECT * FROM outbox_scope_pause('type', 'email', true, 'dave', 'relay down')")
    due = pending_email(conn, ago="3 minutes")
    held = pending_email(conn, ago="10 minutes")
    # Parked by the pause, as a worker's lease parks what a paused scope holds.
    query(conn, "UPDATE effect_live SET available_at = 'infinity', held_by = 'type:email' "
                "WHERE effect_id = %s", (held,))
    done = new_effect(conn, effect_type="email", target="ops@example.com")
    arrange(conn, done, "completed", completed_at="SQL:now() - interval '5 minutes'")
    assert due and done

    s = site()
    s.get("/", "counts")
    counts = {}
    for r in table(s.browser, "counts"):
        n, h = counts.get((r["state"], r["type"]), (0, 0))
        counts[(r["state"], r["type"])] = (n + int(r["effects"]), h + int(r["held by a scope"]))
        assert r["effects href"].startswith(f"/effects?state={r['state']}&type={r['type']}"), r
    assert counts == {("pending", "http"): (1, 0), ("sending", "http"): (1, 0),
                      ("unknown", "http"): (2, 0), ("completed", "http"): (2, 0),
                      ("failed", "http"): (2, 0), ("pending", "email"): (2, 1),
                      ("completed", "email"): (1, 0)}, counts

    ages = s.browser.find_element(By.ID, "ages").text
    m = re.fullmatch(r"oldest due pending: ([0-9.]+) s; held by a scope, oldest: ([0-9.]+) s", ages)
    assert m, ages
    # The due one of 3 minutes, not the held one of 10; the held one apart.
    assert 175 <= float(m.group(1)) < 500, ages
    assert 595 <= float(m.group(2)) < 900, ages

    # The chart: SVG from the server, one polyline a series, no script
    # but the page's refresh.
    raw = s.raw("/")
    assert re.search(r'<svg id="chart"[^>]*>.*<polyline', raw, re.S), raw
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", raw, re.S)
    assert scripts == [(' src="/static/console.js" defer', "")], scripts
    lines = s.browser.find_elements(By.CSS_SELECTOR, "svg#chart polyline")
    assert len(lines) == 4
    series = {}
    for line, name in zip(lines, ("completed", "retried", "failed", "unknown")):
        pts = [tuple(map(float, p.split(","))) for p in line.get_attribute("points").split()]
        series[name] = min(y for _, y in pts) if pts else None
    names = [t.text for t in s.browser.find_elements(By.CSS_SELECTOR, "svg#chart text")]
    assert names[:4] == ["completed", "retried", "failed", "unknown"], names
    # Completions, failures and the unknowns' ambiguous calls of the last
    # minutes rise above the axis (y = 160); nothing was retried.
    assert series["completed"] < 160 and series["failed"] < 160 and series["unknown"] < 160, series
    assert series["retried"] == 160, series
    s.check_logs()


# ---- 3. the effects list ---------------------------------------------------------

def test_effects_filters_and_keyset_paging(conn, site):
    """Each filter of the form, filled in and submitted, shows exactly the
    matching effects; "older" pages on without overlap."""
    ids = populate(conn)
    email = pending_email(conn)
    two = make_run(conn)
    pair = [new_effect(conn, key=two, run=False, target=f"https://pair.example/{i}")
            for i in range(2)]
    # Created three hours ago: its id says so (effect ids begin with their
    # creation's milliseconds, which the window reads).
    old_key = make_run(conn)
    old = str(scalar(conn, "INSERT INTO effect_outbox (effect_id, idempotency_key, effect_type, "
                           "target, payload, created_at, available_at) VALUES (encode(overlay("
                           "uuid_send(gen_random_uuid()) PLACING substring(int8send(floor(extract("
                           "epoch FROM now() - interval '3 hours') * 1000)::bigint) FROM 3) FROM 1 "
                           "FOR 6), 'hex')::uuid, %s, 'http', 'https://old.example/x', '{}', "
                           "now() - interval '3 hours', now()) RETURNING effect_id", (old_key,)))
    provider_key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s",
                          (ids["completed"][0],))
    s = site()

    def filtered(**fields):
        # A fresh form: every field empty but hours (24).
        s.get("/effects", "filters")
        for name, value in fields.items():
            s.field(f"#filters input[name={name}]", value)
        s.submit(s.browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]"), "effects")
        for name, value in fields.items():
            assert s.browser.find_element(By.CSS_SELECTOR, f"#filters input[name={name}]") \
                .get_attribute("value") == value, name
        return shown_ids(s.browser)

    everything = set(sum(ids.values(), [])) | {email, old} | set(pair)
    assert filtered() == everything
    assert filtered(state="failed") == set(ids["failed"])
    assert filtered(state="unknown") == set(ids["unknown"])
    assert filtered(state="pending") == set(ids["pending"]) | {email, old} | set(pair)
    assert filtered(type="email") == {email}
    assert filtered(host="failing.example") == set(ids["failed"])
    assert filtered(run=two) == set(pair)
    assert filtered(key=provider_key) == {ids["completed"][0]}
    assert filtered(error="TIMEOUT after") == set(ids["unknown"])
    assert filtered(error="gave up", state="failed", host="failing.example") == set(ids["failed"])
    assert filtered(host="old.example") == {old}
    assert filtered(host="old.example", hours="1") == set()
    assert filtered(hours="1") == everything - {old}

    # Keyset paging: 60 effects of one host, 50 a page, newest first.
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'page-' || g, 'processing', 'h' FROM generate_series(1, 60) g")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT 'page-' || g, 'http', 'https://page.example/' || g, '{}' "
                "FROM generate_series(1, 60) g")
    query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key LIKE 'page-%%'")
    paged = {str(r[0]) for r in query(conn, "SELECT effect_id FROM effect_outbox "
                                            "WHERE target LIKE 'https://page.example/%%'")}
    first = filtered(host="page.example")
    first_order = [r["effect"] for r in table(s.browser, "effects")]
    assert len(first) == 50 and first <= paged
    assert first_order == sorted(first_order, reverse=True)
    s.submit(s.browser.find_element(By.ID, "next"), "effects")
    assert "host=page.example" in s.browser.current_url
    second = shown_ids(s.browser)
    assert len(second) == 10 and not first & second and first | second == paged
    assert max(second) < min(first)
    assert s.browser.find_elements(By.ID, "next") == []
    s.check_logs()


def test_effects_acts_requeue_cancel_and_cancel_by_filter(conn, site):
    """Requeue one failed effect and cancel one pending effect from the
    effect's page; cancel what a filter matches after a preview with a
    cap and a reason.  The database has it, and who did it."""
    ids = populate(conn)
    emails = [pending_email(conn) for _ in range(3)]
    s = site()
    who = s.people[0]

    failed, other_failed = ids["failed"]
    s.get(f"/effect?id={failed}", "effect-act")
    s.field("#effect-act input[name=reason]", "provider fixed")
    assert s.submit(s.browser.find_element(By.CSS_SELECTOR, "#effect-act button[value=requeue]"),
                    "result") == "done"
    assert state_of(conn, failed) == "pending" and state_of(conn, other_failed) == "failed"
    assert actions_of(conn, failed) == [(who, "requeue", "provider fixed")]

    pending = ids["pending"][0]
    s.get(f"/effect?id={pending}", "effect-act")
    assert s.browser.find_elements(By.CSS_SELECTOR, "#effect-act button[value=requeue]") == []
    s.field("#effect-act input[name=reason]", "sent by hand")
    assert s.submit(s.browser.find_element(By.CSS_SELECTOR, "#effect-act button[value=cancel]"),
                    "result") == "done"
    assert query(conn, "SELECT state, last_error_class FROM outbox_effects WHERE effect_id = %s",
                 (pending,)) == [("failed", "cancelled")]
    assert actions_of(conn, pending) == [(who, "cancel", "sent by hand")]

    # By filter: three pending emails, a cap of two: the two newest.
    s.get("/effects?type=email", "cancel-filter")
    assert shown_ids(s.browser) == set(emails)
    s.field("#cancel-filter input[name=cap]", "2")
    s.field("#cancel-filter input[name=reason]", "wrong template")
    preview = s.submit(s.browser.find_element(By.CSS_SELECTOR, "#cancel-filter button[name=preview]"),
                       "preview")
    assert preview == "2 pending effects match (at most 2): cancel them (they will never be sent)?"
    newest = set(sorted(emails)[1:])
    assert shown_ids(s.browser) == newest
    for e in emails:
        assert state_of(conn, e) == "pending"
    assert s.submit(s.browser.find_element(By.ID, "confirm"), "result") == \
        "cancelled 2 pending effects (they will never be sent)"
    assert {e: state_of(conn, e) for e in emails} == \
        {e: "failed" if e in newest else "pending" for e in emails}
    for e in newest:
        assert actions_of(conn, e) == [(who, "cancel", "wrong template")]
    assert actions_of(conn, min(emails)) == []
    assert state_of(conn, ids["sending"][0]) == "sending"
    s.check_logs()


# ---- 4. one effect ------------------------------------------------------------------

def test_effect_attempts_timeline_and_payload_on_request(conn, site):
    """The history's attempts (worker, start, end, class, status or reply,
    provider id); the payload hidden until "show it" is clicked."""
    populate(conn)
    eid = new_effect(conn, target="https://flaky.example/x",
                     payload={"body": {"note": "payload-marker-5521"}})
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, ended_at, outcome_class, provider_status, provider_id, error_text) "
                "SELECT effect_id, created_at, a.n, gen_random_uuid(), a.w, now() - a.s, "
                "now() - a.s + interval '2 seconds', a.c, a.st, a.p, a.e FROM effect_outbox, "
                "(VALUES (1, 'worker-a', interval '4 minutes', 'retry', 503, NULL, "
                "'service unavailable'), (2, 'worker-b', interval '2 minutes', 'accepted', 202, "
                "'prov-777', NULL)) a(n, w, s, c, st, p, e) WHERE effect_id = %s", (eid,))
    arrange(conn, eid, "completed", attempts=2, provider_id="prov-777")
    times = {a: (s_, e_) for a, s_, e_ in query(
        conn, f"SELECT attempt, {UTC.format('started_at')}, {UTC.format('ended_at')} "
              "FROM effect_history WHERE effect_id = %s AND outcome_class IS NOT NULL", (eid,))}
    s = site()
    s.get(f"/effect?id={eid}", "history")
    rows = table(s.browser, "history")
    calls = {r["attempt"]: r for r in rows if r["class"]}
    assert set(calls) == {"1", "2"}, rows
    for a, worker, cls, status, pid, reply in (("1", "worker-a", "retry", "503", "", "service unavailable"),
                                               ("2", "worker-b", "accepted", "202", "prov-777", "")):
        r = calls[a]
        assert (r["worker"], r["class"], r["status"], r["provider id"], r["reply or error"]) == \
            (worker, cls, status, pid, reply), r
        assert (r["started"], r["ended"]) == times[int(a)], (r, times)
    assert [r["state"] for r in rows if r["state"]] == ["completed"], rows

    assert "payload-marker-5521" not in s.browser.page_source
    assert s.browser.find_elements(By.ID, "payload") == []
    shown = s.submit(s.browser.find_element(By.ID, "show-payload"), "payload")
    assert "payload-marker-5521" in shown, shown
    assert s.browser.find_elements(By.ID, "show-payload") == []
    s.check_logs()


# ---- 5. unknown ---------------------------------------------------------------------

def test_unknown_evidence_and_resolve_not_sent(conn, site):
    """Each unknown effect with its last call's worker, outcome, status and
    error; one resolved "not sent" by clicking goes back to pending."""
    ids = populate(conn)
    third = new_unknown(conn, 2, "reset after the body was sent", "w9", 502,
                        "bad gateway after send")
    s = site()
    s.get("/unknown", "unknown")
    rows = {r["effect"]: r for r in table(s.browser, "unknown")}
    assert set(rows) == set(ids["unknown"]) | {third}
    for u in ids["unknown"]:
        assert rows[u]["last call"] == "worker w1, ambiguous, status 504: gateway timeout", rows[u]
    assert rows[third]["last call"] == "worker w9, ambiguous, status 502: bad gateway after send"
    assert rows[third]["attempts"] == "2"
    for u in rows:
        key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (u,))
        assert rows[u]["provider key"] == key
        assert rows[u]["run key (state)"] == f"{run_of(conn, u)} (approved)"

    s.browser.find_element(By.CSS_SELECTOR, f'input[type=checkbox][value="{third}"]').click()
    s.browser.find_element(By.CSS_SELECTOR, "input[name=verdict][value=not_sent]").click()
    s.field("#resolve input[name=reason]", "provider has no record")
    main = s.submit(s.browser.find_element(By.ID, "resolve-submit"), "result")
    assert f"{third}: now pending" in main, main
    assert "1 resolved, 0 refused" in s.browser.find_element(By.TAG_NAME, "main").text
    assert state_of(conn, third) == "pending"
    assert [state_of(conn, u) for u in ids["unknown"]] == ["unknown", "unknown"]
    assert actions_of(conn, third) == [(s.people[0], "resolve_not_sent", "provider has no record")]
    s.get("/unknown", "unknown")
    assert shown_ids(s.browser, "unknown") == set(ids["unknown"])
    s.check_logs()


# ---- 6. approvals -------------------------------------------------------------------

def test_approvals_waiting_with_drafted_effects_age_and_link(conn, site):
    """The approvals waiting (not the expired or decided ones), with the
    effects they would enqueue and how long they have waited, each linked
    to its page on the n8n kit."""
    def approval(created, expires, consumed="NULL"):
        key = make_run(conn, state="awaiting_human")
        return str(scalar(conn, "INSERT INTO approvals (idempotency_key, token_hash, "
                                "allowed_decisions, expires_at, approver_audience, proposed_effects, "
                                f"created_at, consumed_at) VALUES (%s, sha256(gen_random_uuid()::text"
                                f"::bytea), ARRAY['approve','reject'], now() + interval '{expires}', "
                                "'ops', '[{\"effect_type\": \"http\", \"target\": "
                                "\"https://sink.example/a\"}, {\"effect_type\": \"email\", "
                                f"\"target\": \"ops@example.com\"}}]', now() - interval '{created}', "
                                f"{consumed}) RETURNING approval_id", (key,))), key

    waiting, key = approval("30 minutes", "1 hour")
    expired, _ = approval("3 hours", "-1 hour")
    decided, _ = approval("20 minutes", "1 hour", consumed="now()")
    s = site(extra={"approvals_url": "https://n8n.example.com/webhook/approval?id={id}"})
    s.get("/approvals", "approvals")
    rows = table(s.browser, "approvals")
    assert len(rows) == 1, rows
    r = rows[0]
    assert (r["approval"], r["run key"], r["audience"], r["waiting (min)"], r["effects drafted"],
            r["what"]) == (waiting, key, "ops", "30", "2",
                           "http https://sink.example/a, email ops@example.com"), r
    assert expired not in s.browser.page_source and decided not in s.browser.page_source
    link = s.browser.find_element(By.CSS_SELECTOR, "#approvals a.approval")
    assert link.get_attribute("href") == f"https://n8n.example.com/webhook/approval?id={waiting}"
    assert link.get_attribute("rel") == "noopener noreferrer"
    assert link.get_attribute("target") == "_blank"
    assert "each approval links to its page" in s.browser.find_element(By.TAG_NAME, "main").text
    s.check_logs()


# ---- 7. controls ----------------------------------------------------------------------

def test_controls_switch_off_and_on_and_limit_by_clicking(conn, site):
    """Off globally lists the sends in flight; on allows sends again; a
    limit is set and cleared; the history lists each change and who made
    it; the database has them."""
    ids = populate(conn)
    # Sends allowed (a new database has them off), so that the answer's
    # banner shows the switch the click turned off.
    query(conn, "SELECT * FROM outbox_kill_switch_set(true, 'setup', 'sends allowed')")
    s = site()
    who = s.people[0]

    s.get("/controls", "switch-form")
    assert "kill switch on" in s.browser.find_element(By.ID, "banner").text
    assert Select(s.browser.find_element(By.CSS_SELECTOR, "#switch-form select[name=kind]")) \
        .first_selected_option.get_attribute("value") == ""
    s.field("#switch-form input[name=reason]", "maintenance window")
    assert s.submit(s.browser.find_element(By.ID, "switch-off"), "result") == \
        "kill switch off: no send can start anywhere in the fleet"
    main = s.browser.find_element(By.TAG_NAME, "main").text
    assert "1 effect was already in flight (their outcome will still be recorded):" in main, main
    flight = table(s.browser, "in-flight")
    assert [(r["effect"], r["type"], r["worker"]) for r in flight] == \
        [(ids["sending"][0], "http", "w1")], flight
    assert query(conn, "SELECT enabled, changed_by, reason FROM outbox_control") == \
        [(False, who, "maintenance window")]
    # The answer's banner shows the switch as the click left it.
    banner = s.browser.find_element(By.ID, "banner").text
    assert f"kill switch off (sends stopped fleet-wide): set by {who} at " in banner, banner
    assert ": maintenance window" in banner, banner

    s.get("/controls", "switch-form")
    s.field("#switch-form input[name=reason]", "maintenance over")
    assert s.submit(s.browser.find_element(By.ID, "switch-on"), "result") == \
        "kill switch on: sends allowed"
    assert "kill switch on (sends allowed): set by " + who in \
        s.browser.find_element(By.ID, "banner").text
    assert query(conn, "SELECT enabled, changed_by, reason FROM outbox_control") == \
        [(True, who, "maintenance over")]

    s.get("/controls", "limit-form")
    Select(s.browser.find_element(By.CSS_SELECTOR, "#limit-form select[name=kind]")) \
        .select_by_value("host")
    s.field("#limit-form input[name=value]", "failing.example")
    s.field("#limit-form input[name=rate]", "5")
    s.field("#limit-form input[name=burst]", "10")
    s.field("#limit-form input[name=reason]", "api quota")
    assert s.submit(s.browser.find_element(By.CSS_SELECTOR, "#limit-form button[value=set]"),
                    "result") == "host:failing.example limited"
    assert query(conn, "SELECT paused, rate_per_second, burst, limit_by, limit_reason "
                       "FROM outbox_scopes") == [(False, 5.0, 10, who, "api quota")]
    assert f"scope host:failing.example: not paused; limit 5/s burst 10 by {who} at " in \
        s.browser.find_element(By.ID, "banner").text

    s.get("/controls", "limit-form")
    Select(s.browser.find_element(By.CSS_SELECTOR, "#limit-form select[name=kind]")) \
        .select_by_value("host")
    s.field("#limit-form input[name=value]", "failing.example")
    s.field("#limit-form input[name=reason]", "quota raised")
    assert s.submit(s.browser.find_element(By.CSS_SELECTOR, "#limit-form button[value=clear]"),
                    "result") == "host:failing.example no longer limited"
    assert query(conn, "SELECT rate_per_second FROM outbox_scopes") == []
    assert s.browser.find_elements(By.ID, "scopes") == []

    s.get("/controls", "control-history")
    history = [(r["scope"], r["change"], r["by"], r["reason"])
               for r in table(s.browser, "control-history")]
    assert history[:5] == [("host:failing.example", "unlimit", who, "quota raised"),
                       ("host:failing.example", "limit 5/s", who, "api quota"),
                       ("all", "on", who, "maintenance over"),
                       ("all", "off", who, "maintenance window"),
                       ("all", "on", "setup", "sends allowed")], history
    s.check_logs()


# ---- 8. runs --------------------------------------------------------------------------

def test_runs_by_settled_state_with_their_effects(conn, site):
    """Runs by state as their effects make them (a run whose effects all
    completed is completed, one with a failed effect failed_terminal, even
    before anything wrote the run), and a run's effects by clicking it."""
    ids = populate(conn)
    mixed = make_run(conn)
    done = new_effect(conn, key=mixed, run=False)
    open_ = new_effect(conn, key=mixed, run=False)
    arrange(conn, done, "completed")
    runs = {k: run_of(conn, e) for k, e in (("c0", ids["completed"][0]), ("c1", ids["completed"][1]),
                                            ("f0", ids["failed"][0]), ("f1", ids["failed"][1]))}
    stored = query(conn, "SELECT DISTINCT state FROM workflow_runs WHERE idempotency_key = ANY(%s)",
                   (list(runs.values()),))
    s = site()

    def by_state(state):
        s.get("/runs", "runs-filter")
        Select(s.browser.find_element(By.CSS_SELECTOR, "#runs-filter select[name=state]")) \
            .select_by_visible_text(state)
        s.submit(s.browser.find_element(By.CSS_SELECTOR, "#runs-filter button[type=submit]"), "runs")
        rows = table(s.browser, "runs")
        assert {r["state"] for r in rows} <= {state}, rows
        return {r["run key"]: r for r in rows}

    completed = by_state("completed")
    assert set(completed) == {runs["c0"], runs["c1"]}, (completed, stored)
    assert {(r["effects"], r["open"]) for r in completed.values()} == {("1", "0")}
    failed = by_state("failed_terminal")
    assert set(failed) == {runs["f0"], runs["f1"]}, failed
    approved = by_state("approved")
    # (the hostile run key shown as the pages show producer text: its
    # bidi override as an escape)
    assert set(approved) == {run_of(conn, e).replace("\u202e", "\\u202e")
                             for e in ids["pending"] + ids["sending"] + ids["unknown"]} \
        | {mixed}, approved
    assert (approved[mixed]["effects"], approved[mixed]["open"]) == ("2", "1")

    # A run's effects: click the run.
    s.submit(s.browser.find_element(By.CSS_SELECTOR, f'#runs a[href="/runs?key={mixed}"]'),
             "run-effects")
    effects = {r["effect"]: r["state"] for r in table(s.browser, "run-effects")}
    assert effects == {done: "completed", open_: "pending"}, effects
    s.get("/runs", "runs")
    assert s.browser.find_element(By.ID, "runs")
    s.submit(s.browser.find_element(By.CSS_SELECTOR, f'#runs a[href="/runs?key={runs["f0"]}"]'),
             "run-effects")
    assert {r["effect"]: r["state"] for r in table(s.browser, "run-effects")} == \
        {ids["failed"][0]: "failed"}
    s.check_logs()


# ---- 9. audit -------------------------------------------------------------------------

def test_audit_lists_every_action_filtered_by_operator(conn, site):
    """Two people act; the audit lists both, and filtered by one of them,
    only that person's actions."""
    ids = populate(conn)
    s = site()
    ana, bo = s.people

    def resolve(u, verdict):
        s.get("/unknown", "resolve")
        s.browser.find_element(By.CSS_SELECTOR, f'input[type=checkbox][value="{u}"]').click()
        s.browser.find_element(By.CSS_SELECTOR, f"input[name=verdict][value={verdict}]").click()
        s.field("#resolve input[name=reason]", f"{verdict} per the provider")
        s.submit(s.browser.find_element(By.ID, "resolve-submit"), "result")
        assert "1 resolved, 0 refused" in s.browser.find_element(By.TAG_NAME, "main").text

    resolve(ids["unknown"][0], "sent")
    s.sign_in(bo)
    s.get(f"/effect?id={ids['failed'][0]}", "effect-act")
    assert f"signed in as {bo}" in s.browser.find_element(By.TAG_NAME, "nav").text
    s.field("#effect-act input[name=reason]", "bo requeues")
    assert s.submit(s.browser.find_element(By.CSS_SELECTOR, "#effect-act button[value=requeue]"),
                    "result") == "done"
    resolve(ids["unknown"][1], "not_sent")
    assert query(conn, "SELECT operator, action FROM operator_actions ORDER BY action_id") == \
        [(ana, "resolve_sent"), (bo, "requeue"), (bo, "resolve_not_sent")]

    s.get("/audit", "audit")
    every = [(r["operator"], r["action"], r["effect"], r["reason"]) for r in table(s.browser, "audit")]
    assert every == [(bo, "resolve_not_sent", ids["unknown"][1], "not_sent per the provider"),
                     (bo, "requeue", ids["failed"][0], "bo requeues"),
                     (ana, "resolve_sent", ids["unknown"][0], "sent per the provider")], every

    def of(person):
        s.get("/audit", "audit-filter")
        s.field("#audit-filter input[name=operator]", person)
        s.submit(s.browser.find_element(By.CSS_SELECTOR, "#audit-filter button[type=submit]"), "audit")
        return [(r["operator"], r["action"]) for r in table(s.browser, "audit")]

    assert of(bo) == [(bo, "resolve_not_sent"), (bo, "requeue")]
    assert of(ana) == [(ana, "resolve_sent")]
    assert of("nobody-" + uuid.uuid4().hex[:6]) == []
    s.check_logs()


# ---- 10. without JavaScript ---------------------------------------------------------------

def test_every_view_works_and_acts_without_javascript(conn, site):
    """With JavaScript off in the browser, every view loads and its forms
    work: a filter, the payload link, resolving an unknown effect and
    pausing a scope by clicking.  (That scripts are off is seen against a
    browser with them on: its page reloads itself, this one's does not.)"""
    ids = populate(conn)
    s = site(extra={"refresh_seconds": 1})
    b = s.new_browser(javascript=False)
    pages = [("/", "chart"), ("/effects", "effects"), (f"/effect?id={ids['failed'][0]}", "history"),
             ("/unknown", "unknown"), ("/approvals", "approvals"), ("/controls", "control-history"),
             ("/runs", "runs"), (f"/runs?key={run_of(conn, ids['failed'][0])}", "run-effects"),
             ("/audit", "audit")]
    for path, expect in pages:
        s.get(path, expect, b)
        assert "kill switch" in b.find_element(By.ID, "banner").text, path

    # Scripts are off here: this page stays while the scripted one reloads.
    s.get("/", "chart", b)
    b.execute_script("window.__mark = 1")
    s.get("/", "chart")
    s.browser.execute_script("window.__mark = 1")
    WebDriverWait(s.browser, 20).until(lambda d: d.execute_script("return window.__mark") is None)
    assert b.execute_script("return window.__mark") == 1

    s.get("/effects", "filters", b)
    s.field("#filters input[name=state]", "failed", b)
    s.submit(b.find_element(By.CSS_SELECTOR, "#filters button[type=submit]"), "effects", b)
    assert shown_ids(b) == set(ids["failed"])
    s.get(f"/effect?id={ids['failed'][0]}", "show-payload", b)
    assert '"n": 1' in s.submit(b.find_element(By.ID, "show-payload"), "payload", b)

    u = ids["unknown"][0]
    s.get("/unknown", "resolve", b)
    b.find_element(By.CSS_SELECTOR, f'input[type=checkbox][value="{u}"]').click()
    b.find_element(By.CSS_SELECTOR, "input[name=verdict][value=sent]").click()
    s.field("#resolve input[name=reason]", "seen at the provider", b)
    s.field("#resolve input[name=provider_id]", "prov-nojs", b)
    s.submit(b.find_element(By.ID, "resolve-submit"), "result", b)
    assert "1 resolved, 0 refused" in b.find_element(By.TAG_NAME, "main").text
    assert query(conn, "SELECT state, provider_id FROM outbox_effects WHERE effect_id = %s", (u,)) == \
        [("completed", "prov-nojs")]
    assert actions_of(conn, u) == [(s.people[0], "resolve_sent", "seen at the provider")]

    s.get("/controls", "switch-form", b)
    Select(b.find_element(By.CSS_SELECTOR, "#switch-form select[name=kind]")).select_by_value("host")
    s.field("#switch-form input[name=value]", "failing.example", b)
    s.field("#switch-form input[name=reason]", "provider outage", b)
    assert s.submit(b.find_element(By.ID, "switch-off"), "result", b) == \
        "scope host:failing.example paused"
    assert query(conn, "SELECT kind, value, paused, paused_by, paused_reason FROM outbox_scopes") == \
        [("host", "failing.example", True, s.people[0], "provider outage")]
    s.check_logs()

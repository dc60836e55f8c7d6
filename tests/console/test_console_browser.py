# SPDX-License-Identifier: ISC
"""The console in a real browser: Debian's headless chromium (through
chromium-driver and python3-selenium, nothing downloaded), behind nginx
configured as docs/console.md says (basic auth naming the person in
X-Remote-User).  Every view loads on a database holding effects in every
state; two unknown effects are resolved, the failed effects of a filter
requeued and a scope paused by clicking, and the database is checked; the
browser logs no console error and no CSP violation.  A screenshot of each
view is saved (OUTBOX_CONSOLE_SHOTS=docs/console writes the ones
docs/console.md shows), and docs/console.md shows one of every view."""
import base64
import os

import pytest

from browser_lib import PASSWORD, docs, log_problems, text_once_loaded
from console_lib import populate
from outbox_test import ROOT, scalar

pytest.importorskip("selenium")
from selenium.webdriver.common.by import By  # noqa: E402

SHOTS = ["overview", "effects", "effect", "unknown", "approvals", "controls", "runs", "audit"]


def test_console_in_a_browser(conn, console_factory, console_roles, proxy, browser, tmp_path):
    ids = populate(conn)
    _, people = console_roles
    # No refresh here: a reload between a page's load and a click would
    # leave the click on an element of the page before (the refresh is
    # test_every_view_works_and_acts_without_javascript's).
    c = console_factory(actions=True)
    port = proxy(c.port, people[0])
    base = f"http://127.0.0.1:{port}"
    auth = base64.b64encode(f"{people[0]}:{PASSWORD}".encode()).decode()

    # Without credentials the proxy refuses: nothing reaches the console.
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/")
    assert e.value.code == 401
    # A header sent by the client never passes the proxy: the proxy sets it.
    r = urllib.request.urlopen(urllib.request.Request(
        base + "/", headers={"Authorization": "Basic " + auth, "X-Remote-User": "mallory"}))
    assert f"signed in as {people[0]}" in r.read().decode()

    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                            {"headers": {"Authorization": "Basic " + auth}})
    shots = os.environ.get("OUTBOX_CONSOLE_SHOTS") or str(tmp_path / "shots")
    os.makedirs(shots, exist_ok=True)

    def visit(path, shot=None, expect=None):
        browser.get(base + path)
        assert "signed in as" in browser.find_element(By.TAG_NAME, "nav").text
        if expect:
            browser.find_element(By.ID, expect)
        if shot:
            browser.save_screenshot(os.path.join(shots, f"{shot}.png"))

    visit("/", "overview", "chart")
    visit("/effects", "effects", "effects")
    visit(f"/effect?id={ids['unknown'][0]}", "effect", "history")
    visit("/approvals", "approvals", "approvals")
    visit("/runs", "runs", "runs")
    visit("/controls", None, "control-history")

    # Resolve two unknowns by ticking them.
    visit("/unknown", "unknown", "unknown")
    for u in ids["unknown"]:
        browser.find_element(By.CSS_SELECTOR, f'input[type=checkbox][value="{u}"]').click()
    browser.find_element(By.CSS_SELECTOR, 'input[name=verdict][value=sent]').click()
    browser.find_element(By.CSS_SELECTOR, '#resolve input[name=reason]').send_keys(
        "seen at the provider")
    browser.find_element(By.ID, "resolve-submit").click()
    assert "2 resolved, 0 refused" in text_once_loaded(browser, By.TAG_NAME, "main",
                                                         "2 resolved, 0 refused")
    for u in ids["unknown"]:
        assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (u,)) == \
            "completed"

    # Requeue the failed effects of a filter: preview, then confirm.
    visit("/effects?state=failed&host=failing.example")
    browser.find_element(By.CSS_SELECTOR, "#requeue-filter input[name=reason]").send_keys(
        "provider fixed")
    browser.find_element(By.CSS_SELECTOR, "#requeue-filter button[name=preview]").click()
    assert "2 failed effects match" in text_once_loaded(browser, By.ID, "preview", "2 failed effects match")
    browser.find_element(By.ID, "confirm").click()
    assert "requeued 2 failed effects" in text_once_loaded(browser, By.ID, "result", "requeued 2 failed effects")
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY(%s::uuid[]) "
                        "AND state = 'pending'", (ids["failed"],)) == 2

    # Pause a scope by clicking.
    visit("/controls")
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element(By.CSS_SELECTOR, "#switch-form select[name=kind]")) \
        .select_by_value("type")
    browser.find_element(By.CSS_SELECTOR, "#switch-form input[name=value]").send_keys("email")
    browser.find_element(By.CSS_SELECTOR, "#switch-form input[name=reason]").send_keys(
        "relay down")
    browser.find_element(By.ID, "switch-off").click()
    assert "scope type:email paused" in text_once_loaded(browser, By.ID, "result", "scope type:email paused")
    assert scalar(conn, "SELECT paused FROM outbox_scopes WHERE kind = 'type' "
                        "AND value = 'email'") is True
    assert scalar(conn, "SELECT changed_by FROM outbox_scope_history ORDER BY change_id DESC "
                        "LIMIT 1") == people[0]
    visit("/controls", "controls", "control-history")
    visit(f"/audit?operator={people[0]}", "audit", "audit")
    assert "resolve_sent" in browser.find_element(By.ID, "audit").text

    bad = log_problems(browser)
    assert bad == [], bad
    for s in SHOTS:
        assert os.path.getsize(os.path.join(shots, f"{s}.png")) > 1000, s


def test_docs_show_every_view():
    text = docs()
    for s in SHOTS:
        assert f"](console/{s}.png)" in text, s
        assert os.path.exists(os.path.join(ROOT, "docs", "console", f"{s}.png")), s

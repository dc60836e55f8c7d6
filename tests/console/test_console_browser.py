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
import re
import subprocess
import time

import pytest

from console_lib import populate
from outbox_test import ROOT, free_port, query, scalar

pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

SHOTS = ["overview", "effects", "effect", "unknown", "approvals", "controls", "runs", "audit"]
PASSWORD = "correct horse"


def docs():
    with open(os.path.join(ROOT, "docs", "console.md")) as f:
        return f.read()


def nginx_location():
    """The nginx lines docs/console.md gives, between its markers."""
    m = re.search(r"# --- console proxy begin ---\n(.*?)# --- console proxy end ---", docs(), re.S)
    assert m, "docs/console.md has no marked nginx configuration"
    return m.group(1)


@pytest.fixture
def proxy(tmp_path):
    """nginx in front of a console: start(console_port, person) -> port."""
    procs = []

    def start(console_port, person):
        d = tmp_path / "nginx"
        d.mkdir()
        hashed = subprocess.run(["openssl", "passwd", "-apr1", PASSWORD], capture_output=True,
                                text=True, check=True).stdout.strip()
        (d / "htpasswd").write_text(f"{person}:{hashed}\n")
        port = free_port()
        lines = (nginx_location().replace("/etc/nginx/outbox-console.htpasswd", str(d / "htpasswd"))
                 .replace("127.0.0.1:8470", f"127.0.0.1:{console_port}"))
        (d / "nginx.conf").write_text(f"""
daemon off; master_process off; worker_processes 1;
pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
{lines}
    }}
}}
""")
        p = subprocess.Popen(["nginx", "-p", str(d), "-c", "nginx.conf", "-e", str(d / "error.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        import socket
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert p.poll() is None, (d / "error.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.05)
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


@pytest.fixture
def browser(tmp_path):
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run",
              "--disable-dev-shm-usage", "--window-size=1280,900",
              f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path="/usr/bin/chromedriver",
                                      log_output=str(tmp_path / "chromedriver.log")) \
        if hasattr(webdriver, "ChromeService") else \
        webdriver.chrome.service.Service("/usr/bin/chromedriver",
                                         log_path=str(tmp_path / "chromedriver.log"))
    d = webdriver.Chrome(options=opts, service=service)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def text_once_loaded(browser, by, name, want, timeout=20):
    """The text of an element once the page a click submitted has loaded
    and the element shows want (or, at the deadline, whatever it shows)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            text = browser.find_element(by, name).text
        except (NoSuchElementException, StaleElementReferenceException):
            text = ""
        if want in text:
            break
        time.sleep(0.1)
    return text


def test_console_in_a_browser(conn, console_factory, console_roles, proxy, browser, tmp_path):
    ids = populate(conn)
    _, people = console_roles
    c = console_factory(actions=True, extra={"refresh_seconds": 3})
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

    # The refresh script runs under the policy: a page reloads on its own.
    visit("/")
    browser.execute_script("window.__mark = 1")
    deadline = time.monotonic() + 20
    while browser.execute_script("return window.__mark === 1"):
        assert time.monotonic() < deadline, "the page did not refresh"
        time.sleep(0.2)

    logs = browser.get_log("browser")
    bad = [entry for entry in logs if entry["level"] == "SEVERE"
           or "Content Security Policy" in entry["message"] or "Refused" in entry["message"]]
    assert bad == [], bad
    for s in SHOTS:
        assert os.path.getsize(os.path.join(shots, f"{s}.png")) > 1000, s


def test_docs_show_every_view():
    text = docs()
    for s in SHOTS:
        assert f"](console/{s}.png)" in text, s
        assert os.path.exists(os.path.join(ROOT, "docs", "console", f"{s}.png")), s

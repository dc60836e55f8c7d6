# SPDX-License-Identifier: ISC
"""What the console's browser tests share (the `proxy`, `browser` and
`browser_factory` fixtures are in conftest.py): the nginx lines of
docs/console.md, the basic-auth password the proxy checks, waiting for a
page a click submitted, and the check that the browser logged no error
and no Content-Security-Policy violation."""
import os
import re
import time

from outbox_test import ROOT

PASSWORD = "correct horse"


def docs():
    with open(os.path.join(ROOT, "docs", "console.md")) as f:
        return f.read()


def nginx_location():
    """The nginx lines docs/console.md gives, between its markers."""
    m = re.search(r"# --- console proxy begin ---\n(.*?)# --- console proxy end ---", docs(), re.S)
    assert m, "docs/console.md has no marked nginx configuration"
    return m.group(1)


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


def log_problems(browser):
    """The browser log's errors and Content-Security-Policy violations."""
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
            or "Content Security Policy" in entry["message"] or "Refused" in entry["message"]]

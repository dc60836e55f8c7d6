#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/console-screenshots.sh: regenerate docs/console/*.png (the browser
# test, tests/console/test_console_browser.py, behind nginx in headless
# Chromium, saving a screenshot of each view) and then the record of the
# page sources they were taken of (docs/console/SCREENSHOTS), which
# tests/static/test_console_screenshots.py checks.  Run it after changing
# a page (console/*.c but main.c) and commit both.
set -eu
cd "$(dirname "$0")/.."
OUTBOX_CONSOLE_SHOTS="$PWD/docs/console" make test \
    PYTEST_ARGS="tests/console/test_console_browser.py -k console_in_a_browser"
/usr/bin/python3 scripts/console_shots_record.py > docs/console/SCREENSHOTS
echo "docs/console/*.png and docs/console/SCREENSHOTS regenerated"

# SPDX-License-Identifier: ISC
"""No wait in the tree ends at a wall-clock deadline: a wall clock stepped
back (NTP, an operator, a suite run at another date) must not stretch a
shutdown or a timeout.  Absolute deadlines are taken on CLOCK_MONOTONIC
and waited for with the calls that take a clock (pthread_clockjoin_np,
pthread_cond_timedwait on a condition made with a monotonic condattr,
pthread_clockwait-style calls); the calls below only know CLOCK_REALTIME.
The scan reads code only (tests/static/test_oom_policy.py's scanner)."""
import os
import re

from outbox_test import ROOT
from test_oom_policy import code_only, tree_sources

REALTIME_WAITS = ("pthread_timedjoin_np", "sem_timedwait", "pthread_mutex_timedlock",
                  "pthread_rwlock_timedrdlock", "pthread_rwlock_timedwrlock", "mq_timedreceive",
                  "mq_timedsend")
CALL = re.compile(r"(?<![\w.])(?<!->)\b(" + "|".join(REALTIME_WAITS) + r")\b")


def realtime_waits(text):
    code = code_only(text)
    return [(code.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in CALL.finditer(code)]


def test_the_scan_finds_a_realtime_wait():
    assert realtime_waits("if (pthread_timedjoin_np(t, NULL, &ts) != 0)\n"
                          "  x = sem_timedwait(&s, &ts);\n") == [
        (1, "pthread_timedjoin_np"), (2, "sem_timedwait")]
    assert realtime_waits("/* not pthread_timedjoin_np */ pthread_clockjoin_np(t, 0, c, &ts);\n") == []


def test_no_wait_ends_at_a_wall_clock_deadline():
    found = []
    for f in tree_sources():
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            found += [f"{f}:{line}: {name}" for line, name in realtime_waits(fh.read())]
    assert not found, found

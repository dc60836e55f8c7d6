# SPDX-License-Identifier: ISC
"""Loaded by every Python of a run under scripts/test-at.sh (it puts this
folder on PYTHONPATH).  That run moves the wall clock only
(FAKETIME_DONT_FAKE_MONOTONIC=1: timeouts and intervals are not dates),
and there libfaketime 0.9.10 (Debian 12) fails the absolute monotonic
clock_nanosleep that Python's time.sleep() uses with EINVAL.  time.sleep
here waits with select() instead, which libfaketime leaves alone.
Nothing else changes; outside such a run this file is not on the path."""
import os
import select
import time

if "faketime" in os.environ.get("LD_PRELOAD", "") and os.environ.get("FAKETIME_DONT_FAKE_MONOTONIC") == "1":
    _monotonic = time.monotonic

    def _sleep(seconds):
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        end = _monotonic() + seconds
        while True:
            left = end - _monotonic()
            if left <= 0:
                return
            select.select([], [], [], left)

    time.sleep = _sleep

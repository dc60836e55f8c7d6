# SPDX-License-Identifier: ISC
"""A fleet-wide rate limit delivers its rate (docs/design.md, "Scoped pauses
and rate limits"): R sends a second at the sink, within 10 % over every
5-second window of a steady backlog, whatever the burst, while one of the
three workers is SIGKILLed and replaced.

The bucket defers the rows it has no token for to successive slots; the
workers take them a poll or more after their slot.  A row that counted as
paid only within burst/rate of its slot (0.2 s at 50/s, burst 10) paid
again when taken later and went to the back, its slot lost: the sink saw a
fraction of the rate.
"""
import time

import pytest

from outbox_test import kill_switch, query
from test_scoped_fleet import (arrivals, finished, http_only, limit, loopback_sinks, only_to,  # noqa: F401
                               op, per_second, producers)

RATE = 100
WINDOW = 5.0
MEASURE = 20.0      # seconds of windows, from 1 s after the first send


def windows(times, start, seconds, width=WINDOW, step=0.5):
    """The rate in every window of `width` seconds starting in
    [start, start + seconds - width], `step` apart."""
    out = []
    t = start
    while t + width <= start + seconds + 1e-9:
        out.append((t - start, sum(1 for x in times if t <= x < t + width) / width))
        t += step
    return out


@pytest.mark.slow
@pytest.mark.parametrize("burst", [10, None], ids=["burst10", "default_burst"])
def test_a_limit_delivers_its_rate_over_every_5s_window_through_a_worker_kill(
        conn, op, dispatchers, producers, loopback_sinks, burst):
    kill_switch(conn, True)
    sink = loopback_sinks["127.0.0.2"]
    limit(op, "host", sink.host, RATE, burst)
    # More than the measured span holds at the rate: the backlog stays steady.
    prod = producers(only_to(sink, "limited"))
    prod.batch(int(RATE * (MEASURE + 12)))
    workers = {name: dispatchers(http_only(batch_size=32), name=name) for name in ("a", "b", "c")}
    t0 = wait_first(sink)
    # A worker dies mid-stream; a replacement keeps the fleet at three.
    while time.time() < t0 + MEASURE / 2:
        time.sleep(0.1)
    workers.pop("a").kill()
    workers["d"] = dispatchers(http_only(batch_size=32), name="d")
    while time.time() < t0 + 4 + MEASURE + 0.5:
        time.sleep(0.2)
    times = arrivals(sink)
    # The steady state: once the fleet has sorted the backlog it met into
    # slots (the first burst goes at once; the deferred rows are due behind
    # the backlog that was already due) and the burst's worth is spent.
    start = t0 + 3 + (burst or RATE) / RATE
    rates = windows(times, start, MEASURE)
    bad = [(round(at, 1), r) for at, r in rates if not RATE * 0.9 <= r <= RATE * 1.1]
    print(f"burst {burst or 'default'}: 5 s windows from {min(r for _, r in rates):.1f} to "
          f"{max(r for _, r in rates):.1f}/s (limit {RATE}/s), "
          f"{len(times) / (times[-1] - times[0]):.1f}/s overall")
    assert bad == [], (f"5 s windows off the limit of {RATE}/s by more than 10 %: {bad}; "
                       f"per second from the first send: {per_second(times, t0, MEASURE + 5)}; "
                       f"sends started per second (the database's clock): "
                       f"{per_second(starts(conn), t0, MEASURE + 5)}")
    # Each effect reached the sink at most once.
    keys = sink.keys()
    assert all(n == 1 for n in keys.values()), {k: n for k, n in keys.items() if n != 1}
    limit(op, "host", sink.host, None)


def starts(conn):
    """When each accepted send started, by the database's clock."""
    return sorted(t for (t,) in query(conn, "SELECT extract(epoch FROM started_at)::float8 "
                                            "FROM effect_history WHERE outcome_class = 'accepted'"))


def wait_first(sink, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = arrivals(sink)
        if got:
            return got[0]
        time.sleep(0.05)
    raise AssertionError("no request reached the limited host")

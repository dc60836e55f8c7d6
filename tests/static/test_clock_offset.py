# SPDX-License-Identifier: ISC
"""tests/tools/clock_offset.c, the preload of scripts/test-at.sh: every
wall-clock read moves by the offset, the monotonic clock does not, and a
read in a signal handler that interrupts a wait moves as well (the case
libfaketime gets wrong, which keeps PostgreSQL's lock_timeout from
firing)."""
import os
import subprocess
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OFFSET = 40 * 86400 + 17

PROBE = textwrap.dedent(r"""
    #define _GNU_SOURCE
    #include <poll.h>
    #include <signal.h>
    #include <stdio.h>
    #include <sys/time.h>
    #include <time.h>
    static struct timeval in_handler;
    static volatile sig_atomic_t fired;
    static void on_alarm(int s) { (void)s; gettimeofday(&in_handler, NULL); fired = 1; }
    int main(void) {
        struct timespec real, mono;
        struct timeval tv;
        struct itimerval t = {{0, 0}, {0, 50000}};
        clock_gettime(CLOCK_REALTIME, &real);
        clock_gettime(CLOCK_MONOTONIC, &mono);
        gettimeofday(&tv, NULL);
        signal(SIGALRM, on_alarm);
        setitimer(ITIMER_REAL, &t, NULL);
        while (!fired)
            poll(NULL, 0, 1000);
        printf("%lld %lld %lld %lld %lld\n", (long long)real.tv_sec, (long long)tv.tv_sec,
               (long long)time(NULL), (long long)in_handler.tv_sec, (long long)mono.tv_sec);
        return 0;
    }
""")


def test_every_wall_clock_read_moves_and_the_monotonic_clock_does_not(tmp_path):
    shim = tmp_path / "clock_offset.so"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-shared", "-fPIC",
                    "-o", str(shim), os.path.join(ROOT, "tests/tools/clock_offset.c"), "-ldl"],
                   check=True)
    (tmp_path / "probe.c").write_text(PROBE)
    subprocess.run(["cc", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True)

    def probe(env_extra):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OUTBOX_TEST_CLOCK_OFFSET")}
        env.update(env_extra)
        out = subprocess.run([str(tmp_path / "probe")], env=env, check=True,
                             capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    plain = probe({})
    moved = probe({"LD_PRELOAD": str(shim), "OUTBOX_TEST_CLOCK_OFFSET": str(OFFSET)})
    for i, what in enumerate(["clock_gettime", "gettimeofday", "time", "gettimeofday in a handler"]):
        assert abs(moved[i] - plain[i] - OFFSET) <= 5, (what, plain, moved)
    assert abs(moved[4] - plain[4]) <= 5, ("the monotonic clock moved", plain, moved)

/* SPDX-License-Identifier: ISC */
/*
 * clock_offset.so: the wall clock moved by OUTBOX_TEST_CLOCK_OFFSET
 * seconds, for scripts/test-at.sh (a suite run at another date), loaded
 * with LD_PRELOAD into every process of the run, PostgreSQL's included.
 *
 * It owns only the wall clock's readers: clock_gettime for the realtime
 * clocks, gettimeofday, time and timespec_get add the offset; the
 * monotonic clocks, the sleeps and the timed waits are left alone.
 *
 * Why not libfaketime: Debian 12's libfaketime 0.9.10 reads the real
 * time while one of its own wrapped sleeps or polls is in progress, so a
 * time read in a signal handler that interrupts a wait comes back a
 * month early.  PostgreSQL reads the time in its SIGALRM handler, so its
 * lock_timeout and statement_timeout never fire under it.  This shim has
 * no state after load (one integer), so every read is async-signal-safe
 * and agrees with every other.
 *
 * Limit, on purpose: an absolute deadline on CLOCK_REALTIME handed to the
 * kernel (a pthread_cond_timedwait on a default condition variable,
 * sem_timedwait) is not translated.  Nothing in the suite waits on one:
 * the project's own waits use CLOCK_MONOTONIC.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static long long offset_s;
static clock_gettime_fn real_clock_gettime;

__attribute__((constructor)) static void clock_offset_load(void)
{
	const char *s = getenv("OUTBOX_TEST_CLOCK_OFFSET");

	real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
	offset_s = s != NULL ? strtoll(s, NULL, 10) : 0;
}

static int is_wall_clock(clockid_t clk)
{
	switch (clk) {
	case CLOCK_REALTIME:
	case CLOCK_REALTIME_COARSE:
	case CLOCK_TAI:
		return 1;
	default:
		return 0;
	}
}

/* A reader called before the constructor ran (another library's
 * constructor) resolves the real function itself. */
static int read_clock(clockid_t clk, struct timespec *ts)
{
	if (real_clock_gettime == NULL)
		real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
	return real_clock_gettime(clk, ts);
}

int clock_gettime(clockid_t clk, struct timespec *ts)
{
	int rc = read_clock(clk, ts);

	if (rc == 0 && is_wall_clock(clk))
		ts->tv_sec += (time_t)offset_s;
	return rc;
}

/* glibc declares tv nonnull, but the kernel's call accepts NULL and so
 * must the stand-in. */
#pragma GCC diagnostic ignored "-Wnonnull-compare"
int gettimeofday(struct timeval *restrict tv, void *restrict tz)
{
	struct timespec ts;

	(void)tz;
	if (tv == NULL)
		return 0;
	if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
		return -1;
	tv->tv_sec = ts.tv_sec;
	tv->tv_usec = ts.tv_nsec / 1000;
	return 0;
}

time_t time(time_t *t)
{
	struct timespec ts;

	if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
		return (time_t)-1;
	if (t != NULL)
		*t = ts.tv_sec;
	return ts.tv_sec;
}

int timespec_get(struct timespec *ts, int base)
{
	if (base != TIME_UTC || clock_gettime(CLOCK_REALTIME, ts) != 0)
		return 0;
	return base;
}

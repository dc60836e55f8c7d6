/* SPDX-License-Identifier: ISC */
/*
 * test_metrics.c: the Prometheus text that metrics_render() produces
 * (parsed back line by line), /metrics and /healthz over real HTTP on a
 * loopback port, listen-address errors, and sd_notify messages against a
 * fake NOTIFY_SOCKET.
 *
 * metrics.o and sdnotify.o are linked like the daemon's; a stalled loop is
 * simulated with metrics_heartbeat_at() instead of waiting 30 s.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <event2/event.h>

#include "log.h"
#include "metrics.h"
#include "sdnotify.h"
#include "util.h"

/* ---- a small parser for the text format ---- */

#define MAX_FAMILIES 64
#define MAX_SAMPLES 1024
#define MAX_LABELS 4

struct label {
	char name[32];
	char value[128];
};

struct sample {
	char name[96];
	struct label labels[MAX_LABELS];
	int nlabels;
	double value;
};

struct family {
	char name[96];
	char type[16];
	bool help;
};

struct parsed {
	struct family fam[MAX_FAMILIES];
	int nfam;
	struct sample s[MAX_SAMPLES];
	int ns;
};

static struct family *family_find(struct parsed *p, const char *name)
{
	for (int i = 0; i < p->nfam; i++)
		if (strcmp(p->fam[i].name, name) == 0)
			return &p->fam[i];
	return NULL;
}

/* The family a sample belongs to: its own name, or a histogram's base name
 * for the _bucket/_sum/_count series. */
static struct family *family_of(struct parsed *p, const char *sample)
{
	static const char *const suffix[] = { "_bucket", "_sum", "_count" };
	struct family *f = family_find(p, sample);
	size_t n = strlen(sample);

	if (f)
		return f;
	for (size_t i = 0; i < 3; i++) {
		size_t k = strlen(suffix[i]);
		char base[96];
		if (n <= k || strcmp(sample + n - k, suffix[i]) != 0 || n - k >= sizeof(base))
			continue;
		memcpy(base, sample, n - k);
		base[n - k] = '\0';
		f = family_find(p, base);
		if (f && strcmp(f->type, "histogram") == 0)
			return f;
	}
	return NULL;
}

static bool name_char(char c, bool first)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
	       (!first && c >= '0' && c <= '9');
}

/* Parses one sample line; fails the test on anything malformed. */
static void parse_sample(struct parsed *p, const char *line)
{
	struct sample *s;
	const char *c = line;
	size_t n = 0;
	char *end;

	assert_true(p->ns < MAX_SAMPLES);
	s = &p->s[p->ns++];
	memset(s, 0, sizeof(*s));
	while (name_char(*c, n == 0)) {
		assert_true(n + 1 < sizeof(s->name));
		s->name[n++] = *c++;
	}
	assert_true(n > 0);
	if (*c == '{') {
		c++;
		while (*c != '}') {
			struct label *l;
			size_t k = 0;
			assert_true(s->nlabels < MAX_LABELS);
			l = &s->labels[s->nlabels++];
			while (name_char(*c, k == 0)) {
				assert_true(k + 1 < sizeof(l->name));
				l->name[k++] = *c++;
			}
			assert_true(k > 0);
			assert_int_equal(*c++, '=');
			assert_int_equal(*c++, '"');
			k = 0;
			while (*c != '"') {
				char v = *c++;
				assert_true(v != '\0' && v != '\n');
				if (v == '\\') {
					v = *c++;
					if (v == 'n')
						v = '\n';
					else
						assert_true(v == '\\' || v == '"');
				}
				assert_true(k + 1 < sizeof(l->value));
				l->value[k++] = v;
			}
			c++;
			if (*c == ',')
				c++;
			else
				assert_int_equal(*c, '}');
		}
		c++;
	}
	assert_int_equal(*c++, ' ');
	if (strcmp(c, "+Inf") == 0) {
		s->value = INFINITY;
	} else if (strcmp(c, "NaN") == 0) {
		s->value = NAN;
	} else {
		errno = 0;
		s->value = strtod(c, &end);
		assert_int_equal(errno, 0);
		assert_true(end != c && *end == '\0');
	}
	/* Every sample needs its family's TYPE before it. */
	if (!family_of(p, s->name))
		fail_msg("sample %s has no preceding # TYPE", s->name);
}

static void parse(struct parsed *p, const char *text)
{
	char *copy = strdup(text), *save = NULL;

	memset(p, 0, sizeof(*p));
	assert_non_null(copy);
	assert_true(strlen(text) > 0 && text[strlen(text) - 1] == '\n');
	for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char name[96], rest[64];
		if (strncmp(line, "# TYPE ", 7) == 0) {
			struct family *f;
			assert_int_equal(sscanf(line + 7, "%95s %63s", name, rest), 2);
			assert_null(family_find(p, name));   /* one TYPE per family */
			assert_true(strcmp(rest, "counter") == 0 || strcmp(rest, "gauge") == 0 ||
			            strcmp(rest, "histogram") == 0);
			if (strcmp(rest, "counter") == 0)
				assert_true(strlen(name) > 6 &&
				            strcmp(name + strlen(name) - 6, "_total") == 0);
			assert_true(p->nfam < MAX_FAMILIES);
			f = &p->fam[p->nfam++];
			text_copy(f->name, name, sizeof(f->name));
			text_copy(f->type, rest, sizeof(f->type));
			/* HELP comes first, for the same name. */
			assert_true(line > copy);
		} else if (strncmp(line, "# HELP ", 7) == 0) {
			assert_int_equal(sscanf(line + 7, "%95s", name), 1);
			assert_true(strlen(line) > 7 + strlen(name) + 1);   /* has text */
		} else {
			assert_true(line[0] != '#');
			parse_sample(p, line);
		}
	}
	free(copy);
	for (int i = 0; i < p->ns; i++)
		assert_true(strncmp(p->s[i].name, "outbox_", 7) == 0);
}

static const char *label(const struct sample *s, const char *name)
{
	for (int i = 0; i < s->nlabels; i++)
		if (strcmp(s->labels[i].name, name) == 0)
			return s->labels[i].value;
	return NULL;
}

/* The value of the one sample with this name and (up to two) labels;
 * NAN when absent. */
static double value(struct parsed *p, const char *name, const char *l1, const char *v1,
                    const char *l2, const char *v2)
{
	double found = NAN;
	int hits = 0;

	for (int i = 0; i < p->ns; i++) {
		const struct sample *s = &p->s[i];
		if (strcmp(s->name, name) != 0)
			continue;
		if (l1 && (!label(s, l1) || strcmp(label(s, l1), v1) != 0))
			continue;
		if (l2 && (!label(s, l2) || strcmp(label(s, l2), v2) != 0))
			continue;
		found = s->value;
		hits++;
	}
	assert_true(hits <= 1);
	return found;
}

static struct parsed P;

static void render_parse(void)
{
	char *text = metrics_render();
	parse(&P, text);
	free(text);
}

/* ---- format ---- */

static void test_render_empty(void **state)
{
	(void)state;
	metrics_init("w1");
	render_parse();
	assert_true(value(&P, "outbox_worker_info", "worker", "w1", NULL, NULL) == 1);
	assert_true(value(&P, "outbox_kill_switch_blocked_total", NULL, NULL, NULL, NULL) == 0);
	assert_true(value(&P, "outbox_sends_in_flight", NULL, NULL, NULL, NULL) == 0);
	assert_non_null(family_find(&P, "outbox_sends_total"));
	assert_string_equal(family_find(&P, "outbox_send_duration_seconds")->type, "histogram");
	/* Every declared counter and gauge is exported. */
	for (size_t i = 0; i < M_COUNTER_MAX; i++)
		assert_non_null(family_find(&P, metrics_counter_name(i)));
	for (size_t i = 0; i < G_GAUGE_MAX; i++)
		assert_non_null(family_find(&P, metrics_gauge_name(i)));
}

static void test_render_counters_and_gauges(void **state)
{
	(void)state;
	metrics_init("w1");
	metrics_inc(M_KILL_SWITCH_BLOCKED, 3);
	metrics_inc(M_KILL_SWITCH_BLOCKED, 1);
	metrics_inc(M_LEASE_LOST, 2);
	metrics_inc(M_COUNTER_MAX, 5);              /* out of range: ignored */
	metrics_set(G_QUEUE_LAG_SECONDS, 12.5);
	metrics_set(G_UNKNOWN, 7);
	metrics_set(G_IN_FLIGHT, 1234567);
	metrics_set(G_GAUGE_MAX, 1);                /* ignored */
	metrics_count_send("http", "accepted");
	metrics_count_send("http", "accepted");
	metrics_count_send("http", "ambiguous");
	metrics_count_send("email", "retry");
	metrics_count_send("email", "bogus");       /* counted as other */
	metrics_count_send(NULL, "accepted");
	render_parse();

	assert_true(value(&P, "outbox_kill_switch_blocked_total", NULL, NULL, NULL, NULL) == 4);
	assert_true(value(&P, "outbox_lease_lost_total", NULL, NULL, NULL, NULL) == 2);
	assert_true(value(&P, "outbox_queue_lag_seconds", NULL, NULL, NULL, NULL) == 12.5);
	assert_true(value(&P, "outbox_unknown_effects", NULL, NULL, NULL, NULL) == 7);
	assert_true(value(&P, "outbox_sends_in_flight", NULL, NULL, NULL, NULL) == 1234567);
	assert_true(value(&P, "outbox_sends_total", "provider", "http", "outcome", "accepted") == 2);
	assert_true(value(&P, "outbox_sends_total", "provider", "http", "outcome", "ambiguous") == 1);
	/* Known outcome classes are exported at zero once a provider is seen. */
	assert_true(value(&P, "outbox_sends_total", "provider", "http", "outcome", "terminal") == 0);
	assert_true(value(&P, "outbox_sends_total", "provider", "email", "outcome", "retry") == 1);
	assert_true(value(&P, "outbox_sends_total", "provider", "email", "outcome", "other") == 1);
	assert_true(isnan(value(&P, "outbox_sends_total", "provider", "http", "outcome", "other")));
	assert_true(value(&P, "outbox_sends_total", "provider", "other", "outcome", "accepted") == 1);
	/* The counters go up, never reset, between renders. */
	metrics_count_send("http", "accepted");
	render_parse();
	assert_true(value(&P, "outbox_sends_total", "provider", "http", "outcome", "accepted") == 3);
}

static void test_render_bounded_providers(void **state)
{
	char name[32];

	(void)state;
	metrics_init("w1");
	for (int i = 0; i < 100; i++) {
		snprintf(name, sizeof(name), "p%d", i);
		metrics_count_send(name, "accepted");
		metrics_observe_send(name, 0.01);
	}
	render_parse();
	/* 7 named slots + other, 5 outcomes each; 13 buckets + sum + count. */
	int sends = 0, buckets = 0;
	for (int i = 0; i < P.ns; i++) {
		sends += strcmp(P.s[i].name, "outbox_sends_total") == 0;
		buckets += strcmp(P.s[i].name, "outbox_send_duration_seconds_bucket") == 0;
	}
	assert_int_equal(sends, METRICS_MAX_PROVIDERS * 5);
	assert_int_equal(buckets, METRICS_MAX_PROVIDERS * (int)(METRICS_HISTOGRAM_BUCKETS + 1));
	assert_true(value(&P, "outbox_sends_total", "provider", "p0", "outcome", "accepted") == 1);
	assert_true(value(&P, "outbox_sends_total", "provider", "other", "outcome", "accepted") ==
	            100 - (METRICS_MAX_PROVIDERS - 1));
	assert_true(value(&P, "outbox_send_duration_seconds_count", "provider", "other", NULL, NULL) ==
	            100 - (METRICS_MAX_PROVIDERS - 1));
}

static void test_render_histogram(void **state)
{
	static const double obs[] = { 0.001, 0.005, 0.0051, 0.2, 0.2, 1.0, 3, 29.9, 30, 31, 1e6, -1 };
	double sum = 0;

	(void)state;
	metrics_init("w1");
	for (size_t i = 0; i < sizeof(obs) / sizeof(obs[0]); i++) {
		metrics_observe_send("http", obs[i]);
		sum += obs[i] < 0 ? 0 : obs[i];
	}
	metrics_observe_send("crm", 0.05);
	render_parse();

	double prev_le = -1, prev = 0, inf = NAN;
	int n = 0;
	for (int i = 0; i < P.ns; i++) {
		const struct sample *s = &P.s[i];
		const char *le;
		if (strcmp(s->name, "outbox_send_duration_seconds_bucket") != 0 ||
		    strcmp(label(s, "provider"), "http") != 0)
			continue;
		le = label(s, "le");
		assert_non_null(le);
		double b = strcmp(le, "+Inf") == 0 ? INFINITY : strtod(le, NULL);
		assert_true(b > prev_le);          /* bounds increase */
		assert_true(s->value >= prev);     /* cumulative */
		prev_le = b;
		prev = s->value;
		if (isinf(b))
			inf = s->value;
		n++;
	}
	assert_int_equal(n, (int)METRICS_HISTOGRAM_BUCKETS + 1);
	assert_true(isinf(prev_le));              /* +Inf is the last bucket */
	assert_true(inf == value(&P, "outbox_send_duration_seconds_count", "provider", "http", NULL, NULL));
	assert_true(inf == 12);
	assert_true(value(&P, "outbox_send_duration_seconds_bucket", "provider", "http", "le", "0.005") == 3);
	assert_true(value(&P, "outbox_send_duration_seconds_bucket", "provider", "http", "le", "0.25") == 6);
	assert_true(value(&P, "outbox_send_duration_seconds_bucket", "provider", "http", "le", "30") == 10);
	assert_true(fabs(value(&P, "outbox_send_duration_seconds_sum", "provider", "http", NULL, NULL) - sum) <
	            1e-6);
	assert_true(value(&P, "outbox_send_duration_seconds_count", "provider", "crm", NULL, NULL) == 1);
	assert_true(value(&P, "outbox_send_duration_seconds_bucket", "provider", "crm", "le", "0.025") == 0);
	assert_true(value(&P, "outbox_send_duration_seconds_bucket", "provider", "crm", "le", "0.05") == 1);
}

static void test_render_label_escaping(void **state)
{
	const char *nasty = "a\\b\"c\nd";
	char *text;

	(void)state;
	metrics_init(nasty);
	metrics_count_send(nasty, "accepted");
	text = metrics_render();
	assert_non_null(strstr(text, "outbox_worker_info{worker=\"a\\\\b\\\"c\\nd\"} 1\n"));
	parse(&P, text);
	free(text);
	assert_true(value(&P, "outbox_worker_info", "worker", nasty, NULL, NULL) == 1);
	assert_true(value(&P, "outbox_sends_total", "provider", nasty, "outcome", "accepted") == 1);
}

static void test_render_special_values(void **state)
{
	(void)state;
	metrics_init("w1");
	metrics_set(G_QUEUE_LAG_SECONDS, NAN);
	metrics_set(G_UNKNOWN, INFINITY);
	render_parse();
	assert_true(isnan(value(&P, "outbox_queue_lag_seconds", NULL, NULL, NULL, NULL)));
	assert_true(isinf(value(&P, "outbox_unknown_effects", NULL, NULL, NULL, NULL)));
	/* No heartbeat yet: the age is NaN, not a huge number. */
	assert_true(isnan(value(&P, "outbox_loop_heartbeat_age_seconds", NULL, NULL, NULL, NULL)));
	metrics_heartbeat();
	render_parse();
	double age = value(&P, "outbox_loop_heartbeat_age_seconds", NULL, NULL, NULL, NULL);
	assert_true(age >= 0 && age < 5);
}

/* ---- HTTP ---- */

/* The port of the metrics listener: the one listening TCP socket this
 * process holds (the test opens no other). */
static int listening_port(int skip_fd)
{
	for (int fd = 3; fd < 1024; fd++) {
		int acc = 0;
		socklen_t l = sizeof(acc);
		struct sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		if (fd == skip_fd)
			continue;
		if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &l) != 0 || !acc)
			continue;
		if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
			continue;
		if (ss.ss_family == AF_INET)
			return ntohs(((struct sockaddr_in *)&ss)->sin_port);
		if (ss.ss_family == AF_INET6)
			return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
	}
	return -1;
}

struct fetch {
	int family;
	int port;
	const char *request;
	char response[65536];
	size_t len;
	int done_fd;        /* written when the response is complete */
};

static void *fetch_thread(void *arg)
{
	struct fetch *f = arg;
	struct sockaddr_storage ss;
	socklen_t sl;
	int fd;

	memset(&ss, 0, sizeof(ss));
	if (f->family == AF_INET6) {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
		a->sin6_family = AF_INET6;
		a->sin6_port = htons((uint16_t)f->port);
		a->sin6_addr = in6addr_loopback;
		sl = sizeof(*a);
	} else {
		struct sockaddr_in *a = (struct sockaddr_in *)&ss;
		a->sin_family = AF_INET;
		a->sin_port = htons((uint16_t)f->port);
		a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		sl = sizeof(*a);
	}
	fd = socket(f->family, SOCK_STREAM, 0);
	if (fd >= 0 && connect(fd, (struct sockaddr *)&ss, sl) == 0) {
		size_t off = 0, n = strlen(f->request);
		while (off < n) {
			ssize_t w = write(fd, f->request + off, n - off);
			if (w <= 0)
				break;
			off += (size_t)w;
		}
		for (;;) {
			ssize_t r = read(fd, f->response + f->len, sizeof(f->response) - 1 - f->len);
			if (r <= 0)
				break;
			f->len += (size_t)r;
		}
	}
	if (fd >= 0)
		close(fd);
	f->response[f->len] = '\0';
	if (write(f->done_fd, "x", 1) != 1)
		abort();
	return NULL;
}

static void done_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	event_base_loopbreak(arg);
}

static void timeout_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	*(bool *)arg = true;
}

/* Sends request to the server on base from another thread and runs the
 * loop until the (HTTP/1.0, so closed) response is complete. */
static int http_fetch(struct event_base *base, int family, int port, const char *request,
                      struct fetch *f)
{
	int pfd[2];
	pthread_t t;
	bool timed_out = false;
	struct event *done, *to;
	struct timeval tv = { 10, 0 };

	memset(f, 0, sizeof(*f));
	assert_int_equal(pipe(pfd), 0);
	f->family = family;
	f->port = port;
	f->request = request;
	f->done_fd = pfd[1];
	done = event_new(base, pfd[0], EV_READ, done_cb, base);
	to = evtimer_new(base, timeout_cb, &timed_out);
	event_add(done, NULL);
	event_add(to, &tv);
	assert_int_equal(pthread_create(&t, NULL, fetch_thread, f), 0);
	while (!timed_out && event_base_loop(base, EVLOOP_ONCE) == 0 && event_pending(done, EV_READ, NULL))
		;
	pthread_join(t, NULL);
	event_free(done);
	event_free(to);
	close(pfd[0]);
	close(pfd[1]);
	assert_false(timed_out);
	/* "HTTP/1.1 200 OK" */
	assert_true(f->len > 12);
	return atoi(f->response + 9);
}

static const char *body_of(const struct fetch *f)
{
	const char *b = strstr(f->response, "\r\n\r\n");
	assert_non_null(b);
	return b + 4;
}

static bool ready_ok;
static const char *ready_why = "";

static bool ready_cb(void *arg, char *why, size_t len)
{
	assert_ptr_equal(arg, &ready_ok);
	if (!ready_ok)
		snprintf(why, len, "%s", ready_why);
	return ready_ok;
}

static void test_http_routes(void **state)
{
	struct event_base *base = event_base_new();
	struct fetch f;
	char err[256];
	int port, code;

	(void)state;
	metrics_init("http-worker");
	metrics_count_send("http", "accepted");
	assert_true(metrics_start(base, "127.0.0.1:0", ready_cb, &ready_ok, err, sizeof(err)));
	assert_string_equal(err, "");
	port = listening_port(-1);
	assert_true(port > 0);

	/* No heartbeat yet: starting. */
	ready_ok = true;
	code = http_fetch(base, AF_INET, port, "GET /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 503);
	assert_non_null(strstr(body_of(&f), "starting"));

	metrics_heartbeat();
	code = http_fetch(base, AF_INET, port, "GET /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 200);
	assert_string_equal(body_of(&f), "ok");

	/* Not ready: 503 with the callback's reason. */
	ready_ok = false;
	ready_why = "database unreachable: connection refused";
	code = http_fetch(base, AF_INET, port, "GET /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 503);
	assert_string_equal(body_of(&f), "database unreachable: connection refused");
	ready_why = "";
	code = http_fetch(base, AF_INET, port, "GET /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 503);
	assert_string_equal(body_of(&f), "not ready");

	/* A loop that stopped reporting 31 s ago: stalled, even when ready. */
	ready_ok = true;
	metrics_heartbeat_at(now_mono_ms() - 31000);
	code = http_fetch(base, AF_INET, port, "GET /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 503);
	assert_non_null(strstr(body_of(&f), "stalled"));
	metrics_heartbeat();

	/* /metrics: the rendered text, parseable, with the content type. */
	code = http_fetch(base, AF_INET, port, "GET /metrics HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 200);
	assert_non_null(strstr(f.response, "Content-Type: text/plain; version=0.0.4"));
	parse(&P, body_of(&f));
	assert_true(value(&P, "outbox_worker_info", "worker", "http-worker", NULL, NULL) == 1);
	assert_true(value(&P, "outbox_sends_total", "provider", "http", "outcome", "accepted") == 1);

	/* Query strings are ignored; HEAD has no body; others are 404/405. */
	code = http_fetch(base, AF_INET, port, "GET /metrics?x=1 HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 200);
	code = http_fetch(base, AF_INET, port, "HEAD /healthz HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 200);
	assert_string_equal(body_of(&f), "");
	code = http_fetch(base, AF_INET, port, "GET / HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 404);
	code = http_fetch(base, AF_INET, port, "GET /metricsx HTTP/1.0\r\n\r\n", &f);
	assert_int_equal(code, 404);
	/* A method outside GET and HEAD: 405. */
	code = http_fetch(base, AF_INET, port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", &f);
	assert_int_equal(code, 405);
	/* Not a request line: 400; a request head past 8 KiB: 431. */
	code = http_fetch(base, AF_INET, port, "nonsense\r\n\r\n", &f);
	assert_int_equal(code, 400);
	/* A malformed request line or a version this server does not speak is
	 * answered 400 at once, when the line has arrived: not after the end
	 * of a head that may never come (the connection's 5 s cut), even when
	 * the line alone was sent. */
	{
		static const char *const malformed[] = {
			"\n\r\n", "\r\n\r\n", "\n\n", "\n", "\r\n", " \r\n\r\n",
			"GET /metrics HTTP/1.10\r\n\r\n", "GET /metrics HTTP/1.10\r\n",
			"GET /metrics HTTP/1.2\r\n\r\n", "GET /metrics HTTP/2.0\r\n\r\n",
			"GET /metrics HTTP/1.\r\n\r\n", "GET /metrics HTTP/1\r\n\r\n",
			"GET /metrics HTTP/0.9\r\n\r\n", "GET /metrics http/1.1\r\n\r\n",
			"GET /metrics HTTP/1.1 \r\n\r\n", "GET /metrics HTTP/1.1x\n",
			"GET  /metrics HTTP/1.1\r\n\r\n", "GET metrics HTTP/1.1\r\n\r\n",
			"GET /metrics\r\n\r\n", "GET\r\n", "/metrics HTTP/1.1\r\n",
			"GET /me\x01trics HTTP/1.1\r\n", "GET /m\x7f HTTP/1.1\r\n",
			"GET /m\xc3\xa9 HTTP/1.1\r\n", "GET\t/metrics HTTP/1.1\r\n",
			"G(T /metrics HTTP/1.1\r\n", "GET /metrics\rHTTP/1.1\r\n",
			"GET /metrics HTTP/1.1\r\r\n", "GET \n", "GET \r\n",
		};
		for (size_t i = 0; i < sizeof(malformed) / sizeof(malformed[0]); i++) {
			int64_t t0 = now_mono_ms();
			code = http_fetch(base, AF_INET, port, malformed[i], &f);
			if (code != 400 || now_mono_ms() - t0 > 2000)
				fail_msg("request %zu (%s): %d after %lld ms", i, malformed[i], code,
				         (long long)(now_mono_ms() - t0));
		}
	}
	/* Either line ending, mixed: a head ends at its first empty line. */
	code = http_fetch(base, AF_INET, port, "GET /metrics HTTP/1.1\n\r\n", &f);
	assert_int_equal(code, 200);
	code = http_fetch(base, AF_INET, port, "GET /metrics HTTP/1.0\r\nHost: x\n\n", &f);
	assert_int_equal(code, 200);
	{
		static char big[10000];
		memset(big, 'a', sizeof(big) - 1);
		memcpy(big, "GET /metrics HTTP/1.0\r\nX: ", 26);
		code = http_fetch(base, AF_INET, port, big, &f);
		assert_int_equal(code, 431);
	}
	/* Every answer closed its connection: the server closes its end once
	 * the client's EOF is read, which the loop may not have seen yet when
	 * the client thread reported the answer. */
	for (int64_t t0 = now_mono_ms(); metrics_connections() != 0 && now_mono_ms() - t0 < 5000;)
		event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
	assert_int_equal(metrics_connections(), 0);

	/* Stopped: the port is closed. */
	metrics_stop();
	assert_int_equal(listening_port(-1), -1);
	event_base_free(base);
}

static void test_http_ipv6(void **state)
{
	struct event_base *base = event_base_new();
	struct fetch f;
	char err[256];
	int probe = socket(AF_INET6, SOCK_STREAM, 0);
	struct sockaddr_in6 a;

	(void)state;
	memset(&a, 0, sizeof(a));
	a.sin6_family = AF_INET6;
	a.sin6_addr = in6addr_loopback;
	if (probe < 0 || bind(probe, (struct sockaddr *)&a, sizeof(a)) != 0) {
		if (probe >= 0)
			close(probe);
		event_base_free(base);
		skip();   /* no IPv6 loopback in this sandbox */
	}
	close(probe);
	metrics_init("w6");
	metrics_heartbeat();
	assert_true(metrics_start(base, "[::1]:0", NULL, NULL, err, sizeof(err)));
	int port = listening_port(-1);
	assert_true(port > 0);
	assert_int_equal(http_fetch(base, AF_INET6, port, "GET /healthz HTTP/1.0\r\n\r\n", &f), 200);
	metrics_stop();
	event_base_free(base);
}

static void test_listen_errors(void **state)
{
	struct event_base *base = event_base_new();
	struct sockaddr_in a;
	socklen_t sl = sizeof(a);
	char err[256], addr[64];
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	(void)state;
	metrics_init("w1");
	/* Off: nothing listens. */
	assert_true(metrics_start(base, "", NULL, NULL, err, sizeof(err)));
	assert_int_equal(listening_port(-1), -1);
	assert_true(metrics_start(base, NULL, NULL, NULL, err, sizeof(err)));

	/* A port somebody else holds: false, naming the address and why. */
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	assert_int_equal(listen(fd, 1), 0);
	assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
	snprintf(addr, sizeof(addr), "127.0.0.1:%d", ntohs(a.sin_port));
	assert_false(metrics_start(base, addr, NULL, NULL, err, sizeof(err)));
	assert_non_null(strstr(err, addr));
	assert_non_null(strstr(err, "Address already in use"));
	assert_int_equal(listening_port(fd), -1);   /* nothing left behind */
	close(fd);

	/* Malformed addresses. */
	static const char *const bad[] = {
		"9464", "localhost", ":9464", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000",
		"::1:9464", "[::1]9464", "[::1", "[]:9464",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		assert_false(metrics_start(base, bad[i], NULL, NULL, err, sizeof(err)));
		assert_non_null(strstr(err, "[metrics] listen"));
		assert_non_null(strstr(err, bad[i]));
	}
	/* An address this host does not have. */
	assert_false(metrics_start(base, "192.0.2.1:9464", NULL, NULL, err, sizeof(err)));
	assert_non_null(strstr(err, "192.0.2.1:9464"));
	assert_non_null(strstr(err, "Cannot assign requested address"));
	assert_int_equal(listening_port(-1), -1);
	event_base_free(base);
}

/* ---- sd_notify ---- */

struct notify_sink {
	int fd;
	char path[108];
	char msgs[16][512];
	int n;
};

static void sink_cb(evutil_socket_t fd, short what, void *arg)
{
	struct notify_sink *s = arg;
	ssize_t r;

	(void)what;
	while (s->n < 16 && (r = recv(fd, s->msgs[s->n], sizeof(s->msgs[0]) - 1, MSG_DONTWAIT)) > 0)
		s->msgs[s->n++][r] = '\0';
}

static void sink_open(struct notify_sink *s)
{
	struct sockaddr_un a;

	memset(s, 0, sizeof(*s));
	snprintf(s->path, sizeof(s->path), "/tmp/outbox-notify-test.%d", (int)getpid());
	unlink(s->path);
	s->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	assert_true(s->fd >= 0);
	memset(&a, 0, sizeof(a));
	a.sun_family = AF_UNIX;
	text_copy(a.sun_path, s->path, sizeof(a.sun_path));
	assert_int_equal(bind(s->fd, (struct sockaddr *)&a, sizeof(a)), 0);
	setenv("NOTIFY_SOCKET", s->path, 1);
}

static void sink_close(struct notify_sink *s)
{
	close(s->fd);
	unlink(s->path);
	unsetenv("NOTIFY_SOCKET");
	unsetenv("WATCHDOG_USEC");
	unsetenv("WATCHDOG_PID");
}

static int count_msgs(const struct notify_sink *s, const char *text)
{
	int n = 0;
	for (int i = 0; i < s->n; i++)
		n += strcmp(s->msgs[i], text) == 0;
	return n;
}

static void test_sdnotify_messages(void **state)
{
	struct event_base *base = event_base_new();
	struct notify_sink s;
	unsigned long long usec = 0;

	(void)state;
	sink_open(&s);
	sdnotify_init(base);
	assert_int_equal(sdnotify_watchdog_usec(), 0);   /* no WATCHDOG_USEC: no timer */
	sdnotify_ready("serving\nREADY=1");
	sdnotify_status("%d in flight", 3);
	sdnotify_reloading();
	sdnotify_stopping();
	sink_cb(s.fd, EV_READ, &s);
	assert_int_equal(s.n, 4);
	assert_string_equal(s.msgs[0], "READY=1\nSTATUS=serving READY=1");
	assert_string_equal(s.msgs[1], "STATUS=3 in flight");
	assert_true(sscanf(s.msgs[2], "RELOADING=1\nSTATUS=reloading configuration\nMONOTONIC_USEC=%llu",
	                   &usec) == 1);
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	assert_true(usec > 0 && usec <= (unsigned long long)ts.tv_sec * 1000000ULL + ts.tv_nsec / 1000);
	assert_non_null(strstr(s.msgs[3], "STOPPING=1"));
	sdnotify_shutdown();
	sink_close(&s);

	/* Outside systemd: nothing is sent, nothing fails. */
	sdnotify_init(base);
	sdnotify_ready("x");
	sdnotify_stopping();
	assert_false(sdnotify_enabled());
	sdnotify_shutdown();
	event_base_free(base);
}

static void test_sdnotify_watchdog(void **state)
{
	struct event_base *base = event_base_new();
	struct notify_sink s;
	struct event *rd, *to;
	struct timeval tv = { 10, 0 };
	bool timed_out = false;
	char pid[32];
	int64_t t0;

	(void)state;
	sink_open(&s);
	setenv("WATCHDOG_USEC", "100000", 1);
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	setenv("WATCHDOG_PID", pid, 1);
	t0 = now_mono_ms();
	sdnotify_init(base);
	assert_int_equal(sdnotify_watchdog_usec(), 100000);
	rd = event_new(base, s.fd, EV_READ | EV_PERSIST, sink_cb, &s);
	to = evtimer_new(base, timeout_cb, &timed_out);
	event_add(rd, NULL);
	event_add(to, &tv);
	/* the ping sent by init, then two from the timer */
	while (!timed_out && count_msgs(&s, "WATCHDOG=1") < 3)
		event_base_loop(base, EVLOOP_ONCE);
	assert_false(timed_out);
	/* Two timer pings at 50 ms: at least ~100 ms, far below 10 s. */
	assert_true(now_mono_ms() - t0 >= 90);
	event_free(rd);
	event_free(to);
	sdnotify_shutdown();
	assert_int_equal(sdnotify_watchdog_usec(), 0);
	sink_close(&s);

	/* WATCHDOG_PID of another process: not ours, no timer. */
	sink_open(&s);
	setenv("WATCHDOG_USEC", "100000", 1);
	setenv("WATCHDOG_PID", "1", 1);
	sdnotify_init(base);
	assert_int_equal(sdnotify_watchdog_usec(), 0);
	sdnotify_shutdown();
	sink_close(&s);
	event_base_free(base);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_render_empty),
		cmocka_unit_test(test_render_counters_and_gauges),
		cmocka_unit_test(test_render_bounded_providers),
		cmocka_unit_test(test_render_histogram),
		cmocka_unit_test(test_render_label_escaping),
		cmocka_unit_test(test_render_special_values),
		cmocka_unit_test(test_http_routes),
		cmocka_unit_test(test_http_ipv6),
		cmocka_unit_test(test_listen_errors),
		cmocka_unit_test(test_sdnotify_messages),
		cmocka_unit_test(test_sdnotify_watchdog),
	};
	log_set_min_level(OLOG_ERROR);
	return cmocka_run_group_tests_name("metrics", tests, NULL, NULL);
}

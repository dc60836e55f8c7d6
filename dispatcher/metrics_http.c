/* SPDX-License-Identifier: ISC */
/*
 * metrics_http.c: the HTTP endpoint on [metrics] listen.
 *
 *   GET|HEAD /metrics   the Prometheus text (metrics.c)
 *   GET|HEAD /healthz   200 "ok" when ready and the loop turns, else 503 + reason
 *   other paths         404; other methods 405; a malformed request 400
 *
 * A small HTTP/1.x server of its own rather than evhttp, whose idle timeout
 * restarts with every byte and which has no connection limit: a thousand
 * local clients sending a byte every few seconds held every descriptor the
 * worker had, and sends, database reconnects and /healthz itself failed.
 * Here at most METRICS_MAX_CONNECTIONS are open (a new one closes the
 * oldest, so a probe still gets in past clients holding theirs), each has METRICS_CONNECTION_MS in all to
 * send its request head (at most METRICS_MAX_REQUEST bytes) and read the
 * answer, and every answer ends its connection.  Runs on the worker's
 * loop thread.
 */
#include "metrics.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>

#include "log.h"
#include "util.h"

#define METRICS_MAX_REQUEST 8192    /* request line and headers */

struct mconn {
	TAILQ_ENTRY(mconn) link;
	struct bufferevent *bev;
	struct event *deadline;
	size_t scanned;                /* bytes of the head searched already */
	bool line_ok;                  /* the request line arrived and is well formed */
};
TAILQ_HEAD(mconn_list, mconn);

static struct {
	struct event_base *base;
	struct evconnlistener *listener;
	struct event *resume;          /* re-enables the listener after EMFILE */
	struct mconn_list conns;
	int n_conns;
	unsigned long evicted;         /* closed to make room: at the cap */
} H = { .conns = TAILQ_HEAD_INITIALIZER(H.conns) };

int metrics_connections(void)
{
	return H.n_conns;
}

static void conn_free(struct mconn *c)
{
	TAILQ_REMOVE(&H.conns, c, link);
	H.n_conns--;
	event_free(c->deadline);
	bufferevent_free(c->bev);      /* closes the socket */
	free(c);
}

static void conn_deadline(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	conn_free(arg);
}

static void conn_event(struct bufferevent *bev, short what, void *arg)
{
	(void)bev;
	if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
		conn_free(arg);
}

/* After the answer: whatever the client still sends is thrown away until
 * it closes (or the connection's time is up). */
static void conn_discard(struct bufferevent *bev, void *arg)
{
	struct evbuffer *in = bufferevent_get_input(bev);

	(void)arg;
	evbuffer_drain(in, evbuffer_get_length(in));
}

/* The answer has left: end our side, then wait for the client's end.
 * Closing at once with unread bytes (a request head past the limit, a
 * body) would reset the connection, and the client could lose the
 * answer. */
static void conn_written(struct bufferevent *bev, void *arg)
{
	if (evbuffer_get_length(bufferevent_get_output(bev)) != 0)
		return;
	if (shutdown(bufferevent_getfd(bev), SHUT_WR) != 0) {
		conn_free(arg);
		return;
	}
	bufferevent_disable(bev, EV_WRITE);
	bufferevent_setwatermark(bev, EV_READ, 0, 0);
	bufferevent_setcb(bev, conn_discard, NULL, conn_event, arg);
	bufferevent_enable(bev, EV_READ);
}

static void reply(struct mconn *c, int code, const char *reason, const char *ctype,
                  const char *body, size_t len, bool head_only)
{
	struct evbuffer *out = bufferevent_get_output(c->bev);

	evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nCache-Control: no-store\r\n"
	                         "Content-Length: %zu\r\nConnection: close\r\n\r\n",
	                    code, reason, ctype, len);
	if (!head_only)
		evbuffer_add(out, body, len);
	bufferevent_disable(c->bev, EV_READ);
	bufferevent_setcb(c->bev, NULL, conn_written, conn_event, c);
	bufferevent_enable(c->bev, EV_WRITE);
}

static void reply_plain(struct mconn *c, int code, const char *reason, const char *body,
                        bool head_only)
{
	reply(c, code, reason, "text/plain; charset=utf-8", body, strlen(body), head_only);
}

/* "METHOD SP /target SP HTTP/1.0|HTTP/1.1", nothing else (RFC 9112 3):
 * a token, one space, a target of visible ASCII starting with '/', one
 * space, and a version this server speaks.  line[0..n) without its LF
 * (a CR before it is dropped here). */
static bool request_line_ok(const char *line, size_t n)
{
	size_t i = 0, m;

	if (n > 0 && line[n - 1] == '\r')
		n--;
	while (i < n && (((line[i] | 0x20) >= 'a' && (line[i] | 0x20) <= 'z') ||
	                 (line[i] >= '0' && line[i] <= '9') ||
	                 (line[i] != '\0' && strchr("!#$%&'*+-.^_`|~", line[i]))))
		i++;
	if (i == 0 || i + 1 >= n || line[i] != ' ' || line[i + 1] != '/')
		return false;
	for (i++; i < n && line[i] > 0x20 && line[i] < 0x7f; i++)
		;
	if (i >= n || line[i] != ' ')
		return false;
	m = n - i - 1;
	return m == 8 && (memcmp(line + i + 1, "HTTP/1.1", 8) == 0 ||
	                  memcmp(line + i + 1, "HTTP/1.0", 8) == 0);
}

/* One request line ("GET /metrics?x HTTP/1.1"), already cut at its end
 * and checked (request_line_ok). */
static void route(struct mconn *c, char *line)
{
	char *method = line, *target, *version, *q;
	bool head;

	if (!request_line_ok(line, strlen(line)))
		goto bad;
	target = strchr(method, ' ');
	if (target == NULL)
		goto bad;
	*target++ = '\0';
	version = strchr(target, ' ');
	if (version == NULL)
		goto bad;
	*version = '\0';
	q = strchr(target, '?');
	if (q)
		*q = '\0';
	head = strcmp(method, "HEAD") == 0;
	if (!head && strcmp(method, "GET") != 0) {
		reply_plain(c, 405, "Method Not Allowed", "only GET and HEAD", false);
		return;
	}
	if (strcmp(target, "/metrics") == 0) {
		char *text = metrics_render();
		reply(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), head);
		free(text);
	} else if (strcmp(target, "/healthz") == 0) {
		char why[256];
		metrics_health(why, sizeof(why));
		if (!why[0])
			reply_plain(c, 200, "OK", "ok", head);
		else
			reply_plain(c, 503, "Service Unavailable", why, head);
	} else {
		reply_plain(c, 404, "Not Found", "not found: try /metrics or /healthz", head);
	}
	return;
bad:
	reply_plain(c, 400, "Bad Request", "expected METHOD /path HTTP/1.0 or HTTP/1.1", false);
}

static void conn_read(struct bufferevent *bev, void *arg)
{
	struct mconn *c = arg;
	struct evbuffer *in = bufferevent_get_input(bev);
	struct evbuffer_ptr from, end;
	size_t eol, len = evbuffer_get_length(in);
	char *line;

	/* The request line is judged as soon as it has arrived: a malformed
	 * one (an empty line, an unknown version) is answered at once, not
	 * after the head's end that may never come. */
	if (!c->line_ok) {
		struct evbuffer_ptr nl = evbuffer_search(in, "\n", 1, NULL);
		char first[METRICS_MAX_REQUEST];

		if (nl.pos < 0) {
			if (len > METRICS_MAX_REQUEST)
				reply_plain(c, 431, "Request Header Fields Too Large", "request head too large",
				            false);
			return;
		}
		if ((size_t)nl.pos >= sizeof(first) ||
		    evbuffer_copyout(in, first, (size_t)nl.pos) != (ssize_t)nl.pos ||
		    !request_line_ok(first, (size_t)nl.pos)) {
			reply_plain(c, 400, "Bad Request", "expected METHOD /path HTTP/1.0 or HTTP/1.1",
			            false);
			return;
		}
		c->line_ok = true;
	}
	/* The end of the head (an empty line: LF CRLF or LF LF) is searched
	 * for in what arrived since the last read (and the 2 bytes before
	 * it), not from the start each time: a client sending a byte at a
	 * time would make it quadratic. */
	evbuffer_ptr_set(in, &from, c->scanned > 2 ? c->scanned - 2 : 0, EVBUFFER_PTR_SET);
	end = evbuffer_search(in, "\n\r\n", 3, &from);
	if (end.pos < 0) {
		evbuffer_ptr_set(in, &from, c->scanned > 1 ? c->scanned - 1 : 0, EVBUFFER_PTR_SET);
		end = evbuffer_search(in, "\n\n", 2, &from);
	}
	if (end.pos < 0) {
		c->scanned = len;
		if (len > METRICS_MAX_REQUEST)
			reply_plain(c, 431, "Request Header Fields Too Large", "request head too large", false);
		return;
	}
	line = evbuffer_readln(in, &eol, EVBUFFER_EOL_CRLF);
	if (line == NULL) {
		reply_plain(c, 400, "Bad Request", "expected METHOD /path HTTP/1.x", false);
		return;
	}
	route(c, line);
	free(line);
}

static void on_accept(struct evconnlistener *lev, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg)
{
	struct mconn *c;
	struct timeval tv = { METRICS_CONNECTION_MS / 1000, (METRICS_CONNECTION_MS % 1000) * 1000 };

	(void)lev;
	(void)sa;
	(void)salen;
	(void)arg;
	if (H.n_conns >= METRICS_MAX_CONNECTIONS) {
		/* At the cap the oldest connection makes room: clients that hold
		 * connections open lose them to the next, and a probe (which asks
		 * at once) still gets its answer. */
		if (H.evicted++ % 1000 == 0)
			log_msg(OLOG_WARN, "metrics_busy", "metrics: %d connections open, closing the "
			        "oldest for a new one (%lu so far)", H.n_conns, H.evicted);
		conn_free(TAILQ_FIRST(&H.conns));
	}
	c = text_alloc(sizeof(*c));
	c->bev = bufferevent_socket_new(H.base, fd, BEV_OPT_CLOSE_ON_FREE);
	c->deadline = evtimer_new(H.base, conn_deadline, c);
	if (c->bev == NULL || c->deadline == NULL) {
		if (c->bev)
			bufferevent_free(c->bev);
		else
			evutil_closesocket(fd);
		if (c->deadline)
			event_free(c->deadline);
		free(c);
		return;
	}
	TAILQ_INSERT_TAIL(&H.conns, c, link);
	H.n_conns++;
	evtimer_add(c->deadline, &tv);
	bufferevent_setwatermark(c->bev, EV_READ, 0, METRICS_MAX_REQUEST + 1);
	bufferevent_setcb(c->bev, conn_read, NULL, conn_event, c);
	bufferevent_enable(c->bev, EV_READ);
}

static void resume_accepting(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	if (H.listener)
		evconnlistener_enable(H.listener);
}

/* accept() failed: out of descriptors (EMFILE, ENFILE) or memory.  Pause
 * for a second instead of spinning on a listener that stays readable. */
static void on_accept_error(struct evconnlistener *lev, void *arg)
{
	struct timeval tv = { 1, 0 };
	int e = EVUTIL_SOCKET_ERROR();

	(void)arg;
	if (e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM)
		return;
	log_msg(OLOG_WARN, "metrics_accept", "metrics: accept: %s; pausing the listener for 1 s",
	        strerror(e));
	evconnlistener_disable(lev);
	evtimer_add(H.resume, &tv);
}

/* "host:port" or "[v6]:port" into host and port; false with err. */
static bool split_listen(const char *listen, char *host, size_t hostlen, char *port,
                         size_t portlen, char *err, size_t errlen)
{
	const char *colon, *h = listen;
	size_t n;

	if (listen[0] == '[') {
		const char *close = strchr(listen, ']');
		if (!close || close[1] != ':') {
			snprintf(err, errlen, "metrics: [metrics] listen \"%s\": expected [IPv6]:port", listen);
			return false;
		}
		h = listen + 1;
		n = (size_t)(close - h);
		colon = close + 1;
	} else {
		colon = strrchr(listen, ':');
		if (!colon || memchr(listen, ':', (size_t)(colon - listen))) {
			snprintf(err, errlen, "metrics: [metrics] listen \"%s\": expected host:port "
			         "(IPv6 as [addr]:port)", listen);
			return false;
		}
		n = (size_t)(colon - listen);
	}
	if (n == 0 || n >= hostlen) {
		snprintf(err, errlen, "metrics: [metrics] listen \"%s\": missing or too long host",
		         listen);
		return false;
	}
	memcpy(host, h, n);
	host[n] = '\0';
	colon++;
	if (!*colon || strlen(colon) >= portlen || strspn(colon, "0123456789") != strlen(colon) ||
	    atol(colon) > 65535) {
		snprintf(err, errlen, "metrics: [metrics] listen \"%s\": bad port \"%s\"", listen, colon);
		return false;
	}
	text_copy(port, colon, portlen);
	return true;
}

/* A listening, non-blocking socket on the first address of host:port
 * that binds; -1 with err naming the address on failure. */
static int listen_socket(const char *addr, const char *host, const char *port,
                         char *err, size_t errlen)
{
	struct addrinfo hints, *res = NULL, *ai;
	int fd = -1, rc, saved = 0;

	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
	rc = getaddrinfo(host, port, &hints, &res);
	if (rc != 0) {
		snprintf(err, errlen, "metrics: cannot listen on %s ([metrics] listen): %s", addr, gai_strerror(rc));
		return -1;
	}
	for (ai = res; ai; ai = ai->ai_next) {
		int one = 1;
		fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
		            ai->ai_protocol);
		if (fd < 0) {
			saved = errno;
			continue;
		}
		(void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (ai->ai_family == AF_INET6)
			(void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
		if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 64) == 0)
			break;
		saved = errno;
		close(fd);
		fd = -1;
	}
	freeaddrinfo(res);
	if (fd < 0)
		snprintf(err, errlen, "metrics: cannot listen on %s ([metrics] listen): %s", addr,
		         strerror(saved ? saved : EADDRNOTAVAIL));
	return fd;
}

bool metrics_start(struct event_base *base, const char *listen, metrics_ready_fn ready,
                   void *arg, char *err, size_t errlen)
{
	char host[256], port[8];
	int fd;

	if (err && errlen)
		err[0] = '\0';
	metrics_stop();
	metrics_set_ready(ready, arg);
	if (!listen || !listen[0])
		return true;   /* off */
	if (!err || !errlen) {
		static char scratch[256];
		err = scratch;
		errlen = sizeof(scratch);
	}
	if (!split_listen(listen, host, sizeof(host), port, sizeof(port), err, errlen))
		return false;
	fd = listen_socket(listen, host, port, err, errlen);
	if (fd < 0)
		return false;
	H.base = base;
	H.resume = evtimer_new(base, resume_accepting, NULL);
	/* The listener owns fd from here: freeing it closes the socket. */
	H.listener = H.resume ? evconnlistener_new(base, on_accept, NULL,
	                                           LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC,
	                                           0, fd)
	                      : NULL;
	if (!H.listener) {
		close(fd);
		metrics_stop();
		snprintf(err, errlen, "metrics: cannot serve HTTP on %s", listen);
		return false;
	}
	evconnlistener_set_error_cb(H.listener, on_accept_error);
	{
		struct sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		char h[NI_MAXHOST] = "?", p[NI_MAXSERV] = "?";
		if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
			(void)getnameinfo((struct sockaddr *)&ss, sl, h, sizeof(h), p, sizeof(p),
			                  NI_NUMERICHOST | NI_NUMERICSERV);
		log_msg(OLOG_INFO, "metrics_listening", "metrics on http://%s%s%s:%s/metrics",
		        strchr(h, ':') ? "[" : "", h, strchr(h, ':') ? "]" : "", p);
	}
	return true;
}

void metrics_stop(void)
{
	while (!TAILQ_EMPTY(&H.conns))
		conn_free(TAILQ_FIRST(&H.conns));
	if (H.listener) {
		evconnlistener_free(H.listener);   /* closes the socket */
		H.listener = NULL;
	}
	if (H.resume) {
		event_free(H.resume);
		H.resume = NULL;
	}
}

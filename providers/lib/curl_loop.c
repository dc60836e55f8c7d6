/* SPDX-License-Identifier: ISC */
/*
 * curl_loop.c: libcurl multi on libevent (see curl_loop.h).
 *
 * libcurl tells us which sockets to watch (CURLMOPT_SOCKETFUNCTION) and
 * when to wake it (CURLMOPT_TIMERFUNCTION); we tell it what happened with
 * curl_multi_socket_action() and collect finished transfers from
 * curl_multi_info_read().
 */
#include "curl_loop.h"
#include "text.h"

#include <event2/event.h>
#include <stdlib.h>
#include <sys/queue.h>

struct transfer {
	LIST_ENTRY(transfer) link;
	CURL *easy;
	curl_loop_done_fn done;
	void *arg;
};

struct sock_watch {
	struct event *ev;
	curl_socket_t fd;
};

struct curl_loop {
	struct event_base *base;
	CURLM *multi;
	struct event *timer;
	struct curl_safety safety;
	LIST_HEAD(transfer_list, transfer) transfers;
	int active;
};

static void check_done(struct curl_loop *cl)
{
	CURLMsg *msg;
	int left;

	while ((msg = curl_multi_info_read(cl->multi, &left)) != NULL) {
		struct transfer *t = NULL;
		CURL *easy;
		CURLcode rc;

		if (msg->msg != CURLMSG_DONE)
			continue;
		easy = msg->easy_handle;
		rc = msg->data.result;
		curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&t);
		curl_multi_remove_handle(cl->multi, easy);
		LIST_REMOVE(t, link);
		cl->active--;
		t->done(easy, rc, t->arg);
		free(t);
	}
}

static void on_event(evutil_socket_t fd, short what, void *arg)
{
	struct curl_loop *cl = arg;
	int running, action = 0;

	if (what & EV_READ)
		action |= CURL_CSELECT_IN;
	if (what & EV_WRITE)
		action |= CURL_CSELECT_OUT;
	curl_multi_socket_action(cl->multi, fd, action, &running);
	check_done(cl);
}

static void on_timer(evutil_socket_t fd, short what, void *arg)
{
	struct curl_loop *cl = arg;
	int running;

	(void)fd;
	(void)what;
	curl_multi_socket_action(cl->multi, CURL_SOCKET_TIMEOUT, 0, &running);
	check_done(cl);
}

static int on_timer_change(CURLM *multi, long timeout_ms, void *arg)
{
	struct curl_loop *cl = arg;
	struct timeval tv;

	(void)multi;
	if (timeout_ms < 0) {
		evtimer_del(cl->timer);
		return 0;
	}
	/* 0 means "as soon as possible": still from the loop, never inline,
	 * so a provider's done callback never runs inside its send(). */
	tv.tv_sec = timeout_ms / 1000;
	tv.tv_usec = (timeout_ms % 1000) * 1000;
	evtimer_add(cl->timer, &tv);
	return 0;
}

static int on_socket(CURL *easy, curl_socket_t s, int what, void *arg, void *sockp)
{
	struct curl_loop *cl = arg;
	struct sock_watch *w = sockp;
	short kind;

	(void)easy;
	if (what == CURL_POLL_REMOVE) {
		if (w) {
			event_free(w->ev);
			free(w);
			curl_multi_assign(cl->multi, s, NULL);
		}
		return 0;
	}
	kind = EV_PERSIST | ((what & CURL_POLL_IN) ? EV_READ : 0) | ((what & CURL_POLL_OUT) ? EV_WRITE : 0);
	if (w == NULL) {
		w = text_alloc(sizeof(*w));
		w->ev = event_new(cl->base, s, kind, on_event, cl);
		if (w->ev == NULL) {
			free(w);
			return -1;
		}
		w->fd = s;
		curl_multi_assign(cl->multi, s, w);
	} else {
		/* Re-arm in place (a kept-alive socket changes direction with
		 * every request): no free and allocation per change. */
		event_del(w->ev);
		event_assign(w->ev, cl->base, s, kind, on_event, cl);
	}
	event_add(w->ev, NULL);
	return 0;
}

struct curl_loop *curl_loop_new(struct event_base *base, const struct curl_safety *safety)
{
	struct curl_loop *cl = text_alloc(sizeof(*cl));

	cl->base = base;
	cl->safety = *safety;
	cl->multi = curl_multi_init();
	cl->timer = evtimer_new(base, on_timer, cl);
	if (cl->multi == NULL || cl->timer == NULL) {
		if (cl->multi)
			curl_multi_cleanup(cl->multi);
		if (cl->timer)
			event_free(cl->timer);
		free(cl);
		return NULL;
	}
	LIST_INIT(&cl->transfers);
	curl_multi_setopt(cl->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
	curl_multi_setopt(cl->multi, CURLMOPT_SOCKETDATA, cl);
	curl_multi_setopt(cl->multi, CURLMOPT_TIMERFUNCTION, on_timer_change);
	curl_multi_setopt(cl->multi, CURLMOPT_TIMERDATA, cl);
	return cl;
}

void curl_loop_keep_connections(struct curl_loop *cl, long n)
{
	curl_multi_setopt(cl->multi, CURLMOPT_MAXCONNECTS, n);
}

bool curl_loop_add(struct curl_loop *cl, CURL *easy, curl_loop_done_fn done, void *arg)
{
	struct transfer *t = text_alloc(sizeof(*t));

	t->easy = easy;
	t->done = done;
	t->arg = arg;
	/* Last, over whatever the caller set: no transfer goes without them. */
	curl_io_safe_options(easy, &cl->safety);
	curl_easy_setopt(easy, CURLOPT_PRIVATE, t);
	if (curl_multi_add_handle(cl->multi, easy) != CURLM_OK) {
		free(t);
		return false;
	}
	LIST_INSERT_HEAD(&cl->transfers, t, link);
	cl->active++;
	return true;
}

int curl_loop_active(const struct curl_loop *cl)
{
	return cl->active;
}

void curl_loop_free(struct curl_loop *cl, void (*release)(CURL *easy, void *arg))
{
	struct transfer *t;

	if (cl == NULL)
		return;
	while ((t = LIST_FIRST(&cl->transfers)) != NULL) {
		LIST_REMOVE(t, link);
		curl_multi_remove_handle(cl->multi, t->easy);
		if (release)
			release(t->easy, t->arg);
		free(t);
	}
	curl_multi_cleanup(cl->multi);
	event_free(cl->timer);
	free(cl);
}

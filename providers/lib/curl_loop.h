/* SPDX-License-Identifier: ISC */
/*
 * curl_loop.h: libcurl's multi interface driven by a libevent loop (the
 * hiperfifo pattern): a provider hands over an easy handle and is called
 * back once when the transfer ends, on a later loop pass.
 */
#ifndef OUTBOX_CURL_LOOP_H
#define OUTBOX_CURL_LOOP_H

#include <curl/curl.h>
#include <stdbool.h>

#include "lib/curl_io.h"

struct event_base;
struct curl_loop;

/* The easy handle has been removed from the multi handle; the callee owns
 * it again (curl_easy_cleanup it or reuse it). */
typedef void (*curl_loop_done_fn)(CURL *easy, CURLcode rc, void *arg);

/* safety: applied to every transfer added (curl_io.h); copied, its
 * strings must outlive the loop. */
struct curl_loop *curl_loop_new(struct event_base *base, const struct curl_safety *safety);
/* Keep up to n idle connections for reuse (libcurl's default is 4 x the
 * transfers running at the moment, so a dip between two batches closed
 * connections the next batch had to open again). */
void curl_loop_keep_connections(struct curl_loop *cl, long n);
/* Start a transfer with the loop's safety options set over the caller's;
 * false if libcurl refused it (done is then not called). */
bool curl_loop_add(struct curl_loop *cl, CURL *easy, curl_loop_done_fn done, void *arg);
/* Transfers in progress. */
int curl_loop_active(const struct curl_loop *cl);
/* Abort every transfer (their done is not called; their easy handles and
 * args are released through release, which may be NULL) and free. */
void curl_loop_free(struct curl_loop *cl, void (*release)(CURL *easy, void *arg));

#endif

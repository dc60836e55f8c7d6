/* SPDX-License-Identifier: ISC */
/*
 * main.c: outbox-dispatcher, one worker of the fleet.
 *
 *   outbox-dispatcher --config FILE [--instance N] [--check-config]
 *   outbox-dispatcher --reload PID     (the unit's ExecReload=, reload.c)
 *
 * --instance N (the systemd template passes %i) lets N instances share
 * one config file: worker "<worker_name>-N" (or "<host>-N"), metrics on
 * [metrics] listen's port + N - 1.
 *
 * Runs in the foreground until SIGTERM (graceful: stop leasing, finish
 * in-flight sends within shutdown_grace_ms, release unstarted leases);
 * a second SIGTERM exits at once; SIGHUP reloads the config.
 */
#include <curl/curl.h>
#include <event2/event.h>
#include <event2/thread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "log.h"
#include "reload.h"
#include "util.h"
#include "version.h"
#include "worker.h"


static void usage(FILE *out)
{
	fprintf(out,
	        "usage: outbox-dispatcher --config FILE [--instance N] [--check-config]\n"
	        "       outbox-dispatcher --reload PID\n"
	        "  --config FILE    dispatcher.ini (see dispatcher.ini.example)\n"
	        "  --instance N     instance N (1..1000) of a config shared by N workers: worker\n"
	        "                   name <worker_name or host>-N, metrics port listen + N - 1\n"
	        "  --check-config   load the config and the providers, then exit 0 or 1\n"
	        "                   (binds no port, connects to no database)\n"
	        "  --reload PID     SIGHUP to the worker PID, then wait for its verdict on the\n"
	        "                   new config: exit 0 (applied) or 1 (refused, old one kept)\n"
	        "  --version\n"
	        "Sends only when AI_ACTIONS_ENABLED=true and the fleet kill switch is on.\n");
}

int main(int argc, char **argv)
{
	struct worker_options opt = { 0 };
	struct event_base *base;
	struct worker *w;
	bool check_only = false;
	int rc;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
			opt.config_path = argv[++i];
		} else if (strcmp(argv[i], "--instance") == 0 && i + 1 < argc) {
			opt.instance = argv[++i];
		} else if (strcmp(argv[i], "--reload") == 0 && i + 1 < argc) {
			return reload_request(argv[i + 1], 50000);
		} else if (strcmp(argv[i], "--check-config") == 0) {
			check_only = true;
		} else if (strcmp(argv[i], "--version") == 0) {
			printf("outbox-dispatcher %s\n", OUTBOX_VERSION);
			return 0;
		} else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
			usage(stdout);
			return 0;
		} else {
			fprintf(stderr, "outbox-dispatcher: unknown argument '%s'\n", argv[i]);
			usage(stderr);
			return 2;
		}
	}
	if (opt.config_path == NULL) {
		usage(stderr);
		return 2;
	}
	/* Descriptors for the database, the sends and the metrics port. */
	(void)fd_limit_raise();
	/* A peer closing a socket must not kill the worker. */
	signal(SIGPIPE, SIG_IGN);
	/* Providers hand results back from their own threads. */
	evthread_use_pthreads();
	/* Not thread-safe: done once, before any provider starts a thread. */
	curl_global_init(CURL_GLOBAL_DEFAULT);
	log_init("outbox-dispatcher", NULL);

	base = event_base_new();
	if (base == NULL) {
		fprintf(stderr, "outbox-dispatcher: cannot create the event loop\n");
		return 1;
	}
	w = worker_load(base, &opt);
	if (w == NULL) {
		event_base_free(base);
		curl_global_cleanup();
		return 1;
	}
	if (check_only) {
		log_msg(OLOG_INFO, "config_ok", "%s: config and providers load", opt.config_path);
		rc = 0;
	} else if (!worker_start(w)) {
		rc = 1;
	} else {
		rc = worker_run(w);
	}
	worker_free(w);
	event_base_free(base);
	curl_global_cleanup();
	libevent_global_shutdown();
	return rc;
}

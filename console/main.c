/* SPDX-License-Identifier: ISC */
/*
 * main.c: outbox-console --config FILE.  Reads [database] and [console] of
 * the workers' ini, serves the pages over libmicrohttpd (connection limit
 * and timeouts from the library, one internal thread, so one database
 * connection serves every request in turn), and checks every request
 * before a page sees it:
 *   - the person is named by [console] identity_header, read only from
 *     the peer [console] trusted_proxy (an address, or "unix" for the
 *     listening socket's peers); from any other peer it is ignored;
 *   - a POST is refused (403) unless actions = on, it names a person, its
 *     Origin is the console's own, and its csrf field is this person's
 *     token (an HMAC of the person's name under a key made at start);
 *   - every answer carries a strict Content-Security-Policy (no inline
 *     script or style, frame-ancestors 'none'), nosniff, same-origin referrers and
 *     no-store.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "config.h"
#include "console.h"
#include "util.h"

#define MAX_BODY 65536

struct console_settings console;
static PGconn *viewer;
static unsigned char csrf_key[32];

static const char csp[] =
	"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
	"form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

PGconn *console_db(void)
{
	if (viewer && PQstatus(viewer) == CONNECTION_OK)
		return viewer;
	if (viewer)
		PQfinish(viewer);
	viewer = PQconnectdb(console.conninfo);
	if (PQstatus(viewer) != CONNECTION_OK) {
		fprintf(stderr, "outbox-console: cannot connect to the database: %s",
		        PQerrorMessage(viewer));
		PQfinish(viewer);
		viewer = NULL;
		return NULL;
	}
	/* The login may be a member of more than outbox_viewer (an operator's
	 * role is granted to it so that SET ROLE can take it): pages read as
	 * the viewer, whatever else the login could do. */
	PQclear(PQexec(viewer, "SET ROLE outbox_viewer"));
	PQclear(PQexec(viewer, "SET application_name = 'outbox-console'"));
	return viewer;
}

PGresult *console_query(const char *sql, int n, const char *const *params, const char **err)
{
	PGconn *c = console_db();
	PGresult *r;
	ExecStatusType st;

	*err = NULL;
	if (c == NULL) {
		*err = "the database cannot be reached";
		return NULL;
	}
	r = PQexecParams(c, sql, n, NULL, params, NULL, NULL, 0);
	st = PQresultStatus(r);
	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK) {
		static char msg[512];
		const char *m = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
		snprintf(msg, sizeof(msg), "%s", m ? m : PQerrorMessage(c));
		*err = msg;
		PQclear(r);
		return NULL;
	}
	return r;
}

const char *req_get(const struct req *r, const char *key)
{
	for (int i = 0; i < r->nfields; i++)
		if (strcmp(r->keys[i], key) == 0)
			return r->values[i][0] ? r->values[i] : NULL;
	return NULL;
}

static void req_add(struct req *r, const char *key, const char *value, size_t len)
{
	/* A form field arrives in pieces: a piece of the last field grows it. */
	if (r->nfields >= CONSOLE_MAX_FIELDS)
		return;
	r->keys[r->nfields] = text_strdup(key);
	r->values[r->nfields] = text_alloc(len + 1);
	memcpy(r->values[r->nfields], value, len);
	r->values[r->nfields][len] = '\0';
	r->nfields++;
}

struct pending {
	struct req req;
	struct MHD_PostProcessor *pp;
	size_t body;
	bool too_big;
	char last_key[128];
	int last_index;
};

static enum MHD_Result on_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                const char *filename, const char *content_type,
                                const char *transfer_encoding, const char *data, uint64_t off,
                                size_t size)
{
	struct pending *p = cls;

	if (off > 0 && p->last_index >= 0 && strcmp(p->last_key, key) == 0) {
		char **v = &p->req.values[p->last_index];
		size_t old = strlen(*v);
		char *grown = text_alloc(old + size + 1);
		memcpy(grown, *v, old);
		memcpy(grown + old, data, size);
		grown[old + size] = '\0';
		free(*v);
		*v = grown;
		return MHD_YES;
	}
	req_add(&p->req, key, data ? data : "", size);
	snprintf(p->last_key, sizeof(p->last_key), "%s", key);
	p->last_index = p->req.nfields - 1;
	return MHD_YES;
}

static enum MHD_Result on_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                              const char *value)
{
	struct req *r = cls;

	req_add(r, key, value ? value : "", value ? strlen(value) : 0);
	return MHD_YES;
}

static void pending_free(struct pending *p)
{
	if (p == NULL)
		return;
	if (p->pp)
		MHD_destroy_post_processor(p->pp);
	for (int i = 0; i < p->req.nfields; i++) {
		free(p->req.keys[i]);
		free(p->req.values[i]);
	}
	free(p);
}

static void on_done(void *cls, struct MHD_Connection *c, void **con_cls,
                    enum MHD_RequestTerminationCode toe)
{
	pending_free(*con_cls);
	*con_cls = NULL;
}

/* The peer is the trusted proxy: its address as text equals
 * trusted_proxy, or trusted_proxy is "unix" and the peer came through
 * the listening Unix socket. */
static bool peer_trusted(struct MHD_Connection *c)
{
	const union MHD_ConnectionInfo *ci;
	char addr[INET6_ADDRSTRLEN] = "";
	const struct sockaddr *sa;

	if (!console.trusted_proxy[0])
		return false;
	ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
	if (ci == NULL || ci->client_addr == NULL)
		return false;
	sa = ci->client_addr;
	if (sa->sa_family == AF_UNIX)
		return strcmp(console.trusted_proxy, "unix") == 0;
	if (sa->sa_family == AF_INET)
		inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, addr,
		          sizeof(addr));
	else if (sa->sa_family == AF_INET6)
		inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, addr,
		          sizeof(addr));
	return addr[0] && strcmp(addr, console.trusted_proxy) == 0;
}

static void csrf_token(const char *identity, char out[65])
{
	unsigned char mac[32];
	unsigned int len = sizeof(mac);
	const char *who = identity ? identity : "";

	HMAC(EVP_sha256(), csrf_key, sizeof(csrf_key), (const unsigned char *)who, strlen(who),
	     mac, &len);
	for (unsigned i = 0; i < 32; i++)
		snprintf(out + 2 * i, 3, "%02x", mac[i]);
}

static bool same_token(const char *a, const char *b)
{
	unsigned char d = 0;
	size_t n;

	if (a == NULL || b == NULL || (n = strlen(a)) != strlen(b))
		return false;
	for (size_t i = 0; i < n; i++)
		d |= (unsigned char)(a[i] ^ b[i]);
	return d == 0;
}

/* The Origin of a POST must be the console's own: [console] origin when
 * set, else http(s)://Host of the request. */
static bool origin_ok(struct MHD_Connection *c)
{
	const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
	const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
	char want[600];

	if (origin == NULL)
		return false;
	if (console.origin[0])
		return strcmp(origin, console.origin) == 0;
	if (host == NULL)
		return false;
	snprintf(want, sizeof(want), "http://%s", host);
	if (strcmp(origin, want) == 0)
		return true;
	snprintf(want, sizeof(want), "https://%s", host);
	return strcmp(origin, want) == 0;
}

static enum MHD_Result answer(struct MHD_Connection *c, struct resp *out)
{
	struct MHD_Response *m;
	enum MHD_Result ret;

	m = MHD_create_response_from_buffer(out->body.len, out->body.s, MHD_RESPMEM_MUST_COPY);
	MHD_add_response_header(m, "Content-Type",
	                        out->content_type ? out->content_type : "text/html; charset=utf-8");
	MHD_add_response_header(m, "Content-Security-Policy", csp);
	MHD_add_response_header(m, "X-Content-Type-Options", "nosniff");
	MHD_add_response_header(m, "X-Frame-Options", "DENY");
	/* same-origin, not no-referrer: with no-referrer a browser sends
	 * "Origin: null" on a form's POST, which the Origin check refuses. */
	MHD_add_response_header(m, "Referrer-Policy", "same-origin");
	MHD_add_response_header(m, "Cache-Control", "no-store");
	MHD_add_response_header(m, "Cross-Origin-Opener-Policy", "same-origin");
	if (out->location[0])
		MHD_add_response_header(m, "Location", out->location);
	ret = MHD_queue_response(c, (unsigned)out->status, m);
	MHD_destroy_response(m);
	free(out->body.s);
	return ret;
}

static enum MHD_Result refuse(struct MHD_Connection *c, int status, const char *why)
{
	struct resp out = { .status = status, .content_type = "text/plain; charset=utf-8" };

	sb_init(&out.body, 128);
	sb_puts(&out.body, why);
	sb_puts(&out.body, "\n");
	return answer(c, &out);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
	struct pending *p = *con_cls;
	struct resp out = { .status = 200 };
	bool post = strcmp(method, "POST") == 0;

	if (p == NULL) {
		const char *who = NULL;

		if (!post && strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
			return refuse(c, 405, "method not allowed");
		p = text_alloc(sizeof(*p));
		p->last_index = -1;
		*con_cls = p;
		p->req.method = post ? "POST" : "GET";
		p->req.path = url;
		if (peer_trusted(c))
			who = MHD_lookup_connection_value(c, MHD_HEADER_KIND, console.identity_header);
		p->req.identity = who && who[0] ? who : NULL;
		csrf_token(p->req.identity, p->req.csrf);
		if (post) {
			/* Refused before the body is read. */
			if (!console.actions)
				return refuse(c, 403, "the console is read-only ([console] actions = off)");
			if (p->req.identity == NULL)
				return refuse(c, 403, "an act needs a person named by the trusted proxy");
			if (!origin_ok(c))
				return refuse(c, 403, "the request's Origin is not this console's");
			p->pp = MHD_create_post_processor(c, 8192, on_field, p);
			if (p->pp == NULL)
				return refuse(c, 415, "a form (application/x-www-form-urlencoded) is expected");
		} else {
			MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, on_arg, &p->req);
		}
		return MHD_YES;
	}
	if (post && *upload_data_size) {
		p->body += *upload_data_size;
		if (p->body > MAX_BODY)
			p->too_big = true;
		else
			MHD_post_process(p->pp, upload_data, *upload_data_size);
		*upload_data_size = 0;
		return MHD_YES;
	}
	if (p->too_big)
		return refuse(c, 413, "the form is too large");
	if (post && !same_token(req_get(&p->req, "csrf"), p->req.csrf))
		return refuse(c, 403, "the form's token is missing or wrong: reload the page");

	if (strcmp(url, "/static/console.css") == 0) {
		out.content_type = "text/css; charset=utf-8";
		sb_init(&out.body, strlen(console_css));
		sb_puts(&out.body, console_css);
	} else if (strcmp(url, "/static/console.js") == 0) {
		out.content_type = "text/javascript; charset=utf-8";
		sb_init(&out.body, strlen(console_js));
		sb_puts(&out.body, console_js);
	} else if (strcmp(url, "/favicon.ico") == 0 || strcmp(url, "/static/favicon.svg") == 0) {
		out.content_type = "image/svg+xml";
		sb_init(&out.body, strlen(console_icon));
		sb_puts(&out.body, console_icon);
	} else {
		sb_init(&out.body, 16384);
		pages_handle(&p->req, &out);
	}
	return answer(c, &out);
}

/* Before binding unix:/PATH: nothing there, or a socket nobody answers
 * on (left by a console that was killed) is removed.  A socket something
 * still answers on, or a file that is no socket, is left alone and the
 * start refused: another console may be serving there, or the path is a
 * mistake. */
static bool stale_socket_removed(const struct sockaddr_un *un, const char *listen_on, char *err,
                                 size_t errlen)
{
	struct stat st;
	int probe;

	if (lstat(un->sun_path, &st) != 0) {
		if (errno == ENOENT)
			return true;
		snprintf(err, errlen, "listen %s: %s", listen_on, strerror(errno));
		return false;
	}
	if (!S_ISSOCK(st.st_mode)) {
		snprintf(err, errlen, "listen %s: the path exists and is not a socket: left alone",
		         listen_on);
		return false;
	}
	probe = socket(AF_UNIX, SOCK_STREAM, 0);
	if (probe < 0) {
		snprintf(err, errlen, "listen %s: %s", listen_on, strerror(errno));
		return false;
	}
	if (connect(probe, (const struct sockaddr *)un, sizeof(*un)) == 0) {
		close(probe);
		snprintf(err, errlen, "listen %s: something is serving on this socket already "
		         "(another outbox-console?): left alone", listen_on);
		return false;
	}
	close(probe);
	if (errno != ECONNREFUSED) {
		snprintf(err, errlen, "listen %s: cannot tell whether the socket is in use: %s",
		         listen_on, strerror(errno));
		return false;
	}
	if (unlink(un->sun_path) != 0) {
		snprintf(err, errlen, "listen %s: the stale socket cannot be removed: %s", listen_on,
		         strerror(errno));
		return false;
	}
	fprintf(stderr, "outbox-console: %s: removed a stale socket nobody answered on\n",
	        un->sun_path);
	return true;
}

/* listen: HOST:PORT (IPv4 or [IPv6]:PORT) or unix:/PATH; a bound socket. */
static int listen_socket(const char *listen_on, char *err, size_t errlen)
{
	int fd, one = 1;

	if (strncmp(listen_on, "unix:", 5) == 0) {
		struct sockaddr_un un = { .sun_family = AF_UNIX };
		if (strlen(listen_on + 5) >= sizeof(un.sun_path)) {
			snprintf(err, errlen, "listen: the socket path is too long");
			return -1;
		}
		snprintf(un.sun_path, sizeof(un.sun_path), "%s", listen_on + 5);
		if (!stale_socket_removed(&un, listen_on, err, errlen))
			return -1;
		fd = socket(AF_UNIX, SOCK_STREAM, 0);
		if (fd >= 0) {
			/* Made owner and group read-write only (the proxy reaches it
			 * through the group), never for a moment world-writable. */
			mode_t old = umask(0117);
			int rc = bind(fd, (struct sockaddr *)&un, sizeof(un));
			int saved = errno;
			umask(old);
			errno = saved;
			if (rc != 0) {
				close(fd);
				fd = -1;
			}
		}
		if (fd < 0) {
			snprintf(err, errlen, "listen %s: %s", listen_on, strerror(errno));
			return -1;
		}
	} else {
		char host[256];
		const char *colon = strrchr(listen_on, ':');
		struct sockaddr_storage ss;
		socklen_t len;
		long port;
		char *end;

		memset(&ss, 0, sizeof(ss));
		if (colon == NULL || (size_t)(colon - listen_on) >= sizeof(host)) {
			snprintf(err, errlen, "listen '%s': expected HOST:PORT or unix:/PATH", listen_on);
			return -1;
		}
		port = strtol(colon + 1, &end, 10);
		if (*end || port < 0 || port > 65535) {
			snprintf(err, errlen, "listen '%s': bad port", listen_on);
			return -1;
		}
		snprintf(host, sizeof(host), "%.*s", (int)(colon - listen_on), listen_on);
		if (host[0] == '[' && host[strlen(host) - 1] == ']') {
			struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
			host[strlen(host) - 1] = '\0';
			s6->sin6_family = AF_INET6;
			s6->sin6_port = htons((uint16_t)port);
			if (inet_pton(AF_INET6, host + 1, &s6->sin6_addr) != 1)
				goto bad_host;
			len = sizeof(*s6);
		} else {
			struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
			s4->sin_family = AF_INET;
			s4->sin_port = htons((uint16_t)port);
			if (inet_pton(AF_INET, host, &s4->sin_addr) != 1)
				goto bad_host;
			len = sizeof(*s4);
		}
		fd = socket(ss.ss_family, SOCK_STREAM, 0);
		if (fd >= 0)
			setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (fd < 0 || bind(fd, (struct sockaddr *)&ss, len) != 0) {
			snprintf(err, errlen, "listen %s: %s", listen_on, strerror(errno));
			if (fd >= 0)
				close(fd);
			return -1;
		}
	}
	if (listen(fd, 64) != 0) {
		snprintf(err, errlen, "listen %s: %s", listen_on, strerror(errno));
		close(fd);
		return -1;
	}
	return fd;
bad_host:
	snprintf(err, errlen, "listen '%s': the host must be an IP address", listen_on);
	return -1;
}

static void usage(FILE *out)
{
	fprintf(out,
	        "usage: outbox-console --config FILE\n"
	        "The operator's web console: the queue, the unknown effects with their evidence,\n"
	        "the approvals waiting, the kill switch and its scopes (docs/console.md).\n"
	        "Reads [database] and [console] of FILE; serves on [console] listen (default\n"
	        "127.0.0.1:8470). Read-only unless [console] actions = on.\n");
}

int main(int argc, char **argv)
{
	const char *path = NULL;
	struct config *cfg;
	struct core_settings core;
	struct MHD_Daemon *d;
	sigset_t stop;
	char err[1024];
	int fd, sig;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
			path = argv[++i];
		} else if (strncmp(argv[i], "--config=", 9) == 0) {
			path = argv[i] + 9;
		} else if (strcmp(argv[i], "--help") == 0) {
			usage(stdout);
			return 0;
		} else if (strcmp(argv[i], "--version") == 0) {
			printf("outbox-console %s\n", OUTBOX_CONSOLE_VERSION);
			return 0;
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (path == NULL) {
		usage(stderr);
		return 2;
	}
	cfg = config_load(path, err, sizeof(err));
	if (cfg == NULL || !config_core(cfg, &core, err, sizeof(err))) {
		fprintf(stderr, "outbox-console: %s\n", err);
		config_free(cfg);
		return 2;
	}
	console.conninfo = config_value(cfg, "console", core_keys_console, "conninfo");
	if (!console.conninfo[0])
		console.conninfo = core.conninfo;
	console.listen = config_value(cfg, "console", core_keys_console, "listen");
	console.actions = config_bool(cfg, "console", core_keys_console, "actions");
	console.trusted_proxy = config_value(cfg, "console", core_keys_console, "trusted_proxy");
	console.identity_header = config_value(cfg, "console", core_keys_console, "identity_header");
	console.origin = config_value(cfg, "console", core_keys_console, "origin");
	console.refresh_seconds = config_int(cfg, "console", core_keys_console, "refresh_seconds");
	console.max_connections = config_int(cfg, "console", core_keys_console, "max_connections");
	console.approvals_url = config_value(cfg, "console", core_keys_console, "approvals_url");
	random_bytes(csrf_key, sizeof(csrf_key));

	/* SIGTERM and SIGINT are waited for here, never delivered to the
	 * server's thread (which inherits this mask). */
	sigemptyset(&stop);
	sigaddset(&stop, SIGTERM);
	sigaddset(&stop, SIGINT);
	pthread_sigmask(SIG_BLOCK, &stop, NULL);
	signal(SIGPIPE, SIG_IGN);
	fd = listen_socket(console.listen, err, sizeof(err));
	if (fd < 0) {
		fprintf(stderr, "outbox-console: %s\n", err);
		config_free(cfg);
		return 1;
	}
	d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL,
	                     &on_request, NULL, MHD_OPTION_LISTEN_SOCKET, fd,
	                     MHD_OPTION_CONNECTION_LIMIT, (unsigned)console.max_connections,
	                     MHD_OPTION_CONNECTION_TIMEOUT, 30u,
	                     MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(256 * 1024),
	                     MHD_OPTION_NOTIFY_COMPLETED, &on_done, NULL, MHD_OPTION_END);
	if (d == NULL) {
		fprintf(stderr, "outbox-console: the HTTP server did not start\n");
		close(fd);
		config_free(cfg);
		return 1;
	}
	fprintf(stderr, "outbox-console: serving on %s (%s)\n", console.listen,
	        console.actions ? "actions on" : "read-only");
	sigwait(&stop, &sig);
	MHD_stop_daemon(d);
	close(fd);
	/* A clean stop leaves no socket behind. */
	if (strncmp(console.listen, "unix:", 5) == 0)
		unlink(console.listen + 5);
	if (viewer)
		PQfinish(viewer);
	config_free(cfg);
	return 0;
}

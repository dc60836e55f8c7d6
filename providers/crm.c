/*
 * crm.c: the `crm` provider: Salesforce REST upsert by External ID, and
 * reconciliation by looking the external id up (docs/crm.md).
 *
 *   target   "Object/ExternalIdField", e.g. "Task/Outbox_Key__c"
 *   payload  a JSON object of the fields to upsert (scalars or null)
 *
 *   send       PATCH {instance_url}/services/data/{api_version}/sobjects/
 *                    {Object}/{ExternalIdField}/{effect key}
 *   reconcile  GET   the same path ?fields=Id
 *
 * The effect key is the record's external id, so an upsert repeated after
 * an ambiguous outcome updates the record the first call created: this
 * provider honours keys.  Every transfer runs on the worker's loop through
 * curl_loop; a call's state lives in one struct crm_call until its done
 * callback has returned.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "lib/curl_io.h"
#include "lib/curl_loop.h"
#include "lib/json_text.h"
#include "provider.h"

#define CRM_NAME          "crm"
#define CRM_NAME_MAX      80        /* Salesforce API names are at most 80 */
#define CRM_RESP_MAX      (1 << 20) /* response bytes kept; the rest is dropped */
#define CRM_INSTANCE_URL_MAX 1024
/* instance URL + "/services/data/vNN.N/sobjects/" + 2 names + key + query */
#define CRM_URL_MAX       (CRM_INSTANCE_URL_MAX + 64 + 2 * CRM_NAME_MAX + 2 + 255 + 16)

static const struct outbox_conf_key crm_keys[] = {
	{ "instance_url", CONF_STR, "", 0, 0,
	  "https://NAME.my.salesforce.com (http only for a loopback test server)" },
	{ "api_version", CONF_STR, "v59.0", 0, 0, "REST API version, vNN.N" },
	{ "access_token", CONF_SECRET, "", 0, 0,
	  "OAuth access token: file:/path or env:NAME; sent as a Bearer token, never logged" },
	{ "ca_file", CONF_STR, "", 0, 0, "PEM bundle to verify the server with; empty: the system's" },
	{ "auth_retry_ms", CONF_INT, "60000", 0, 86400000,
	  "401 (token rejected): retry after this long instead of failing the effect" },
	{ NULL, CONF_STR, NULL, 0, 0, NULL },
};

struct crm {
	const struct outbox_host *host;
	const struct outbox_conf *conf;
	struct curl_loop *loop;
	char *sobjects_url;        /* {instance_url}/services/data/{v}/sobjects/ */
	char *ca_file;             /* NULL: libcurl's default bundle */
	const char *protocols;     /* "https", or "http" for a loopback server */
	char host_key[300];
	bool auth_failing;         /* last answer was 401: log the change once */
};

enum crm_call_kind {
	CALL_UPSERT,
	CALL_UPSERT_LOOKUP,        /* GET after an upsert that returned no id */
	CALL_RECONCILE,
};

struct crm_call {
	struct crm *crm;
	enum crm_call_kind kind;
	outbox_done_fn done;
	outbox_recon_fn recon_done;
	void *token;
	char *record_url;          /* .../sobjects/Object/Field/key */
	char *body;                /* the upsert's JSON; NULL for GETs */
	struct curl_slist *headers;
	struct curl_body resp;     /* the first CRM_RESP_MAX bytes: a size never fails a call */
	long retry_after_ms;       /* -1: no Retry-After on the last response */
	int upsert_status;         /* CALL_UPSERT_LOOKUP: what the PATCH answered */
	char local_ref[OUTBOX_PROVIDER_ID_MAX];
	char errbuf[CURL_ERROR_SIZE];
};

/* ---------------------------------------------------------------------- */
/* small helpers                                                          */

static void fmt(char *dst, size_t len, const char *f, ...) __attribute__((format(printf, 3, 4)));
static void fmt(char *dst, size_t len, const char *f, ...)
{
	va_list ap;

	if (len == 0)
		return;
	va_start(ap, f);
	vsnprintf(dst, len, f, ap);
	va_end(ap);
}

static char *crm_strdup(const char *s)
{
	size_t n = strlen(s) + 1;
	char *p = malloc(n);

	if (p)
		memcpy(p, s, n);
	return p;
}

/* A Salesforce API name: a letter, then letters, digits and underscores. */
static bool api_name_ok(const char *s, size_t n)
{
	if (n == 0 || n > CRM_NAME_MAX || !isalpha((unsigned char)s[0]))
		return false;
	for (size_t i = 1; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '_')
			return false;
	return true;
}

/* Copy text that goes into logs and the database: printable ASCII only,
 * so a hostile response cannot forge log lines. */
static void copy_printable(char *dst, size_t len, const char *src, size_t n)
{
	size_t o = 0;

	if (len == 0)
		return;
	for (size_t i = 0; i < n && o + 1 < len; i++) {
		unsigned char c = (unsigned char)src[i];
		dst[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : (c == '\n' || c == '\t' ? ' ' : '?');
	}
	dst[o] = '\0';
}

/* A record id as Salesforce writes them: 15 or 18 alphanumerics.  Anything
 * else is still accepted as an id if it is short and printable. */
static bool id_ok(const char *s)
{
	size_t n = s ? strlen(s) : 0;

	if (n == 0 || n >= OUTBOX_PROVIDER_ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
			return false;
	return true;
}

/* Plain http is for a local test server only: "localhost", 127.0.0.0/8
 * written as an address, or [::1].  ("127.example.com" is a name, not a
 * loopback address.) */
static bool is_loopback_host(const char *h)
{
	struct in_addr a4;

	if (strcmp(h, "localhost") == 0 || strcmp(h, "[::1]") == 0 || strcmp(h, "::1") == 0)
		return true;
	return inet_pton(AF_INET, h, &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127;
}

/* ---------------------------------------------------------------------- */
/* init / shutdown                                                        */

/* "v59.0": a v, digits and at least one inner dot, 4 to 8 characters. */
static bool api_version_ok(const char *v)
{
	size_t n = strlen(v);

	return n >= 4 && n <= 8 && v[0] == 'v' && isdigit((unsigned char)v[1]) &&
	       strspn(v + 1, "0123456789.") == n - 1 && strchr(v, '.') != NULL && v[n - 1] != '.';
}

/* c->sobjects_url: {instance_url}/services/data/{api_version}/sobjects/,
 * from the parsed URL without its trailing slashes. */
static bool set_sobjects_url(struct crm *c, CURLU *u, const char *api_version, char *err,
                             size_t errlen)
{
	char *base = NULL;
	size_t n;

	if (curl_url_get(u, CURLUPART_URL, &base, 0) != CURLUE_OK) {
		fmt(err, errlen, "%s: cannot rebuild the URL", c->host->conf_where(c->conf, "instance_url"));
		return false;
	}
	n = strlen(base);
	while (n > 0 && base[n - 1] == '/')
		base[--n] = '\0';
	c->sobjects_url = malloc(n + strlen(api_version) + 32);
	if (c->sobjects_url == NULL) {
		fmt(err, errlen, "out of memory");
		curl_free(base);
		return false;
	}
	sprintf(c->sobjects_url, "%s/services/data/%s/sobjects/", base, api_version);
	curl_free(base);
	return true;
}

static bool parse_instance_url(struct crm *c, const char *url, const char *api_version,
                               char *err, size_t errlen)
{
	const struct outbox_host *h = c->host;
	CURLU *u = curl_url();
	char *scheme = NULL, *hostname = NULL, *port = NULL, *path = NULL, *query = NULL,
	     *frag = NULL, *user = NULL;
	bool ok = false;

	if (u == NULL) {
		fmt(err, errlen, "out of memory");
		return false;
	}
	if (strlen(url) > CRM_INSTANCE_URL_MAX) {
		fmt(err, errlen, "%s: longer than %d characters", h->conf_where(c->conf, "instance_url"),
		    CRM_INSTANCE_URL_MAX);
		goto out;
	}
	if (url[0] == '\0') {
		fmt(err, errlen, "%s: required: the org's URL, e.g. https://example.my.salesforce.com",
		    h->conf_where(c->conf, "instance_url"));
		goto out;
	}
	if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_HOST, &hostname, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK) {
		fmt(err, errlen, "%s: not a URL: \"%.200s\"", h->conf_where(c->conf, "instance_url"), url);
		goto out;
	}
	curl_url_get(u, CURLUPART_PATH, &path, 0);
	curl_url_get(u, CURLUPART_QUERY, &query, 0);
	curl_url_get(u, CURLUPART_FRAGMENT, &frag, 0);
	curl_url_get(u, CURLUPART_USER, &user, 0);
	if (strcmp(scheme, "https") == 0) {
		c->protocols = "https";
	} else if (strcmp(scheme, "http") == 0 && is_loopback_host(hostname)) {
		c->protocols = "http";
	} else {
		fmt(err, errlen, "%s: must be https:// (plain http only for a loopback test server), got \"%.200s\"",
		    h->conf_where(c->conf, "instance_url"), url);
		goto out;
	}
	if ((path && strcmp(path, "/") != 0 && path[0] != '\0') || query || frag || user) {
		fmt(err, errlen, "%s: give only scheme, host and port (no path, query or user), got \"%.200s\"",
		    h->conf_where(c->conf, "instance_url"), url);
		goto out;
	}
	if (!api_version_ok(api_version)) {
		fmt(err, errlen, "%s: must look like v59.0, got \"%.32s\"",
		    h->conf_where(c->conf, "api_version"), api_version);
		goto out;
	}
	if (!set_sobjects_url(c, u, api_version, err, errlen))
		goto out;
	fmt(c->host_key, sizeof(c->host_key), "%s:%s", hostname, port);
	ok = true;
out:
	curl_free(scheme);
	curl_free(hostname);
	curl_free(port);
	curl_free(path);
	curl_free(query);
	curl_free(frag);
	curl_free(user);
	curl_url_cleanup(u);
	return ok;
}

/* The token goes into a header line: no control characters, no spaces. */
static bool token_ok(const char *t)
{
	if (t[0] == '\0')
		return false;
	for (; *t; t++)
		if ((unsigned char)*t <= 0x20 || (unsigned char)*t == 0x7f)
			return false;
	return true;
}

static void crm_shutdown(void *self);

static void *crm_init(const struct outbox_host *host, const struct outbox_conf *conf, char *err,
                      size_t errlen)
{
	struct crm *c = calloc(1, sizeof(*c));
	const char *ca;

	if (c == NULL) {
		fmt(err, errlen, "out of memory");
		return NULL;
	}
	c->host = host;
	c->conf = conf;
	if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
		fmt(err, errlen, "libcurl failed to initialise");
		free(c);
		return NULL;
	}
	if (!parse_instance_url(c, host->conf_str(conf, "instance_url"),
	                        host->conf_str(conf, "api_version"), err, errlen))
		goto fail;
	if (!token_ok(host->conf_str(conf, "access_token"))) {
		fmt(err, errlen, "%s: required, one line without spaces (file:/path or env:NAME)",
		    host->conf_where(conf, "access_token"));
		goto fail;
	}
	ca = host->conf_str(conf, "ca_file");
	if (ca[0]) {
		if (access(ca, R_OK) != 0) {
			fmt(err, errlen, "%s: cannot read %s: %s", host->conf_where(conf, "ca_file"), ca,
			    strerror(errno));
			goto fail;
		}
		c->ca_file = crm_strdup(ca);
		if (c->ca_file == NULL) {
			fmt(err, errlen, "out of memory");
			goto fail;
		}
	}
	c->loop = curl_loop_new(host->base);
	if (c->loop == NULL) {
		fmt(err, errlen, "cannot set up libcurl on the event loop");
		goto fail;
	}
	host->log(OLOG_INFO, CRM_NAME, "Salesforce upsert by external id at %s (TLS verification %s)",
	          c->sobjects_url, strcmp(c->protocols, "https") == 0 ? "on" : "n/a: loopback http");
	return c;
fail:
	crm_shutdown(c);
	return NULL;
}

static void call_free(struct crm_call *k)
{
	if (k == NULL)
		return;
	/* The Authorization line holds the token: wipe it before freeing. */
	for (struct curl_slist *s = k->headers; s; s = s->next)
		memset(s->data, 0, strlen(s->data));
	curl_slist_free_all(k->headers);
	free(k->record_url);
	free(k->body);
	curl_body_free(&k->resp);
	free(k);
}

static void release_transfer(CURL *easy, void *arg)
{
	curl_easy_cleanup(easy);
	call_free(arg);
}

static void crm_shutdown(void *self)
{
	struct crm *c = self;

	if (c == NULL)
		return;
	curl_loop_free(c->loop, release_transfer);
	free(c->sobjects_url);
	free(c->ca_file);
	free(c);
	curl_global_cleanup();
}

/* ---------------------------------------------------------------------- */
/* validate                                                               */

/* Split "Object/Field" into its two API names. */
static bool parse_target(const char *target, size_t *obj_len, const char **field, char *err,
                         size_t errlen)
{
	const char *slash = strchr(target, '/');

	if (slash == NULL || strchr(slash + 1, '/') != NULL) {
		fmt(err, errlen, "crm target \"%.100s\" must be Object/ExternalIdField, e.g. Task/Outbox_Key__c",
		    target);
		return false;
	}
	if (!api_name_ok(target, (size_t)(slash - target))) {
		fmt(err, errlen, "crm target \"%.100s\": \"%.*s\" is not an object API name (letters, "
		    "digits, underscores, starting with a letter)", target,
		    (int)(slash - target > 80 ? 80 : slash - target), target);
		return false;
	}
	if (!api_name_ok(slash + 1, strlen(slash + 1))) {
		fmt(err, errlen, "crm target \"%.100s\": \"%.80s\" is not a field API name (letters, "
		    "digits, underscores, starting with a letter)", target, slash + 1);
		return false;
	}
	*obj_len = (size_t)(slash - target);
	*field = slash + 1;
	return true;
}

static bool check_payload(const json_t *payload, const char *field, char *err, size_t errlen)
{
	const char *k;
	json_t *v;

	if (!json_is_object(payload)) {
		fmt(err, errlen, "crm payload must be a JSON object of fields to upsert");
		return false;
	}
	json_object_foreach((json_t *)payload, k, v) {
		if (!api_name_ok(k, strlen(k))) {
			fmt(err, errlen, "crm payload: \"%.80s\" is not a field API name", k);
			return false;
		}
		if (strcasecmp(k, "Id") == 0) {
			fmt(err, errlen, "crm payload must not set \"Id\": the record is found by its external id");
			return false;
		}
		if (strcasecmp(k, field) == 0) {
			fmt(err, errlen, "crm payload must not set the external id field \"%s\": its value is "
			    "the effect's key", field);
			return false;
		}
		if (json_is_object(v) || json_is_array(v)) {
			fmt(err, errlen, "crm payload: field \"%s\" must be a string, number, boolean or null", k);
			return false;
		}
	}
	return true;
}

static bool key_ok(const char *key)
{
	size_t n = key ? strlen(key) : 0;

	if (n == 0 || n > 255)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)key[i]) && key[i] != '-' && key[i] != '_')
			return false;
	return true;
}

static bool crm_validate(void *self, const struct outbox_effect *e, char *host_key,
                         size_t host_keylen, char *err, size_t errlen)
{
	struct crm *c = self;
	const char *field;
	size_t obj_len;

	if (!parse_target(e->target, &obj_len, &field, err, errlen))
		return false;
	if (!check_payload(e->payload, field, err, errlen))
		return false;
	if (!key_ok(e->effect_key)) {
		fmt(err, errlen, "crm: effect key is not a usable external id");
		return false;
	}
	fmt(host_key, host_keylen, "%s", c->host_key);
	return true;
}

/* ---------------------------------------------------------------------- */
/* transfers                                                              */

/* Retry-After: delta-seconds or an HTTP-date.  Only the last response's
 * headers count (a status line starts a new response). */
static size_t on_header(char *data, size_t size, size_t nmemb, void *arg)
{
	struct crm_call *k = arg;
	size_t n = size * nmemb;
	char line[256];

	if (n >= 5 && strncmp(data, "HTTP/", 5) == 0) {
		k->retry_after_ms = -1;
		return n;
	}
	if (n < 12 || strncasecmp(data, "Retry-After:", 12) != 0)
		return n;
	{
		size_t m = n - 12;
		char *v = line, *end;
		long secs;

		while (m > 0 && (data[12 + m - 1] == '\r' || data[12 + m - 1] == '\n' ||
		                 data[12 + m - 1] == ' '))
			m--;
		copy_printable(line, sizeof(line), data + 12, m);
		while (*v == ' ')
			v++;
		errno = 0;
		secs = strtol(v, &end, 10);
		if (end != v && *end == '\0' && errno == 0 && secs >= 0) {
			k->retry_after_ms = secs > 86400L * 7 ? 86400L * 7 * 1000 : secs * 1000;
		} else {
			time_t when = curl_getdate(v, NULL);
			if (when != (time_t)-1) {
				time_t now = time(NULL), secs_left = when > now ? when - now : 0;
				if (secs_left > 86400L * 7)
					secs_left = 86400L * 7;
				k->retry_after_ms = (long)secs_left * 1000;
			}
		}
	}
	return n;
}

static CURL *make_easy(struct crm_call *k, const char *url, bool patch, const char *token,
                       char *err, size_t errlen)
{
	struct crm *c = k->crm;
	CURL *easy = curl_easy_init();
	char auth[4200];
	struct curl_slist *h = NULL;

	if (easy == NULL) {
		fmt(err, errlen, "crm: cannot create a transfer");
		return NULL;
	}
	if (k->headers == NULL) {
		if (strlen(token) > sizeof(auth) - 32) {
			fmt(err, errlen, "crm: access_token is too long");
			curl_easy_cleanup(easy);
			return NULL;
		}
		fmt(auth, sizeof(auth), "Authorization: Bearer %s", token);
		h = curl_slist_append(NULL, auth);
		memset(auth, 0, sizeof(auth));
		if (h)
			h = curl_slist_append(h, "Accept: application/json");
		if (h)
			h = curl_slist_append(h, "Content-Type: application/json");
		if (h)
			h = curl_slist_append(h, "Expect:");
		if (h == NULL) {
			fmt(err, errlen, "crm: out of memory");
			curl_easy_cleanup(easy);
			return NULL;
		}
		k->headers = h;
	}
	k->errbuf[0] = '\0';
	k->retry_after_ms = -1;
	curl_body_free(&k->resp);
	k->resp.max = CRM_RESP_MAX;
	curl_easy_setopt(easy, CURLOPT_URL, url);
	curl_loop_safe_options(easy, c->protocols, c->ca_file);
	curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
	/* One connection per call: on a reused connection that dies before the
	 * answer, libcurl silently sends the request again, and the attempts
	 * log would no longer be one row per call. */
	curl_easy_setopt(easy, CURLOPT_FORBID_REUSE, 1L);
	curl_easy_setopt(easy, CURLOPT_FRESH_CONNECT, 1L);
	curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, c->host->conf_int(c->conf, "timeout_ms"));
	curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS,
	                 c->host->conf_int(c->conf, "connect_timeout_ms"));
	curl_easy_setopt(easy, CURLOPT_USERAGENT, "outbox-dispatcher-crm/1");
	curl_easy_setopt(easy, CURLOPT_HTTPHEADER, k->headers);
	/* The instance URL is the operator's own: no per-address SSRF check. */
	curl_io_attach(easy, NULL, &k->resp, on_header, k);
	curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, k->errbuf);
	if (patch) {
		curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, "PATCH");
		curl_easy_setopt(easy, CURLOPT_POSTFIELDS, k->body);
		curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, (long)strlen(k->body));
	} else {
		curl_easy_setopt(easy, CURLOPT_HTTPGET, 1L);
	}
	return easy;
}

static void on_done(CURL *easy, CURLcode rc, void *arg);

static bool start(struct crm_call *k, bool patch, char *err, size_t errlen)
{
	struct crm *c = k->crm;
	char url[CRM_URL_MAX];
	CURL *easy;

	fmt(url, sizeof(url), "%s%s", k->record_url, patch ? "" : "?fields=Id");
	easy = make_easy(k, url, patch, c->host->conf_str(c->conf, "access_token"), err, errlen);
	if (easy == NULL)
		return false;
	if (!curl_loop_add(c->loop, easy, on_done, k)) {
		fmt(err, errlen, "crm: libcurl refused the transfer");
		curl_easy_cleanup(easy);
		return false;
	}
	return true;
}

static struct crm_call *new_call(struct crm *c, const struct outbox_effect *e,
                                 enum crm_call_kind kind, char *err, size_t errlen)
{
	struct crm_call *k;
	const char *field;
	size_t obj_len;

	if (!parse_target(e->target, &obj_len, &field, err, errlen))
		return NULL;
	if (!key_ok(e->effect_key)) {
		fmt(err, errlen, "crm: effect key is not a usable external id");
		return NULL;
	}
	if (!token_ok(c->host->conf_str(c->conf, "access_token"))) {
		fmt(err, errlen, "crm: access_token is empty or not one line");
		return NULL;
	}
	k = calloc(1, sizeof(*k));
	if (k == NULL) {
		fmt(err, errlen, "crm: out of memory");
		return NULL;
	}
	k->crm = c;
	k->kind = kind;
	k->retry_after_ms = -1;
	k->record_url = malloc(strlen(c->sobjects_url) + strlen(e->target) + strlen(e->effect_key) + 2);
	if (k->record_url == NULL) {
		fmt(err, errlen, "crm: out of memory");
		free(k);
		return NULL;
	}
	/* Object/Field are API names and the key is [A-Za-z0-9_-]: nothing to
	 * escape. */
	sprintf(k->record_url, "%s%s/%s", c->sobjects_url, e->target, e->effect_key);
	fmt(k->local_ref, sizeof(k->local_ref), "sf:%.*s/%s/%s", (int)obj_len, e->target, field,
	    e->effect_key);
	return k;
}

static bool crm_send(void *self, const struct outbox_effect *e, outbox_done_fn done, void *token,
                     char *err, size_t errlen)
{
	struct crm *c = self;
	struct crm_call *k;
	const char *field;
	size_t obj_len;

	if (!parse_target(e->target, &obj_len, &field, err, errlen) ||
	    !check_payload(e->payload, field, err, errlen))
		return false;
	k = new_call(c, e, CALL_UPSERT, err, errlen);
	if (k == NULL)
		return false;
	k->done = done;
	k->token = token;
	/* The fields as the producer wrote them (19.99 stays 19.99: json_text.h);
	 * jansson re-encodes only a payload handed over without its text. */
	if (e->payload_text && e->payload_len > 0)
		k->body = json_text_compact(e->payload_text, e->payload_len, NULL);
	else
		k->body = json_dumps(e->payload, JSON_COMPACT);
	if (k->body == NULL) {
		fmt(err, errlen, "crm: cannot encode the payload");
		call_free(k);
		return false;
	}
	if (!start(k, true, err, errlen)) {
		call_free(k);
		return false;
	}
	return true;
}

static bool crm_reconcile(void *self, const struct outbox_effect *e, outbox_recon_fn done,
                          void *token, char *err, size_t errlen)
{
	struct crm *c = self;
	struct crm_call *k = new_call(c, e, CALL_RECONCILE, err, errlen);

	if (k == NULL)
		return false;
	k->recon_done = done;
	k->token = token;
	if (!start(k, false, err, errlen)) {
		call_free(k);
		return false;
	}
	return true;
}

/* ---------------------------------------------------------------------- */
/* answers                                                                */

/* "ERROR_CODE: message" from Salesforce's [{"errorCode","message"}] error
 * array (or the body's start when it is something else). */
static void sf_error_text(const struct crm_call *k, long status, char *dst, size_t len)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	json_t *first = json_is_array(j) ? json_array_get(j, 0) : j;
	const char *code = json_string_value(json_object_get(first, "errorCode"));
	const char *msg = json_string_value(json_object_get(first, "message"));
	char body[200];

	if (code || msg) {
		char tmp[OUTBOX_ERROR_MAX];
		fmt(tmp, sizeof(tmp), "HTTP %ld %s: %s", status, code ? code : "ERROR", msg ? msg : "");
		copy_printable(dst, len, tmp, strlen(tmp));
	} else if (k->resp.len) {
		copy_printable(body, sizeof(body), k->resp.data, k->resp.len);
		fmt(dst, len, "HTTP %ld: %s", status, body);
	} else {
		fmt(dst, len, "HTTP %ld", status);
	}
	json_decref(j);
}

static bool sf_error_code_is(const struct crm_call *k, const char *code)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	json_t *first = json_is_array(j) ? json_array_get(j, 0) : j;
	const char *c = json_string_value(json_object_get(first, "errorCode"));
	bool is = c && strcmp(c, code) == 0;

	json_decref(j);
	return is;
}

/* The record id from {"id": ...} (upsert) or {"Id": ...} (lookup). */
static bool body_id(const struct crm_call *k, const char *name, char *dst, size_t len)
{
	json_t *j = k->resp.data ? json_loadb(k->resp.data, k->resp.len, 0, NULL) : NULL;
	const char *id = json_string_value(json_object_get(j, name));
	bool ok = id_ok(id);

	if (ok)
		fmt(dst, len, "%s", id);
	json_decref(j);
	return ok;
}

/* Did any request byte leave the host?  Before the connection (and TLS)
 * was up, nothing did: pretransfer is the moment the request starts. */
static bool request_started(CURL *easy)
{
	curl_off_t pre = 0;
	long sent = 0;

	if (curl_easy_getinfo(easy, CURLINFO_PRETRANSFER_TIME_T, &pre) != CURLE_OK ||
	    curl_easy_getinfo(easy, CURLINFO_REQUEST_SIZE, &sent) != CURLE_OK)
		return true;
	return pre > 0 || sent > 0;
}

static void transport_error(CURL *easy, CURLcode rc, const struct crm_call *k, char *dst, size_t len)
{
	fmt(dst, len, "%s%s%s", curl_easy_strerror(rc), k->errbuf[0] ? ": " : "", k->errbuf);
	dst[strcspn(dst, "\r\n")] = '\0';
	(void)easy;
}

static void finish_upsert(struct crm_call *k, struct outbox_result *r)
{
	k->done(k->token, r);
	call_free(k);
}

static void upsert_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct crm *c = k->crm;
	struct outbox_result r = { .outcome = OUTCOME_TERMINAL, .retry_after_ms = -1 };
	long status = 0;
	char err[OUTBOX_ERROR_MAX];

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	r.status = (int)status;
	if (rc != CURLE_OK) {
		transport_error(easy, rc, k, r.error, sizeof(r.error));
		r.outcome = request_started(easy) ? OUTCOME_AMBIGUOUS : OUTCOME_NOT_SENT;
		r.status = 0;
		curl_easy_cleanup(easy);
		finish_upsert(k, &r);
		return;
	}
	if (status != 401 && c->auth_failing) {
		c->auth_failing = false;
		c->host->log(OLOG_INFO, CRM_NAME, "access token accepted again");
	}
	if (status == 200 || status == 201 || status == 204) {
		r.outcome = OUTCOME_ACCEPTED;
		if (status != 204 && body_id(k, "id", r.provider_id, sizeof(r.provider_id))) {
			curl_easy_cleanup(easy);
			finish_upsert(k, &r);
			return;
		}
		/* 204 (API before v46.0) or a body without an id: the write is
		 * done; one GET gives the record's real Id. */
		curl_easy_cleanup(easy);
		k->kind = CALL_UPSERT_LOOKUP;
		k->upsert_status = (int)status;
		if (start(k, false, err, sizeof(err)))
			return;
		fmt(r.provider_id, sizeof(r.provider_id), "%s", k->local_ref);
		finish_upsert(k, &r);
		return;
	}
	sf_error_text(k, status, r.error, sizeof(r.error));
	if (status == 300) {
		r.outcome = OUTCOME_TERMINAL;
		fmt(r.error, sizeof(r.error), "HTTP 300: several records have this external id; "
		    "Salesforce updated none (make the field unique)");
	} else if (status == 401) {
		/* The token expired or was revoked: nothing was written, and only
		 * an operator can fix it.  Failing every effect until then would
		 * burn them; retry later instead (attempts still count). */
		r.outcome = OUTCOME_RETRY;
		r.retry_after_ms = c->host->conf_int(c->conf, "auth_retry_ms");
		if (!c->auth_failing) {
			c->auth_failing = true;
			c->host->log(OLOG_WARN, CRM_NAME, "Salesforce rejected the access token (%s): set "
			             "[provider.crm] access_token and reload; effects wait and retry",
			             r.error);
		}
	} else if (status == 409 || status == 429 || status == 503 ||
	           (status == 403 && sf_error_code_is(k, "REQUEST_LIMIT_EXCEEDED")) ||
	           (status == 400 && sf_error_code_is(k, "UNABLE_TO_LOCK_ROW"))) {
		r.outcome = OUTCOME_RETRY;
		r.retry_after_ms = k->retry_after_ms;
	} else if (status >= 500) {
		r.outcome = OUTCOME_AMBIGUOUS;
		r.retry_after_ms = k->retry_after_ms;
	} else {
		r.outcome = OUTCOME_TERMINAL;
	}
	curl_easy_cleanup(easy);
	finish_upsert(k, &r);
}

/* The GET after an upsert that gave no id: the upsert's outcome stands
 * (accepted); only the provider id depends on this answer. */
static void upsert_lookup_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct outbox_result r = { .outcome = OUTCOME_ACCEPTED, .retry_after_ms = -1 };
	long status = 0;

	r.status = k->upsert_status;
	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	if (rc != CURLE_OK || status != 200 || !body_id(k, "Id", r.provider_id, sizeof(r.provider_id))) {
		fmt(r.provider_id, sizeof(r.provider_id), "%s", k->local_ref);
		k->crm->host->log(OLOG_INFO, CRM_NAME, "upsert accepted (HTTP %d) but the Id lookup "
		                  "answered %ld: provider id is the local reference", r.status,
		                  rc == CURLE_OK ? status : 0L);
	}
	curl_easy_cleanup(easy);
	finish_upsert(k, &r);
}

static void reconcile_answer(CURL *easy, CURLcode rc, struct crm_call *k)
{
	struct outbox_recon_result r = { .verdict = RECON_CANNOT_TELL };
	long status = 0;

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	if (rc != CURLE_OK) {
		transport_error(easy, rc, k, r.error, sizeof(r.error));
	} else {
		r.status = (int)status;
		if (status == 200) {
			if (body_id(k, "Id", r.provider_id, sizeof(r.provider_id)))
				r.verdict = RECON_SENT;
			else
				fmt(r.error, sizeof(r.error), "HTTP 200 without a record Id");
		} else if (status == 404 && sf_error_code_is(k, "NOT_FOUND")) {
			r.verdict = RECON_NOT_SENT;
			sf_error_text(k, status, r.error, sizeof(r.error));
		} else if (status == 300) {
			fmt(r.error, sizeof(r.error), "HTTP 300: several records have this external id");
		} else {
			sf_error_text(k, status, r.error, sizeof(r.error));
		}
	}
	curl_easy_cleanup(easy);
	k->recon_done(k->token, &r);
	call_free(k);
}

static void on_done(CURL *easy, CURLcode rc, void *arg)
{
	struct crm_call *k = arg;

	switch (k->kind) {
	case CALL_UPSERT:
		upsert_answer(easy, rc, k);
		return;
	case CALL_UPSERT_LOOKUP:
		upsert_lookup_answer(easy, rc, k);
		return;
	case CALL_RECONCILE:
		reconcile_answer(easy, rc, k);
		return;
	}
	abort();
}

/* ---------------------------------------------------------------------- */

static const struct outbox_provider crm_provider = {
	.abi = OUTBOX_PROVIDER_ABI,
	.name = CRM_NAME,
	.caps = OUTBOX_CAP_HONOURS_KEYS | OUTBOX_CAP_RECONCILE,
	.keys = crm_keys,
	.init = crm_init,
	.validate = crm_validate,
	.send = crm_send,
	.reconcile = crm_reconcile,
	.shutdown = crm_shutdown,
};

const struct outbox_provider *outbox_provider_entry(void)
{
	return &crm_provider;
}

/* SPDX-License-Identifier: ISC */
/*
 * http_lookup.c: the http provider's optional reconciliation of `unknown`
 * effects (see http_lookup.h, docs/http.md "Asking the provider").
 *
 * For an effect whose target matches reconcile_targets, one request to
 * reconcile_url (with {key} = the effect key the send carried as
 * Idempotency-Key, {effect_id}, {origin} = the target's scheme://host:port)
 * and its answer mapped, never guessed:
 *
 *   a found status and a provider id at reconcile_id_header or the JSON
 *   pointer reconcile_id_json           -> sent (completed, that id)
 *   a not-found status, and the last attempt started at least
 *   reconcile_min_age_seconds ago       -> not sent (pending, same key)
 *   anything else (another status, a found status without an id, a
 *   timeout, a connection error, a not-found that is too young)
 *                                       -> cannot tell (stays unknown)
 *
 * The lookup goes through the same SSRF rules, TLS verification, CA file
 * and proxy as the sends, on its own libcurl multi handle, never follows
 * redirects and never sends a body.
 */
#include "http_lookup.h"

#include <ctype.h>
#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "curl_io.h"
#include "curl_loop.h"
#include "netrules.h"
#include "text.h"
#include "url.h"

#define LOOKUP_MAX_TARGETS 32
#define LOOKUP_MAX_STATUSES 16
#define LOOKUP_MAX_RESPONSE 65536

struct http_lookup {
	const struct outbox_host *host;
	const struct netrules *rules;
	struct curl_loop *loop;
	char *url_template, *method, *id_pointer, *id_header, *extra_header;
	const char *ca_file, *proxy, *user_agent;
	struct url_prefix targets[LOOKUP_MAX_TARGETS];
	int n_targets;
	long found[LOOKUP_MAX_STATUSES], not_found[LOOKUP_MAX_STATUSES];
	int n_found, n_not_found;
	long min_age_ms, timeout_ms;
};

struct lookup_call {
	struct http_lookup *lk;
	outbox_recon_fn done;
	void *token;
	char *url;
	struct curl_slist *headers;
	struct curl_body resp;
	char *hdr_id;
	long long age_ms;
	struct curl_guard guard;   /* the SSRF rules at connect time */
};

/* ---- configuration ------------------------------------------------------ */

static bool parse_statuses(const char *text, long *out, int *n, char *err, size_t errlen,
                           const char *where)
{
	const char *p = text;

	*n = 0;
	while (*p) {
		char *end;
		long v;

		while (*p == ',' || *p == ' ')
			p++;
		if (*p == '\0')
			break;
		v = strtol(p, &end, 10);
		if (end == p || v < 100 || v > 599 || *n >= LOOKUP_MAX_STATUSES) {
			snprintf(err, errlen, "%s: a comma-separated list of HTTP statuses (100-599) expected",
			         where);
			return false;
		}
		out[(*n)++] = v;
		p = end;
	}
	if (*n == 0) {
		snprintf(err, errlen, "%s: at least one status is needed", where);
		return false;
	}
	return true;
}

static bool status_in(long s, const long *list, int n)
{
	for (int i = 0; i < n; i++)
		if (list[i] == s)
			return true;
	return false;
}

/* reconcile_targets: URL prefixes or host names (url.h says what each
 * covers), parsed once; a target is matched on its parsed parts. */
static bool parse_targets(struct http_lookup *lk, const char *text, char *err, size_t errlen,
                          const char *where)
{
	const char *p = text;

	while (*p) {
		char entry[1024], why[256];
		size_t len;

		while (*p == ',' || *p == ' ')
			p++;
		len = strcspn(p, ", ");
		if (len == 0)
			break;
		if (lk->n_targets >= LOOKUP_MAX_TARGETS) {
			snprintf(err, errlen, "%s: at most %d targets", where, LOOKUP_MAX_TARGETS);
			return false;
		}
		if (len >= sizeof(entry)) {
			snprintf(err, errlen, "%s: an entry is longer than %zu bytes", where,
			         sizeof(entry) - 1);
			return false;
		}
		memcpy(entry, p, len);
		entry[len] = '\0';
		if (!url_prefix_parse(entry, &lk->targets[lk->n_targets], why, sizeof(why))) {
			snprintf(err, errlen, "%s: %s", where, why);
			return false;
		}
		lk->n_targets++;
		p += len;
	}
	if (lk->n_targets == 0) {
		snprintf(err, errlen, "%s: set it to the URL prefixes or host names the lookup answers for",
		         where);
		return false;
	}
	return true;
}

/* The three texts checked before anything is allocated: the URL
 * template, the method and the extra header. */
static bool check_texts(const struct outbox_host *host, const struct outbox_conf *conf,
                        const char *tpl, const char *method, const char *hdr, char *err,
                        size_t errlen)
{
	if (strncmp(tpl, "http://", 7) != 0 && strncmp(tpl, "https://", 8) != 0 &&
	    strncmp(tpl, "{origin}", 8) != 0) {
		snprintf(err, errlen, "%s: must start with http://, https:// or {origin}",
		         host->conf_where(conf, "reconcile_url"));
		return false;
	}
	for (const char *c = tpl; *c; c++)
		if ((unsigned char)*c <= 0x20 || *c == 0x7f) {
			snprintf(err, errlen, "%s: no spaces or control characters in the URL",
			         host->conf_where(conf, "reconcile_url"));
			return false;
		}
	for (const char *c = method; *c; c++)
		if (!isupper((unsigned char)*c)) {
			snprintf(err, errlen, "%s: an upper-case HTTP method (GET, HEAD, ...)",
			         host->conf_where(conf, "reconcile_method"));
			return false;
		}
	if (method[0] == '\0') {
		snprintf(err, errlen, "%s: empty", host->conf_where(conf, "reconcile_method"));
		return false;
	}
	if (hdr[0] && (strchr(hdr, ':') == NULL || strpbrk(hdr, "\r\n") != NULL)) {
		/* The value may be a secret: never echoed. */
		snprintf(err, errlen, "%s: one header as \"Name: value\", on one line",
		         host->conf_where(conf, "reconcile_header"));
		return false;
	}
	return true;
}

/* What a found answer is read from (id pointer, id header), the targets
 * asked about and the statuses that mean found and not found. */
static bool check_answers(struct http_lookup *lk, const struct outbox_host *host,
                          const struct outbox_conf *conf, char *err, size_t errlen)
{
	if (lk->id_pointer[0] && lk->id_pointer[0] != '/') {
		snprintf(err, errlen, "%s: a JSON pointer (\"/id\", \"/data/0/id\") or empty",
		         host->conf_where(conf, "reconcile_id_json"));
		return false;
	}
	if (lk->id_pointer[0] == '\0' && lk->id_header[0] == '\0') {
		snprintf(err, errlen, "%s: a found answer must name the provider id: set "
		         "reconcile_id_json or reconcile_id_header", host->conf_where(conf, "reconcile_id_json"));
		return false;
	}
	if (!parse_targets(lk, host->conf_str(conf, "reconcile_targets"), err, errlen,
	                   host->conf_where(conf, "reconcile_targets")) ||
	    !parse_statuses(host->conf_str(conf, "reconcile_found_status"), lk->found, &lk->n_found,
	                    err, errlen, host->conf_where(conf, "reconcile_found_status")) ||
	    !parse_statuses(host->conf_str(conf, "reconcile_not_found_status"), lk->not_found,
	                    &lk->n_not_found, err, errlen,
	                    host->conf_where(conf, "reconcile_not_found_status")))
		return false;
	for (int i = 0; i < lk->n_found; i++)
		if (status_in(lk->found[i], lk->not_found, lk->n_not_found)) {
			snprintf(err, errlen, "%s: status %ld cannot mean both found and not found",
			         host->conf_where(conf, "reconcile_not_found_status"), lk->found[i]);
			return false;
		}
	return true;
}

struct http_lookup *http_lookup_new(const struct outbox_host *host, const struct outbox_conf *conf,
                                    const struct netrules *rules, const char *ca_file,
                                    const char *proxy, const char *user_agent, char *err,
                                    size_t errlen)
{
	const char *tpl = host->conf_str(conf, "reconcile_url");
	const char *hdr = host->conf_str(conf, "reconcile_header");
	const char *method = host->conf_str(conf, "reconcile_method");
	struct http_lookup *lk;

	err[0] = '\0';
	if (tpl[0] == '\0')
		return NULL;
	if (!check_texts(host, conf, tpl, method, hdr, err, errlen))
		return NULL;
	lk = text_alloc(sizeof(*lk));
	lk->host = host;
	lk->rules = rules;
	lk->ca_file = ca_file;
	lk->proxy = proxy;
	lk->user_agent = user_agent;
	lk->min_age_ms = host->conf_int(conf, "reconcile_min_age_seconds") * 1000;
	lk->timeout_ms = host->conf_int(conf, "reconcile_timeout_ms");
	lk->url_template = text_strdup(tpl);
	lk->method = text_strdup(method);
	lk->id_pointer = text_strdup(host->conf_str(conf, "reconcile_id_json"));
	lk->id_header = text_strdup(host->conf_str(conf, "reconcile_id_header"));
	lk->extra_header = text_strdup(hdr);
	lk->loop = curl_loop_new(host->base, &(struct curl_safety){ "http,https", ca_file, proxy });
	if (!lk->loop) {
		snprintf(err, errlen, "cannot set up libcurl on the event loop");
		goto fail;
	}
	if (!check_answers(lk, host, conf, err, errlen))
		goto fail;
	return lk;
fail:
	http_lookup_free(lk);
	return NULL;
}

/* ---- one lookup --------------------------------------------------------- */

static bool target_matches(const struct http_lookup *lk, const struct url_parts *t,
                           const char *path)
{
	for (int i = 0; i < lk->n_targets; i++)
		if (url_prefix_matches(&lk->targets[i], t, path))
			return true;
	return false;
}

/* The template with {key}, {effect_id} and {origin} filled in; the key and
 * id are hex and a uuid, so they need no escaping. */
static char *fill_template(const char *tpl, const char *key, const char *id, const char *origin)
{
	size_t cap = strlen(tpl) + 1, n = 0;
	char *out;

	for (const char *p = tpl; *p; p++)
		if (*p == '{')
			cap += strlen(key) + strlen(id) + strlen(origin);
	out = text_alloc(cap);
	for (const char *p = tpl; *p;) {
		const char *v = NULL;
		size_t skip = 0;
		if (strncmp(p, "{key}", 5) == 0)
			v = key, skip = 5;
		else if (strncmp(p, "{effect_id}", 11) == 0)
			v = id, skip = 11;
		else if (strncmp(p, "{origin}", 8) == 0)
			v = origin, skip = 8;
		if (v) {
			memcpy(out + n, v, strlen(v));
			n += strlen(v);
			p += skip;
		} else {
			out[n++] = *p++;
		}
	}
	out[n] = '\0';
	return out;
}

static size_t on_header(char *line, size_t size, size_t nitems, void *arg)
{
	struct lookup_call *c = arg;

	curl_header_take(line, size * nitems, c->lk->id_header, &c->hdr_id);
	return size * nitems;
}

bool http_lookup_pointer_id(const char *json, size_t len, const char *pointer, char *out,
                            size_t outlen)
{
	json_t *doc = json_loadb(json, len, JSON_DECODE_ANY, NULL);
	json_t *v = doc;
	const char *p = pointer;
	bool ok = false;

	while (v && *p == '/') {
		char tok[256];
		size_t n = 0;
		for (p++; *p && *p != '/' && n < sizeof(tok) - 1; p++) {
			if (*p == '~' && (p[1] == '0' || p[1] == '1')) {
				tok[n++] = p[1] == '0' ? '~' : '/';
				p++;
			} else {
				tok[n++] = *p;
			}
		}
		tok[n] = '\0';
		if (json_is_object(v)) {
			v = json_object_get(v, tok);
		} else if (json_is_array(v) && n > 0 && strspn(tok, "0123456789") == n) {
			v = json_array_get(v, strtoul(tok, NULL, 10));
		} else {
			v = NULL;
		}
	}
	if (v && *p == '\0') {
		if (json_is_string(v) && json_string_length(v) > 0 &&
		    json_string_length(v) < outlen) {
			snprintf(out, outlen, "%s", json_string_value(v));
			ok = strpbrk(out, "\r\n") == NULL;
		} else if (json_is_integer(v)) {
			snprintf(out, outlen, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
			ok = true;
		}
	}
	json_decref(doc);
	return ok;
}

static void call_free(struct lookup_call *c)
{
	/* reconcile_header may be a credential: wiped before it is freed. */
	for (struct curl_slist *l = c->headers; l; l = l->next)
		memset(l->data, 0, strlen(l->data));
	curl_slist_free_all(c->headers);
	free(c->url);
	curl_body_free(&c->resp);
	free(c->hdr_id);
	free(c);
}

static void on_done(CURL *easy, CURLcode rc, void *arg)
{
	struct lookup_call *c = arg;
	struct http_lookup *lk = c->lk;
	struct outbox_recon_result r = { .verdict = RECON_CANNOT_TELL };
	long status = 0;

	curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
	r.status = (int)status;
	if (rc != CURLE_OK) {
		snprintf(r.error, sizeof(r.error), "lookup failed: %s%s", curl_easy_strerror(rc),
		         c->guard.refused ? " (address refused by the SSRF rules)" : "");
	} else if (status_in(status, lk->found, lk->n_found)) {
		if (c->hdr_id && c->hdr_id[0])
			snprintf(r.provider_id, sizeof(r.provider_id), "%s", c->hdr_id);
		else if (lk->id_pointer[0] && c->resp.data)
			http_lookup_pointer_id(c->resp.data, c->resp.len, lk->id_pointer, r.provider_id,
			                       sizeof(r.provider_id));
		if (r.provider_id[0])
			r.verdict = RECON_SENT;
		else
			snprintf(r.error, sizeof(r.error),
			         "lookup: HTTP %ld (found) without a provider id at %s: not trusted",
			         status, lk->id_header[0] ? lk->id_header : lk->id_pointer);
	} else if (status_in(status, lk->not_found, lk->n_not_found)) {
		if (c->age_ms >= 0 && c->age_ms >= lk->min_age_ms) {
			r.verdict = RECON_NOT_SENT;
			snprintf(r.error, sizeof(r.error), "lookup: HTTP %ld (not found) %lld s after the "
			         "last attempt", status, c->age_ms / 1000);
		} else {
			snprintf(r.error, sizeof(r.error), "lookup: HTTP %ld (not found) but the last "
			         "attempt started only %lld ms ago (reconcile_min_age_seconds %ld)",
			         status, c->age_ms, lk->min_age_ms / 1000);
		}
	} else {
		snprintf(r.error, sizeof(r.error), "lookup: HTTP %ld means neither found nor not found",
		         status);
	}
	curl_easy_cleanup(easy);
	c->done(c->token, &r);
	call_free(c);
}

bool http_lookup_ask(struct http_lookup *lk, const struct outbox_effect *e, outbox_recon_fn done,
                     void *token, char *err, size_t errlen)
{
	struct lookup_call *c;
	struct url_parts target, lookup;
	char origin[1024], why[256], *path = NULL;
	bool matches;
	CURL *easy;

	if (!url_split(e->target, &target, &path, why, sizeof(why)) ||
	    !url_origin(&target, origin, sizeof(origin))) {
		free(path);
		snprintf(err, errlen, "the target is not a URL the lookup can use");
		return false;
	}
	if (url_path_ambiguous(path) != NULL) {
		snprintf(err, errlen, "no lookup for this target: %s", url_path_ambiguous(path));
		free(path);
		return false;
	}
	matches = target_matches(lk, &target, path);
	free(path);
	if (!matches) {
		snprintf(err, errlen, "no lookup is configured for this target (reconcile_targets)");
		return false;
	}
	c = text_alloc(sizeof(*c));
	c->lk = lk;
	c->done = done;
	c->token = token;
	c->age_ms = e->attempt_age_ms;
	/* {origin} is the parsed target's: never its user-info. */
	c->url = fill_template(lk->url_template, e->effect_key, e->effect_id, origin);
	if (!url_split(c->url, &lookup, NULL, why, sizeof(why))) {
		snprintf(err, errlen, "the lookup URL made for this effect is not a valid URL");
		call_free(c);
		return false;
	}
	c->guard.rules = lk->rules;
	c->guard.host_listed = netrules_host_listed(lk->rules, lookup.host);
	c->resp.max = LOOKUP_MAX_RESPONSE;
	c->resp.fail_past_max = true;   /* too big to be an answer about one effect */
	c->headers = curl_slist_append(NULL, "Accept: application/json");
	if (c->headers && lk->extra_header[0])
		c->headers = curl_slist_append(c->headers, lk->extra_header);
	easy = curl_easy_init();
	if (c->headers == NULL || easy == NULL) {
		if (easy)
			curl_easy_cleanup(easy);
		snprintf(err, errlen, "out of memory");
		call_free(c);
		return false;
	}
	curl_easy_setopt(easy, CURLOPT_URL, c->url);
	curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, lk->method);
	if (strcmp(lk->method, "HEAD") == 0)
		curl_easy_setopt(easy, CURLOPT_NOBODY, 1L);
	curl_easy_setopt(easy, CURLOPT_HTTPHEADER, c->headers);
	curl_easy_setopt(easy, CURLOPT_USERAGENT, lk->user_agent);
	curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, lk->timeout_ms);
	curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(easy, CURLOPT_FORBID_REUSE, 1L);
	curl_io_attach(easy, &c->guard, &c->resp, on_header, c);
	if (!curl_loop_add(lk->loop, easy, on_done, c)) {
		curl_easy_cleanup(easy);
		snprintf(err, errlen, "libcurl refused the lookup");
		call_free(c);
		return false;
	}
	return true;
}

static void release_call(CURL *easy, void *arg)
{
	curl_easy_cleanup(easy);
	call_free(arg);
}

void http_lookup_free(struct http_lookup *lk)
{
	if (lk == NULL)
		return;
	if (lk->loop)
		curl_loop_free(lk->loop, release_call);
	for (int i = 0; i < lk->n_targets; i++)
		url_prefix_free(&lk->targets[i]);
	free(lk->url_template);
	free(lk->method);
	free(lk->id_pointer);
	free(lk->id_header);
	if (lk->extra_header)
		memset(lk->extra_header, 0, strlen(lk->extra_header));
	free(lk->extra_header);
	free(lk);
}

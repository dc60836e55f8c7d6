/* SPDX-License-Identifier: ISC */
/*
 * netrules.c: SSRF allow-list and special address ranges (see netrules.h).
 */
#include "netrules.h"
#include "text.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct cidr {
	int family;                 /* AF_INET or AF_INET6 */
	unsigned char addr[16];
	int prefix;
};

struct netrules {
	char **names;
	size_t n_names;
	struct cidr *cidrs;
	size_t n_cidrs;
	bool public_ok;
};

static const struct {
	const char *net;
	int prefix;
} special_v4[] = {
	{ "0.0.0.0", 8 }, { "10.0.0.0", 8 }, { "100.64.0.0", 10 }, { "127.0.0.0", 8 },
	{ "169.254.0.0", 16 }, { "172.16.0.0", 12 }, { "192.0.0.0", 24 }, { "192.0.2.0", 24 },
	{ "192.168.0.0", 16 }, { "198.18.0.0", 15 }, { "198.51.100.0", 24 }, { "203.0.113.0", 24 },
	{ "224.0.0.0", 4 }, { "240.0.0.0", 4 },
	/* 6to4 relay anycast: a relay forwards to the IPv6 address inside. */
	{ "192.88.99.0", 24 },
}, special_v6[] = {
	{ "::", 128 }, { "::1", 128 }, { "fc00::", 7 }, { "fe80::", 10 }, { "ff00::", 8 },
	{ "2001:db8::", 32 }, { "100::", 64 },
	/* Translation prefixes: behind NAT64 or SIIT they reach the IPv4
	 * address inside (loopback, metadata...): the well-known and the
	 * local-use NAT64 prefixes, and SIIT's IPv4-translated addresses
	 * (::ffff:0:a.b.c.d; IPv4-mapped ::ffff:a.b.c.d is checked as IPv4). */
	{ "64:ff9b::", 96 }, { "64:ff9b:1::", 48 }, { "::ffff:0:0:0", 96 },
	/* IPv4-compatible (deprecated), 6to4 and Teredo embed IPv4 addresses;
	 * site-local is the old private range. */
	{ "::", 96 }, { "2002::", 16 }, { "2001::", 32 }, { "fec0::", 10 },
};

static bool prefix_match(const unsigned char *a, const unsigned char *net, int prefix)
{
	int full = prefix / 8, rest = prefix % 8;

	if (memcmp(a, net, (size_t)full) != 0)
		return false;
	if (rest == 0)
		return true;
	return ((a[full] ^ net[full]) & (0xff << (8 - rest))) == 0;
}

static bool parse_cidr(const char *s, struct cidr *c)
{
	char buf[64], *slash;
	long prefix = -1;

	if (strlen(s) >= sizeof(buf))
		return false;
	strcpy(buf, s);
	slash = strchr(buf, '/');
	if (slash) {
		char *end;
		*slash = '\0';
		prefix = strtol(slash + 1, &end, 10);
		/* Range first: a huge or negative prefix must not reach memcmp(). */
		if (*end != '\0' || end == slash + 1 || prefix < 0 || prefix > 128)
			return false;
	}
	memset(c, 0, sizeof(*c));
	if (inet_pton(AF_INET, buf, c->addr) == 1) {
		c->family = AF_INET;
		c->prefix = prefix < 0 ? 32 : (int)prefix;
		return c->prefix <= 32;
	}
	if (inet_pton(AF_INET6, buf, c->addr) == 1) {
		c->family = AF_INET6;
		c->prefix = prefix < 0 ? 128 : (int)prefix;
		return c->prefix <= 128;
	}
	return false;
}

static bool valid_name(const char *s)
{
	if (*s == '\0' || strlen(s) > 253)
		return false;
	if (s[0] == '*' && s[1] == '.') {
		s += 2;
		if (*s == '\0' || *s == '.')
			return false;   /* "*." alone would match every name */
	}
	for (; *s; s++)
		if (!isalnum((unsigned char)*s) && *s != '-' && *s != '.')
			return false;
	return true;
}

void netrules_free(struct netrules *r)
{
	if (r == NULL)
		return;
	for (size_t i = 0; i < r->n_names; i++)
		free(r->names[i]);
	free(r->names);
	free(r->cidrs);
	free(r);
}

struct netrules *netrules_parse(const char *list, bool public_ok, char *err, size_t errlen)
{
	struct netrules *r = text_alloc(sizeof(*r));
	char *copy = text_strdup(list ? list : ""), *save = NULL, *tok;
	size_t cap = 1;

	for (const char *p = copy; *p; p++)
		cap += *p == ',';
	r->names = text_array(cap, sizeof(char *));
	r->cidrs = text_array(cap, sizeof(struct cidr));
	r->public_ok = public_ok;
	for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *end;
		while (isspace((unsigned char)*tok))
			tok++;
		end = tok + strlen(tok);
		while (end > tok && isspace((unsigned char)end[-1]))
			*--end = '\0';
		if (*tok == '\0')
			continue;
		if (parse_cidr(tok, &r->cidrs[r->n_cidrs])) {
			r->n_cidrs++;
		} else if (strchr(tok, '/') == NULL && strchr(tok, ':') == NULL && valid_name(tok)) {
			r->names[r->n_names] = text_strdup(tok);
			for (char *c = r->names[r->n_names]; *c; c++)
				*c = (char)tolower((unsigned char)*c);
			r->n_names++;
		} else {
			snprintf(err, errlen, "\"%.64s\" is neither a host name, an address nor a CIDR range", tok);
			free(copy);
			netrules_free(r);
			return NULL;
		}
	}
	free(copy);
	return r;
}

bool netrules_host_listed(const struct netrules *r, const char *host)
{
	size_t hl = strlen(host);

	for (size_t i = 0; i < r->n_names; i++) {
		const char *n = r->names[i];
		if (n[0] == '*' && n[1] == '.') {
			size_t sl = strlen(n + 1);   /* ".example.com" */
			if (hl > sl && strcasecmp(host + hl - sl, n + 1) == 0)
				return true;
		} else if (strcasecmp(host, n) == 0) {
			return true;
		}
	}
	return false;
}

/* Normalise to a family and 4 or 16 bytes; IPv4-mapped IPv6 becomes IPv4. */
static int addr_bytes(const struct sockaddr *sa, unsigned char out[16])
{
	if (sa->sa_family == AF_INET) {
		memcpy(out, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
		return AF_INET;
	}
	if (sa->sa_family == AF_INET6) {
		const unsigned char *b = ((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr.s6_addr;
		static const unsigned char mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
		if (memcmp(b, mapped, 12) == 0) {
			memcpy(out, b + 12, 4);
			return AF_INET;
		}
		memcpy(out, b, 16);
		return AF_INET6;
	}
	return AF_UNSPEC;
}

static bool is_special(int family, const unsigned char *a)
{
	unsigned char net[16];

	if (family == AF_INET) {
		for (size_t i = 0; i < sizeof(special_v4) / sizeof(special_v4[0]); i++) {
			inet_pton(AF_INET, special_v4[i].net, net);
			if (prefix_match(a, net, special_v4[i].prefix))
				return true;
		}
		return false;
	}
	for (size_t i = 0; i < sizeof(special_v6) / sizeof(special_v6[0]); i++) {
		inet_pton(AF_INET6, special_v6[i].net, net);
		if (prefix_match(a, net, special_v6[i].prefix))
			return true;
	}
	return false;
}

static bool listed_addr(const struct netrules *r, int family, const unsigned char *a)
{
	for (size_t i = 0; i < r->n_cidrs; i++)
		if (r->cidrs[i].family == family && prefix_match(a, r->cidrs[i].addr, r->cidrs[i].prefix))
			return true;
	return false;
}

bool netrules_addr_allowed(const struct netrules *r, const struct sockaddr *sa)
{
	unsigned char a[16];
	int family = addr_bytes(sa, a);

	if (family == AF_UNSPEC)
		return false;
	if (listed_addr(r, family, a))
		return true;
	if (is_special(family, a))
		return false;
	return r->public_ok;
}

bool netrules_host_allowed_by_name(const struct netrules *r, const char *host, char *err,
                                   size_t errlen)
{
	struct sockaddr_in6 s6;
	struct sockaddr_in s4;

	if (netrules_host_listed(r, host))
		return true;
	memset(&s4, 0, sizeof(s4));
	memset(&s6, 0, sizeof(s6));
	if (inet_pton(AF_INET, host, &s4.sin_addr) == 1) {
		s4.sin_family = AF_INET;
		if (netrules_addr_allowed(r, (struct sockaddr *)&s4))
			return true;
	} else if (inet_pton(AF_INET6, host, &s6.sin6_addr) == 1) {
		s6.sin6_family = AF_INET6;
		if (netrules_addr_allowed(r, (struct sockaddr *)&s6))
			return true;
	} else {
		return true;   /* a name: its addresses are checked at connect */
	}
	snprintf(err, errlen,
	         "target address %.64s is outside the allow-list (private, loopback, link-local and "
	         "metadata ranges need [provider.http] allow_hosts)", host);
	return false;
}

void netrules_format_addr(const struct sockaddr *sa, char *buf, size_t len)
{
	const void *src = sa->sa_family == AF_INET
	                  ? (const void *)&((const struct sockaddr_in *)(const void *)sa)->sin_addr
	                  : (const void *)&((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr;

	if (inet_ntop(sa->sa_family, src, buf, (socklen_t)len) == NULL)
		snprintf(buf, len, "?");
}

/* SPDX-License-Identifier: ISC */
/*
 * netrules.h: the HTTP provider's SSRF rules: an allow-list of host
 * names, addresses and CIDR ranges, and the ranges refused unless listed
 * (loopback, private, link-local incl. cloud metadata, CGNAT, multicast,
 * reserved, unspecified, the 6to4 relay anycast range, the NAT64 and
 * SIIT translation prefixes; IPv4-mapped IPv6 is checked as IPv4).
 */
#ifndef OUTBOX_NETRULES_H
#define OUTBOX_NETRULES_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

struct netrules;

/* list: comma-separated names ("api.example.com", "*.example.com"),
 * addresses or CIDR ranges.  public_ok: whether addresses outside the
 * special ranges pass without being listed. */
struct netrules *netrules_parse(const char *list, bool public_ok, char *err, size_t errlen);
void netrules_free(struct netrules *r);

/* The host name itself is listed: every address it resolves to passes. */
bool netrules_host_listed(const struct netrules *r, const char *host);
/* Early check at validation time: an address literal is checked now (a
 * name is checked at connect time, address by address). */
bool netrules_host_allowed_by_name(const struct netrules *r, const char *host, char *err,
                                   size_t errlen);
bool netrules_addr_allowed(const struct netrules *r, const struct sockaddr *sa);
void netrules_format_addr(const struct sockaddr *sa, char *buf, size_t len);

#endif

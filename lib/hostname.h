/* SPDX-License-Identifier: ISC */
/*
 * hostname.h: one spelling for every way of writing a host, so that what a
 * scope names, what the database reads from a target and what the worker
 * connects to compare equal (docs/design.md, "Scoped pauses and rate
 * limits").
 *
 * The canonical form:
 *   - an IPv4 address as a dotted quad of decimals, whatever spelling
 *     libcurl and inet_aton() accept: "2130706434", "0x7f.1", "127.1",
 *     "0177.0.0.01" are all "127.0.0.1";
 *   - an IPv4-mapped IPv6 address (::ffff:a.b.c.d, in any spelling) as
 *     the IPv4 address it connects to;
 *   - any other IPv6 address as inet_ntop() writes it (RFC 5952: lower
 *     case, the longest run of zero groups shortened, no single group
 *     shortened), without brackets;
 *   - a name in lower case, without a trailing dot.
 */
#ifndef OUTBOX_HOSTNAME_H
#define OUTBOX_HOSTNAME_H

#include <stddef.h>

enum host_form {
	HOST_BAD = 0,   /* nothing a connection could be made to */
	HOST_NAME,
	HOST_IPV4,
	HOST_IPV6,
};

/* in (with or without IPv6 brackets) in canonical form into out.  HOST_BAD
 * for what no connection can be made to: empty, a port or anything but a
 * host, "::::", a dotted string of numbers that is not an IPv4 address
 * ("1.2.3.4.5", "256.1.1.1"), a name with an empty or overlong label; out
 * then holds in, lower case.  out is cut to len (a host is at most 253
 * bytes; 256 always holds one). */
enum host_form host_canon(const char *in, char *out, size_t len);

#endif

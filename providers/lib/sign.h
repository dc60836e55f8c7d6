/* SPDX-License-Identifier: ISC */
/*
 * sign.h: Standard Webhooks signing and base64, for providers (no program
 * links providers/lib/).
 */
#ifndef OUTBOX_SIGN_H
#define OUTBOX_SIGN_H

#include <stdbool.h>
#include <stddef.h>

/* HMAC-SHA256(secret, id "." timestamp "." body) into out; false when
 * OpenSSL failed (out is then not a signature: send nothing). */
bool webhook_hmac(const unsigned char *secret, size_t secret_len, const char *id, const char *ts,
                  const char *body, size_t body_len, unsigned char out[32]);
/* Standard base64 with padding; false if out is too small. */
bool b64_encode(const unsigned char *in, size_t len, char *out, size_t outlen);
/* Decoded length, or -1 on bad input or too small out. */
long b64_decode(const char *in, unsigned char *out, size_t outlen);

#endif

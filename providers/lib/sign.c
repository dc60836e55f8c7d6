/* SPDX-License-Identifier: ISC */
/*
 * sign.c: Standard Webhooks HMAC and base64 (see sign.h).
 */
#include "sign.h"
#include "text.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdlib.h>
#include <string.h>

bool webhook_hmac(const unsigned char *secret, size_t secret_len, const char *id, const char *ts,
                  const char *body, size_t body_len, unsigned char out[32])
{
	size_t idl = strlen(id), tsl = strlen(ts), n = idl + tsl + body_len + 2;
	unsigned char *msg = text_alloc(n);   /* never NULL: text.h */
	unsigned int outlen = 32;
	bool ok;

	memcpy(msg, id, idl);
	msg[idl] = '.';
	memcpy(msg + idl + 1, ts, tsl);
	msg[idl + 1 + tsl] = '.';
	memcpy(msg + idl + tsl + 2, body, body_len);
	ok = HMAC(EVP_sha256(), secret, (int)secret_len, msg, n, out, &outlen) != NULL && outlen == 32;
	free(msg);
	return ok;
}

bool b64_encode(const unsigned char *in, size_t len, char *out, size_t outlen)
{
	if (outlen < 4 * ((len + 2) / 3) + 1)
		return false;
	EVP_EncodeBlock((unsigned char *)out, in, (int)len);
	return true;
}

/* Strict base64: the alphabet, then at most two '=' at the very end
 * (EVP_DecodeBlock alone accepts padding in the middle). */
static bool b64_strict(const char *in, size_t len)
{
	size_t pad = 0;

	if (len == 0)
		return true;
	if (len % 4 != 0)
		return false;
	while (pad < 2 && in[len - 1 - pad] == '=')
		pad++;
	for (size_t i = 0; i < len - pad; i++) {
		char c = in[i];
		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
		      c == '+' || c == '/'))
			return false;
	}
	return true;
}

long b64_decode(const char *in, unsigned char *out, size_t outlen)
{
	size_t len = strlen(in), pad = 0;
	unsigned char tmp[1024];
	int n;

	if (len == 0 || !b64_strict(in, len) || len / 4 * 3 > sizeof(tmp))
		return -1;
	if (in[len - 1] == '=')
		pad++;
	if (len >= 2 && in[len - 2] == '=')
		pad++;
	n = EVP_DecodeBlock(tmp, (const unsigned char *)in, (int)len);
	if (n < 0 || (size_t)n - pad > outlen)
		return -1;
	memcpy(out, tmp, (size_t)n - pad);
	return (long)n - (long)pad;
}

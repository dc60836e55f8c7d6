/* SPDX-License-Identifier: ISC */
/*
 * record.c: which Salesforce record an effect names and what it writes:
 * the target "Object/ExternalIdField" and the effect key (the external
 * id), the payload's fields, checked before any attempt (validate), and a
 * new call's record URL and local reference built from them.
 */
#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "crm/crm.h"

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

bool crm_parse_target(const char *target, size_t *obj_len, const char **field, char *err,
                      size_t errlen)
{
	const char *slash = strchr(target, '/');

	if (slash == NULL || strchr(slash + 1, '/') != NULL) {
		crm_fmt(err, errlen, "crm target \"%.100s\" must be Object/ExternalIdField, e.g. "
		        "Task/Outbox_Key__c", target);
		return false;
	}
	if (!api_name_ok(target, (size_t)(slash - target))) {
		crm_fmt(err, errlen, "crm target \"%.100s\": \"%.*s\" is not an object API name (letters, "
		        "digits, underscores, starting with a letter)", target,
		        (int)(slash - target > 80 ? 80 : slash - target), target);
		return false;
	}
	if (!api_name_ok(slash + 1, strlen(slash + 1))) {
		crm_fmt(err, errlen, "crm target \"%.100s\": \"%.80s\" is not a field API name (letters, "
		        "digits, underscores, starting with a letter)", target, slash + 1);
		return false;
	}
	*obj_len = (size_t)(slash - target);
	*field = slash + 1;
	return true;
}

bool crm_check_payload(const json_t *payload, const char *field, char *err, size_t errlen)
{
	const char *k;
	json_t *v;

	if (!json_is_object(payload)) {
		crm_fmt(err, errlen, "crm payload must be a JSON object of fields to upsert");
		return false;
	}
	json_object_foreach((json_t *)payload, k, v) {
		if (!api_name_ok(k, strlen(k))) {
			crm_fmt(err, errlen, "crm payload: \"%.80s\" is not a field API name", k);
			return false;
		}
		if (strcasecmp(k, "Id") == 0) {
			crm_fmt(err, errlen, "crm payload must not set \"Id\": the record is found by its "
			        "external id");
			return false;
		}
		if (strcasecmp(k, field) == 0) {
			crm_fmt(err, errlen, "crm payload must not set the external id field \"%s\": its value "
			        "is the effect's key", field);
			return false;
		}
		if (json_is_object(v) || json_is_array(v)) {
			crm_fmt(err, errlen, "crm payload: field \"%s\" must be a string, number, boolean or "
			        "null", k);
			return false;
		}
	}
	return true;
}

/* The effect key as an external id in the URL path: 1 to 255 of
 * [A-Za-z0-9_-], so nothing needs escaping. */
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

bool crm_validate(void *self, const struct outbox_effect *e, char *host_key,
                  size_t host_keylen, char *err, size_t errlen)
{
	struct crm *c = self;
	const char *field;
	size_t obj_len;

	if (!crm_parse_target(e->target, &obj_len, &field, err, errlen))
		return false;
	if (!crm_check_payload(e->payload, field, err, errlen))
		return false;
	if (!key_ok(e->effect_key)) {
		crm_fmt(err, errlen, "crm: effect key is not a usable external id");
		return false;
	}
	crm_fmt(host_key, host_keylen, "%s", c->host_key);
	return true;
}

struct crm_call *crm_call_new(struct crm *c, const struct outbox_effect *e,
                              enum crm_call_kind kind, char *err, size_t errlen)
{
	struct crm_call *k;
	const char *field;
	size_t obj_len;

	if (!crm_parse_target(e->target, &obj_len, &field, err, errlen))
		return NULL;
	if (!key_ok(e->effect_key)) {
		crm_fmt(err, errlen, "crm: effect key is not a usable external id");
		return NULL;
	}
	if (!crm_token_ok(c->host->conf_str(c->conf, "access_token"))) {
		crm_fmt(err, errlen, "crm: access_token is empty or not one line");
		return NULL;
	}
	k = text_alloc(sizeof(*k));
	k->crm = c;
	k->kind = kind;
	k->retry_after_ms = -1;
	k->record_url = text_alloc(strlen(c->sobjects_url) + strlen(e->target) + strlen(e->effect_key) + 2);
	/* Object/Field are API names and the key is [A-Za-z0-9_-]: nothing to
	 * escape. */
	sprintf(k->record_url, "%s%s/%s", c->sobjects_url, e->target, e->effect_key);
	crm_fmt(k->local_ref, sizeof(k->local_ref), "sf:%.*s/%s/%s", (int)obj_len, e->target, field,
	        e->effect_key);
	return k;
}

/* SPDX-License-Identifier: ISC */
/*
 * provider.h: the one interface between the dispatcher and a provider
 * plugin (http, email, crm, and anyone's fourth).
 *
 * A provider is a shared object `outbox_NAME.so` exporting
 *
 *     const struct outbox_provider *outbox_provider_entry(void);
 *
 * The dispatcher dlopen()s it from `[dispatcher] provider_dir`, refuses it
 * unless OUTBOX_PROVIDER_ABI_OLDEST <= abi <= OUTBOX_PROVIDER_ABI, validates the `[provider.NAME]`
 * config section against the provider's key table, then calls init().
 *
 * Threading: every callback below is called on the worker's event loop
 * thread, and a provider must call `done` on that thread too (a provider
 * that blocks, like email, runs its work on threads of its own and hands
 * results back through the loop).  `done` is never called from inside
 * send() or reconcile(): always from a later loop pass.
 *
 * Ownership: the effect passed to send()/reconcile() and everything it
 * points to stay valid until `done` has returned; a provider copies what it
 * needs beyond that.
 */
#ifndef OUTBOX_PROVIDER_H
#define OUTBOX_PROVIDER_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

struct event_base;

/* Bump when anything below changes layout or meaning.  3: struct
 * outbox_host gained late_result (a plugin built for 3 may read it, so a
 * dispatcher that speaks only 2 refuses it).  4: struct outbox_provider
 * gained one_host, which the dispatcher reads only from a plugin built for
 * 4 or later.  The dispatcher still loads plugins built for
 * OUTBOX_PROVIDER_ABI_OLDEST: every change since was an append, to a
 * struct the dispatcher allocates or to the end of this one. */
#define OUTBOX_PROVIDER_ABI 4
#define OUTBOX_PROVIDER_ABI_OLDEST 2

/* The failure classes of docs/design.md.  The dispatcher, not the provider, maps a
 * class to the next state (it knows attempts, max_attempts and whether
 * keys are honoured). */
enum outbox_outcome {
	OUTCOME_ACCEPTED,   /* 2xx, SMTP 250 after DATA: completed */
	OUTCOME_NOT_SENT,   /* no request byte left the host: retry */
	OUTCOME_RETRY,      /* 429/503/409, SMTP 4xx before DATA: retry */
	OUTCOME_TERMINAL,   /* other 4xx, 422, SMTP 5xx, invalid: failed */
	OUTCOME_AMBIGUOUS,  /* sent, no trustworthy answer: unknown or retry */
};

/* Reconciliation answers. */
enum outbox_recon {
	RECON_SENT,         /* the provider has it: completed, with provider_id */
	RECON_NOT_SENT,     /* the provider has no trace: pending, same key */
	RECON_CANNOT_TELL,  /* stays unknown for an operator */
};

/* Capabilities: what the provider can do by nature.  Whether a deployment
 * trusts the endpoint to honour keys is the config's
 * `honours_idempotency_keys`, which defaults to the capability bit. */
#define OUTBOX_CAP_HONOURS_KEYS  0x1u
#define OUTBOX_CAP_RECONCILE     0x2u
/* With OUTBOX_CAP_RECONCILE: the provider can reconcile only when its
 * section sets the key `reconcile_url` (a lookup is optional, as http's
 * is).  Without it, no `unknown` effect of its type is leased to be asked
 * about. */
#define OUTBOX_CAP_RECONCILE_IF_CONFIGURED 0x4u
/* send() starts the request at once: nothing waits inside the provider for
 * a thread or a connection beyond its max_in_flight and max_per_host.  The
 * worker then leases and marks rows for it in one statement (outbox_claim)
 * when they can all start, as it would mark them; a provider that queues
 * (email's thread pool) does not set it, so its rows are marked only as
 * they start and a worker that dies leaves no queued row `sending`.  Older
 * plugins do not set it: their rows are leased, then marked. */
#define OUTBOX_CAP_STARTS_AT_ONCE 0x8u

/* One effect, as leased.  Read-only for the provider. */
struct outbox_effect {
	const char *effect_id;     /* uuid text */
	const char *run_key;       /* workflow_runs.idempotency_key */
	const char *effect_key;    /* the key the provider sees (hex, 64 chars) */
	const char *effect_type;
	const char *target;
	const json_t *payload;     /* parsed payload (always a JSON object) */
	const char *payload_hash;  /* sha256 hex of the payload text */
	int attempt;               /* 1-based: the attempt being made */
	/* The payload as stored (PostgreSQL's jsonb text: valid JSON, numbers
	 * as the producer wrote them).  Forward values from here, not by
	 * re-encoding `payload`: jansson turns 19.99 into 19.989999999999998
	 * (lib/json_text.h).  Since ABI 2. */
	const char *payload_text;
	size_t payload_len;
	/* reconcile() only: milliseconds since the effect's last attempt
	 * started, by the database's clock (-1: unknown).  A provider whose
	 * "not found" needs time to become definitive (a request may still
	 * be on its way or in processing) compares it with its minimum age.
	 * Appended within ABI 2: the dispatcher allocates this struct, so a
	 * plugin built before it never reads it. */
	long long attempt_age_ms;
};

#define OUTBOX_PROVIDER_ID_MAX 256
#define OUTBOX_ERROR_MAX       512

struct outbox_result {
	enum outbox_outcome outcome;
	int status;                 /* HTTP status, SMTP reply code; 0 if none */
	long retry_after_ms;        /* from Retry-After; -1 when absent */
	bool key_conflict;          /* 422 "same key, different payload": alert */
	char provider_id[OUTBOX_PROVIDER_ID_MAX];
	char error[OUTBOX_ERROR_MAX];
};

struct outbox_recon_result {
	enum outbox_recon verdict;
	int status;
	char provider_id[OUTBOX_PROVIDER_ID_MAX];
	char error[OUTBOX_ERROR_MAX];
};

typedef void (*outbox_done_fn)(void *token, const struct outbox_result *res);
typedef void (*outbox_recon_fn)(void *token, const struct outbox_recon_result *res);

/* Config: a provider declares its keys; the dispatcher checks types and
 * bounds and names file, line and key on error before init() runs. */
enum outbox_conf_type { CONF_STR, CONF_INT, CONF_BOOL, CONF_SECRET };

struct outbox_conf_key {
	const char *name;
	enum outbox_conf_type type;
	const char *def;           /* default, as text; NULL: empty */
	long min, max;             /* CONF_INT bounds */
	const char *help;
};

struct outbox_conf;            /* opaque: one validated section */

/* Levels for host->log. */
enum outbox_log_level { OLOG_DEBUG, OLOG_INFO, OLOG_WARN, OLOG_ERROR };

/* What the dispatcher lends a provider. */
struct outbox_host {
	unsigned abi;
	struct event_base *base;   /* the worker's libevent loop */
	const char *worker;        /* this worker's name, for logs */
	/* One JSON log line {"level","provider","msg"}; never pass secrets. */
	void (*log)(enum outbox_log_level level, const char *provider,
	            const char *fmt, ...) __attribute__((format(printf, 3, 4)));
	/* Validated config values.  conf_str never returns NULL ("" if unset);
	 * a CONF_SECRET value is resolved from "file:/path" or "env:NAME". */
	const char *(*conf_str)(const struct outbox_conf *c, const char *key);
	long (*conf_int)(const struct outbox_conf *c, const char *key);
	bool (*conf_bool)(const struct outbox_conf *c, const char *key);
	/* "file:line" of a key (or of the section when the key is unset), for
	 * errors a provider finds in init(). */
	const char *(*conf_where)(const struct outbox_conf *c, const char *key);
	/* The provider's acceptance of a call it has already reported through
	 * done() as ambiguous (the relay's 250 arriving after the provider
	 * gave up waiting for it).  Called on the loop thread with the
	 * effect_id and attempt of that call; only OUTCOME_ACCEPTED is acted
	 * on: the dispatcher completes the effect with res->provider_id if it
	 * is still `unknown` because of exactly that attempt, and records how
	 * in the attempts log.  Since ABI 3; may be NULL. */
	void (*late_result)(const char *provider, const char *effect_id, int attempt,
	                    const struct outbox_result *res);
};

struct outbox_provider {
	unsigned abi;              /* OUTBOX_PROVIDER_ABI */
	const char *name;          /* effect_type it serves */
	unsigned caps;             /* OUTBOX_CAP_* */
	const struct outbox_conf_key *keys; /* terminated by {NULL} */

	/* Build the provider's state from its section.  On failure return
	 * NULL with a message naming the key in err. */
	void *(*init)(const struct outbox_host *host, const struct outbox_conf *conf,
	              char *err, size_t errlen);

	/* Check an effect before it is marked `sending`: payload shape,
	 * target syntax, header injection.  False: the effect is failed with
	 * err as its reason, nothing sent, no attempt spent.  On success,
	 * host_key receives the destination used for per-host concurrency and
	 * the circuit breaker (e.g. "api.example.com:443"). */
	bool (*validate)(void *self, const struct outbox_effect *e,
	                 char *host_key, size_t host_keylen, char *err, size_t errlen);

	/* Start one send.  False: it could not even start (err says why; the
	 * dispatcher treats it as OUTCOME_NOT_SENT).  True: done(token, ...)
	 * is called exactly once, later, on the loop thread. */
	bool (*send)(void *self, const struct outbox_effect *e,
	             outbox_done_fn done, void *token, char *err, size_t errlen);

	/* Ask whether an `unknown` effect reached the provider.  NULL when the
	 * provider lacks OUTBOX_CAP_RECONCILE.  Same contract as send(). */
	bool (*reconcile)(void *self, const struct outbox_effect *e,
	                  outbox_recon_fn done, void *token, char *err, size_t errlen);

	/* Sends in flight when shutdown() is called are abandoned: their done
	 * is not called.  Free everything. */
	void (*shutdown)(void *self);

	/* Top-level payload members this provider reads only from payload_text
	 * (lib/json_text.h), never from `payload`: the worker leaves them out
	 * of its parse (found in the text: absent from `payload`), which for
	 * a webhook body was most of the worker's JSON work.  NULL-terminated;
	 * NULL: none.  Since ABI 2. */
	const char *const *text_members;

	/* The host every effect of this provider connects to, when it has one
	 * (a CRM instance, a relay), as a host key validate() gives ("host" or
	 * "host:port"); NULL: it depends on the effect.  Called once, after
	 * init().  The worker tells the database that host for the rows it
	 * claims, so that a host pause lists a send in flight under the host
	 * it goes to.  Without it (NULL, or a plugin built before ABI 4) a
	 * claimed row's host is read from its target when that is an http URL;
	 * any other is listed under every host paused.  Since ABI 4. */
	const char *(*one_host)(void *self);
};

/* The symbol every plugin exports. */
const struct outbox_provider *outbox_provider_entry(void);
typedef const struct outbox_provider *(*outbox_provider_entry_fn)(void);

#endif /* OUTBOX_PROVIDER_H */

-- SPDX-License-Identifier: ISC
-- 106_scoped_controls.sql: pauses of one scope (an effect type, a host, a
-- CRM object) and fleet-wide rate limits per type or host (docs/design.md,
-- "Scoped pauses and rate limits").
--
-- A scope is (kind, value).  Its row says whether it is paused and at
-- what rate its sends may start; the rate is a token bucket kept in the
-- row, so that every worker of the fleet draws on the same budget.  The
-- sending transition reads the rows under the kill-switch lock, which
-- every change of a scope takes exclusively: once a pause has committed,
-- no send of that scope starts anywhere.

CREATE TABLE outbox_scopes (
    kind            text NOT NULL CHECK (kind IN ('type', 'host', 'crm_object')),
    -- An effect type as written; a host and a CRM object in lower case.
    value           text NOT NULL CHECK (value <> '' AND length(value) <= 255),
    paused          boolean NOT NULL DEFAULT false,
    paused_by       text,
    paused_reason   text,
    paused_at       timestamptz,
    -- Sends per second the fleet may start (NULL: no limit), and how many
    -- may start at once after a quiet spell.
    rate_per_second double precision CHECK (rate_per_second > 0),
    burst           integer CHECK (burst >= 1),
    limit_by        text,
    limit_reason    text,
    limit_at        timestamptz,
    -- The bucket: tokens left at tokens_at; next_slot is the start time
    -- given to the last row held back, so that rows held by different
    -- calls are spread over the slots after it instead of all due at once.
    tokens          double precision NOT NULL DEFAULT 0,
    tokens_at       timestamptz NOT NULL DEFAULT now(),
    next_slot       timestamptz NOT NULL DEFAULT '-infinity',
    -- Rows this scope has held back (parked or deferred), for the metrics.
    held_total      bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, value),
    CHECK (kind <> 'crm_object' OR rate_per_second IS NULL),
    CHECK ((rate_per_second IS NULL) = (burst IS NULL))
);

CREATE TABLE outbox_scope_history (
    change_id       bigserial PRIMARY KEY,
    kind            text NOT NULL,
    value           text NOT NULL,
    action          text NOT NULL CHECK (action IN ('off', 'on', 'limit', 'unlimit')),
    rate_per_second double precision,
    burst           integer,
    changed_by      text NOT NULL,
    reason          text NOT NULL,
    changed_at      timestamptz NOT NULL DEFAULT now()
);

-- True while any scope is paused or limited: the sending transition reads
-- the scopes only then (with none, its statements are the ones it ran
-- before scopes existed).
ALTER TABLE outbox_control ADD COLUMN scoped boolean NOT NULL DEFAULT false;

-- The scope holding a pending row back ('type:email', 'host:api.example.com',
-- 'crm_object:task'): parked at available_at 'infinity' while the scope is
-- paused, deferred to its slot while over a limit.  Nullable, no default:
-- no rewrite.  The partial index holds only held rows, so claims (which
-- never change the column) stay HOT and new rows add no entry.
ALTER TABLE effect_live ADD COLUMN held_by text;
CREATE INDEX effect_live_held_idx ON effect_live (held_by) WHERE held_by IS NOT NULL;

REVOKE ALL ON outbox_scopes, outbox_scope_history FROM PUBLIC;
GRANT SELECT ON outbox_scopes, outbox_scope_history TO outbox_dispatcher, outbox_operator;
GRANT SELECT (held_by) ON effect_live TO outbox_producer, outbox_dispatcher;

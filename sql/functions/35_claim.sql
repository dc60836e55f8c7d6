-- SPDX-License-Identifier: ISC
-- functions/35_claim.sql: the lease and the sending transition in one
-- statement, for the rows a worker can send at once (docs/design.md,
-- "Effect states"; docs/performance.md, "The claim").
--
-- outbox_lease + outbox_mark_sending write two versions of each effect row
-- (the lease, then `sending`) and take its lock twice, over two round
-- trips.  A worker with free send slots for a whole batch calls
-- outbox_claim instead: due rows go from pending straight to `sending`,
-- under the kill switch's shared lock, in one statement.  The worker asks
-- for no more rows than its provider and busiest host have room for, so a
-- claimed row is sent as soon as the answer arrives, as a marked row is:
-- a worker that dies holding claimed rows leaves no more never-sent
-- `unknown` effects than one that dies holding marked ones.  A row that
-- still cannot go (its host's breaker opened meanwhile, it was already
-- held) is given back with outbox_unclaim, attempt undone.

-- Lease up to p_limit due rows (as outbox_lease: in (available_at,
-- effect_id) order, from the position when given) and move them to
-- `sending` with the next attempt, p_call as their mark token.  Returns
-- outbox_lease's columns; `attempts` is the count before this attempt.
-- An oversized payload or metadata comes back NULL with its length, as
-- from outbox_lease.
-- Nothing while the kill switch is off (read under its lock: this is the
-- commit point, as in outbox_mark_sending).
--
-- p_repeat: the same call sent again after the connection broke with it
-- on the wire (the worker sets it; its first answer may have committed).
-- It leases nothing new: it returns the rows that call moved, or, when
-- the kill switch went off since, puts them back to pending, attempt
-- undone.  The call's advisory lock, taken first by both, makes a repeat
-- wait for a first call still running on the old connection; the repeat
-- leaves the token in outbox_claim_repeats, so that a first call reaching
-- the server only after it (a retransmitted query, a stalled server)
-- claims nothing.
--
-- While a scope this claim's types could meet is paused or limited (a
-- type scope of one of p_types, a CRM object's, or a host), the claim
-- reads the scopes for each due row as the database can (below, and
-- docs/design.md, "Scoped pauses and rate limits"): rows that meet none,
-- or only limits they certainly belong to and whose buckets have a token
-- for each of them now, are claimed, the tokens drawn; otherwise the claim
-- is a lease (outbox_lease, which parks what a pause visibly holds): its
-- rows come back with leased_only true, pending with this worker's lease,
-- and are marked with outbox_mark_sending, the commit point that reads
-- the scopes with the host each provider connects to.  A claim cannot
-- know that host before the worker has seen the row, so each claimed row
-- comes back with check_hosts, the scoped hosts it drew no token for, and
-- the worker gives back (to be marked) a row it would connect to one of
-- them for.

-- due_entries (the same on every row): the entries of the due index the
-- call's walk read.  Far more than the rows it returns means the head of
-- the index is full of entries no claim can take (the dead rows of effects
-- finished while a long transaction holds vacuum back, sends in flight),
-- whatever the machine's speed, and the worker then claims from its
-- position (dispatcher/take.c).  NULL from a repeat.
--
-- p_lease_if_scoped: the caller knows leased_only.  A worker built before
-- scopes existed does not, and would send the leased rows as if marked:
-- while a scope is set, its claim takes nothing.
--
-- p_type_hosts (aligned with p_types): the host every row of that type
-- connects to, when its provider has one (a CRM instance), recorded with
-- the rows the claim moves to `sending` for the list a host pause returns;
-- NULL: read from the target.  A worker built before it passes none, and
-- while any scope it could meet is set its claim is a lease, as before.
--
-- (The older signatures go first: a result type cannot be replaced, and a
-- call naming the older parameters must find one function.)
DROP FUNCTION IF EXISTS outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                                     timestamp with time zone, uuid, boolean);
DROP FUNCTION IF EXISTS outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                                     timestamp with time zone, uuid, boolean, integer);
DROP FUNCTION IF EXISTS outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                                     timestamp with time zone, uuid, boolean, integer, boolean);
DROP FUNCTION IF EXISTS outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                                     timestamp with time zone, uuid, boolean, integer, boolean,
                                     text[]);
-- The result gained due_entries (a result type cannot be replaced either):
-- the function of the same parameters without it goes first.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc p
                WHERE p.proname = 'outbox_claim' AND p.pronargs = 14
                  AND p.pronamespace = 'public'::regnamespace
                  AND NOT 'due_entries' = ANY (p.proargnames)) THEN
        DROP FUNCTION outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                                   timestamp with time zone, uuid, boolean, integer, boolean,
                                   text[]);
    END IF;
END $$;
CREATE OR REPLACE FUNCTION outbox_claim(p_owner uuid, p_worker text, p_limit integer,
                                        p_lease_seconds integer, p_types text[],
                                        p_env_enabled boolean, p_idempotent_types text[],
                                        p_call uuid, p_after_at timestamptz DEFAULT NULL,
                                        p_after_id uuid DEFAULT NULL,
                                        p_repeat boolean DEFAULT false,
                                        p_max_payload_bytes integer DEFAULT 67108864,
                                        p_lease_if_scoped boolean DEFAULT false,
                                        p_type_hosts text[] DEFAULT NULL)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               metadata text, approved_by text, retry_base integer,
               available_at timestamptz, payload_bytes integer, metadata_bytes integer,
               leased_only boolean, check_hosts text[], due_entries bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    allowed boolean;
    scoped boolean;
    s_kind text[];
    s_value text[];
    s_paused boolean[];
    hosts text[];
    locked text;
    after_at timestamptz := p_after_at;
    after_id uuid := p_after_id;
    walked bigint;
BEGIN
    IF p_call IS NULL THEN
        RAISE EXCEPTION 'outbox_claim: a call token is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Locks by assignment, not PERFORM: an expression without a table is
    -- evaluated without starting an executor (this runs once per claim).
    locked := pg_advisory_xact_lock(hashtextextended(p_call::text, 0))::text;
    IF p_repeat THEN
        PERFORM outbox_claim_repeated(p_call);
    ELSIF EXISTS (SELECT 1 FROM outbox_claim_repeats r WHERE r.call = p_call) THEN
        RETURN;     -- its repeat (or a give-up) came first
    END IF;
    locked := pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key())::text;
    walked := pg_stat_get_xact_tuples_returned('effect_live_due_idx'::regclass);
    SELECT c.enabled, c.scoped INTO allowed, scoped FROM outbox_control c WHERE c.id = 1;
    allowed := coalesce(allowed, false) AND p_env_enabled;
    -- Scopes this claim's types could meet, in key order (the order every
    -- caller locks them in): a type scope of one of them, a CRM object's
    -- when it takes crm, or any host.  A pause or limit on a type this
    -- worker does not serve leaves its claim whole.
    IF scoped THEN
        SELECT coalesce(array_agg(s.kind ORDER BY s.kind, s.value), '{}'),
               coalesce(array_agg(s.value ORDER BY s.kind, s.value), '{}'),
               coalesce(array_agg(s.paused ORDER BY s.kind, s.value), '{}')
          INTO s_kind, s_value, s_paused
          FROM outbox_scopes s
         WHERE s.kind = ANY ('{crm_object,host,type}')     -- the key's walk
           AND (s.paused OR s.rate_per_second IS NOT NULL)
           AND (s.kind = 'host' OR (s.kind = 'type' AND s.value = ANY (p_types))
                OR (s.kind = 'crm_object' AND 'crm' = ANY (p_types)));
        hosts := ARRAY(SELECT s_value[i] FROM generate_subscripts(s_kind, 1) AS i
                        WHERE s_kind[i] = 'host');
        scoped := cardinality(s_kind) > 0;
    END IF;
    IF p_repeat THEN
        IF NOT allowed THEN
            PERFORM outbox_unclaim_call(p_owner, p_call);
            RETURN;
        END IF;
        RETURN QUERY
        WITH moved AS MATERIALIZED (
            SELECT o.effect_id, o.attempts - 1 AS attempts, o.retry_base, o.available_at,
                   (SELECT c.drawn FROM effect_calls c WHERE c.call = p_call) AS drawn
              FROM effect_live o
             WHERE o.effect_id = ANY (coalesce((SELECT c.ids FROM effect_calls c
                                                 WHERE c.call = p_call), '{}'))
               AND o.state = 'sending'
               AND o.lease_owner = p_owner AND o.mark_token = p_call)
        SELECT m.effect_id, b.idempotency_key, b.effect_type, b.target,
               CASE WHEN octet_length(b.payload_text) <= p_max_payload_bytes
                    THEN b.payload_text END,
               b.payload_hash, b.effect_key, m.attempts,
               CASE WHEN octet_length(b.metadata_text) <= outbox_metadata_max_bytes()
                    THEN b.metadata_text END,
               b.approved_by, m.retry_base, m.available_at,
               octet_length(b.payload_text), octet_length(b.metadata_text), false,
               -- Each row's unpaid hosts, as the first call told them.
               CASE WHEN cardinality(hosts) > 0
                    THEN ARRAY(SELECT v FROM unnest(hosts) AS v
                                WHERE NOT coalesce((m.drawn -> m.effect_id::text)
                                                   ? outbox_scope_name('host', v), false)) END,
               NULL::bigint
          FROM moved m
         CROSS JOIN LATERAL (
               SELECT e.idempotency_key, e.effect_type, e.target,
                      e.payload::text AS payload_text, e.payload_hash, e.effect_key,
                      e.metadata::text AS metadata_text, e.approved_by
                 FROM effect_outbox e WHERE e.effect_id = m.effect_id
            OFFSET 0) b
         ORDER BY m.available_at, m.effect_id;
        RETURN;
    END IF;
    IF NOT allowed THEN
        RETURN;
    END IF;
    -- A worker that passes no hosts (built before the claim's reading of
    -- scopes) has its claim turned into a lease while a scope it could
    -- meet is set, marked later with the host each provider connects to.
    IF scoped AND p_type_hosts IS NULL THEN
        IF p_lease_if_scoped THEN
            RETURN QUERY SELECT l.*, true, NULL::text[],
                                  pg_stat_get_xact_tuples_returned('effect_live_due_idx'::regclass)
                                      - walked
                           FROM outbox_lease(p_owner, p_worker, p_limit, p_lease_seconds,
                                             p_types, p_env_enabled, p_after_at, p_after_id,
                                             p_max_payload_bytes) l;
        END IF;
        RETURN;
    END IF;
    -- The position rules and the one statement shape of outbox_lease.
    IF after_at > now() - interval '50 milliseconds' THEN
        after_at := now() - interval '50 milliseconds';
        after_id := NULL;
    END IF;
    after_at := coalesce(after_at, '-infinity');
    after_id := coalesce(after_id, '00000000-0000-0000-0000-000000000000');
    IF scoped THEN
        -- The statement below, reading the scopes for each due row as the
        -- database can (docs/design.md, "Scoped pauses and rate limits").
        -- A row meets a scope by its type, its CRM object, or a host: its
        -- type's one host (p_type_hosts), else a scope's host anywhere in
        -- an http target (any spelling aside); a row of a type with no
        -- host known may go to any.  It claims the rows when each meets
        -- only limits it certainly belongs to (its type, its one host, the
        -- host an http URL starts with) and those limits' buckets have a
        -- token for every row now: it draws them, as the mark would.
        -- Otherwise (a pause met, a row deferred by a limit, a host only
        -- perhaps in the URL, a bucket short) it claims nothing, and the
        -- rows are leased, to be marked by the sending transition.  The
        -- reading only filters: each row comes back with check_hosts, the
        -- scoped hosts it drew no token for, and the worker gives back a
        -- claimed row it would connect to one of them for, to be marked.
        -- (Such a row is `sending` until the give-back commits; a pause in
        -- that moment lists it, though it never starts.  The exact
        -- reading, outbox_target_host, costs more per row than the claim
        -- itself.)  The first walk reads only what the reading needs; the
        -- payloads are read for the rows claimed.
        RETURN QUERY
        WITH due AS MATERIALIZED (
            SELECT l.ctid AS row_at, l.effect_id, l.held_by FROM effect_live l
             WHERE (l.available_at, l.effect_id) > (after_at, after_id)
               AND l.available_at <= now()
               AND l.state = 'pending'
               AND (l.lease_expires_at IS NULL OR l.lease_expires_at < now())
               AND l.effect_type = ANY (p_types)
             ORDER BY l.available_at, l.effect_id
             LIMIT p_limit
             FOR UPDATE SKIP LOCKED),
        aim AS MATERIALIZED (
            SELECT d.effect_id, d.held_by, b.effect_type, b.target, lower(b.target) AS url,
                   p_type_hosts[array_position(p_types, b.effect_type)] AS one_host
              FROM due d
             CROSS JOIN LATERAL (
                   SELECT e.effect_type, e.target FROM effect_outbox e
                    WHERE e.effect_id = d.effect_id OFFSET 0) b),
        -- Each scope (j) each row meets, and whether the claim may pay for
        -- it: a limit, not a pause, on a row no limit deferred, that the
        -- row certainly belongs to.
        hit AS MATERIALIZED (
            SELECT x.effect_id, j.j,
                   NOT s_paused[j.j] AND x.held_by IS NULL
                   AND CASE s_kind[j.j]
                       WHEN 'type' THEN true
                       WHEN 'host' THEN x.one_host IS NOT NULL
                            OR (x.effect_type = 'http'
                                AND left(x.url, position('://' IN x.url) + 2)
                                    IN ('http://', 'https://')
                                AND CASE substr(x.url, position('://' IN x.url) + 3,
                                                length(s_value[j.j]) + 1)
                                    WHEN s_value[j.j] THEN true
                                    WHEN s_value[j.j] || '/' THEN true
                                    WHEN s_value[j.j] || '?' THEN true
                                    WHEN s_value[j.j] || '#' THEN true
                                    -- A port, not a user's password before
                                    -- another host ('host:pw@other').
                                    WHEN s_value[j.j] || ':' THEN
                                         substr(x.url, position('://' IN x.url) + 4
                                                       + length(s_value[j.j]))
                                         ~ '^[0-9]*([/?#]|$)'
                                    ELSE false END)
                       ELSE false END AS payable
              FROM aim x
             CROSS JOIN LATERAL (
                   SELECT i AS j FROM generate_subscripts(s_kind, 1) AS i
                    WHERE CASE s_kind[i]
                          WHEN 'type' THEN x.effect_type = s_value[i]
                          WHEN 'crm_object' THEN x.effect_type = 'crm'
                               AND lower(split_part(x.target, '/', 1)) = s_value[i]
                          ELSE CASE WHEN x.one_host IS NOT NULL THEN x.one_host = s_value[i]
                                    WHEN x.effect_type = 'http' THEN strpos(x.url, s_value[i]) > 0
                                    ELSE true END
                          END) j),
        -- The tokens each limit met needs, its bucket locked (key order,
        -- as the mark locks them) and refilled to now; nothing locked when
        -- a row cannot be paid.
        need AS MATERIALIZED (
            SELECT h.j, count(*) AS n FROM hit h
             WHERE NOT EXISTS (SELECT 1 FROM hit k WHERE NOT k.payable)
             GROUP BY h.j ORDER BY h.j),
        bucket AS MATERIALIZED (
            SELECT n.j, n.n, t.tokens FROM need n
             CROSS JOIN LATERAL (
                   SELECT least(s.burst::double precision,
                                s.tokens + s.rate_per_second
                                  * greatest(extract(epoch FROM now() - s.tokens_at), 0))
                            AS tokens
                     FROM outbox_scopes s
                    WHERE s.kind = s_kind[n.j] AND s.value = s_value[n.j]
                      AND s.rate_per_second IS NOT NULL
                      FOR UPDATE) t),
        free AS MATERIALIZED (
            SELECT NOT EXISTS (SELECT 1 FROM hit h WHERE NOT h.payable)
                   AND NOT EXISTS (SELECT 1 FROM need n
                                    WHERE NOT EXISTS (SELECT 1 FROM bucket b
                                                       WHERE b.j = n.j AND b.tokens >= n.n))
                   AS ok),
        -- The draw: the claim pays for its rows only when every bucket
        -- has a token for each of them, so it never goes below zero (a
        -- mark's debt reserves the slots of the rows it deferred).
        drawn AS (
            UPDATE outbox_scopes s SET tokens = b.tokens - b.n, tokens_at = now()
              FROM bucket b
             WHERE s.kind = s_kind[b.j] AND s.value = s_value[b.j] AND (SELECT f.ok FROM free f)),
        -- What each row drew, by its id: kept with the call (its repeat,
        -- a give-back's refund), and each row's unpaid hosts read from it
        -- by key, not by a scan of the hits per row.
        paid AS MATERIALIZED (
            SELECT coalesce(jsonb_object_agg(d.effect_id, d.names), '{}') AS m
              FROM (SELECT h.effect_id,
                           jsonb_agg(outbox_scope_name(s_kind[h.j], s_value[h.j]) ORDER BY h.j)
                               AS names
                      FROM hit h JOIN bucket b ON b.j = h.j
                     WHERE (SELECT f.ok FROM free f)
                     GROUP BY h.effect_id) d),
        claimed AS (
            UPDATE effect_live o
               SET state = 'sending', attempts = o.attempts + 1,
                   lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
                   lease_expires_at = now() + make_interval(secs => p_lease_seconds),
                   sending_since = now(), mark_token = p_call,
                   sending_idempotent = o.effect_type = ANY (p_idempotent_types),
                   updated_at = now()
             WHERE o.ctid = ANY (ARRAY(SELECT d.row_at FROM due d)) AND (SELECT f.ok FROM free f)
            RETURNING o.effect_id, o.attempts - 1 AS attempts, o.retry_base, o.available_at,
                      o.effect_type),
        called AS (
            INSERT INTO effect_calls (call, lease_owner, worker, ids, deadline, hosts, drawn)
            SELECT p_call, p_owner, p_worker, array_agg(c.effect_id),
                   now() + make_interval(secs => p_lease_seconds),
                   array_agg(p_type_hosts[array_position(p_types, c.effect_type)]),
                   (SELECT p.m FROM paid p)
              FROM claimed c HAVING count(*) > 0
            ON CONFLICT (call) DO NOTHING)
        SELECT c.effect_id, b.idempotency_key, b.effect_type, b.target,
               CASE WHEN octet_length(b.payload_text) <= p_max_payload_bytes
                    THEN b.payload_text END,
               b.payload_hash, b.effect_key, c.attempts,
               CASE WHEN octet_length(b.metadata_text) <= outbox_metadata_max_bytes()
                    THEN b.metadata_text END,
               b.approved_by, c.retry_base, c.available_at,
               octet_length(b.payload_text), octet_length(b.metadata_text), false,
               CASE WHEN cardinality(hosts) > 0
                    THEN ARRAY(SELECT v FROM unnest(hosts) AS v
                                WHERE NOT coalesce(((SELECT p.m FROM paid p) -> c.effect_id::text)
                                                   ? outbox_scope_name('host', v), false)) END,
               pg_stat_get_xact_tuples_returned('effect_live_due_idx'::regclass) - walked
          FROM claimed c
         CROSS JOIN LATERAL (
               SELECT e.idempotency_key, e.effect_type, e.target,
                      e.payload::text AS payload_text, e.payload_hash, e.effect_key,
                      e.metadata::text AS metadata_text, e.approved_by
                 FROM effect_outbox e WHERE e.effect_id = c.effect_id
                OFFSET 0) b
         ORDER BY c.available_at, c.effect_id;
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY SELECT l.*, true, NULL::text[],
                                  pg_stat_get_xact_tuples_returned('effect_live_due_idx'::regclass)
                                      - walked
                       FROM outbox_lease(p_owner, p_worker, p_limit, p_lease_seconds, p_types,
                                         p_env_enabled, p_after_at, p_after_id,
                                         p_max_payload_bytes) l;
        RETURN;
    END IF;
    -- One statement: the due rows, their move to `sending` (in place: no
    -- indexed column changes), the call's row for the reaper, and what the
    -- worker sends, read from the immutable body row by its key.  OFFSET 0
    -- keeps the body's subquery whole, so each payload is turned into text
    -- once, not once per use of it (pulled up, it was three times).
    RETURN QUERY
    WITH due AS (
        SELECT l.ctid AS row_at FROM effect_live l
         WHERE (l.available_at, l.effect_id) > (after_at, after_id)
           AND l.available_at <= now()
           AND l.state = 'pending'
           AND (l.lease_expires_at IS NULL OR l.lease_expires_at < now())
           AND l.effect_type = ANY (p_types)
         ORDER BY l.available_at, l.effect_id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE effect_live o
           SET state = 'sending', attempts = o.attempts + 1,
               lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds),
               sending_since = now(), mark_token = p_call,
               sending_idempotent = o.effect_type = ANY (p_idempotent_types),
               updated_at = now()
         WHERE o.ctid = ANY (ARRAY(SELECT d.row_at FROM due d))
        RETURNING o.effect_id, o.attempts - 1 AS attempts, o.retry_base, o.available_at,
                  o.effect_type),
    called AS (
        INSERT INTO effect_calls (call, lease_owner, worker, ids, deadline, hosts)
        SELECT p_call, p_owner, p_worker, array_agg(c.effect_id),
               now() + make_interval(secs => p_lease_seconds),
               array_agg(p_type_hosts[array_position(p_types, c.effect_type)])
          FROM claimed c HAVING count(*) > 0
        ON CONFLICT (call) DO NOTHING)
    SELECT c.effect_id, b.idempotency_key, b.effect_type, b.target,
           CASE WHEN octet_length(b.payload_text) <= p_max_payload_bytes THEN b.payload_text END,
           b.payload_hash, b.effect_key, c.attempts,
           CASE WHEN octet_length(b.metadata_text) <= outbox_metadata_max_bytes()
                THEN b.metadata_text END,
           b.approved_by, c.retry_base, c.available_at,
           octet_length(b.payload_text), octet_length(b.metadata_text), false, NULL::text[],
           pg_stat_get_xact_tuples_returned('effect_live_due_idx'::regclass) - walked
      FROM claimed c
     CROSS JOIN LATERAL (
           SELECT e.idempotency_key, e.effect_type, e.target, e.payload::text AS payload_text,
                  e.payload_hash, e.effect_key, e.metadata::text AS metadata_text, e.approved_by
             FROM effect_outbox e WHERE e.effect_id = c.effect_id
            OFFSET 0) b
     ORDER BY c.available_at, c.effect_id;
END $$;

-- Claimed rows of p_owner that were not sent go back to pending, the
-- attempt undone (nothing left the worker).  With p_release the lease goes
-- too and the row is due again after p_delay_ms; without it the worker
-- keeps the lease and marks the row later with outbox_mark_sending.
CREATE OR REPLACE FUNCTION outbox_unclaim(p_owner uuid, p_ids uuid[], p_call uuid,
                                          p_release boolean, p_delay_ms bigint DEFAULT 0)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    back uuid[];
    owed jsonb;
BEGIN
    -- A call whose rows drew tokens is refunded below, which locks the
    -- scopes' rows: first the kill switch's lock, shared, as the claim
    -- and the mark take it before any effect row, so that a pause (which
    -- holds it exclusively, then its scope's row, then the rows sending)
    -- is never waited for the other way round.
    SELECT c.drawn INTO owed FROM effect_calls c WHERE c.call = p_call;
    IF owed IS NOT NULL AND owed <> '{}' THEN
        PERFORM pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key());
    END IF;
    PERFORM outbox_lock_owned(p_owner, p_ids);      -- lock order: effect_id
    WITH moved AS (
    UPDATE effect_live o
       SET state = 'pending', attempts = o.attempts - 1, sending_since = NULL,
           mark_token = NULL, sending_idempotent = false, updated_at = now(),
           lease_owner = CASE WHEN p_release THEN NULL ELSE o.lease_owner END,
           lease_worker = CASE WHEN p_release THEN NULL ELSE o.lease_worker END,
           lease_expires_at = CASE WHEN p_release THEN NULL ELSE o.lease_expires_at END,
           available_at = CASE WHEN p_release
                               THEN greatest(o.available_at,
                                             now() + make_interval(secs => greatest(p_delay_ms, 0) / 1000.0))
                               ELSE o.available_at END
     WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                WHERE k.effect_id = ANY (p_ids) ORDER BY k.effect_id))
       AND o.lease_owner = p_owner
       AND o.state = 'sending' AND o.mark_token = p_call
    RETURNING o.effect_id)
    SELECT coalesce(array_agg(m.effect_id), '{}') INTO back FROM moved m;
    -- The tokens these rows drew in the claim, given back to the buckets
    -- (after the effect rows, in key order, as every caller locks them),
    -- and struck from the call's record, so that none is refunded twice:
    -- a row given back to be marked pays at its mark, once.
    IF cardinality(back) > 0 AND owed IS NOT NULL AND owed <> '{}' THEN
        WITH due AS (
            SELECT split_part(x, ':', 1) AS kind, substr(x, strpos(x, ':') + 1) AS value,
                   count(*) AS n
              FROM unnest(back) AS r(id)
             CROSS JOIN LATERAL jsonb_array_elements_text(
                   coalesce(owed -> r.id::text, '[]')) AS x
             GROUP BY 1, 2),
        got AS (
            SELECT s.kind, s.value FROM outbox_scopes s
             WHERE (s.kind, s.value) IN (SELECT d.kind, d.value FROM due d)
               AND s.rate_per_second IS NOT NULL
             ORDER BY s.kind, s.value FOR UPDATE)
        UPDATE outbox_scopes s
           SET tokens = least(s.burst::double precision,
                              s.tokens + s.rate_per_second
                                * greatest(extract(epoch FROM now() - s.tokens_at), 0) + d.n),
               tokens_at = greatest(s.tokens_at, now())
          FROM due d JOIN got g ON g.kind = d.kind AND g.value = d.value
         WHERE s.kind = d.kind AND s.value = d.value;
        UPDATE effect_calls c SET drawn = c.drawn - back::text[] WHERE c.call = p_call;
    END IF;
    RETURN cardinality(back);
END $$;

-- A claim token that was repeated or given up on: a first call carrying it
-- does nothing from now on.  Tokens older than an hour go (a first call
-- that late would find its rows' leases long expired anyway).
CREATE OR REPLACE FUNCTION outbox_claim_repeated(p_call uuid)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    DELETE FROM outbox_claim_repeats WHERE at < now() - interval '1 hour';
    INSERT INTO outbox_claim_repeats (call) VALUES (p_call) ON CONFLICT DO NOTHING;
$$;

-- Every row one claim call moved, back to pending with its lease dropped,
-- and the call given up on (outbox_claim_repeated): a repeated claim after
-- the kill switch went off, or a worker whose claim or mark was refused (it cannot
-- tell whether that was a repeat whose first call committed).  Found
-- through the call's row; only those rare cases get here.
CREATE OR REPLACE FUNCTION outbox_unclaim_call(p_owner uuid, p_call uuid)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_call::text, 0));
    PERFORM outbox_claim_repeated(p_call);
    RETURN outbox_unclaim(p_owner,
                          ARRAY(SELECT o.effect_id FROM effect_live o
                                 WHERE o.effect_id = ANY (coalesce(
                                           (SELECT c.ids FROM effect_calls c
                                             WHERE c.call = p_call), '{}'))
                                   AND o.state = 'sending'
                                   AND o.lease_owner = p_owner AND o.mark_token = p_call),
                          p_call, true, 0);
END $$;

REVOKE EXECUTE ON FUNCTION
    outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                 timestamp with time zone, uuid, boolean, integer, boolean, text[]),
    outbox_unclaim(uuid, uuid[], uuid, boolean, bigint),
    outbox_claim_repeated(uuid),
    outbox_unclaim_call(uuid, uuid)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid,
                 timestamp with time zone, uuid, boolean, integer, boolean, text[]),
    outbox_unclaim(uuid, uuid[], uuid, boolean, bigint),
    outbox_unclaim_call(uuid, uuid)
    TO outbox_dispatcher;

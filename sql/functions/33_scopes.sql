-- SPDX-License-Identifier: ISC
-- functions/33_scopes.sql: scoped pauses and fleet-wide rate limits
-- (docs/design.md, "Scoped pauses and rate limits").
--
-- A scope is a kind and a value: an effect type, a host, a CRM object.
-- The operator pauses one (outbox_scope_pause) or gives it a rate
-- (outbox_scope_limit, types and hosts); both take the kill-switch lock
-- exclusively, as the global switch does, and the sending transition
-- (outbox_mark_sending) holds it shared while it reads them.  So once a
-- pause has committed no send of its scope starts anywhere, and the sends
-- it returns are all that were in flight.
--
-- Rows a scope holds back stay pending and spend no attempt: a paused
-- scope parks them (available_at 'infinity', held_by naming the scope)
-- until it resumes; a limit defers them to the slots its bucket will have
-- tokens for.  The lease parks what it can see is paused (types, CRM
-- objects, hosts of URL targets), so a paused backlog is walked once.
-- While no scope is paused or limited (outbox_control.scoped false) none
-- of this runs: the lease, claim and mark run the statements they ran
-- before scopes existed.

-- A host in its one spelling, as the worker writes it (lib/hostname.h):
-- an IPv4 address in any form libcurl and inet_aton() accept
-- (2130706434, 0x7f.1, 127.1, 0177.0.0.01) or IPv4-mapped (::ffff:a.b.c.d)
-- as the dotted quad; any other IPv6 address as inet_ntop() writes it
-- (RFC 5952), without brackets; a name in lower case without a trailing
-- dot.  NULL for what no connection can be made to: a port, "::::",
-- "1.2.3.4.5", an empty label.
CREATE OR REPLACE FUNCTION outbox_host_canon(p_host text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    h text := lower(p_host);
    parts text[];
    n integer;
    v numeric;
    addr numeric := 0;
    a inet;
BEGIN
    IF h LIKE '[%]' THEN
        h := substr(h, 2, length(h) - 2);
        IF h NOT LIKE '%:%' THEN
            RETURN NULL;
        END IF;
    END IF;
    IF length(h) > 253 OR h = '' THEN
        RETURN NULL;
    END IF;
    IF h LIKE '%:%' THEN
        IF h !~ '^[0-9a-f:.]+$' THEN
            RETURN NULL;
        END IF;
        BEGIN
            a := h::inet;
        EXCEPTION WHEN invalid_text_representation THEN
            RETURN NULL;
        END;
        IF family(a) <> 6 OR masklen(a) <> 128 THEN
            RETURN NULL;
        END IF;
        IF a << '::ffff:0.0.0.0/96'::inet THEN
            RETURN host('0.0.0.0'::inet + (a - '::ffff:0.0.0.0'::inet));
        END IF;
        RETURN host(a);
    END IF;
    IF right(h, 1) = '.' THEN
        h := left(h, -1);
    END IF;
    -- IPv4 as libcurl reads it: one to four parts, each 0x hex, 0 octal
    -- or decimal, the last filling the bytes left.
    IF h ~ '^(0x[0-9a-f]+|0[0-7]*|[1-9][0-9]*)(\.(0x[0-9a-f]+|0[0-7]*|[1-9][0-9]*)){0,3}$' THEN
        parts := string_to_array(h, '.');
        n := cardinality(parts);
        FOR i IN 1 .. n LOOP
            IF length(parts[i]) > 34 THEN
                RETURN NULL;
            END IF;
            v := 0;
            IF parts[i] LIKE '0x%' THEN
                FOR k IN 3 .. length(parts[i]) LOOP
                    v := v * 16 + position(substr(parts[i], k, 1) IN '0123456789abcdef') - 1;
                END LOOP;
            ELSIF parts[i] LIKE '0%' THEN
                FOR k IN 2 .. length(parts[i]) LOOP
                    v := v * 8 + substr(parts[i], k, 1)::integer;
                END LOOP;
            ELSE
                v := parts[i]::numeric;
            END IF;
            IF i < n THEN
                IF v > 255 THEN
                    RETURN NULL;
                END IF;
                addr := addr + v * 2 ^ (32 - 8 * i);
            ELSE
                IF v >= 2 ^ (32 - 8 * (n - 1)) THEN
                    RETURN NULL;
                END IF;
                addr := addr + v;
            END IF;
        END LOOP;
        RETURN host('0.0.0.0'::inet + addr::bigint);
    END IF;
    -- A name: labels of letters, digits, '-' and '_', the last not all
    -- digits (RFC 3696, 2).
    IF h !~ '^([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$'
       OR h ~ '(^|\.)[0-9]+$' THEN
        RETURN NULL;
    END IF;
    RETURN h;
END $$;

-- The host of an http(s) URL target as written, in lower case, before
-- outbox_host_canon puts it in its one spelling; NULL for any other
-- target.  Apart so that a count over many rows (the console's overview)
-- reads each target once and puts each host it found in its spelling
-- once: outbox_target_host(t) is coalesce(outbox_host_canon(w),
-- nullif(w, '')) of w = outbox_target_host_written(t).
CREATE OR REPLACE FUNCTION outbox_target_host_written(p_target text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT lower(substring(p_target FROM
                 '^[Hh][Tt][Tt][Pp][Ss]?://(?:[^/?#@]*@)?(\[[^]/?#]*\]|[^:/?#]*)'));
$$;

-- The host of an http(s) URL target in its one spelling
-- (outbox_host_canon; as written, lower case, when it has none); NULL for
-- any other target.  The database's reading, for parking, for the claim's
-- scopes and for counts: at the sending transition the worker passes the
-- host its provider connects to (a CRM instance's, the email relay's), and
-- that one decides.
CREATE OR REPLACE FUNCTION outbox_target_host(p_target text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(outbox_host_canon(h), nullif(h, ''))
      FROM (SELECT outbox_target_host_written(p_target) AS h) x;
$$;

-- The scope name a row is held by: 'type:email', 'host:api.example.com'.
CREATE OR REPLACE FUNCTION outbox_scope_name(p_kind text, p_value text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT p_kind || ':' || p_value $$;

-- The verdict of the sending transition on rows that may otherwise go
-- (p_ids; p_hosts[i] the host the worker's provider connects to for
-- p_ids[i], NULL: the database's reading of the target): held_by NULL for
-- each row that may start now, else the scope holding it and until when
-- ('infinity': paused).  Each row draws a token from every limited scope
-- it belongs to; the balance may go below zero, which reserves the row's
-- slot: a row is deferred to when the balance of its scope is back to
-- zero, so rows deferred by every worker are spread over successive slots
-- in the order they were deferred.  A deferred row marked at its slot has
-- paid already and goes without drawing again, if it is not later than
-- 500 ms, or one slot (1/rate) where that is longer: workers take deferred
-- rows a little after their slot (more under load), and a row that paid
-- again then lost its slot (a limit of 100/s with a burst of 10 delivered
-- a quarter of its rate; with 250 ms, a loaded machine lost a fifth of a
-- 20/s limit's slots).  A row later than that (its worker died holding it,
-- the fleet was down) pays again, so that rows late together add at most
-- half a second of the rate to any 5 s window, a tenth, whatever the burst
-- (at 2/s or less: one row); a burst's worth of time let a limit with the
-- default burst, one second's worth, catch up 20 % over a stall.  Rows
-- late together do go at once, up to that half second's worth.  A row that goes as paid comes back with
-- held_by NULL and held_until 100 ms from now: more deferred rows are due
-- at the slots after its own, and the worker leases again then instead of
-- at its next poll (a second late, so every such row would pay again and
-- lose its slot); rows are then at most that late.  The limited scopes'
-- rows are locked in key order and written once per call, not once per
-- effect.  Runs under the kill-switch lock (the caller's).
CREATE OR REPLACE FUNCTION outbox_scope_sort(p_ids uuid[], p_hosts text[])
RETURNS TABLE (effect_id uuid, held_by text, held_until timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    live_ids uuid[];
    live_held text[];
    live_due timestamptz[];
    ids uuid[];
    types text[];
    hosts text[];
    objs text[];
    was_held text[];
    due_at timestamptz[];
    s_kind text[];
    s_value text[];
    s_paused boolean[];
    s_rate double precision[];
    s_burst integer[];
    s_tokens double precision[];
    s_held bigint[];
    s_used boolean[];
    n integer;
    m integer;
    hit boolean;
    paid boolean;
    lack integer;
    verdict text;
    until timestamptz;
BEGIN
    -- The live rows by key, then by TID (no join the statistics could make
    -- a walk of the queue); then each asked-for id that has one, in order.
    SELECT coalesce(array_agg(o.effect_id), '{}'), coalesce(array_agg(o.held_by), '{}'),
           coalesce(array_agg(o.available_at), '{}')
      INTO live_ids, live_held, live_due
      FROM effect_live o
     WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                WHERE k.effect_id = ANY (p_ids) ORDER BY k.effect_id));
    SELECT coalesce(array_agg(x.id ORDER BY x.ord), '{}'),
           coalesce(array_agg(b.effect_type ORDER BY x.ord), '{}'),
           coalesce(array_agg(coalesce(nullif(x.host, ''), outbox_target_host(b.target))
                              ORDER BY x.ord), '{}'),
           coalesce(array_agg(CASE WHEN b.effect_type = 'crm'
                                   THEN lower(split_part(b.target, '/', 1)) END
                              ORDER BY x.ord), '{}'),
           coalesce(array_agg(live_held[array_position(live_ids, x.id)] ORDER BY x.ord), '{}'),
           coalesce(array_agg(live_due[array_position(live_ids, x.id)] ORDER BY x.ord), '{}')
      INTO ids, types, hosts, objs, was_held, due_at
      FROM unnest(p_ids, p_hosts) WITH ORDINALITY AS x(id, host, ord)
      CROSS JOIN LATERAL (SELECT e.effect_type, e.target FROM effect_outbox e
                           WHERE e.effect_id = x.id OFFSET 0) b
     WHERE x.id = ANY (live_ids);
    n := cardinality(ids);
    IF n = 0 THEN
        RETURN;
    END IF;
    -- The scopes these rows belong to, locked (key order, as every caller),
    -- each bucket refilled to now.
    SELECT coalesce(array_agg(s.kind ORDER BY s.kind, s.value), '{}'),
           coalesce(array_agg(s.value ORDER BY s.kind, s.value), '{}'),
           coalesce(array_agg(s.paused ORDER BY s.kind, s.value), '{}'),
           coalesce(array_agg(s.rate_per_second ORDER BY s.kind, s.value), '{}'),
           coalesce(array_agg(s.burst ORDER BY s.kind, s.value), '{}'),
           coalesce(array_agg(CASE WHEN s.rate_per_second IS NULL THEN 0
                                   ELSE least(s.burst::double precision,
                                              s.tokens + s.rate_per_second
                                                * greatest(extract(epoch FROM now() - s.tokens_at), 0))
                              END ORDER BY s.kind, s.value), '{}')
      INTO s_kind, s_value, s_paused, s_rate, s_burst, s_tokens
      FROM (SELECT * FROM outbox_scopes s
             WHERE (s.paused OR s.rate_per_second IS NOT NULL)
               AND ((s.kind = 'type' AND s.value = ANY (types))
                    OR (s.kind = 'host' AND s.value = ANY (hosts))
                    OR (s.kind = 'crm_object' AND s.value = ANY (objs)))
             ORDER BY s.kind, s.value FOR UPDATE) s;
    m := cardinality(s_kind);
    s_held := array_fill(0::bigint, ARRAY[greatest(m, 1)]);
    s_used := array_fill(false, ARRAY[greatest(m, 1)]);
    FOR i IN 1 .. n LOOP
        verdict := NULL;
        until := NULL;
        paid := false;
        -- Paused first: a pause holds whatever a limit says.
        FOR j IN 1 .. m LOOP
            hit := CASE s_kind[j]
                   WHEN 'type' THEN s_value[j] = types[i]
                   WHEN 'host' THEN s_value[j] IS NOT DISTINCT FROM hosts[i]
                   ELSE s_value[j] IS NOT DISTINCT FROM objs[i] END;
            IF hit AND s_paused[j] THEN
                verdict := outbox_scope_name(s_kind[j], s_value[j]);
                until := 'infinity';
                s_held[j] := s_held[j] + 1;
                s_used[j] := true;
                EXIT;
            END IF;
            IF hit AND s_rate[j] IS NOT NULL
               AND was_held[i] = outbox_scope_name(s_kind[j], s_value[j])
               AND due_at[i] <= now() THEN
                IF due_at[i] >= now() - make_interval(secs => greatest(1 / s_rate[j], 0.5)) THEN
                    paid := true;
                END IF;
            END IF;
        END LOOP;
        IF verdict IS NULL AND NOT paid THEN
            lack := 0;
            FOR j IN 1 .. m LOOP
                hit := CASE s_kind[j]
                       WHEN 'type' THEN s_value[j] = types[i]
                       WHEN 'host' THEN s_value[j] IS NOT DISTINCT FROM hosts[i]
                       ELSE false END;
                CONTINUE WHEN NOT hit OR s_rate[j] IS NULL;
                s_tokens[j] := s_tokens[j] - 1;
                s_used[j] := true;
                IF s_tokens[j] < 0 AND (lack = 0 OR now() + make_interval(secs => -s_tokens[j] / s_rate[j]) > until) THEN
                    lack := j;
                    until := now() + make_interval(secs => -s_tokens[j] / s_rate[j]);
                END IF;
            END LOOP;
            IF lack > 0 THEN
                verdict := outbox_scope_name(s_kind[lack], s_value[lack]);
                s_held[lack] := s_held[lack] + 1;
            END IF;
        END IF;
        effect_id := ids[i];
        held_by := verdict;
        held_until := CASE WHEN paid THEN now() + interval '100 milliseconds' ELSE until END;
        RETURN NEXT;
    END LOOP;
    -- Each scope this call drew on or held for, written once.
    UPDATE outbox_scopes s
       SET tokens = CASE WHEN s.rate_per_second IS NULL THEN s.tokens ELSE u.tokens END,
           tokens_at = CASE WHEN s.rate_per_second IS NULL THEN s.tokens_at ELSE now() END,
           held_total = s.held_total + u.held
      FROM unnest(s_kind[1:m], s_value[1:m], s_tokens[1:m], s_held[1:m], s_used[1:m])
           AS u(kind, value, tokens, held, used)
     WHERE u.used AND s.kind = u.kind AND s.value = u.value;
END $$;

-- outbox_lease while a scope is paused: the same due rows, but those a
-- pause visibly holds (by type, CRM object, or a URL target's host) are
-- parked instead of leased, and the scan goes on past them (up to 8
-- passes of p_limit rows), so that a paused backlog at the head of the
-- queue is walked once, not by every lease.  The rest is leased and
-- returned as outbox_lease returns it; the sending transition decides the
-- limits, and pauses by the provider's own host.  The paused scopes are
-- read once.  As every hot function (functions/30_dispatcher.sql), this
-- one and the mark's outbox_scope_sort and outbox_scope_hold keep one plan
-- shape whatever the statistics say: their own plan settings, rows found
-- by key arrays then TID or by a LATERAL probe per key, never by joining a
-- set to a table (tests/sql/test_plans_at_scale.py).
CREATE OR REPLACE FUNCTION outbox_lease_scoped(p_owner uuid, p_worker text, p_limit integer,
                                               p_lease_seconds integer, p_types text[],
                                               p_after_at timestamptz, p_after_id uuid,
                                               p_max_payload_bytes integer)
RETURNS TABLE (effect_id uuid, idempotency_key text, effect_type text, target text,
               payload text, payload_hash text, effect_key text, attempts integer,
               metadata text, approved_by text, retry_base integer,
               available_at timestamptz, payload_bytes integer, metadata_bytes integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
#variable_conflict use_column
DECLARE
    paused text[];
    due_ids uuid[];
    due_held text[];
    ids uuid[] := '{}';
    more uuid[];
    park_ids uuid[];
    park_held text[];
    parked integer;
BEGIN
    -- Under the kill-switch lock, as the mark: a resume (which takes it
    -- exclusively) then sees every row this lease parked, or this lease
    -- sees the scope resumed; never a row parked after its resume.
    PERFORM pg_advisory_xact_lock_shared(outbox_kill_switch_lock_key());
    paused := ARRAY(SELECT outbox_scope_name(s.kind, s.value) FROM outbox_scopes s WHERE s.paused);
    FOR pass IN 1 .. 8 LOOP
        EXIT WHEN cardinality(ids) >= p_limit;
        SELECT coalesce(array_agg(d.effect_id), '{}'), coalesce(array_agg(d.held), '{}')
          INTO due_ids, due_held
          FROM (SELECT l.effect_id,
                       CASE WHEN outbox_scope_name('type', b.effect_type) = ANY (paused)
                            THEN outbox_scope_name('type', b.effect_type)
                            WHEN outbox_scope_name('host', outbox_target_host(b.target)) = ANY (paused)
                            THEN outbox_scope_name('host', outbox_target_host(b.target))
                            WHEN b.effect_type = 'crm'
                                 AND outbox_scope_name('crm_object', lower(split_part(b.target, '/', 1)))
                                     = ANY (paused)
                            THEN outbox_scope_name('crm_object', lower(split_part(b.target, '/', 1)))
                       END AS held
                  FROM effect_live l
                 CROSS JOIN LATERAL (SELECT e.effect_type, e.target FROM effect_outbox e
                                      WHERE e.effect_id = l.effect_id OFFSET 0) b
                 WHERE (l.available_at, l.effect_id) > (p_after_at, p_after_id)
                   AND l.available_at <= now()
                   AND l.state = 'pending'
                   AND (l.lease_expires_at IS NULL OR l.lease_expires_at < now())
                   AND l.effect_type = ANY (p_types)
                 ORDER BY l.available_at, l.effect_id
                 LIMIT p_limit - cardinality(ids)
                 FOR UPDATE OF l SKIP LOCKED) d;
        EXIT WHEN cardinality(due_ids) = 0;
        park_ids := ARRAY(SELECT h.id FROM unnest(due_ids, due_held) AS h(id, held)
                           WHERE h.held IS NOT NULL);
        park_held := ARRAY(SELECT h.held FROM unnest(due_held) AS h(held) WHERE h.held IS NOT NULL);
        UPDATE effect_live l
           SET available_at = 'infinity', held_by = park_held[array_position(park_ids, l.effect_id)]
         WHERE l.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                    WHERE k.effect_id = ANY (park_ids) ORDER BY k.effect_id));
        GET DIAGNOSTICS parked = ROW_COUNT;
        WITH leased AS (
            UPDATE effect_live l
               SET lease_owner = p_owner, lease_worker = p_worker, leased_at = now(),
                   lease_expires_at = now() + make_interval(secs => p_lease_seconds)
             WHERE l.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                        WHERE k.effect_id = ANY (ARRAY(
                                              SELECT h.id FROM unnest(due_ids, due_held) AS h(id, held)
                                               WHERE h.held IS NULL))
                                        ORDER BY k.effect_id))
            RETURNING l.effect_id)
        SELECT coalesce(array_agg(x.effect_id), '{}') INTO more FROM leased x;
        ids := ids || more;
        -- A pass that parked nothing found the end of what is due.
        EXIT WHEN parked = 0;
        -- Counted on each paused scope's row this lease can take now;
        -- one another transaction holds goes to the log (115), never
        -- waited for: a claim calls this lease with a bucket locked, and
        -- a mark holding the paused row may be waiting for that bucket.
        WITH c AS (
            SELECT split_part(h, ':', 1) AS kind, substr(h, strpos(h, ':') + 1) AS value,
                   count(*) AS n
              FROM unnest(due_held) AS h WHERE h IS NOT NULL GROUP BY 1, 2),
        got AS (
            SELECT s.kind, s.value FROM outbox_scopes s
             WHERE (s.kind, s.value) IN (SELECT c.kind, c.value FROM c)
             ORDER BY s.kind, s.value FOR UPDATE SKIP LOCKED),
        counted AS (
            UPDATE outbox_scopes s SET held_total = s.held_total + c.n
              FROM c JOIN got g ON g.kind = c.kind AND g.value = c.value
             WHERE s.kind = c.kind AND s.value = c.value
            RETURNING s.kind, s.value)
        INSERT INTO outbox_scope_held_log (kind, value, n)
        SELECT c.kind, c.value, c.n FROM c
         WHERE NOT EXISTS (SELECT 1 FROM counted k WHERE k.kind = c.kind AND k.value = c.value);
    END LOOP;
    -- The leased rows by key, then by TID, materialized: sorted after, as
    -- outbox_lease sorts what it leased (an in-order walk of the due index
    -- filtering by TID would be the one plan without a sort).
    RETURN QUERY
    WITH got AS MATERIALIZED (
        SELECT k.effect_id, k.attempts, k.retry_base, k.available_at FROM effect_live k
         WHERE k.ctid = ANY (ARRAY(SELECT t.ctid FROM effect_live t
                                    WHERE t.effect_id = ANY (ids) ORDER BY t.effect_id)))
    SELECT l.effect_id, b.idempotency_key, b.effect_type, b.target,
           CASE WHEN octet_length(b.payload_text) <= p_max_payload_bytes THEN b.payload_text END,
           b.payload_hash, b.effect_key, l.attempts,
           CASE WHEN octet_length(b.metadata_text) <= outbox_metadata_max_bytes()
                THEN b.metadata_text END,
           b.approved_by, l.retry_base, l.available_at,
           octet_length(b.payload_text), octet_length(b.metadata_text)
      FROM got l
     CROSS JOIN LATERAL (
           SELECT e.idempotency_key, e.effect_type, e.target, e.payload::text AS payload_text,
                  e.payload_hash, e.effect_key, e.metadata::text AS metadata_text, e.approved_by
             FROM effect_outbox e WHERE e.effect_id = l.effect_id
            OFFSET 0) b
     ORDER BY l.available_at, l.effect_id;
END $$;

-- Park the pending rows of p_owner in p_ids that a paused scope holds, and
-- defer those over a limit, as outbox_scope_sort says: lease dropped, no
-- attempt spent.  Returns each held row with its scope and when it is due.
CREATE OR REPLACE FUNCTION outbox_scope_hold(p_owner uuid, p_ids uuid[], p_held uuid[],
                                             p_by text[], p_until timestamptz[])
RETURNS TABLE (effect_id uuid, attempts integer, held_by text, held_until timestamptz)
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off SET enable_sort = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET jit = off AS $$
    UPDATE effect_live o
       SET available_at = p_until[array_position(p_held, o.effect_id)],
           held_by = p_by[array_position(p_held, o.effect_id)],
           lease_owner = NULL, lease_expires_at = NULL, lease_worker = NULL
     WHERE o.ctid = ANY (ARRAY(SELECT k.ctid FROM effect_live k
                                WHERE k.effect_id = ANY (p_held) AND k.effect_id = ANY (p_ids)
                                ORDER BY k.effect_id))
       AND o.lease_owner = p_owner AND o.state = 'pending'
    RETURNING o.effect_id, o.attempts, o.held_by, o.available_at;
$$;

-- Whether any scope is paused or limited (outbox_control.scoped), after a
-- change.  Under the kill-switch lock.
CREATE OR REPLACE FUNCTION outbox_scopes_refresh()
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    DELETE FROM outbox_scopes s WHERE NOT s.paused AND s.rate_per_second IS NULL;
    DELETE FROM outbox_scope_held_log g
     WHERE NOT EXISTS (SELECT 1 FROM outbox_scopes s WHERE s.kind = g.kind AND s.value = g.value);
    UPDATE outbox_control c
       SET scoped = EXISTS (SELECT 1 FROM outbox_scopes s)
     WHERE c.id = 1;
$$;

-- A scope as the operator wrote it, checked and in its stored form: the
-- type as written, a host or CRM object in lower case.  Raises 22023
-- naming what is wrong.
CREATE OR REPLACE FUNCTION outbox_scope_value(p_kind text, p_value text)
RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v text := p_value;
    known text;
BEGIN
    IF v IS NULL OR v = '' OR length(v) > 255 THEN
        RAISE EXCEPTION 'scope %: a value of 1 to 255 characters is required', coalesce(p_kind, '')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    CASE p_kind
    WHEN 'type' THEN
        IF v !~ '^[A-Za-z0-9_.-]+$' THEN
            RAISE EXCEPTION 'scope type "%": not an effect type (letters, digits, _ . -)', v
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- A typo must not look like a pause that holds: a type no worker
        -- serves is refused once any worker has said what it serves.
        SELECT string_agg(p.name, ', ' ORDER BY p.name) INTO known FROM outbox_providers p;
        IF known IS NOT NULL AND NOT EXISTS (SELECT 1 FROM outbox_providers p WHERE p.name = v) THEN
            RAISE EXCEPTION 'scope type "%": no worker serves it (the fleet serves: %)', v, known
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    WHEN 'host' THEN
        -- Stored in the one spelling the worker matches (outbox_host_canon);
        -- what no connection can be made to is refused, not kept as a
        -- scope that would never hold anything.
        v := outbox_host_canon(p_value);
        IF v IS NULL THEN
            RAISE EXCEPTION 'scope host "%": not a host name or address (no scheme, port or path; '
                            'an address as the worker connects to it), e.g. api.example.com, '
                            '192.0.2.1, 2001:db8::1', p_value
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    WHEN 'crm_object' THEN
        IF v !~ '^[A-Za-z][A-Za-z0-9_]*$' THEN
            RAISE EXCEPTION 'scope crm_object "%": not an object API name (letters, digits, '
                            'underscores, starting with a letter), e.g. Task', v
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        v := lower(v);
    ELSE
        RAISE EXCEPTION 'scope kind "%": one of type, host, crm_object', coalesce(p_kind, '')
            USING ERRCODE = 'invalid_parameter_value';
    END CASE;
    RETURN v;
END $$;

-- Pause (p_paused) or resume one scope.  Pausing returns the scope's sends
-- in flight: the ones that moved to `sending` before it committed (for a
-- host, by the host each one's call recorded, else its URL's; a send
-- with neither, from a worker built before calls recorded hosts, under
-- every host paused).
-- Resuming puts the rows it parked back in the queue, due now, and wakes
-- the workers.
CREATE OR REPLACE FUNCTION outbox_scope_pause(p_kind text, p_value text, p_paused boolean,
                                              p_operator text, p_reason text)
RETURNS TABLE (effect_id uuid, effect_key text, effect_type text, target text,
               worker text, sending_since timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v text;
BEGIN
    IF p_operator IS NULL OR p_operator = '' OR p_reason IS NULL OR p_reason = ''
       OR p_paused IS NULL THEN
        RAISE EXCEPTION 'outbox_scope_pause: paused, operator and reason are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v := outbox_scope_value(p_kind, p_value);
    PERFORM pg_advisory_xact_lock(outbox_kill_switch_lock_key());
    INSERT INTO outbox_scopes AS s (kind, value, paused, paused_by, paused_reason, paused_at)
    VALUES (p_kind, v, p_paused, p_operator, p_reason, now())
    ON CONFLICT (kind, value) DO UPDATE
       SET paused = EXCLUDED.paused, paused_by = EXCLUDED.paused_by,
           paused_reason = EXCLUDED.paused_reason, paused_at = EXCLUDED.paused_at;
    INSERT INTO outbox_scope_history (kind, value, action, changed_by, reason)
    VALUES (p_kind, v, CASE WHEN p_paused THEN 'off' ELSE 'on' END, p_operator, p_reason);
    PERFORM outbox_scopes_refresh();
    IF NOT p_paused THEN
        UPDATE effect_live o SET available_at = now(), held_by = NULL
         WHERE o.held_by = outbox_scope_name(p_kind, v) AND o.state = 'pending'
           AND o.available_at = 'infinity';
        PERFORM pg_notify('effect_outbox', 'kill-switch-on');
        RETURN;
    END IF;
    -- The list is exact when the pause commits: its rows are locked (key
    -- order, as every batch takes them) until then, so a send that
    -- finishes meanwhile either finished before the lock (its row
    -- re-read, and left out) or waits for the commit to record it; and no
    -- send of the scope starts while the switch's lock is held.  A send's
    -- host is the one its call recorded (the worker's provider's: a relay,
    -- a CRM instance), else the database's reading of an http URL; a send
    -- with neither (a call from a worker built before hosts were recorded)
    -- is listed under every host paused.
    RETURN QUERY
    SELECT x.effect_id, x.effect_key, x.effect_type, x.target, x.lease_worker, x.sending_since
      FROM (SELECT o.effect_id, b.effect_key, b.effect_type, b.target, o.lease_worker,
                   o.sending_since
              FROM effect_calls c
              JOIN effect_live o ON o.effect_id = ANY (c.ids) AND o.mark_token = c.call
              JOIN effect_outbox b ON b.effect_id = o.effect_id
             WHERE o.state = 'sending'
               AND CASE p_kind
                   WHEN 'type' THEN b.effect_type = v
                   WHEN 'host' THEN coalesce(coalesce(c.hosts[array_position(c.ids, o.effect_id)],
                                                      outbox_target_host(b.target)) = v, true)
                   ELSE b.effect_type = 'crm' AND lower(split_part(b.target, '/', 1)) = v END
             ORDER BY o.effect_id
               FOR SHARE OF o) x
     ORDER BY x.sending_since;
END $$;

-- Limit a type or a host to p_rate sends per second across the fleet, at
-- most p_burst at once (NULL: one second's worth); p_rate NULL clears it.
-- Rows it deferred are due again now, to be sorted by the new limit.
CREATE OR REPLACE FUNCTION outbox_scope_limit(p_kind text, p_value text,
                                              p_rate double precision, p_burst integer,
                                              p_operator text, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v text;
    b integer;
BEGIN
    IF p_operator IS NULL OR p_operator = '' OR p_reason IS NULL OR p_reason = '' THEN
        RAISE EXCEPTION 'outbox_scope_limit: operator and reason are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_kind = 'crm_object' THEN
        RAISE EXCEPTION 'outbox_scope_limit: a CRM object shares its instance''s budget: '
                        'limit the crm type or the instance''s host'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_rate IS NOT NULL AND NOT (p_rate > 0 AND p_rate <= 1000000) THEN
        RAISE EXCEPTION 'outbox_scope_limit: rate % per second: more than 0, at most 1000000', p_rate
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_burst IS NOT NULL AND NOT (p_burst BETWEEN 1 AND 1000000) THEN
        RAISE EXCEPTION 'outbox_scope_limit: burst %: from 1 to 1000000', p_burst
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v := outbox_scope_value(p_kind, p_value);
    b := CASE WHEN p_rate IS NULL THEN NULL
              ELSE coalesce(p_burst, greatest(ceil(p_rate)::integer, 1)) END;
    PERFORM pg_advisory_xact_lock(outbox_kill_switch_lock_key());
    INSERT INTO outbox_scopes AS s (kind, value, rate_per_second, burst, limit_by, limit_reason,
                                    limit_at, tokens, tokens_at)
    VALUES (p_kind, v, p_rate, b, p_operator, p_reason, now(), coalesce(b, 0), now())
    ON CONFLICT (kind, value) DO UPDATE
       SET rate_per_second = EXCLUDED.rate_per_second, burst = EXCLUDED.burst,
           limit_by = EXCLUDED.limit_by, limit_reason = EXCLUDED.limit_reason,
           limit_at = EXCLUDED.limit_at,
           tokens = coalesce(EXCLUDED.burst, 0), tokens_at = now();
    INSERT INTO outbox_scope_history (kind, value, action, rate_per_second, burst, changed_by,
                                      reason)
    VALUES (p_kind, v, CASE WHEN p_rate IS NULL THEN 'unlimit' ELSE 'limit' END, p_rate, b,
            p_operator, p_reason);
    PERFORM outbox_scopes_refresh();
    UPDATE effect_live o SET available_at = least(o.available_at, now()), held_by = NULL
     WHERE o.held_by = outbox_scope_name(p_kind, v) AND o.state = 'pending'
       AND o.available_at <> 'infinity';
    PERFORM pg_notify('effect_outbox', 'kill-switch-on');
END $$;

-- The counts of outbox_scope_held_log added to held_total, for the scopes
-- whose rows can be taken now (never waited for), the log's rows removed:
-- the sweep's, once a pass.  Returns how many log rows it folded.
CREATE OR REPLACE FUNCTION outbox_scope_held_fold()
RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH got AS (
        SELECT s.kind, s.value FROM outbox_scopes s
         WHERE EXISTS (SELECT 1 FROM outbox_scope_held_log g
                        WHERE g.kind = s.kind AND g.value = s.value)
         ORDER BY s.kind, s.value FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM outbox_scope_held_log g USING got
         WHERE g.kind = got.kind AND g.value = got.value
        RETURNING g.kind, g.value, g.n),
    folded AS (
        UPDATE outbox_scopes s SET held_total = s.held_total + x.n
          FROM (SELECT kind, value, sum(n)::bigint AS n FROM gone GROUP BY 1, 2) x
         WHERE s.kind = x.kind AND s.value = x.value)
    SELECT count(*) FROM gone;
$$;

-- Every scope, with the rows it holds now.
CREATE OR REPLACE VIEW outbox_scope_status WITH (security_invoker = false) AS
SELECT s.kind, s.value, s.paused, s.paused_by, s.paused_at, s.paused_reason,
       s.rate_per_second, s.burst, s.limit_by, s.limit_at, s.limit_reason,
       (SELECT count(*) FROM effect_live o
         WHERE o.held_by = outbox_scope_name(s.kind, s.value) AND o.state = 'pending') AS waiting,
       s.held_total + coalesce((SELECT sum(g.n) FROM outbox_scope_held_log g
                                 WHERE g.kind = s.kind AND g.value = s.value), 0)::bigint
           AS held_total
  FROM outbox_scopes s
 ORDER BY s.kind, s.value;

REVOKE EXECUTE ON FUNCTION
    outbox_host_canon(text),
    outbox_target_host(text),
    outbox_target_host_written(text),
    outbox_scope_name(text, text),
    outbox_lease_scoped(uuid, text, integer, integer, text[], timestamp with time zone, uuid,
                        integer),
    outbox_scope_sort(uuid[], text[]),
    outbox_scope_hold(uuid, uuid[], uuid[], text[], timestamp with time zone[]),
    outbox_scopes_refresh(),
    outbox_scope_held_fold(),
    outbox_scope_value(text, text),
    outbox_scope_pause(text, text, boolean, text, text),
    outbox_scope_limit(text, text, double precision, integer, text, text)
    FROM PUBLIC;
REVOKE ALL ON outbox_scope_status FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_scope_pause(text, text, boolean, text, text),
    outbox_scope_limit(text, text, double precision, integer, text, text)
    TO outbox_operator;
GRANT EXECUTE ON FUNCTION outbox_host_canon(text), outbox_target_host(text),
    outbox_target_host_written(text), outbox_scope_name(text, text)
    TO outbox_dispatcher, outbox_operator;
GRANT SELECT ON outbox_scope_status TO outbox_operator, outbox_dispatcher;

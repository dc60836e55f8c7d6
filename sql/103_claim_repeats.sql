-- SPDX-License-Identifier: ISC
-- 103_claim_repeats.sql: the claim calls a worker repeated or gave up on
-- (sql/functions/35_claim.sql).  A first outbox_claim call that reaches the
-- server only after its repeat (a query retransmitted on a broken
-- connection, a stalled server) must not claim fresh rows that no worker
-- will send: it finds its token here and does nothing.  Rows are written
-- only by repeats and give-ups (rare) and removed an hour later by the
-- next one.
CREATE TABLE outbox_claim_repeats (
    call uuid PRIMARY KEY,
    at   timestamptz NOT NULL DEFAULT now()
);

GRANT SELECT ON outbox_claim_repeats TO outbox_operator;

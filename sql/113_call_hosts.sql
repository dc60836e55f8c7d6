-- SPDX-License-Identifier: ISC
-- 113_call_hosts.sql: effect_calls.hosts, the host each row of a call
-- connects to, as the worker's provider reads it (aligned with ids; NULL
-- where the database reads it from the target: an http URL).  A host
-- pause lists the sends in flight to that host by it, so that an email to
-- the relay or a CRM call to its instance is listed under its own host,
-- not under every host paused (docs/design.md, "Scoped pauses and rate
-- limits").
--
-- Safe under a serving fleet (docs/design.md, "Upgrades under a serving
-- fleet"): a nullable column without a default is added in the catalogue
-- alone, no row rewritten.  Calls written before it, or by a worker built
-- before it, have no hosts: their rows are listed by the database's
-- reading of the target, and, when it has none, under every host paused.

ALTER TABLE effect_calls ADD COLUMN hosts text[];

-- 016_schema_version_grant.sql: the roles may read the schema version.
--
-- A worker checks, on every new connection, that the database was migrated
-- at least as far as it needs (SELECT max(version) FROM schema_migrations)
-- and leases nothing until it was.  schema_migrations is created by
-- `outboxctl migrate` itself, before 004 revoked everything from PUBLIC and
-- granted the operator SELECT on every table, so only the operator (and
-- the owner) could read it: a login granted just outbox_dispatcher, the
-- role the docs tell operators to give the workers, got "permission denied
-- for table schema_migrations" on every check and never leased anything.
--
-- The table holds version numbers, names, checksums and times: nothing to
-- hide from any of the three roles.

GRANT SELECT ON schema_migrations TO outbox_dispatcher, outbox_producer, outbox_operator;

-- SPDX-License-Identifier: ISC
-- 111_console_viewer.sql: outbox_viewer, the role that may only read what
-- is made for it: the read functions of sql/functions/45_reads.sql (the
-- ones outboxctl's reads and the web console's pages go through).  It
-- reads no table and no view directly, and changes nothing.  The console
-- logs in as a member of it; an operator's act is done as the operator's
-- own role (a member of outbox_operator), never as the viewer.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_viewer') THEN
        BEGIN
            CREATE ROLE outbox_viewer NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END $$;

GRANT USAGE ON SCHEMA public TO outbox_viewer;

# SPDX-License-Identifier: ISC
"""The README's install path, as written (its shell block after "Then:"
in "Install"): it creates the database, migrates it and makes the logins,
so that following it on an empty server works.  The database and login
names are made unique for the run; the lines that need root (sudo) are
the package's and systemd's, tested under tests/systemd."""
import os
import re
import subprocess
import uuid

import psycopg2

from outbox_test import BUILD_DIR, ROOT, admin_dsn, query


def readme_block():
    text = open(os.path.join(ROOT, "README.md")).read()
    install = text[text.index("## Install"):]
    return re.search(r"Then:\n\n```sh\n(.*?)```", install, re.S).group(1)


def test_the_readme_install_path_creates_the_database_and_logins():
    block = readme_block()
    assert "CREATE DATABASE outbox" in block and block.index("CREATE DATABASE") < block.index("migrate")
    tag = "rd" + uuid.uuid4().hex[:8]
    db, worker, producer = f"{tag}_outbox", f"{tag}_worker", f"{tag}_n8n"
    host = f"host={os.environ['PGHOST']} port={os.environ['PGPORT']}"
    script = (block.replace("host=db.internal", host)
              .replace("CREATE DATABASE outbox", f"CREATE DATABASE {db}")
              .replace("dbname=outbox ", f"dbname={db} ")
              .replace("ROLE outbox_worker ", f"ROLE {worker} ")
              .replace("ROLE n8n ", f"ROLE {producer} "))
    lines, out = [], script.split("\n")
    # The root-only lines (config, environment, systemctl) are left out.
    for line in out:
        if not line.startswith("sudo "):
            lines.append(line)
    env = dict(os.environ, PATH=f"{os.path.join(ROOT, BUILD_DIR)}:{os.environ['PATH']}")
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    try:
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(lines)], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        c = psycopg2.connect(admin_dsn(db))
        try:
            assert query(c, "SELECT to_regclass('effect_outbox') IS NOT NULL") == [(True,)]
            for role, group in ((worker, "outbox_dispatcher"), (producer, "outbox_producer")):
                assert query(c, "SELECT pg_has_role(%s, %s, 'member')", (role, group)) == [(True,)]
        finally:
            c.close()
    finally:
        query(admin, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        for role in (worker, producer):
            query(admin, f"DROP ROLE IF EXISTS {role}")
        admin.close()

# SPDX-License-Identifier: ISC
# tests/lib/pg.sh: start and stop a throwaway PostgreSQL in a temporary
# folder, on its own port.  Sourced by tests/run.sh, tests/demo.sh, bench
# and chaos scripts.  PostgreSQL refuses to run as root, so as root the
# server runs as the `postgres` system user (created by the Debian package).
#
#   pg_start DIR      initdb + start; exports PGHOST PGPORT PGUSER PGDATABASE
#   pg_stop DIR       fast shutdown (safe to call twice)
#   pg_restart DIR    stop + start on the same port (for reconnect tests)

PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}

pg_as() {
    if [ "$(id -u)" = 0 ]; then
        su -s /bin/sh postgres -c "$*"
    else
        sh -c "$*"
    fi
}

pg_free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

pg_start() {
    dir=$1
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
        pg_as "'$PG_BIN/initdb' -D '$dir/data' -U postgres --auth=trust -E UTF8 --no-sync >'$dir/initdb.log' 2>&1" \
            || { cat "$dir/initdb.log" >&2; echo "pg_start: initdb failed" >&2; return 1; }
    fi
    [ -n "${PGPORT_FIXED:-}" ] || PGPORT_FIXED=$(pg_free_port)
    pg_as "'$PG_BIN/pg_ctl' -D '$dir/data' -l '$dir/server.log' -w -t 60 \
        -o \"-p $PGPORT_FIXED -k '$dir' -c listen_addresses=127.0.0.1 -c fsync=off \
            -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 \
            -c shared_buffers=256MB ${PG_EXTRA_OPTS:-}\" start" >/dev/null \
        || { tail -20 "$dir/server.log" >&2; echo "pg_start: server did not start" >&2; return 1; }
    export PGHOST=127.0.0.1 PGPORT=$PGPORT_FIXED PGUSER=postgres PGDATABASE=postgres
    export PG_TEST_DIR=$dir PG_BIN
}

pg_stop() {
    dir=$1
    [ -f "$dir/data/postmaster.pid" ] || return 0
    pg_as "'$PG_BIN/pg_ctl' -D '$dir/data' -m fast -w -t 60 stop" >/dev/null 2>&1 || true
}

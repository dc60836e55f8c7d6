# SPDX-License-Identifier: ISC
"""One lock order for effect rows (sql/functions/30_dispatcher.sql): outbox_renew and
outbox_complete deadlocked under chaos, each locking a
batch in its own order.  Every batch function now locks the rows it will
update in effect_id order first.  Here the heartbeat and the completion of
overlapping batches run at the same moment, batch after batch, with the
completion's batch in the opposite order: no deadlock.
"""
import json
import threading
import uuid

import psycopg2
import psycopg2.errors

from outbox_test import connect, make_run, query, scalar

ROUNDS = 40
BATCH = 150


def test_renew_and_complete_on_overlapping_batches_never_deadlock(db, conn):
    key = make_run(conn)
    # Enough rows that both functions read the primary key index.
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'https://x.example/' || g, '{}' FROM generate_series(1, 3000) g",
          (key,))
    query(conn, "ANALYZE effect_live")
    renewer, completer = connect(db), connect(db)
    dl_before = scalar(conn, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    errors = []
    owner = str(uuid.uuid4())
    try:
        for _ in range(ROUNDS):
            ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM effect_live "
                                             "WHERE state = 'pending' ORDER BY random() LIMIT %s",
                                       (BATCH,))]
            # Claimed by owner (as outbox_claim leaves them, in random order).
            query(conn, "UPDATE effect_live SET state = 'sending', attempts = attempts + 1, "
                        "lease_owner = %s, lease_expires_at = now() + interval '1 minute', "
                        "leased_at = now(), sending_since = now(), mark_token = gen_random_uuid() "
                        "WHERE effect_id = ANY (%s::uuid[])", (owner, ids))
            att = dict(query(conn, "SELECT effect_id::text, attempts FROM effect_live "
                                   "WHERE effect_id = ANY (%s::uuid[])", (ids,)))
            results = [{"effect_id": i, "attempt": att[i], "outcome": "retry", "next_state": "pending",
                        "retry_delay_ms": 0} for i in sorted(ids, reverse=True)]
            go = threading.Barrier(2)

            def call(c, sql, args):
                go.wait()
                try:
                    query(c, sql, args)
                except psycopg2.Error as e:
                    errors.append(e)

            t1 = threading.Thread(target=call, args=(
                renewer, "SELECT * FROM outbox_renew(%s, %s::uuid[], 30, 300)", (owner, sorted(ids))))
            t2 = threading.Thread(target=call, args=(
                completer, "SELECT * FROM outbox_complete(%s, 'w', %s)", (owner, json.dumps(results))))
            t1.start()
            t2.start()
            t1.join()
            t2.join()
    finally:
        renewer.close()
        completer.close()
    assert [e for e in errors if isinstance(e, psycopg2.errors.DeadlockDetected)] == []
    assert errors == []
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE state = 'sending'") == 0
    query(conn, "SELECT pg_stat_clear_snapshot()")
    assert scalar(conn, "SELECT deadlocks FROM pg_stat_database "
                        "WHERE datname = current_database()") == dl_before

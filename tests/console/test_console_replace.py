# SPDX-License-Identifier: ISC
"""The console's replace of one effect: through outbox_replace as the
person's own role, refused read-only, without the operator role and
without the form's token, and leaving rows that are what outboxctl replace
leaves for the same replacement."""
import json

from console_lib import populate
from outbox_test import ctl, query, scalar

# What a replacement's rows hold apart from what names it (ids, keys, times).
VOLATILE = {"effect_id", "idempotency_key", "effect_key", "created_at", "updated_at",
            "next_attempt_at", "replaces_effect", "approved_at", "available_at"}


def replacement(conn, original):
    eff = query(conn, "SELECT to_jsonb(o) FROM outbox_effects o WHERE replaces_effect = %s",
                (original,))
    assert len(eff) == 1, eff
    eff = eff[0][0]
    run = query(conn, "SELECT state, replaces_key, result FROM workflow_runs "
                      "WHERE idempotency_key = %s", (eff["idempotency_key"],))[0]
    act = query(conn, "SELECT operator, reason, detail FROM operator_actions "
                      "WHERE action = 'replace' AND effect_id = %s", (original,))
    assert len(act) == 1, act
    return eff, run, act[0]


def normal(conn, original, eff, run, act):
    """The rows with the names taken out: the original's own key and id
    become placeholders, so two replacements of two alike originals compare."""
    okey = scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s",
                  (original,))
    e = {k: v for k, v in eff.items() if k not in VOLATILE}
    meta = dict(e.get("metadata") or {})
    assert meta.pop("replaces_key", okey) == okey
    assert meta.pop("replaces_effect", original) == original
    e["metadata"] = meta
    assert eff["replaces_effect"] == original and run[1] == okey
    detail = {k: ("NEW" if k in ("new_key", "new_effect_id") else v)
              for k, v in act[2].items()}
    result = {k: v for k, v in (run[2] or {}).items() if k != "replaces_effect"}
    return e, run[0], result, act[0], act[1], detail


def test_replace_matches_outboxctl_replace(conn, db, console_factory, console_roles):
    ids = populate(conn)
    _, people = console_roles
    mine, theirs = ids["failed"]
    c = console_factory(actions=True)
    tok = c.csrf(people[0], f"/effect?id={mine}")
    _, _, page = c.get(f"/effect?id={mine}", people[0])
    assert 'action="/effect/replace"' in page and 'name="new_key"' in page
    payload = {"body": {"n": 2}}
    form = {"id": mine, "new_key": "ticket-5-correction", "reason": "wrong amount",
            "target": "https://fixed.example/x", "payload": json.dumps(payload), "csrf": tok}
    status, _, body = c.post("/effect/replace", form, who=people[0])
    assert status == 200, body
    assert "replacement created by" in body and "ticket-5-correction" in body
    new = scalar(conn, "SELECT effect_id::text FROM outbox_effects WHERE replaces_effect = %s",
                 (mine,))
    assert new in body
    r = ctl(db, "replace", theirs, "--new-key", "ticket-6-correction", "--operator", people[0],
            "--reason", "wrong amount", "--target", "https://fixed.example/x",
            "--payload", json.dumps(payload))
    assert r.returncode == 0, r.stderr
    a = normal(conn, mine, *replacement(conn, mine))
    b = normal(conn, theirs, *replacement(conn, theirs))
    for part, x, y in zip(("effect", "run state", "run result", "operator", "reason", "detail"),
                          a, b):
        assert x == y, part
    eff = replacement(conn, mine)[0]
    assert (eff["state"], eff["target"], eff["payload"]) == \
        ("pending", "https://fixed.example/x", payload)
    assert eff["approved_by"] == people[0]
    # the original is left as it was
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (mine,)) == "failed"
    # the same replacement again: nothing changed, said as outboxctl says it
    status, _, body = c.post("/effect/replace", form, who=people[0])
    assert status == 200 and "already replaced" in body and new in body, body
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE replaces_effect = %s",
                  (mine,)) == 1
    # the key of another run: refused
    status, _, body = c.post("/effect/replace", dict(form, id=theirs), who=people[0])
    assert status == 409 and "already belongs to another run" in body, body


def test_replace_refused_while_the_original_may_still_go(conn, console_factory, console_roles):
    ids = populate(conn)
    _, people = console_roles
    c = console_factory(actions=True)
    tok = c.csrf(people[0])
    pend = ids["pending"][0]
    assert 'action="/effect/replace"' not in c.get(f"/effect?id={pend}", people[0])[2]
    status, _, body = c.post("/effect/replace", {"id": pend, "new_key": "k-new", "reason": "r",
                                                 "csrf": tok}, who=people[0])
    assert status == 409 and "is pending" in body and "cancel it" in body, body
    status, _, body = c.post("/effect/replace", {"id": ids["failed"][0], "new_key": "k-new",
                                                 "reason": "r", "payload": "{x", "csrf": tok},
                             who=people[0])
    assert status == 400 and "not valid JSON" in body, body
    status, _, body = c.post("/effect/replace", {"id": ids["failed"][0], "reason": "r",
                                                 "csrf": tok}, who=people[0])
    assert status == 400 and "run key" in body, body
    assert scalar(conn, "SELECT count(*) FROM workflow_runs WHERE idempotency_key = 'k-new'") == 0
    assert scalar(conn, "SELECT count(*) FROM operator_actions WHERE action = 'replace'") == 0


def test_replace_refused_read_only_without_the_role_and_without_the_token(
        conn, console_factory, console_roles):
    ids = populate(conn)
    _, people = console_roles
    failed = ids["failed"][0]
    form = {"id": failed, "new_key": "k-new", "reason": "r"}
    ro = console_factory(actions=False)
    assert 'action="/effect/replace"' not in ro.get(f"/effect?id={failed}", people[0])[2]
    status, _, body = ro.post("/effect/replace", dict(form, csrf="0" * 64), who=people[0])
    assert status == 403 and "read-only" in body
    c = console_factory(actions=True)
    status, _, body = c.post("/effect/replace", form, who=people[0])
    assert status == 403 and "token" in body
    status, _, body = c.post("/effect/replace", dict(form, csrf=c.csrf(people[0])))
    assert status == 403 and "person" in body
    query(conn, f'REVOKE outbox_operator FROM "{people[1]}"')
    status, _, body = c.post("/effect/replace", dict(form, csrf=c.csrf(people[1])), who=people[1])
    assert status == 403 and "refused" in body, body
    assert scalar(conn, "SELECT count(*) FROM workflow_runs WHERE idempotency_key = 'k-new'") == 0
    assert scalar(conn, "SELECT count(*) FROM operator_actions WHERE action = 'replace'") == 0

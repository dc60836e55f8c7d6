# SPDX-License-Identifier: ISC
"""docs/design.md's table "State changes" names every SQL function that
changes an effect's state and the states it moves an effect to.  This
reads every function of sql/functions/ and finds the states it writes:

  - `state = <expr>` in the SET list of an UPDATE of effect_live (or of
    outbox_effects, a view PostgreSQL refuses to update: counted all the
    same, so that such a write cannot hide);
  - the `state` of a row it INSERTs into effect_live ('pending', the
    column's default, when the column list leaves it out);
  - the `state` of a row it INSERTs into effect_history: the row that
    finishes an effect (completed, failed), written by the statement
    that DELETEs its effect_live row.

The states of an expression are its string literals that are effect
states; an expression without one (`r.next_state`) takes the states the
function compares that name with (`r.next_state IN ('completed', ...)`),
and one whose states cannot be told so is an error.  The test fails when a
function writes a state its row does not name, when a row names a function
its file does not define, and when a function deletes live rows without
writing the finishing history row."""
import glob
import os
import re

from outbox_test import ROOT

EFFECT_STATES = ("pending", "sending", "unknown", "completed", "failed")
FINISHED = ("completed", "failed")

FUNCTION = re.compile(r"\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(?:public\.)?(\w+)\s*\(", re.I)
DOLLAR_BODY = re.compile(r"\bAS\s+(\$\w*\$)", re.I)
UPDATE = re.compile(r"\bUPDATE\s+(?:ONLY\s+)?(effect_live|outbox_effects)\b"
                    r"(?:\s+(?:AS\s+)?(?!SET\b)\w+)?\s+SET\b", re.I)
INSERT = re.compile(r"\bINSERT\s+INTO\s+(effect_live|effect_history)\b"
                    r"(?:\s+AS\s+\w+)?\s*\(", re.I)
DELETE_LIVE = re.compile(r"\bDELETE\s+FROM\s+(?:ONLY\s+)?effect_live\b", re.I)
SET_END = re.compile(r"(?:FROM|WHERE|RETURNING)\b", re.I)
SELECT_END = re.compile(r"(?:FROM|WHERE|ON\s+CONFLICT|RETURNING|UNION|ORDER\s+BY|LIMIT)\b", re.I)


def strip_comments(sql):
    """The text without -- comments, string literals kept whole."""
    out, i, n = [], 0, len(sql)
    while i < n:
        c = sql[i]
        if c == "'":
            j = i + 1
            while j < n:
                if sql[j] == "'" and j + 1 < n and sql[j + 1] == "'":
                    j += 2
                elif sql[j] == "'":
                    break
                else:
                    j += 1
            out.append(sql[i:j + 1])
            i = j + 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def scan_to(text, start, stop_word=None):
    """From start, the end of the list that starts there: the index of the
    first top-level stop word (a regex), `;`, or `)` that closes a
    parenthesis opened before start."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == "'":
            i = text.index("'", i + 1) + 1
            while i < n and text[i] == "'":
                i = text.index("'", i + 1) + 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                return i
            depth -= 1
        elif c == ";" and depth == 0:
            return i
        elif depth == 0 and stop_word is not None and (i == 0 or not (text[i - 1].isalnum()
                                                                      or text[i - 1] == "_")):
            if stop_word.match(text, i):
                return i
        i += 1
    return n


def split_top(text):
    """text split at its top-level commas."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == "'":
            j = i + 1
            while True:
                j = text.index("'", j) + 1
                if j < len(text) and text[j] == "'":
                    j += 1
                    continue
                break
            cur.append(text[i:j])
            i = j
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def functions(sql):
    """(name, body) of every function the SQL text defines; the body
    without comments."""
    found = []
    for m in FUNCTION.finditer(sql):
        rest = sql[m.end():]
        nxt = FUNCTION.search(rest)
        scope = rest[:nxt.start()] if nxt else rest
        d = DOLLAR_BODY.search(scope)
        if d:
            start = d.end()
            end = rest.index(d.group(1), start)
            body = rest[start:end]
        else:       # LANGUAGE sql ... RETURN expr;
            body = scope[:scope.find(";")]
        found.append((m.group(1), strip_comments(body)))
    return found


def states_of(expr, body):
    """The effect states an expression may have (see the module's text)."""
    literals = re.findall(r"'((?:[^']|'')*)'", expr)
    if literals:
        return {s for s in literals if s in EFFECT_STATES}
    ref = re.fullmatch(r"\s*(?:\w+\.)?(\w+)\s*", expr)
    if ref is None or ref.group(1).lower() == "state":
        raise ValueError(f"cannot tell which states `{expr.strip()}` is")
    states = compared_states(ref.group(1), body, set())
    if not states:
        raise ValueError(f"cannot tell which states `{expr.strip()}` is: the function compares "
                         f"{ref.group(1)} with no effect state")
    return states


def compared_states(name, body, seen):
    """The effect states the body compares `name` with, or those of the
    names it is an alias of (`g.next_state AS final_state`)."""
    seen.add(name.lower())
    n = re.escape(name)
    states = set()
    for lst in re.findall(rf"\b{n}\s+IN\s*\(([^)]*)\)", body, re.I):
        states |= set(re.findall(r"'(\w+)'", lst))
    states |= set(re.findall(rf"\b{n}\s*=\s*'(\w+)'", body, re.I))
    states &= set(EFFECT_STATES)
    if not states:
        for source in re.findall(rf"(?:\w+\.)?(\w+)\s+AS\s+{n}\b", body, re.I):
            if source.lower() not in seen and source.lower() != "state":
                states |= compared_states(source, body, seen)
    return states


def inserted_state_exprs(body, start):
    """The expressions an INSERT whose column list opens at `start` puts in
    its `state` column; None when the list has no such column."""
    close = scan_to(body, start)
    cols = [c.lower() for c in split_top(body[start:close])]
    if "state" not in cols:
        return None
    k = cols.index("state")
    rest = body[close + 1:]
    m = re.match(r"\s*(VALUES|SELECT(?:\s+DISTINCT)?)\b", rest, re.I)
    if m is None:
        raise ValueError("an INSERT ... (state ...) neither VALUES nor SELECT")
    exprs = []
    if m.group(1).upper() == "VALUES":
        for t in re.finditer(r"\(", rest[m.end():]):
            pos = m.end() + t.end()
            items = split_top(rest[pos:scan_to(rest, pos)])
            exprs.append(items[k])
            after = rest[scan_to(rest, pos) + 1:]
            if not re.match(r"\s*,", after):
                break
    else:
        pos = m.end()
        items = split_top(rest[pos:scan_to(rest, pos, SELECT_END)])
        exprs.append(re.sub(r"\s+AS\s+\w+$", "", items[k], flags=re.I))
    return exprs


def written_states(body):
    """{state: where} the function body writes, and whether it writes a
    finishing history row."""
    writes = {}
    finishes = False
    for m in UPDATE.finditer(body):
        end = scan_to(body, m.end(), SET_END)
        for item in split_top(body[m.end():end]):
            a = re.match(r"state\s*=\s*(.*)$", item, re.I | re.S)
            if a:
                for s in states_of(a.group(1), body):
                    writes[s] = f"UPDATE {m.group(1)}"
    for m in INSERT.finditer(body):
        exprs = inserted_state_exprs(body, m.end())
        table = m.group(1)
        if exprs is None:
            if table == "effect_live":
                writes["pending"] = "INSERT INTO effect_live"
            continue
        for e in exprs:
            for s in states_of(e, body):
                writes[s] = f"INSERT INTO {table}"
                if table == "effect_history" and s in FINISHED:
                    finishes = True
    return writes, finishes


def design_table():
    """{function: (to-states, file)} from docs/design.md's table."""
    with open(f"{ROOT}/docs/design.md", encoding="utf-8") as fh:
        doc = fh.read()
    m = re.search(r"^## State changes\n(.*?)(?=^## )", doc, re.M | re.S)
    assert m, 'docs/design.md has no section "State changes"'
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        name = re.match(r"`(\w+)`", cells[0]).group(1)
        to = {s.strip() for s in re.split(r",|/|\bor\b", cells[2]) if s.strip()}
        assert to <= set(EFFECT_STATES), f"{name}: {to - set(EFFECT_STATES)} are not effect states"
        assert name not in rows, f"{name} has two rows"
        rows[name] = (to, cells[3])
    assert rows, "the table State changes has no rows"
    return rows


def problems(files, table):
    """Every disagreement between the functions of `files` ({path relative
    to the root: text}) and the table."""
    out = []
    defined = {}
    for rel, fns in files.items():
        for name, body in fns:
            defined.setdefault(name, set()).add(rel)
            try:
                writes, finishes = written_states(body)
            except ValueError as e:
                out.append(f"{rel}: {name}: {e}")
                continue
            if DELETE_LIVE.search(body) and not finishes:
                out.append(f"{rel}: {name} deletes effect_live rows without an effect_history "
                           "row that finishes them (state completed or failed)")
            if not writes:
                continue
            if name not in table:
                out.append(f"{rel}: {name} writes {sorted(writes)} and has no row in "
                           'docs/design.md, "State changes"')
                continue
            to, where = table[name]
            if where != rel:
                out.append(f"{name}: the table says {where}, it is in {rel}")
            for s in sorted(set(writes) - to):
                out.append(f"{rel}: {name} writes {s} ({writes[s]}), its row says only "
                           f"{sorted(to)}")
    for name, (_, where) in table.items():
        if where not in defined.get(name, set()):
            out.append(f'docs/design.md, "State changes": {name} is not defined in {where}')
    return out


def repo_functions():
    files = {}
    for path in sorted(glob.glob(f"{ROOT}/sql/functions/*.sql")):
        with open(path, encoding="utf-8") as fh:
            files[os.path.relpath(path, ROOT)] = functions(fh.read())
    return files


def test_every_state_a_function_writes_is_in_the_table():
    assert problems(repo_functions(), design_table()) == []


def test_the_scan_finds_each_kind_of_state_write():
    """The scan sees what it must: a planted function of each shape makes a
    problem, so the test above can fail."""
    planted = {
        # an UPDATE's literal, through a CASE
        "outbox_planted_update": """AS $$ BEGIN
            UPDATE effect_live l
               SET attempts = l.attempts + 1,
                   state = CASE WHEN l.sending_idempotent THEN 'pending' ELSE 'unknown' END
             WHERE l.effect_id = p_id; END $$;""",
        # a finishing row written by the DELETE's statement
        "outbox_planted_finish": """AS $fn$ BEGIN
            WITH gone AS (DELETE FROM effect_live l WHERE l.effect_id = p_id RETURNING l.*)
            INSERT INTO effect_history (effect_id, created_at, attempt, started_at, state,
                                        last_error)
            SELECT g.effect_id, g.created_at, g.attempts, now(), r.next_state, 'x; y'
              FROM gone g, jsonb_to_recordset(p) AS r(next_state text)
             WHERE r.next_state IN ('completed', 'failed'); END $fn$;""",
        # a reopened effect: a new live row, state by default
        "outbox_planted_reopen": """AS $$
            INSERT INTO effect_live (effect_id, effect_type, created_at, available_at)
            SELECT b.effect_id, b.effect_type, b.created_at, now() FROM effect_outbox b $$;""",
    }
    text = "".join(f"CREATE OR REPLACE FUNCTION {n}(p_id uuid) RETURNS void\n"
                   f"LANGUAGE plpgsql {body}\n" for n, body in planted.items())
    files = {"planted.sql": functions(text)}
    found = problems(files, {})
    assert found == [
        "planted.sql: outbox_planted_update writes ['pending', 'unknown'] and has no row in "
        'docs/design.md, "State changes"',
        "planted.sql: outbox_planted_finish writes ['completed', 'failed'] and has no row in "
        'docs/design.md, "State changes"',
        "planted.sql: outbox_planted_reopen writes ['pending'] and has no row in "
        'docs/design.md, "State changes"',
    ], found
    # Named in the table, but not for the state written: still a problem.
    table = {}
    table["outbox_planted_update"] = ({"pending"}, "planted.sql")
    table["outbox_planted_finish"] = ({"completed", "failed"}, "planted.sql")
    table["outbox_planted_reopen"] = ({"pending"}, "planted.sql")
    table["outbox_planted_gone"] = ({"failed"}, "planted.sql")
    assert problems(files, table) == [
        "planted.sql: outbox_planted_update writes unknown (UPDATE effect_live), its row says "
        "only ['pending']",
        'docs/design.md, "State changes": outbox_planted_gone is not defined in planted.sql']


def test_a_delete_without_its_finishing_row_is_found():
    body = strip_comments("DELETE FROM effect_live l WHERE l.effect_id = p_id; -- gone")
    files = {"planted.sql": [("outbox_planted_drop", body)]}
    assert problems(files, {}) == [
        "planted.sql: outbox_planted_drop deletes effect_live rows without an effect_history "
        "row that finishes them (state completed or failed)"]


def test_a_state_that_cannot_be_told_is_an_error():
    body = strip_comments("UPDATE effect_live l SET state = x.state FROM x")
    files = {"planted.sql": [("outbox_planted_copy", body)]}
    assert problems(files, {}) == [
        "planted.sql: outbox_planted_copy: cannot tell which states `x.state` is"]

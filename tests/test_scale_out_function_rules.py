"""SPEC section 15: the shapes that stopped every layer on Citus (issue 30), as static rules over
the services' SQL and the live schema's functions, triggers and keys (the rules of
``tests/test_scale_out_rules.py`` go on here; the same scanner):

5. no STABLE or VOLATILE function applied to a column in an UPDATE's SET list or in the WHERE
   of an UPDATE or DELETE, in the services' statements and in the statements of the database's
   own functions. Citus refuses them ("STABLE functions used in UPDATE queries cannot be called
   with column references"); ``jsonb_build_object`` is STABLE, and
   :func:`buzz_delivery.services.sql.history_object` builds a history entry IMMUTABLY;
6. a function of ours that reads or writes tables is called by the services only as a statement
   of its own whose distribution argument is the community (``SELECT f(%(community_id)s, ...)``
   or ``SELECT ... FROM f(%(community_id)s, ...)``, no other FROM item, no WHERE), and is
   delegated (:func:`buzz_delivery.scaleout.delegated_functions`). Called once per row of a
   query, Citus runs it inside that query on a shard, where its own queries are refused
   ("cannot execute a distributed query from a query on a shard"); not delegated, its
   parameterised statements are planned on the coordinator, which cannot route a generic plan
   ("could not create distributed plan ... parameters in SQL functions");
7. a trigger function of a community-scoped table or of the community table, and every function
   of ours it calls, reaches only community-scoped tables, each SELECT, UPDATE and DELETE naming
   ``community_id`` (the community table: ``id``) equal to the row's community or an argument:
   on Citus the trigger runs on the shard, where only the community's shard group is local (any
   other query is refused, and a table local to the coordinator is not there at all);
8. no foreign key of a community-scoped table is ``ON DELETE`` or ``ON UPDATE SET NULL`` or
   ``SET DEFAULT``: Citus refuses them on a key that holds the distribution column.

Every checker has a self-test on known-bad and known-good input, and the collectors must find a
plausible number of functions, calls and triggers, so no test passes by matching nothing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from django.db import connection

from buzz_delivery.scaleout import delegated_functions
from tests.test_scale_out_rules import (
    COMMUNITY_TABLE,
    Token,
    collect,
    collect_statements,
    column_refs,
    find_writes,
    scoped_tables,
    set_and_where,
    split_top,
    tokenize,
)

pytestmark = pytest.mark.django_db

# Words that look like calls or columns but are SQL: never a function of pg_proc, never a column.
SQL_WORDS = {
    "and", "or", "not", "case", "when", "then", "else", "end", "is", "in", "null", "true", "false",
    "array", "exists", "any", "all", "some", "coalesce", "greatest", "least", "nullif", "distinct",
    "as", "from", "where", "select", "values", "row", "interval", "between", "like", "ilike", "on",
    "cast", "extract", "over", "filter", "within", "group", "order", "by", "limit", "asc", "desc",
    "found", "lateral", "join", "using", "for", "update", "share", "key", "no", "skip", "locked",
}  # fmt: skip


def _close(tokens: list[Token], open_at: int) -> int:
    """Index of the ``)`` that closes the ``(`` at ``open_at``."""
    depth = tokens[open_at].depth
    for j in range(open_at + 1, len(tokens)):
        if tokens[j].text == ")" and tokens[j].depth == depth:
            return j
    return len(tokens) - 1


def calls(tokens: list[Token]) -> list[tuple[str, int, int]]:
    """``(name, index of the name, index of its closing paren)`` of every call in ``tokens``."""
    out = []
    for i, t in enumerate(tokens[:-1]):
        if t.kind == "word" and tokens[i + 1].text == "(" and t.low not in SQL_WORDS:
            if i and tokens[i - 1].text in (".", "::"):
                continue  # a schema-qualified name's tail is judged by its head; a cast's type
            out.append((t.low, i, _close(tokens, i + 1)))
    return out


def _is_param(ref: str, params: frozenset[str]) -> bool:
    """A reference that is a value of the statement, not a column: a PL/pgSQL argument or
    variable (``cid``, ``w.failed``) or the trigger's ``NEW``/``OLD`` row."""
    head = ref.split(".", 1)[0].strip('"').lower()
    return head in params or head in ("new", "old")


def columns(tokens: list[Token], params: frozenset[str] = frozenset()) -> list[str]:
    """The column references of ``tokens`` (:func:`column_refs` without SQL words and values)."""
    return [r for r in column_refs(tokens) if r.lower() not in SQL_WORDS and not _is_param(r, params)]


# --- rule 5: no STABLE/VOLATILE function over a column in a write's SET or WHERE ------------


def rule5_violations(sql: str, volatility: dict[str, set[str]], params: frozenset[str] = frozenset()) -> list[str]:
    """Calls of a STABLE function (``volatility``: name -> its overloads' ``provolatile``) whose
    arguments hold a column, or of a VOLATILE one, in the SET list or the WHERE of an UPDATE or
    DELETE."""
    out = []
    for w in find_writes(sql):
        for clause, tokens in set_and_where(w):
            for name, at, end in calls(tokens):
                kinds = volatility.get(name, set())
                if "v" in kinds:  # Citus refuses a VOLATILE function there with or without columns
                    out.append(f"{clause} of {w.kind} {w.table}: {name}() is VOLATILE")
                    continue
                refs = columns(tokens[at + 2 : end], params) if "s" in kinds else []
                if refs:
                    out.append(f"{clause} of {w.kind} {w.table}: {name}() is STABLE, over {refs}")
    return out


# --- the live schema -------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    """One function of ours in the database (schema ``public``, PL/pgSQL or SQL)."""

    name: str
    signature: str
    language: str
    volatility: str
    returns_trigger: bool
    arguments: tuple[str, ...]
    body: str

    @functools.cached_property
    def params(self) -> frozenset[str]:
        """Its arguments and declared variables: values, not columns, in its statements."""
        names = {a.lower() for a in self.arguments if a}
        declare = re.search(r"\bDECLARE\b(.*?)\bBEGIN\b", self.body, re.S | re.I)
        if declare:
            for part in declare.group(1).split(";"):
                words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", part)
                if words:
                    names.add(words[0].lower())
        return frozenset(names)


@functools.cache
def our_functions() -> dict[str, Function]:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT p.proname, p.oid::regprocedure::text, l.lanname, p.provolatile,
                   p.prorettype = 'trigger'::regtype, coalesce(p.proargnames, '{}'), p.prosrc
            FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
            WHERE p.pronamespace = 'public'::regnamespace AND l.lanname IN ('plpgsql', 'sql')
            """
        )
        rows = cursor.fetchall()
    return {r[0]: Function(r[0], r[1], r[2], r[3], r[4], tuple(r[5]), r[6]) for r in rows}


@functools.cache
def volatility_by_name() -> dict[str, set[str]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT proname, array_agg(DISTINCT provolatile::text) FROM pg_proc GROUP BY proname")
        return {name: set(kinds) for name, kinds in cursor.fetchall()}


@functools.cache
def table_names() -> frozenset[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p')"
        )
        return frozenset(row[0] for row in cursor.fetchall())


def statements_of(body: str) -> list[str]:
    """The statements of a PL/pgSQL or SQL body: split at ``;`` outside parentheses and strings."""
    out, current, depth = [], [], 0
    for token in re.finditer(r"'(?:[^']|'')*'|--[^\n]*|/\*.*?\*/|[();]|[^'();-]+|-", body, re.S):
        text = token.group()
        if text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
        if text == ";" and depth == 0:
            out.append("".join(current))
            current = []
        else:
            current.append(text)
    out.append("".join(current))
    return [s for s in out if s.strip()]


def reads_tables(function: Function) -> bool:
    """True when the function's body names a table of the schema."""
    words = set(re.findall(r"[a-z_][a-z_0-9]*", function.body.lower()))
    return bool(words & table_names())


def test_rule5_the_services_apply_no_stable_function_to_a_column():
    statements, _ = collect_statements()
    volatility = volatility_by_name()
    assert {"i"} == volatility["jsonb_object"] and "s" in volatility["jsonb_build_object"]
    problems = [f"{source}: {p}" for source, sql in statements for p in rule5_violations(sql, volatility)]
    assert not problems, "rule 5 (no STABLE/VOLATILE function over a column in a write):\n" + "\n".join(problems)


def test_rule5_our_database_functions_apply_no_stable_function_to_a_column():
    functions = our_functions()
    volatility = volatility_by_name()
    writers = [f for f in functions.values() if any(find_writes(s) for s in statements_of(f.body))]
    assert len(writers) >= 10, [f.name for f in writers]
    problems = [
        f"{f.name}: {p}"
        for f in writers
        for s in statements_of(f.body)
        for p in rule5_violations(s, volatility, f.params)
    ]
    assert not problems, "rule 5 (no STABLE/VOLATILE function over a column in a write):\n" + "\n".join(problems)


VOLATILITY = {
    "jsonb_build_object": {"s"},
    "jsonb_object": {"i"},
    "buzz_delivery_history_push": {"i"},
    "buzz_delivery_now": {"s"},
    "format": {"s"},
    "random": {"v"},
    "make_interval": {"i"},
}
D = "UPDATE buzz_delivery_delivery AS d"
RULE5_BAD = [
    f"{D} SET history = buzz_delivery_history_push(d.history, jsonb_build_object('g', d.lease_generation))"
    " WHERE d.community_id = %(c)s",
    f"{D} SET failure_message = format('%%s', d.attempt) WHERE d.community_id = %(c)s",
    f"{D} SET a = 1 WHERE d.community_id = %(c)s AND d.renewals > random() * d.attempt",
    "DELETE FROM buzz_delivery_delivery AS d WHERE d.community_id = %(c)s AND format('%%s', d.status) = 'x'",
]
RULE5_GOOD = [
    f"{D} SET history = buzz_delivery_history_push(d.history, jsonb_build_object('at', buzz_delivery_now())"
    " || jsonb_object(ARRAY['actor', (d.claimed_by)::text])) WHERE d.community_id = %(c)s",
    f"{D} SET failure_message = format('%%s of %%s', w.failed, cid) WHERE d.community_id = cid",
    f"{D} SET output = jsonb_build_object('decision', NEW.state) WHERE d.community_id = NEW.community_id",
    "SELECT jsonb_build_object('g', d.lease_generation) FROM buzz_delivery_delivery AS d",
]


@pytest.mark.parametrize("sql", RULE5_BAD)
def test_rule5_reports_a_stable_function_over_a_column(sql):
    assert rule5_violations(sql, VOLATILITY), sql


@pytest.mark.parametrize("sql", RULE5_GOOD)
def test_rule5_passes_immutable_functions_and_values(sql):
    assert not rule5_violations(sql, VOLATILITY, frozenset({"w", "cid"})), rule5_violations(sql, VOLATILITY)


# --- rule 6: our table functions are called alone, naming the community, and delegated -----


def rule6_violations(sql: str, table_functions: dict[str, tuple[str, ...]], delegated: dict[str, int]) -> list[str]:
    """Calls of ``table_functions`` (name -> argument names) in ``sql`` that are not a statement
    of their own delegated on the argument ``delegated[name]`` (its index) holding the
    community."""
    toks = [t for t in tokenize(sql) if t.text != ";"]
    out = []
    for name, at, end in calls(toks):
        if name not in table_functions:
            continue
        if name not in delegated:
            out.append(f"{name}() reads tables but is not delegated (buzz_delegated_functions)")
            continue
        if not _standalone(toks, at, end):
            out.append(f"{name}() is not a statement of its own (SELECT f(...) or SELECT ... FROM f(...)): Citus "
                       "runs it per row inside a shard's query")  # fmt: skip
            continue
        arguments = split_top(toks[at + 2 : end], toks[at + 1].depth + 1)
        index = delegated[name]
        if index >= len(arguments) or not any(t.text == "%(community_id)s" for t in arguments[index]):
            out.append(f"{name}(): its argument {index + 1} (the distribution argument) is not %(community_id)s")
    return out


def _standalone(toks: list[Token], at: int, end: int) -> bool:
    """The call ``toks[at:end + 1]`` is the whole statement: ``SELECT f(...)``, or ``SELECT <list>
    FROM f(...) [[AS] alias]`` (what Citus delegates; no other FROM item, no WHERE)."""
    before = [t.up for t in toks[:at] if t.depth == 0]
    after = [t for t in toks[end + 1 :] if t.depth == 0]
    if before[:1] != ["SELECT"]:
        return False
    if before == ["SELECT"]:
        return not after
    if before[-1] != "FROM" or before.count("FROM") != 1:
        return False
    alias = [t.up for t in after]
    return all(t.kind == "word" for t in after) and (alias in ([], ["AS", alias[-1]]) or len(alias) == 1)


def _delegated() -> dict[str, int]:
    """Delegated function name -> index of its distribution argument."""
    out = {}
    functions = our_functions()
    for signature, argument in delegated_functions():
        name = signature.split("(", 1)[0]
        out[name] = list(functions[name].arguments).index(argument)
    return out


def _calls_ours(sql: str) -> bool:
    return bool(re.search(r"\bbuzz_\w+\s*\(", sql))


def test_rule6_the_services_call_table_functions_alone_and_delegated():
    functions = our_functions()
    table_functions = {n: f.arguments for n, f in functions.items() if not f.returns_trigger and reads_tables(f)}
    assert {"buzz_delivery_claim_pending", "buzz_workflows_end_run"} <= set(table_functions)
    statements, _ = collect(_calls_ours)
    called = {c[0] for _, sql in statements for c in calls(tokenize(sql))} & set(table_functions)
    assert {"buzz_delivery_claim_pending", "buzz_workflows_end_run_if_active"} <= called, called
    delegated = _delegated()
    problems = [
        f"{source}: {p}" for source, sql in statements for p in rule6_violations(sql, table_functions, delegated)
    ]
    assert not problems, "rule 6 (table functions called alone and delegated):\n" + "\n".join(problems)


def test_every_delegated_function_exists_with_its_distribution_argument():
    functions = our_functions()
    for signature, argument in delegated_functions():
        name = signature.split("(", 1)[0]
        assert name in functions, signature
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regprocedure(%s)::text", [signature])
            assert cursor.fetchone()[0] == functions[name].signature, signature
        assert argument in functions[name].arguments, (signature, argument)


TABLE_FUNCTIONS = {"f": ("cid", "rid"), "g": ("p_community_id", "p_x")}
DELEGATED = {"f": 0}
RULE6_BAD = [
    "SELECT f(s.community_id, s.id) FROM buzz_workflows_step AS s WHERE s.community_id = %(community_id)s",
    "SELECT f(%(community_id)s, r.run_id) FROM buzz_workflows_run r WHERE r.community_id = %(community_id)s",
    "SELECT f(%(community_id)s, %(run_id)s) FROM buzz_delivery_community c WHERE c.id = %(community_id)s",
    "SELECT f(%(run_id)s, %(community_id)s)",
    "SELECT g(%(community_id)s, %(x)s)",
    "SELECT 1 WHERE f(%(community_id)s, %(run_id)s)",
]
RULE6_GOOD = [
    "SELECT f(%(community_id)s, %(run_id)s)",
    "SELECT f(%(community_id)s::uuid, %(run_id)s::uuid)",
    "SELECT d.id, d.status FROM f(%(community_id)s::uuid, %(x)s::bigint) AS d",
    "SELECT x FROM f(%(community_id)s, %(run_id)s) d;",
    "SELECT h(s.id) FROM t s",
]


@pytest.mark.parametrize("sql", RULE6_BAD)
def test_rule6_reports_a_table_function_called_per_row_or_undelegated(sql):
    assert rule6_violations(sql, TABLE_FUNCTIONS, DELEGATED), sql


@pytest.mark.parametrize("sql", RULE6_GOOD)
def test_rule6_passes_a_delegated_call_of_its_own(sql):
    assert not rule6_violations(sql, TABLE_FUNCTIONS, DELEGATED), rule6_violations(sql, TABLE_FUNCTIONS, DELEGATED)


# --- rule 7: triggers reach only their community's shard group -----------------------------

_TABLE_AFTER = {"FROM", "JOIN", "UPDATE", "INTO"}
_NOT_A_TABLE_BEFORE = {"FOR", "KEY", "NO", "DO", "ON"}  # FOR [NO KEY] UPDATE, DO UPDATE, ON UPDATE


def _tables(tokens: list[Token], tables: Iterable[str]) -> list[tuple[str, str, str]]:
    """``(keyword, table, alias)`` of each table ``tokens`` read or write."""
    known, out = set(tables), []
    for i, t in enumerate(tokens[:-1]):
        if t.up not in _TABLE_AFTER or (i and tokens[i - 1].up in _NOT_A_TABLE_BEFORE):
            continue
        name = tokens[i + 1].low
        if name not in known:
            continue
        j = i + 2 + (i + 2 < len(tokens) and tokens[i + 2].up == "AS")
        alias = tokens[j].low if j < len(tokens) and tokens[j].kind == "word" and tokens[j].up not in (
            "WHERE", "SET", "ON", "JOIN", "USING", "VALUES", "GROUP", "ORDER", "LIMIT", "FOR", "CROSS", "LEFT",
        ) else name  # fmt: skip
        out.append((t.up, name, alias))
    return out


def _operand(tokens: list[Token], i: int, step: int) -> tuple[str | None, str | None]:
    """``(qualifier, name)`` of the ``[qualifier.]name`` operand next to ``tokens[i]`` (``step``
    -1: before it, +1: after it)."""
    if step < 0:
        if i < 1 or tokens[i - 1].kind != "word":
            return None, None
        qualified = i >= 3 and tokens[i - 2].text == "." and tokens[i - 3].kind == "word"
        return (tokens[i - 3].low if qualified else None), tokens[i - 1].low
    if i + 1 >= len(tokens) or tokens[i + 1].kind != "word":
        return None, None
    if i + 3 < len(tokens) and tokens[i + 2].text == "." and tokens[i + 3].kind == "word":
        return tokens[i + 1].low, tokens[i + 3].low
    return None, tokens[i + 1].low


def _guarded_aliases(tokens: list[Token], found: list[tuple[str, str, str]], params: frozenset[str]) -> set[str]:
    """The aliases of ``found`` tables whose community column (the community table's ``id``)
    the statement equates with a value (the row's community, an argument), or with the
    community column of a table so guarded (a colocated join); ``"*"`` for an unqualified one."""
    keys = {alias: ("id" if table == COMMUNITY_TABLE else "community_id") for _, table, alias in found}
    names = {table: alias for _, table, alias in found}
    pairs = []
    for i, t in enumerate(tokens):
        if t.text == "=" and not (i and tokens[i - 1].text == ":"):
            pairs.append((_operand(tokens, i, -1), _operand(tokens, i, +1)))
    guarded: set[str] = set()
    changed = True
    while changed:
        changed = False
        for a, b in pairs + [(b, a) for a, b in pairs]:
            (qualifier, name), (other_qualifier, other_name) = a, b
            if name is None or other_name is None:
                continue
            alias = names.get(qualifier, qualifier) if qualifier else "*"
            is_key = name in keys.values() if alias == "*" else keys.get(alias) == name
            if alias in guarded or not is_key:
                continue
            value = other_qualifier or other_name
            other_alias = names.get(other_qualifier, other_qualifier) if other_qualifier else None
            if _is_param(value, params) or (other_alias in guarded and keys.get(other_alias) == other_name):
                guarded.add(alias)
                changed = True
    return guarded


def rule7_violations(body: str, params: frozenset[str], scoped: set[str], tables: Iterable[str]) -> list[str]:
    """Statements of a trigger's (or a function it calls) ``body`` that reach a table outside
    the community's shard group, or a community-scoped table without naming the community."""
    out = []
    reachable = scoped | {COMMUNITY_TABLE}
    for statement in statements_of(body):
        toks = tokenize(statement)
        found = _tables(toks, tables)
        guarded = _guarded_aliases(toks, found, params)
        for keyword, table, alias in found:
            if table not in reachable:
                out.append(f"{keyword} {table}: not a table of the community's shard group")
            elif keyword != "INTO" and alias not in guarded and "*" not in guarded:
                out.append(f"{keyword} {table}: the statement does not name the row's community")
    return out


@functools.cache
def trigger_functions() -> dict[str, set[str]]:
    """Function name -> the community-scoped tables (or the community table) whose triggers run
    it, directly or through the functions of ours it calls."""
    scoped = [*scoped_tables(), COMMUNITY_TABLE]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT p.proname, t.tgrelid::regclass::text FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid"
            " WHERE NOT t.tgisinternal AND t.tgrelid::regclass::text = ANY(%s)",
            [scoped],
        )
        direct = cursor.fetchall()
    functions = our_functions()
    reached: dict[str, set[str]] = {}
    todo = list(direct)
    while todo:
        name, table = todo.pop()
        if name not in functions or table in reached.setdefault(name, set()):
            continue
        reached[name].add(table)
        todo += [(c[0], table) for c in calls(tokenize(functions[name].body)) if c[0] in functions]
    return reached


def test_rule7_triggers_reach_only_their_communitys_shard_group():
    functions = our_functions()
    reached = trigger_functions()
    assert {"buzz_workflows_advance", "buzz_workflows_end_run", "buzz_agents_count_unit"} <= set(reached), reached
    scoped, tables = set(scoped_tables()), table_names()
    problems = [
        f"{name} (a trigger of {', '.join(sorted(on))}): {p}"
        for name, on in sorted(reached.items())
        for p in rule7_violations(functions[name].body, functions[name].params, scoped, tables)
    ]
    assert not problems, "rule 7 (triggers stay in the community's shard group):\n" + "\n".join(problems)


SCOPED = {"buzz_delivery_delivery", "buzz_workflows_step", "buzz_workflows_run"}
TABLES = [*SCOPED, COMMUNITY_TABLE, "buzz_delivery_worker", "buzz_demo_statuschange"]
RULE7_BAD = [
    "SELECT count(*) INTO n FROM buzz_delivery_delivery WHERE status = 'pending'",
    "UPDATE buzz_workflows_step SET state = 'ready' WHERE id = NEW.id",
    "UPDATE buzz_workflows_step s SET state = 'ready' WHERE s.run_id = NEW.run_id AND s.community_id = s.x",
    "INSERT INTO buzz_demo_statuschange (delivery_id) VALUES (NEW.id)",
    "PERFORM 1 FROM buzz_delivery_worker w WHERE w.community_id = NEW.community_id",
    "IF EXISTS (SELECT 1 FROM buzz_workflows_run r JOIN buzz_workflows_step s ON s.run_id = r.run_id"
    " WHERE r.community_id = cid) THEN RETURN; END IF",
]
RULE7_GOOD = [
    "UPDATE buzz_workflows_step SET deps_done = deps_done + 1 WHERE community_id = NEW.community_id AND run_id = x",
    "PERFORM 1 FROM buzz_workflows_run WHERE community_id = cid AND run_id = rid FOR NO KEY UPDATE",
    "UPDATE buzz_workflows_step AS st SET a = 1 WHERE st.community_id = NEW.community_id AND st.key = NEW.step_id",
    "IF EXISTS (SELECT 1 FROM buzz_workflows_step WHERE community_id = OLD.id) THEN RAISE; END IF",
    "SELECT 1 FROM buzz_delivery_community c WHERE c.id = cid AND c.deletion_state = 'active'",
    "INSERT INTO buzz_workflows_step (id, community_id) VALUES (gen_random_uuid(), NEW.community_id)"
    " ON CONFLICT (community_id, id) DO NOTHING",
    "SELECT e->>'await' INTO mode FROM buzz_workflows_run r JOIN buzz_workflows_step d ON"
    " d.community_id = r.community_id AND d.id = r.x WHERE r.community_id = NEW.community_id AND r.run_id = NEW.run_id",
    "reason := 'run_' || st",
]


@pytest.mark.parametrize("body", RULE7_BAD)
def test_rule7_reports_a_trigger_leaving_its_shard_group(body):
    assert rule7_violations(body, frozenset({"cid", "rid", "n", "x"}), SCOPED, TABLES), body


@pytest.mark.parametrize("body", RULE7_GOOD)
def test_rule7_passes_statements_naming_the_rows_community(body):
    found = rule7_violations(body, frozenset({"cid", "rid", "x", "mode", "reason", "st"}), SCOPED, TABLES)
    assert not found, found


# --- rule 8: no SET NULL / SET DEFAULT keys ---------------------------------------------------


def rule8_violations(keys: list[tuple[str, str, str, str]], scoped: set[str]) -> list[str]:
    """Foreign keys ``(name, table, on delete, on update)`` (``pg_constraint``'s action codes) of
    ``scoped`` tables whose action sets NULL (``n``) or a default (``d``)."""
    actions = {"n": "SET NULL", "d": "SET DEFAULT"}
    out = []
    for name, table, on_delete, on_update in keys:
        if table not in scoped:
            continue
        for verb, code in (("ON DELETE", on_delete), ("ON UPDATE", on_update)):
            if code in actions:
                out.append(f"{table}: foreign key {name} is {verb} {actions[code]}")
    return out


def test_rule8_no_key_of_a_community_scoped_table_sets_null_or_a_default():
    scoped = set(scoped_tables())
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conname::text, conrelid::regclass::text, confdeltype::text, confupdtype::text FROM pg_constraint"
            " WHERE contype = 'f' AND conrelid::regclass::text = ANY(%s)",
            [sorted(scoped)],
        )
        keys = cursor.fetchall()
    assert len(keys) >= 20, keys
    problems = rule8_violations(keys, scoped)
    assert not problems, "rule 8 (no SET NULL / SET DEFAULT keys):\n" + "\n".join(problems)


def test_rule8_reports_set_null_and_set_default_and_passes_the_others():
    scoped = {"a"}
    assert rule8_violations([("k", "a", "n", "a")], scoped)
    assert rule8_violations([("k", "a", "a", "d")], scoped)
    assert not rule8_violations([("k", "a", "c", "a"), ("k", "a", "a", "r"), ("k", "b", "n", "n")], scoped)

"""SPEC section 15: the statements and keys that keep every layer runnable on Citus.

A static check of the services' SQL (every ``buzz_delivery.services`` module and every
``buzz_delivery.<app>.services`` package, discovered, so a new app is covered without an edit
here) plus a look at the live schema:

1. every UPDATE and DELETE names ``community_id`` (the community table: its ``id``) in its own
   WHERE, at the statement's own parenthesis depth, as an AND-ed equality;
2. no CASE ... END or COALESCE(...) holds ``now()``-like calls or interval arithmetic;
3. no SET assignment, and no WHERE of an UPDATE or DELETE, applies interval arithmetic to a
   column (``buzz_delivery_plus_seconds`` is the IMMUTABLE way), and no RETURNING holds a
   ``now()``-like call;
4. every primary key, unique constraint and unique index of a community-scoped table includes
   ``community_id`` (Citus's rule; the primary keys put ``id`` first so that lookups by id alone
   stay index probes, see migration 0007); foreign keys between such tables are composite on it.

Every checker has a self-test on a known-bad and a known-good statement, and the collector
must find a plausible number of statements, so the test cannot pass by matching nothing.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from django.db import connection

import buzz_delivery

# --- the scanner --------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<comment>--[^\n]*|/\*.*?\*/)
      | (?P<string>'(?:[^']|'')*')
      | (?P<param>%\(\w+\)s|%s)
      | (?P<word>"[^"]+"|\{\w*\}|[A-Za-z_][A-Za-z_0-9$]*)
      | (?P<number>\d+(?:\.\d+)?)
      | (?P<op>::|=>|<=|>=|<>|!=|\|\||.)""",
    re.S | re.X,
)
TIME_CALLS = {
    "now", "buzz_delivery_now", "statement_timestamp", "clock_timestamp", "current_timestamp",
    "transaction_timestamp", "localtimestamp", "current_date", "current_time", "localtime", "timeofday",
}  # fmt: skip
INTERVAL_WORDS = {"make_interval", "interval"}
CLAUSES = {"SET", "FROM", "USING", "WHERE", "RETURNING"}
COMPARISONS = {",", "=", "<", ">", "<=", ">=", "<>", "!="}
EXPRESSION_BOUNDARIES = {"AND", "OR", "NOT", "CASE", "WHEN", "THEN", "ELSE", "END", "IS", "IN", "BETWEEN"} | CLAUSES
NON_COLUMN_WORDS = {"interval", "null", "true", "false", "distinct"} | TIME_CALLS
COMMUNITY_TABLE = "buzz_delivery_community"
# Not community-scoped: local tables on a Citus coordinator (docs/scale-out.md).
EXEMPT_TABLES = {"buzz_delivery_maintenance_lease", "buzz_delivery_maintenance_run", "buzz_delivery_worker"}


@dataclass(frozen=True)
class Token:
    """One lexical token; ``depth`` counts the parentheses around it (a paren has the outer depth)."""

    kind: str  # word, param, string, number, op
    text: str
    depth: int

    @property
    def up(self) -> str:
        return self.text.upper()

    @property
    def low(self) -> str:
        return self.text.lower().strip('"')


def tokenize(sql: str) -> list[Token]:
    """Tokens of ``sql`` without whitespace and comments; string literals become one ``string`` token."""
    tokens, depth = [], 0
    for m in _TOKEN.finditer(sql):
        kind, text = m.lastgroup or "op", m.group()
        if kind in ("space", "comment"):
            continue
        if text == ")":
            depth -= 1
        tokens.append(Token(kind, text, depth))
        if text == "(":
            depth += 1
    return tokens


@dataclass
class Write:
    """One UPDATE / DELETE (or ``ON CONFLICT DO UPDATE``) inside a statement string."""

    kind: str  # UPDATE, DELETE, UPSERT
    table: str
    alias: str
    depth: int
    clauses: dict[str, list[Token]]  # clause keyword -> its tokens (keyword excluded), own depth or deeper


def find_writes(sql: str) -> list[Write]:
    """Every write in ``sql``, with its clauses split at the write's own parenthesis depth."""
    toks, writes = tokenize(sql), []
    for i, tok in enumerate(toks):
        prev = toks[i - 1].up if i else ""
        nxt = toks[i + 1].up if i + 1 < len(toks) else ""
        if tok.up == "UPDATE" and prev == "DO":
            kind, j = "UPSERT", i + 1
        elif tok.up == "UPDATE" and prev not in ("FOR", "KEY", "ON") and i + 1 < len(toks):
            kind, j = "UPDATE", i + 1
        elif tok.up == "DELETE" and nxt == "FROM" and prev != "ON":
            kind, j = "DELETE", i + 2
        else:
            continue
        table = alias = ""
        if kind != "UPSERT":
            j += j < len(toks) and toks[j].up == "ONLY"
            if j >= len(toks):
                continue
            table = alias = toks[j].low
            j += 1
            j += j < len(toks) and toks[j].up == "AS"
            if j < len(toks) and toks[j].kind == "word" and toks[j].up not in CLAUSES:
                alias = toks[j].low
        clauses: dict[str, list[Token]] = {}
        current: list[Token] = []
        for k in range(j, len(toks)):
            t = toks[k]
            if t.depth < tok.depth or (t.text == ";" and t.depth == tok.depth):
                break
            if t.depth == tok.depth and t.up in CLAUSES and toks[k - 1].up != "DISTINCT":
                current = clauses.setdefault(t.up, [])
            elif t.depth == tok.depth and t.up == "ON" and k + 1 < len(toks) and toks[k + 1].up == "CONFLICT":
                break
            else:
                current.append(t)
        if kind == "DELETE" or "SET" in clauses:  # an UPDATE without SET is prose, not SQL
            writes.append(Write(kind, table, alias, tok.depth, clauses))
    return writes


def split_top(tokens: list[Token], depth: int, sep: str = ",") -> list[list[Token]]:
    """``tokens`` split on ``sep`` at ``depth`` (e.g. a SET list into assignments)."""
    parts: list[list[Token]] = [[]]
    for t in tokens:
        if t.text == sep and t.depth == depth:
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def spans(tokens: list[Token], opener: str) -> list[list[Token]]:
    """Each ``CASE ... END`` (``opener='CASE'``) or ``COALESCE( ... )`` span of ``tokens``."""
    found = []
    for i, t in enumerate(tokens):
        if t.up != opener:
            continue
        nest = 0
        for j in range(i + 1, len(tokens)):
            u = tokens[j]
            if opener == "CASE" and u.depth == t.depth and u.up in ("CASE", "END"):
                nest += 1 if u.up == "CASE" else -1
                if nest < 0:
                    found.append(tokens[i : j + 1])
                    break
            elif opener != "CASE" and u.text == ")" and u.depth == t.depth:
                found.append(tokens[i : j + 1])
                break
    return found


def enclosing_calls(tokens: list[Token], m: int) -> list[str]:
    """Names of the function calls whose parentheses hold ``tokens[m]``, innermost first."""
    names, target = [], tokens[m].depth
    for j in range(m - 1, -1, -1):
        if tokens[j].text == "(" and tokens[j].depth == target - 1:
            names.append(tokens[j - 1].low if j and tokens[j - 1].kind == "word" else "")
            target -= 1
    return names


def arithmetic_chain(tokens: list[Token], m: int) -> list[Token]:
    """The ``+``/``-`` expression around ``tokens[m]``: out to a comma, comparison, keyword or paren."""
    depth = tokens[m].depth

    def boundary(t: Token) -> bool:
        return t.depth < depth or (t.depth == depth and (t.text in COMPARISONS or t.up in EXPRESSION_BOUNDARIES))

    lo, hi = m, m
    while lo > 0 and not boundary(tokens[lo - 1]):
        lo -= 1
    while hi + 1 < len(tokens) and not boundary(tokens[hi + 1]):
        hi += 1
    return tokens[lo : hi + 1]


def column_refs(tokens: list[Token]) -> list[str]:
    """Words of ``tokens`` that name columns: not calls, casts' types, named arguments or keywords."""
    refs = []
    for i, t in enumerate(tokens):
        after = tokens[i + 1].text if i + 1 < len(tokens) else ""
        before = tokens[i - 1].text if i else ""
        if t.kind != "word" or after in ("(", "=>", ".") or before == "::" or t.low in NON_COLUMN_WORDS:
            continue
        refs.append(f"{tokens[i - 2].text}.{t.text}" if before == "." else t.text)
    return refs


# --- the rules ------------------------------------------------------------------------------


def rule1_violations(sql: str) -> list[str]:
    """UPDATE/DELETE without an AND-ed ``community_id =`` (community table: ``id =``) in its own WHERE."""
    out = []
    for w in find_writes(sql):
        if w.kind == "UPSERT" or w.table in EXEMPT_TABLES:
            continue
        key = "id" if w.table == COMMUNITY_TABLE else "community_id"
        own = [t for t in w.clauses.get("WHERE", []) if t.depth == w.depth]
        if any(t.up == "OR" for t in own):
            out.append(f"{w.kind} {w.table}: OR at the WHERE's own depth defeats the {key} guard")
        if not any(_is_guard(own, i, w, key) for i in range(len(own))):
            out.append(f"{w.kind} {w.table}: its own WHERE does not name {w.alias}.{key} = ...")
    return out


def _is_guard(own: list[Token], i: int, w: Write, key: str) -> bool:
    """``own[i]`` is ``key =`` (bare, or qualified by the written table's alias or name)."""
    if own[i].low != key or i + 1 >= len(own) or own[i + 1].text != "=":
        return False
    return i < 2 or own[i - 1].text != "." or own[i - 2].low in (w.alias, w.table)


def rule2_violations(sql: str) -> list[str]:
    """A CASE or COALESCE holding a now()-like call or interval arithmetic."""
    toks, out = tokenize(sql), []
    for opener in ("CASE", "COALESCE"):
        for span in spans(toks, opener):
            bad = sorted({t.low for t in span if t.kind == "word" and t.low in TIME_CALLS | INTERVAL_WORDS})
            if bad:
                out.append(f"{opener} holds {', '.join(bad)}: {' '.join(t.text for t in span)[:120]}")
    return out


def set_and_where(w: Write) -> list[tuple[str, list[Token]]]:
    """The parts of a write Citus judges for function volatility: each SET assignment, and its
    WHERE (``("SET" | "WHERE", tokens)``)."""
    parts = [("SET", a) for a in split_top(w.clauses.get("SET", []), w.depth)]
    parts.append(("WHERE", w.clauses.get("WHERE", [])))
    return parts


def rule3_violations(sql: str) -> list[str]:
    """Interval arithmetic on a column in a SET assignment or in the write's WHERE (``timestamptz
    + interval`` is STABLE: Citus refuses it over a column in both); a now()-like call in
    RETURNING."""
    out = []
    for w in find_writes(sql):
        for clause, tokens in set_and_where(w):
            for m, t in enumerate(tokens):
                if t.low not in INTERVAL_WORDS or "buzz_delivery_plus_seconds" in enclosing_calls(tokens, m):
                    continue
                refs = column_refs(arithmetic_chain(tokens, m))
                if refs:
                    text = " ".join(a.text for a in tokens)
                    out.append(f"{clause} {text[:100]}: {t.low} arithmetic on column(s) {', '.join(refs)}")
        bad = sorted({t.low for t in w.clauses.get("RETURNING", []) if t.low in TIME_CALLS})
        if bad:
            out.append(f"{w.kind} {w.table}: RETURNING holds {', '.join(bad)}")
    return out


SUBLINK = re.compile(r"\b(?:EXISTS|IN)\s*\(\s*SELECT\b", re.IGNORECASE)
_KEYWORDS = "JOIN|ON|WHERE|LEFT|RIGHT|INNER|CROSS|FULL|USING|GROUP|ORDER|LIMIT"
INNER_ALIAS = re.compile(rf"\b(?:FROM|JOIN)\s+([\w.{{}}]+)(?:\s+(?:AS\s+)?(?!(?:{_KEYWORDS})\b)(\w+))?", re.IGNORECASE)
CORRELATED_COMMUNITY = re.compile(r"\b(\w+)\.community_id\s*=\s*(\w+)\.community_id\b", re.IGNORECASE)


def _parenthesised(sql: str, start: int) -> str:
    """The text inside the parenthesis that opens at ``sql[start]``."""
    depth = 0
    for i in range(start, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[i], 0)
        if depth == 0:
            return sql[start + 1 : i]
    return sql[start + 1 :]


def rule5_violations(sql: str) -> list[str]:
    """In a statement that names its community (``community_id = %(...)s``), a subquery (EXISTS,
    IN) tied to the outer row by ``x.community_id = outer.community_id``: Citus prunes a
    subquery's shards by its own conditions, so the statement goes to every shard (and a
    transaction that also NOTIFYs on a shard cannot commit in two phases). Name the parameter."""
    if not re.search(r"community_id\s*=\s*%\(", sql):
        return []
    out = []
    for m in SUBLINK.finditer(sql):
        body = _parenthesised(sql, sql.index("(", m.start()))
        inner = set()
        for table, alias in INNER_ALIAS.findall(body):
            inner.add(table.rsplit(".", 1)[-1].lower())
            if alias:
                inner.add(alias.lower())
        for a, b in CORRELATED_COMMUNITY.findall(body):
            outer = [x for x in (a, b) if x.lower() not in inner]
            if outer:
                out.append(f"subquery ties community_id to the outer {outer[0]}: {' '.join(body.split())[:100]}")
    return out


RULES = {
    "rule 1 (community_id in the statement's own WHERE)": rule1_violations,
    "rule 2 (no now()/interval inside CASE or COALESCE)": rule2_violations,
    "rule 3 (no interval arithmetic on a column in SET or WHERE; no now() in RETURNING)": rule3_violations,
    "rule 5 (a subquery names the community's parameter, not the outer row's column)": rule5_violations,
}

# --- the collector --------------------------------------------------------------------------

# SQL built by functions: (module, function, the keyword arguments of each call).
BUILDERS = {
    ("buzz_delivery.services.sql", "claim_oldest_pending"): [
        {"by_id": i, "by_binding": b} for i in (False, True) for b in (False, True)
    ],
    ("buzz_delivery.services.flow", "claim_with_limits"): [
        {"kinds": kinds, "by_id": i, "by_binding": b}
        for kinds in (("community", "target", "workflow"), ("target",))
        for i in (False, True)
        for b in (False, True)
    ],
    # The record's side of a terminal move (stage 2); its entries are sql.END_* (module constants).
    ("buzz_delivery.services.sql", "end_on_record"): [{"history": None}],
}


def services_modules() -> list[str]:
    """``buzz_delivery.services.*`` and every ``buzz_delivery.<app>.services[.*]`` module."""
    roots = ["buzz_delivery.services"]
    for sub in pkgutil.iter_modules(buzz_delivery.__path__):
        name = f"buzz_delivery.{sub.name}.services"
        if sub.ispkg and importlib.util.find_spec(name) is not None:
            roots.append(name)
    names = []
    for root in roots:
        mod = importlib.import_module(root)
        names.append(root)
        if hasattr(mod, "__path__"):
            names += [m.name for m in pkgutil.walk_packages(mod.__path__, root + ".")]
    return names


def _has_write(sql: str) -> bool:
    return bool(find_writes(sql))


def _values(value: object) -> list[tuple[object, object]]:
    """(key, value) pairs of a module attribute: a dict's items, a sequence's items, a plan-cached
    statement's own statement and the call the services send (``services.cached``), or itself."""
    from buzz_delivery.services.cached import CachedStatement

    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list | tuple):
        return list(enumerate(value))
    if isinstance(value, CachedStatement):
        return [("statement", value.statement), ("call", value.call)]
    return [("", value)]


@functools.cache
def collect(predicate: Callable[[str], bool]) -> tuple[list[tuple[str, str]], list[str]]:
    """(source name, SQL) of every statement of the services for which ``predicate`` holds, and
    the unlisted SQL builders found."""
    found: dict[str, str] = {}
    unlisted = []
    for (name, func), calls in BUILDERS.items():
        for kwargs in calls:
            text = getattr(importlib.import_module(name), func)(**kwargs)
            found.setdefault(text, f"{name}.{func}({', '.join(f'{k}={v}' for k, v in kwargs.items())})")
    for name in services_modules():
        module = importlib.import_module(name)
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:  # names assigned here (not imported), values as imported
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if not isinstance(target, ast.Name) or target.id.startswith("__"):
                    continue
                for key, text in _values(getattr(module, target.id, None)):
                    if isinstance(text, str) and predicate(text):
                        found.setdefault(text, f"{name}.{target.id}" + (f"[{key!r}]" if key != "" else ""))
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            body = func.body[1:] if ast.get_docstring(func) else func.body
            for node in (n for stmt in body for n in ast.walk(stmt)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and predicate(node.value):
                    found.setdefault(node.value, f"{name}.{func.name} (inline, line {node.lineno})")
                elif isinstance(node, ast.JoinedStr) and (name, func.name) not in BUILDERS:
                    parts = [v.value if isinstance(v, ast.Constant) else "{x}" for v in node.values]
                    if predicate("".join(str(p) for p in parts)):
                        unlisted.append(f"{name}.{func.name} (line {node.lineno}): add it to BUILDERS")
    return [(source, text) for text, source in found.items()], unlisted


def collect_statements() -> tuple[list[tuple[str, str]], list[str]]:
    """(source name, SQL) of every write statement, and the unlisted SQL builders found."""
    return collect(_has_write)


def test_collector_finds_the_statements():
    statements, unlisted = collect_statements()
    names = {source for source, _ in statements}
    core = [s for s in names if s.startswith("buzz_delivery.services.") and "(" not in s]
    assert len(core) >= 10, f"the collector found only {sorted(core)}"
    for expected in (
        "buzz_delivery.services.sql.RENEW_IF_CURRENT_GENERATION",  # (the retry is found as its function, cached.RETRY)
        "buzz_delivery.services.pruner.DELETE_TERMINAL_OLDER_THAN",
        "buzz_delivery.services.lifecycle.PURGE_BATCH",
        "buzz_delivery.services.lifecycle.MOVE_IF_STATE",
        "buzz_delivery.services.runlock.RENEW_IF_STILL_HELD",
    ):
        assert expected in names, f"the collector missed {expected}"
    assert sum("claim_oldest_pending(" in s for s in names) == 4
    assert not unlisted, "functions build UPDATE/DELETE SQL the test does not check:\n" + "\n".join(unlisted)


@pytest.mark.parametrize("rule", list(RULES))
def test_services_sql_follows_the_rule(rule):
    statements, _ = collect_statements()
    problems = [f"{source}: {rule}: {detail}" for source, sql in statements for detail in RULES[rule](sql)]
    assert not problems, "\n".join(problems)


# --- self-tests: each checker reports a known-bad statement and passes a known-good one -----

D = "UPDATE buzz_delivery_delivery AS d"
BAD = {
    rule1_violations: [
        f"{D} SET status = 'x' WHERE d.id = %(id)s",
        f"WITH b AS (SELECT id FROM t WHERE community_id = %(c)s) {D} SET status = 'x' FROM b WHERE d.id = b.id",
        f"{D} SET status = 'x' FROM b WHERE b.community_id = %(c)s AND d.id = b.id",
        f"{D} SET status = 'x' WHERE d.id = %(id)s OR d.community_id = %(c)s",
        "DELETE FROM {table} WHERE {pk} IN (SELECT {pk} FROM {table} WHERE community_id = %(c)s)",
        "WITH x AS (DELETE FROM buzz_delivery_event AS e WHERE e.id = 1 RETURNING 1) "
        f"{D} SET a = 1 WHERE d.community_id = %(c)s",
        "UPDATE buzz_delivery_community SET deletion_state = 'x' WHERE community_id = %(c)s",
    ],
    rule2_violations: [
        f"{D} SET finished_at = CASE WHEN x THEN now() END WHERE d.community_id = %(c)s",
        f"{D} SET t = COALESCE(d.t, buzz_delivery_now()) WHERE d.community_id = %(c)s",
        f"{D} SET t = CASE WHEN d.t < %(now)s - interval '1 day' THEN 1 END WHERE d.community_id = %(c)s",
    ],
    rule3_violations: [
        f"{D} SET next_attempt_at = d.next_attempt_at + make_interval(secs => 5) WHERE d.community_id = %(c)s",
        f"{D} SET a = 1, t = buzz_delivery_now() + make_interval(secs => d.backoff) WHERE d.community_id = %(c)s",
        f"{D} SET t = lease_until + %(s)s::interval WHERE d.community_id = %(c)s",
        f"{D} SET a = 1 WHERE d.community_id = %(c)s RETURNING d.id, clock_timestamp()",
        f"{D} SET a = 1 WHERE d.community_id = %(c)s AND d.claimed_at + make_interval(secs => d.s) < %(now)s",
    ],
    rule5_violations: [
        f"{D} SET a = 1 WHERE d.community_id = %(c)s AND EXISTS (SELECT 1 FROM buzz_agents_journal AS j"
        " WHERE j.community_id = d.community_id AND j.run_id = d.id)",
        f"{D} SET a = 1 WHERE d.community_id = %(c)s AND NOT EXISTS (SELECT 1 FROM e WHERE e.x = 1 AND"
        " (e.community_id = d.community_id))",
        f"{D} SET a = 1 WHERE d.community_id = %(c)s"
        " AND d.id IN (SELECT r.id FROM r WHERE d.community_id = r.community_id)",
    ],
}
GOOD = [
    f"{D} SET status = 'x' -- WHERE d.id = 1 OR now()\n WHERE d.community_id = %(c)s AND d.id = %(id)s",
    f"{D} SET status = 'x' FROM b WHERE community_id = %(c)s AND (d.id = b.id OR d.id = 2)",
    "DELETE FROM {table} WHERE community_id = %(c)s AND {pk} IN (SELECT {pk} FROM {table} LIMIT 5)",
    "UPDATE buzz_delivery_community SET deletion_state = %(s)s WHERE id = %(id)s RETURNING id",
    "UPDATE buzz_delivery_community AS c SET deletion_state = 'OR now()' WHERE c.id = %(id)s",
    f"{D} SET f = CASE WHEN d.t <= %(now)s THEN %(now)s::timestamptz END,"
    " l = LEAST(buzz_delivery_now() + make_interval(secs => %(s)s), d.expires_at),"
    " n = buzz_delivery_when(d.a < 3, buzz_delivery_plus_seconds(buzz_delivery_now(), d.a * 2))"
    " FROM unnest(%(ids)s::uuid[]) AS f(id) WHERE d.community_id = %(c)s AND d.id = f.id RETURNING d.l",
    "DELETE FROM buzz_delivery_maintenance_lease AS l WHERE l.name = %(n)s RETURNING 1",
    f"{D} SET a = 1 WHERE d.community_id = %(c)s"
    " AND d.finished_at < %(now)s::timestamptz - make_interval(secs => %(s)s)"
    " AND buzz_delivery_plus_seconds(d.claimed_at, d.s) < buzz_delivery_now()",
    "SELECT 1 FROM t FOR UPDATE SKIP LOCKED",
    f"{D} SET a = 1 WHERE d.community_id = %(c)s AND EXISTS (SELECT 1 FROM buzz_agents_journal AS j"
    " WHERE j.community_id = %(c)s AND j.run_id = d.id)",
    f"{D} SET a = 1 WHERE d.community_id = %(c)s AND EXISTS (SELECT 1 FROM r JOIN s ON s.community_id = r.community_id"
    " WHERE r.community_id = %(c)s)",
    "SELECT c.id FROM c WHERE EXISTS (SELECT 1 FROM r WHERE r.community_id = c.id)",
]


@pytest.mark.parametrize("checker", list(BAD), ids=lambda f: f.__name__)
def test_checker_reports_known_bad_statements(checker):
    for sql in BAD[checker]:
        assert checker(sql), f"{checker.__name__} missed: {sql}"


@pytest.mark.parametrize("sql", GOOD)
def test_checkers_pass_known_good_statements(sql):
    for checker in RULES.values():
        assert not checker(sql), f"{checker.__name__} wrongly reported: {checker(sql)}"


# --- rule 4: keys of the community-scoped tables (live schema) -------------------------------

_COLUMNS = """ARRAY(SELECT a.attname::text FROM unnest(con.{key}) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = con.{rel} AND a.attnum = k.attnum ORDER BY k.ord)"""
KEYS = f"""
SELECT con.conname::text, 'constraint ' || con.contype::text, {_COLUMNS.format(key="conkey", rel="conrelid")}
FROM pg_constraint con WHERE con.conrelid = %(table)s::regclass AND con.contype IN ('p', 'u', 'x')
UNION ALL
SELECT i.indexrelid::regclass::text, 'unique index',
       ARRAY(SELECT pg_get_indexdef(i.indexrelid, k, true) FROM generate_series(1, i.indnkeyatts) AS k ORDER BY k)
FROM pg_index i WHERE i.indrelid = %(table)s::regclass AND i.indisunique
"""
FOREIGN_KEYS = f"""
SELECT con.conname::text, con.conrelid::regclass::text, con.confrelid::regclass::text,
       {_COLUMNS.format(key="conkey", rel="conrelid")}, {_COLUMNS.format(key="confkey", rel="confrelid")}
FROM pg_constraint con WHERE con.contype = 'f' AND con.conrelid = ANY(%(tables)s::regclass[])
"""


def key_violations(table: str, keys: list[tuple[str, str, list[str]]]) -> list[str]:
    """Keys (name, kind, columns) of a community-scoped ``table`` that do not include community_id."""
    return [
        f"{table}: {kind} {name} on ({', '.join(cols)}) does not include community_id"
        for name, kind, cols in keys
        if "community_id" not in cols
    ]


def fk_violations(fks: list[tuple[str, str, str, list[str], list[str]]], scoped: set[str]) -> list[str]:
    """Foreign keys (name, from, to, columns, referenced columns) between scoped tables not composite
    on community_id -> community_id."""
    out = []
    for name, src, dst, cols, refs in fks:
        if src not in scoped or dst not in scoped:
            continue
        pairs = dict(zip(cols, refs, strict=True))
        if len(cols) < 2 or pairs.get("community_id") != "community_id":
            out.append(f"{src}: foreign key {name} ({', '.join(cols)}) -> {dst} ({', '.join(refs)}) is not composite")
    return out


def scoped_tables() -> list[str]:
    from buzz_delivery.catalog import catalog_models

    return [m._meta.db_table for m in catalog_models()]


@pytest.mark.django_db
def test_keys_of_community_scoped_tables_include_community_id():
    tables, problems = scoped_tables(), []
    assert len(tables) >= 4, tables
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(KEYS, {"table": table})
            keys = cursor.fetchall()
            assert any(kind == "constraint p" for _, kind, _ in keys), f"{table}: no primary key found"
            problems += key_violations(table, keys)
        cursor.execute(FOREIGN_KEYS, {"tables": tables})
        fks = cursor.fetchall()
    assert any(dst in tables for _, _, dst, _, _ in fks), "no foreign key between community-scoped tables found"
    problems += fk_violations(fks, set(tables))
    assert not problems, "rule 4 (keys and foreign keys include community_id):\n" + "\n".join(problems)


def test_key_checkers_report_known_bad_keys():
    assert key_violations("t", [("t_pkey", "constraint p", ["id"])])
    assert not key_violations("t", [("t_key", "unique index", ["run_id", "community_id"])])
    assert key_violations("t", [("t_expr", "unique index", ["lower(name)"])])
    assert not key_violations("t", [("t_pkey", "constraint p", ["community_id", "id"])])
    scoped = {"a", "b"}
    assert fk_violations([("fk", "a", "b", ["run_id"], ["id"])], scoped)
    assert fk_violations([("fk", "a", "b", ["community_id", "run_id"], ["id", "community_id"])], scoped)
    assert not fk_violations([("fk", "a", "b", ["community_id", "run_id"], ["community_id", "id"])], scoped)
    assert not fk_violations([("fk", "a", "buzz_delivery_community", ["community_id"], ["id"])], scoped)

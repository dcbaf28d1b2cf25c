"""Does a lazy claim history entry pay (issue 31)? The claim stops pushing its history entry and
every settle pushes the claim's entry (rebuilt from the row's columns) and then its own, in one
statement; A/B against main's schema, in one run:

    python -m bench.lazy_claim_ab [--rounds 4] [--deliveries 20000] [--peers-rounds 2]

Two ``CREATE DATABASE ... TEMPLATE`` copies of the migrated bench database: **main** as migrated;
**lazy**: the three plan-cached claim functions redefined (from ``pg_get_functiondef``) without
their ``history = ...`` assignment, the three plan-cached settles (``finish_lease``,
``finish_leases``, ``settle_leases``) pushing :data:`CLAIM_ENTRY` before their own entry, and the
history guard's WHEN accepting one or two appended entries. The claim's entry is rebuilt with
IMMUTABLE operations only (Citus's SET-list rule): its ``at`` is ``claimed_at`` rendered as
``jsonb_build_object`` prints a timestamptz under ``TimeZone = 'UTC'`` (checked here on every row
drained, see :data:`SAME`). Each round drains ``--deliveries`` through the claim 50 -> settle 50 of
``services.cached`` on one backend in each copy, ``bench.server_ladder``'s way (backend CPU from
``/proc``, claim and settle apart), the order alternating; then ``--peers-rounds`` rounds of
``bench.run --only peers --peers worker,pgqueuer_tuned --synchronous-commit off --repeats 1`` on
each copy, alternating. Load averages are printed with every figure.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

from bench import baseline, data, env
from bench.server_ladder import _drain
from bench.worker_ladder import _rewritten, _run_peers, _url

D = data.OURS


def _utc_text(column: str) -> str:
    """``column`` (timestamptz) as ``to_json`` prints it under UTC, IMMUTABLE operations only."""
    t = f"timezone('UTC', {column})"

    def part(field: str, width: int) -> str:
        return f"lpad(extract({field} FROM {t})::int::text, {width}, '0')"

    s = f"extract(second FROM {t})"
    return (
        f"{part('year', 4)} || '-' || {part('month', 2)} || '-' || {part('day', 2)} || 'T' || "
        f"{part('hour', 2)} || ':' || {part('minute', 2)} || ':' || lpad(floor({s})::int::text, 2, '0') || "
        f"rtrim(rtrim(substr(({s} - floor({s}))::text, 2), '0'), '.') || '+00:00'"
    )


# The claim's entry as the claim writes it today (sql._CLAIM_ENTRY), from the claimed row's columns.
CLAIM_ENTRY = (
    f"(jsonb_object(ARRAY['at', {_utc_text('d.claimed_at')}, 'event', 'claim', 'status', 'claimed', "
    "'actor', d.claimed_by::text]) || ('{\"generation\": ' || d.lease_generation::text || "
    "', \"attempt\": ' || d.attempt::text || '}')::jsonb)"
)
# The rebuilt entry against jsonb_build_object's of the same columns, on synthetic claimed rows
# (whole seconds, milliseconds, microseconds; a wide span of dates), under TimeZone UTC.
SAME = f"""
SELECT count(*) FILTER (WHERE x.a IS DISTINCT FROM x.b), count(*) FROM (
  SELECT {CLAIM_ENTRY} AS a, jsonb_build_object('at', d.claimed_at, 'event', 'claim', 'status', 'claimed',
         'actor', d.claimed_by, 'generation', d.lease_generation, 'attempt', d.attempt) AS b
  FROM (SELECT date_trunc(CASE i %% 3 WHEN 0 THEN 'second' WHEN 1 THEN 'milliseconds' ELSE 'microseconds' END,
                          timestamptz '1990-01-01 00:00:00+00' + random() * interval '20000 days') AS claimed_at,
               'holder ' || i AS claimed_by, i::bigint AS lease_generation, i %% 7 AS attempt
        FROM generate_series(1, %(n)s) AS i) AS d) AS x
"""


def _check_entry(conn: psycopg.Connection, n: int = 100_000) -> None:
    conn.execute("SET TimeZone = 'UTC'")
    differ, total = conn.execute(SAME, {"n": n}).fetchone()  # type: ignore[misc]
    print(f"rebuilt claim entry vs jsonb_build_object: {differ} of {total} differ", flush=True)
    if differ:
        raise SystemExit("the rebuilt claim entry differs")


CLAIM_SET = re.compile(r",\s*history = buzz_delivery_history_push\(d\.history, [^\n]*\n")
SETTLES = ("buzz_delivery_finish_lease(", "buzz_delivery_finish_leases(", "buzz_delivery_settle_leases(")
PUSH = "history = buzz_delivery_history_push(d.history, "


# The same entry with its time through jsonb_build_object (STABLE: refused by Citus over a column in
# a SET list; plain PostgreSQL only; comparison).
CLAIM_ENTRY_STABLE = (
    "(jsonb_build_object('at', d.claimed_at) || jsonb_object(ARRAY['event', 'claim', 'status', 'claimed', "
    "'actor', d.claimed_by::text]) || ('{\"generation\": ' || d.lease_generation::text || "
    "', \"attempt\": ' || d.attempt::text || '}')::jsonb)"
)


def _lazy(body: str, entry: str | None = CLAIM_ENTRY) -> str:
    """The claim without its entry, each settle pushing ``entry`` first (None: only its own)."""
    if re.search(r"FUNCTION public\.buzz_delivery_claim_(pending|hinted|limited)\(", body):
        new = CLAIM_SET.sub("\n", body, count=1)
        if new == body:
            raise SystemExit(f"a claim function no longer has the expected form:\n{body}")
        return new
    if entry is not None and any(f"FUNCTION public.{name}" in body for name in SETTLES):
        if body.count(PUSH) != 1:
            raise SystemExit(f"a settle function no longer has the expected form:\n{body}")
        return body.replace(
            PUSH, f"history = buzz_delivery_history_push(buzz_delivery_history_push(d.history, {entry}), "
        )
    return body


GUARD = (
    "NEW.history IS DISTINCT FROM OLD.history AND NOT ("
    "(NEW.history - (-1) - (-1)) = OLD.history"
    " OR (NEW.history - (-1)) = OLD.history"
    " OR (jsonb_array_length(OLD.history) >= 49 AND (NEW.history - (-1) - (-1))"
    " = (OLD.history - (50 * (1 - LEAST((jsonb_array_length(OLD.history) - 48) / 2, 1))) - 0))"
    " OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0)))"
)


def _apply_lazy(conn: psycopg.Connection, entry: str | None = CLAIM_ENTRY) -> None:
    for statement in _rewritten(conn, lambda body: _lazy(body, entry)):
        conn.execute(statement)
    if entry is None:
        return
    (name, func) = conn.execute(
        "SELECT tgname, tgfoid::regproc::text FROM pg_trigger WHERE tgrelid = %s::regclass"
        " AND tgname LIKE '%%history_append_only%%'",
        [D],
    ).fetchone()  # type: ignore[misc]
    conn.execute(f'DROP TRIGGER "{name}" ON {D}')
    conn.execute(
        f'CREATE TRIGGER "{name}" BEFORE UPDATE OF history ON {D} FOR EACH ROW WHEN ({GUARD}) EXECUTE FUNCTION {func}()'
    )
    left = conn.execute(
        "SELECT count(*) FROM pg_proc WHERE proname LIKE 'buzz\\_delivery\\_claim\\_%%' AND prosrc LIKE '%%history%%'"
    ).fetchone()[0]  # type: ignore[index]
    if left:
        raise SystemExit(f"{left} claim functions still push history")


VARIANTS = {
    "main": ("main's schema", None),
    "lazy": ("lazy claim entry, time rendered IMMUTABLE (Citus-legal)", lambda c: _apply_lazy(c, CLAIM_ENTRY)),
    "lazy_stable": (
        "lazy claim entry, time through jsonb_build_object (plain PG only; comparison)",
        lambda c: _apply_lazy(c, CLAIM_ENTRY_STABLE),
    ),
    "no_claim_entry": (
        "claim pushes nothing, settles unchanged (bound; loses the entry)",
        lambda c: _apply_lazy(c, None),
    ),
}


def _no_guard(conn: psycopg.Connection) -> None:
    (name,) = conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname LIKE '%%history_append_only%%'", [D]
    ).fetchone()  # type: ignore[misc]
    conn.execute(f'DROP TRIGGER "{name}" ON {D}')


VARIANTS["main_noguard"] = ("main's schema without the history guard (comparison)", _no_guard)
VARIANTS["lazy_noguard"] = (
    "lazy (IMMUTABLE time) without the history guard (comparison)",
    lambda c: (_apply_lazy(c, CLAIM_ENTRY), _no_guard(c)),
)


def _best(body: str) -> str:
    """The most favourable lazy form (a lower bound, not a product form): the STABLE time, both
    entries appended by one concatenation with no 50-entry trim (the bench's rows hold 0 entries)."""
    body = _lazy(body, None)
    if any(f"FUNCTION public.{name}" in body for name in SETTLES):
        return body.replace(PUSH, f"history = (d.history || {CLAIM_ENTRY_STABLE} || ")
    return body


def _apply_best(conn: psycopg.Connection) -> None:
    for statement in _rewritten(conn, _best):
        conn.execute(statement)
    _no_guard(conn)


VARIANTS["lazy_best"] = ("lazy, STABLE time, one concatenation, no guard (lower bound; comparison)", _apply_best)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lazy_claim_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--deliveries", type=int, default=20_000)
    parser.add_argument("--peers-rounds", type=int, default=2)
    parser.add_argument("--variants", default="main,lazy", help=f"known: {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    control = env.connect(url)
    baseline.create_table(control)
    data.reset(control)
    (tenant,) = data.create_tenants(1)
    from django.db import connections

    connections.close_all()
    control.close()
    base = urlsplit(url).path.lstrip("/")
    admin = env.connect(_url(url, "postgres"))
    names = tuple(n for n in args.variants.split(",") if n)
    if set(names) - set(VARIANTS):
        raise SystemExit(f"unknown variants; known: {', '.join(VARIANTS)}")
    copies = {name: _url(url, f"{base}_{name}") for name in names}
    ladder: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    peers: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    try:
        for name in names:
            admin.execute(f'DROP DATABASE IF EXISTS "{base}_{name}"')
            admin.execute(f'CREATE DATABASE "{base}_{name}" TEMPLATE "{base}"')
        for name in names:
            apply = VARIANTS[name][1]
            if apply:
                with env.connect(copies[name]) as conn:
                    apply(conn)
        with env.connect(copies[names[0]]) as conn:
            _check_entry(conn)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                load = _load()
                started = time.monotonic()
                ladder[name].append(_drain(copies[name], tenant, args.deliveries))
                claim, settle = ladder[name][-1]
                with env.connect(copies[name]) as conn:
                    hist = conn.execute(
                        f"SELECT min(jsonb_array_length(history)), max(jsonb_array_length(history)) FROM {D}"
                    ).fetchone()
                print(f"round {round_ + 1} {name}: claim {claim:.1f} + settle {settle:.1f} = {claim + settle:.1f} "
                      f"µs/delivery (load {load}, {time.monotonic() - started:.0f} s, history entries {hist})",
                      flush=True)  # fmt: skip
        for round_ in range(args.peers_rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                print(f"peers round {round_ + 1} {name} (load {_load()})", flush=True)
                for key, runs in _run_peers(copies[name], 1, ("worker", "pgqueuer_tuned"),
                                            ("--synchronous-commit", "off")).items():  # fmt: skip
                    peers.setdefault((name, *key), []).extend(runs)
                print(f"    (load after {_load()})", flush=True)
            for name in (n for n in names if n != "main"):
                with env.connect(copies[name]) as conn:
                    left = conn.execute(
                        "SELECT count(*) FROM pg_proc WHERE proname LIKE 'buzz\\_delivery\\_claim\\_%%'"
                        " AND prosrc LIKE '%%history%%'"
                    ).fetchone()[0]  # type: ignore[index]
                    if left:
                        raise SystemExit("the lazy copy's claims push history again after bench.run")
    finally:
        for name in names:
            admin.execute(f'DROP DATABASE IF EXISTS "{base}_{name}"')
        admin.close()
    print("\n| variant | claim µs | settle µs | server µs per delivery (median) | all rounds |\n|---|---|---|---|---|")
    for name in names:
        totals = [c + s for c, s in ladder[name]]
        print(f"| {name} | {statistics.median(c for c, _ in ladder[name]):.1f} | "
              f"{statistics.median(s for _, s in ladder[name]):.1f} | {statistics.median(totals):.1f} | "
              f"{', '.join(f'{t:.0f}' for t in totals)} |")  # fmt: skip
    if peers:
        print("\n| variant | system | K | rate /s (each) | server µs (each) | client µs (each) |")
        print("|---|---|---|---|---|---|")
        for (name, system, k), runs in sorted(peers.items()):
            cells = [", ".join(f"{r[i]:,.0f}" for r in runs) for i in range(3)]
            print(f"| {name} | {system} | {k} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

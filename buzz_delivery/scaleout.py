"""Distributing the tables on a Citus coordinator (SPEC section 15, docs/scale-out.md).

``buzz_delivery_community`` is distributed by its ``id``; every table of the deletion catalog
(the core's and those registered by sibling apps) by ``community_id``, colocated with it, so a
community's rows and its row live in the same shard group, on one node. Citus refuses to
distribute a table that foreign keys point into or out of, so the foreign keys among these
tables are read from the catalog, dropped, and created again once every table is distributed.
The delivery queue (``buzz_delivery_delivery_queue``, core migration 0037) is in the core's catalog
before its record, so it is distributed after the record, colocated with it, and its foreign key
to the record's primary key is created again with the others (core 0037 distributes it itself on
a cluster whose record already is). Everything runs in one transaction: it all happens or
nothing does. Running it again is a no-op for the tables (tables already distributed are left
alone, and their keys are never touched).

The functions of :func:`delegated_functions` (the plan-cached claim and settles of
:mod:`buzz_delivery.services.cached`, and what the apps list) are then *delegated*: Citus sends
each call whole to the worker that holds the community its distribution argument names, where
its statements run on the local shards (one round trip from the coordinator, as a plain
statement would be; ``force_delegation``, so inside a transaction too). There they plan each
call (``plan_cache_mode = force_custom_plan``): Citus routes a statement by its community, which
a generic plan does not know ("could not create distributed plan ... parameters in SQL
functions"). Both are set again on every run, so run this command after every ``migrate`` on
Citus: a migration that re-creates such a function puts back its plain-PostgreSQL settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import connections, transaction

from buzz_delivery.catalog import catalog_models
from buzz_delivery.models import Community
from buzz_delivery.services import cached

# Trigger DDL on distributed tables (django-pgtrigger's migrations included) needs this on.
SESSION_SETTINGS = (
    "SET LOCAL citus.enable_unsafe_triggers = on",
    "SET LOCAL citus.multi_shard_modify_mode = 'sequential'",
)


# The AppConfig attribute a sibling app lists its delegated functions in: ``(signature,
# argument naming the community)`` pairs.
DELEGATED_ATTRIBUTE = "buzz_delegated_functions"


def delegated_functions() -> list[tuple[str, str]]:
    """``(signature, distribution argument)`` of every function the services call as one
    statement naming a community (``SELECT f(<community>, ...)`` or ``SELECT ... FROM f(...)``):
    the core's plan-cached lease functions, then what the installed apps list in
    :data:`DELEGATED_ATTRIBUTE`."""
    from django.apps import apps

    found = [(f"{s.function}({', '.join(kind for _, kind in s.params)})", "p_community_id") for s in cached.ALL]
    for config in apps.get_app_configs():
        found.extend(getattr(config, DELEGATED_ATTRIBUTE, ()) or ())
    return found


class CitusNotAvailable(RuntimeError):
    """The database has no ``citus`` extension: there is nothing to distribute onto."""


@dataclass
class DistributionResult:
    """What :func:`distribute_tables` did: tables distributed now, tables that already were,
    and how many foreign keys it dropped and created again."""

    distributed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    foreign_keys: int = 0
    delegated: list[str] = field(default_factory=list)


def tables() -> list[tuple[str, str]]:
    """``(table, distribution column)`` in distribution order: the community first."""
    return [(Community._meta.db_table, "id")] + [(m._meta.db_table, "community_id") for m in reversed(catalog_models())]


def citus_version(using: str = "default") -> str | None:
    """The installed Citus extension's version in that database, or ``None``."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
        row = cursor.fetchone()
    return row[0] if row else None


def distribute_tables(using: str = "default", *, shard_count: int | None = None) -> DistributionResult:
    """Distribute the community table and colocate every catalog table with it.

    Returns a :class:`DistributionResult`. Raises :class:`CitusNotAvailable` when the
    database has no Citus extension (nothing is changed), and lets Citus's own errors through
    (the transaction rolls back). ``shard_count``: shards of the colocation group (Citus's
    ``citus.shard_count`` when ``None``; only used for the tables distributed now)."""
    if citus_version(using) is None:
        raise CitusNotAvailable("the citus extension is not installed in this database: nothing to distribute onto")
    names = [t for t, _ in tables()]
    result = DistributionResult()
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for statement in SESSION_SETTINGS:
            cursor.execute(statement)
        if shard_count is not None:
            cursor.execute(f"SET LOCAL citus.shard_count = {int(shard_count)}")
        cursor.execute(
            "SELECT logicalrelid::regclass::text FROM pg_dist_partition WHERE logicalrelid::regclass::text = ANY(%s)",
            [names],
        )
        done = {row[0] for row in cursor.fetchall()}
        todo = [(t, col) for t, col in tables() if t not in done]
        result.already = [t for t in names if t in done]
        if todo:
            result.foreign_keys = _distribute(cursor, todo, names)
            result.distributed = [t for t, _ in todo]
        result.delegated = _delegate(cursor)
    return result


def _distribute(cursor: Any, todo: list[tuple[str, str]], names: list[str]) -> int:
    """Distribute ``todo`` (the community table first), dropping and re-creating the foreign
    keys among ``names`` that touch them; returns how many keys were re-created."""
    # Foreign keys touching a table still local, among our tables.
    cursor.execute(
        """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint
        WHERE contype = 'f' AND conrelid::regclass::text = ANY(%(names)s)
          AND confrelid::regclass::text = ANY(%(names)s)
          AND (conrelid::regclass::text = ANY(%(todo)s) OR confrelid::regclass::text = ANY(%(todo)s))
        ORDER BY 1, 2
        """,
        {"names": names, "todo": [t for t, _ in todo]},
    )
    keys = cursor.fetchall()
    for table, name, _definition in keys:
        cursor.execute(f'ALTER TABLE "{table}" DROP CONSTRAINT "{name}"')
    community = Community._meta.db_table
    for table, column in todo:
        if table == community:
            cursor.execute("SELECT create_distributed_table(%s, %s)", [table, column])
        else:
            cursor.execute("SELECT create_distributed_table(%s, %s, colocate_with => %s)", [table, column, community])
    for table, name, definition in keys:
        cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}')
    return len(keys)


def _delegate(cursor: Any) -> list[str]:
    """Delegate every function of :func:`delegated_functions` to the worker of its community,
    planned per call there (see the module docstring); returns their signatures."""
    community = Community._meta.db_table
    done = []
    for signature, argument in delegated_functions():
        cursor.execute(f"ALTER FUNCTION {signature} SET plan_cache_mode = force_custom_plan")
        cursor.execute(
            "SELECT create_distributed_function(%s, %s, colocate_with => %s, force_delegation => true)",
            [signature, argument, community],
        )
        done.append(signature)
    return done

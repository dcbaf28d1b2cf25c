"""Distributing the tables on a Citus coordinator (SPEC section 15, docs/scale-out.md).

``buzz_delivery_community`` is distributed by its ``id``; every table of the deletion catalog
(the core's and those registered by sibling apps) by ``community_id``, colocated with it, so a
community's rows and its row live in the same shard group, on one node. Citus refuses to
distribute a table that foreign keys point into or out of, so the foreign keys among these
tables are read from the catalog, dropped, and created again once every table is distributed.
Everything runs in one transaction: it all happens or nothing does. Running it again is a
no-op (tables already distributed are left alone, and their keys are never touched).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connections, transaction

from buzz_delivery.catalog import catalog_models
from buzz_delivery.models import Community

# Trigger DDL on distributed tables (django-pgtrigger's migrations included) needs this on.
SESSION_SETTINGS = (
    "SET LOCAL citus.enable_unsafe_triggers = on",
    "SET LOCAL citus.multi_shard_modify_mode = 'sequential'",
)


class CitusNotAvailable(RuntimeError):
    """The database has no ``citus`` extension: there is nothing to distribute onto."""


@dataclass
class DistributionResult:
    """What :func:`distribute_tables` did: tables distributed now, tables that already were,
    and how many foreign keys it dropped and created again."""

    distributed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    foreign_keys: int = 0


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
        if not todo:
            return result
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
                cursor.execute(
                    "SELECT create_distributed_table(%s, %s, colocate_with => %s)", [table, column, community]
                )
            result.distributed.append(table)
        for table, name, definition in keys:
            cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}')
        result.foreign_keys = len(keys)
    return result

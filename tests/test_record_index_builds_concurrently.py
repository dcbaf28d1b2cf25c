"""The record's indexes are built and dropped CONCURRENTLY once the record holds a table at work
(core 0015 and 0036's rule, bench/results/index-diet.md): a plain ``DROP INDEX`` takes ACCESS
EXCLUSIVE on the record and a plain ``CREATE INDEX`` SHARE, both held to the migration's commit,
so every settle, and with the DROP every read of the view, waits for the whole build of an index
over every row. Static: the migrations from core 0039 on are read, nothing runs."""

from __future__ import annotations

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations
from django.db.migrations.loader import MigrationLoader

FIRST = "0039"


def _record_index_operations() -> list[tuple[str, object, bool]]:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    found = []
    for (app, name), migration in loader.disk_migrations.items():
        if app != "buzz_delivery" or name[:4] < FIRST:
            continue
        for op in migration.operations:
            if isinstance(op, migrations.AddIndex | migrations.RemoveIndex) and op.model_name == "deliveryrecord":
                found.append((name, op, migration.atomic))
    return found


def test_the_records_indexes_are_built_and_dropped_concurrently():
    found = _record_index_operations()
    assert found, "no migration from 0039 on touches the record's indexes"
    plain = [
        (name, type(op).__name__)
        for name, op, atomic in found
        if atomic or not isinstance(op, AddIndexConcurrently | RemoveIndexConcurrently)
    ]
    assert plain == []

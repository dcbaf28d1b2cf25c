"""Community lifecycle moves and the deletion catalog (SPEC section 5)."""

from __future__ import annotations

import importlib
import uuid

import pytest
from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import connection, models

from buzz_delivery import services
from buzz_delivery.catalog import DELETION_CATALOG, catalog_models, deletion_catalog
from buzz_delivery.exceptions import CommunityNotFound, LifecycleError
from buzz_delivery.models import Community
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.citus_support import CITUS_MODE
from tests.lifecycle_support import fill_community, raw_write

pytestmark = pytest.mark.django_db

COMPOSITE_KEYS = importlib.import_module("buzz_delivery.migrations.0002_tenant_keys_and_write_fence").COMPOSITE_KEYS
REPLACED_BY_0036 = {"delivery_workflow_same_community", "delivery_run_same_community"}


def state_of(community: Community) -> tuple[str, int]:
    community.refresh_from_db()
    return community.deletion_state, community.fence_generation


# --- forward-only moves -------------------------------------------------------


def test_each_forward_move_bumps_the_fence_generation_and_stamps_the_time(community):
    assert state_of(community) == ("active", 0)
    assert community.state_changed_at is None
    for generation, state in enumerate(("quiescing", "fenced", "tombstone"), start=1):
        moved = services.advance_community(community.id, state)
        assert (moved.deletion_state, moved.fence_generation) == (state, generation)
        assert moved.state_changed_at is not None
        assert state_of(community) == (state, generation)


@pytest.mark.parametrize(
    ("start", "target"),
    [
        ("active", "active"),
        ("active", "fenced"),
        ("active", "tombstone"),
        ("quiescing", "active"),
        ("quiescing", "quiescing"),
        ("quiescing", "tombstone"),
        ("fenced", "quiescing"),
        ("fenced", "active"),
        ("tombstone", "fenced"),
        ("tombstone", "active"),
        ("tombstone", "tombstone"),
    ],
)
def test_a_backward_skipping_or_repeated_move_is_a_lifecycle_error_and_changes_nothing(community, start, target):
    advance_to(community, start)
    before = state_of(community)
    with pytest.raises(LifecycleError, match=f"from {start} to {target}"):
        services.advance_community(community.id, target)
    assert state_of(community) == before


@pytest.mark.parametrize(
    ("start", "target"),
    [
        ("active", "fenced"),
        ("active", "tombstone"),
        ("quiescing", "active"),
        ("fenced", "quiescing"),
        ("tombstone", "active"),
        ("fenced", "fenced"),
    ],
)
def test_the_database_refuses_a_backward_or_skipping_move_even_through_raw_sql(community, start, target):
    advance_to(community, start)
    before = state_of(community)
    failed = raw_write(
        "UPDATE buzz_delivery_community SET deletion_state = %(s)s WHERE id = %(c)s", {"s": target, "c": community.id}
    )
    if start == target:  # no move at all is simply no move: nothing to refuse, nothing bumped
        assert failed is None
    else:
        assert failed == "BD002"
    assert state_of(community) == before


def test_a_raw_forward_move_is_accepted_and_the_database_bumps_the_generation(community):
    failed = raw_write(
        "UPDATE buzz_delivery_community SET deletion_state = 'quiescing', fence_generation = 99 WHERE id = %(c)s",
        {"c": community.id},
    )
    assert failed is None
    assert state_of(community) == ("quiescing", 1)


def test_the_fence_generation_never_changes_without_a_move(community):
    failed = raw_write("UPDATE buzz_delivery_community SET fence_generation = 7 WHERE id = %(c)s", {"c": community.id})
    assert failed == "BD002"
    assert state_of(community) == ("active", 0)


def test_a_community_id_never_changes(community):
    failed = raw_write(
        "UPDATE buzz_delivery_community SET id = %(n)s WHERE id = %(c)s", {"n": uuid.uuid4(), "c": community.id}
    )
    # Citus refuses any change of a distribution column before our trigger runs (0A000).
    assert failed == ("0A000" if CITUS_MODE else "BD002")


def test_moving_to_tombstone_requires_every_row_gone(community):
    fill_community(community, rows=1)
    advance_to(community, "fenced")
    with pytest.raises(LifecycleError, match="still holds rows"):
        services.advance_community(community.id, "tombstone")
    assert state_of(community) == ("fenced", 2)


def test_an_empty_fenced_community_moves_to_tombstone(community):
    advance_to(community, "fenced")
    assert services.advance_community(community.id, "tombstone").deletion_state == "tombstone"


def test_the_database_refuses_a_raw_move_to_tombstone_while_rows_are_left(community):
    fill_community(community, rows=1)
    advance_to(community, "fenced")
    failed = raw_write(
        "UPDATE buzz_delivery_community SET deletion_state = 'tombstone' WHERE id = %(c)s", {"c": community.id}
    )
    assert failed == "BD002"


def test_bad_arguments_are_validation_errors_naming_the_argument(community):
    with pytest.raises(ValidationError) as err:
        services.advance_community("not-a-uuid", "quiescing")
    assert list(err.value.message_dict) == ["community_id"]
    with pytest.raises(ValidationError) as err:
        services.advance_community(community.id, "deleted")
    assert list(err.value.message_dict) == ["state"]
    assert state_of(community) == ("active", 0)


def test_an_unknown_community_is_reported():
    with pytest.raises(CommunityNotFound):
        services.advance_community(uuid.uuid4(), "quiescing")


def test_moving_one_community_leaves_the_others_alone(community):
    other = CommunityFactory()
    services.advance_community(community.id, "quiescing")
    assert state_of(other) == ("active", 0)


# --- the deletion catalog: drift and order --------------------------------------


def community_scoped_models() -> set[type[models.Model]]:
    """Models of every installed app with a relation to Community (own or inherited fields):
    the core's and its sibling apps' (``buzz_delivery.workflows``...). Not an unmanaged model:
    a view's rows are its table's (the delivery view over ``DeliveryRecord``)."""
    scoped = set()
    for model in apps.get_models():
        if not model._meta.managed:
            continue
        for f in model._meta.get_fields(include_parents=True):
            forward = f.is_relation and (f.concrete or not f.auto_created)
            if forward and f.related_model is Community:
                scoped.add(model)
    return scoped


def catalog_drift(catalog: tuple[str, ...], table_names: list[str] | None = None) -> list[str]:
    """Problems of a catalog: community-scoped models missing, entries without a model or table."""
    tables = set(connection.introspection.table_names() if table_names is None else table_names)
    problems = []
    listed = set()
    for label in catalog:
        try:
            model = apps.get_model(label)
        except LookupError:
            problems.append(f"{label}: no such model")
            continue
        listed.add(model)
        if model._meta.db_table not in tables:
            problems.append(f"{label}: table {model._meta.db_table} does not exist")
    for model in sorted(community_scoped_models() - listed, key=lambda m: m._meta.label):
        problems.append(f"{model._meta.label}: community-scoped but not in DELETION_CATALOG")
    return problems


def foreign_key_edges(tables: list[str]) -> set[tuple[str, str, str]]:
    """(constraint or field, from table, to table) for every foreign key between ``tables``:
    the database's (composite keys of migration 0002 included) and Django's (even without
    a database constraint)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT con.conname, src.relname, dst.relname
            FROM pg_constraint con
            JOIN pg_class src ON src.oid = con.conrelid
            JOIN pg_class dst ON dst.oid = con.confrelid
            WHERE con.contype = 'f' AND src.relname = ANY(%s) AND dst.relname = ANY(%s)
            """,
            [tables, tables],
        )
        edges = set(cursor.fetchall())
    for table in tables:
        model = next(m for m in apps.get_models() if m._meta.db_table == table)
        for f in model._meta.get_fields(include_parents=True):
            if f.is_relation and f.concrete and f.related_model._meta.db_table in tables:
                edges.add((f"{model.__name__}.{f.name}", table, f.related_model._meta.db_table))
    return edges


def order_problems(catalog: tuple[str, ...]) -> list[str]:
    """Edges where a catalog table references a table that does not come later in the catalog."""
    tables = [apps.get_model(label)._meta.db_table for label in catalog]
    return sorted(
        f"{name}: {src} references {dst}, which must come later"
        for name, src, dst in foreign_key_edges(tables)
        if src != dst and tables.index(dst) < tables.index(src)
    )


def test_every_community_scoped_model_is_in_the_deletion_catalog_and_every_entry_exists():
    assert community_scoped_models(), "the drift check found no community-scoped model at all"
    assert catalog_drift(deletion_catalog()) == []


def test_sibling_apps_register_their_tables_before_the_cores():
    catalog = deletion_catalog()
    assert catalog[-len(DELETION_CATALOG) :] == DELETION_CATALOG
    assert {
        "buzz_workflows.Step",
        "buzz_workflows.Run",
        "buzz_workflows.DefinitionVersion",
        "buzz_workflows.Approval",
    } <= set(catalog)
    without_steps = tuple(label for label in catalog if label != "buzz_workflows.Step")
    assert catalog_drift(without_steps) == ["buzz_workflows.Step: community-scoped but not in DELETION_CATALOG"]


def test_the_drift_check_fails_for_a_missing_model_a_vanished_model_or_a_dropped_table():
    full = deletion_catalog()
    without_event = tuple(label for label in full if label != "buzz_delivery.Event")
    assert catalog_drift(without_event) == ["buzz_delivery.Event: community-scoped but not in DELETION_CATALOG"]
    assert catalog_drift((*full, "buzz_delivery.Ghost")) == ["buzz_delivery.Ghost: no such model"]
    tables = [t for t in connection.introspection.table_names() if t != "buzz_delivery_workflow_run"]
    assert catalog_drift(full, tables) == ["buzz_delivery.WorkflowRun: table buzz_delivery_workflow_run does not exist"]


def test_the_catalog_lists_children_before_the_parents_they_reference():
    tables = [m._meta.db_table for m in catalog_models()]
    seen = {name for name, _src, _dst in foreign_key_edges(tables)}
    # The edge query sees the composite tenant keys of migration 0002 (the delivery's keys to its
    # workflow and run are one since core 0036) and Django's own keys.
    assert {name for _table, name, _cols, _ref in COMPOSITE_KEYS} - REPLACED_BY_0036 <= seen
    assert "delivery_run_workflow_same_community" in seen
    assert {"DeliveryRecord.run", "WorkflowRun.workflow"} <= seen
    assert order_problems(deletion_catalog()) == []


def test_the_order_check_fails_for_a_parent_listed_before_its_child():
    swapped = (
        "buzz_delivery.WorkflowRun",
        "buzz_delivery.DeliveryRecord",
        "buzz_delivery.Event",
        "buzz_delivery.Workflow",
    )
    problems = order_problems(swapped)
    assert (
        "delivery_run_workflow_same_community: buzz_delivery_delivery_record references buzz_delivery_workflow_run, "
        "which must come later" in problems
    )
    assert all("buzz_delivery_delivery_record references buzz_delivery_workflow_run" in p for p in problems)


def test_catalog_models_follow_the_catalog_order():
    assert [m._meta.label for m in catalog_models()] == list(deletion_catalog())


def test_the_tombstone_trigger_checks_every_table_of_the_deletion_catalog():
    from buzz_delivery.triggers import TENANT_TABLES

    assert sorted(TENANT_TABLES) == sorted(apps.get_model(label)._meta.db_table for label in DELETION_CATALOG)
    # Every catalog table, the sibling apps' too, is named by some BEFORE UPDATE trigger function
    # on the community table that refuses the tombstone move (the core's, or a sibling's own).
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT string_agg(pg_get_functiondef(t.tgfoid), ' ')
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
            WHERE c.relname = 'buzz_delivery_community' AND NOT t.tgisinternal
            """
        )
        guards = cursor.fetchone()[0]
    missing = [
        m._meta.db_table for m in catalog_models() if f"FROM {m._meta.db_table} WHERE community_id" not in guards
    ]
    assert missing == []

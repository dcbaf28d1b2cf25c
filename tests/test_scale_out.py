"""The scale-out rework on plain PostgreSQL (SPEC section 15): what runs everywhere, CI included.
The cluster itself is exercised by tests/test_citus.py in Citus mode."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from buzz_delivery import scaleout, services
from buzz_delivery.catalog import catalog_models
from buzz_delivery.models import Community, WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, WorkflowRunFactory
from tests.citus_support import CITUS_MODE
from tests.operator_support import lapsed


def _tables_and_keys() -> list[tuple[str, str]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE contype IN ('p', 'f', 'u') AND conrelid::regclass::text LIKE 'buzz_delivery_%%' ORDER BY 1, 2"
        )
        return cursor.fetchall()


@pytest.mark.django_db
def test_distribute_tables_refuses_without_citus_and_changes_nothing():
    before = _tables_and_keys()
    with pytest.raises(CommandError, match="citus extension is not installed") as info:
        call_command("distribute_tables")
    assert info.value.returncode == 3
    assert _tables_and_keys() == before


def test_the_community_is_distributed_first_and_every_catalog_table_after_it():
    order = scaleout.tables()
    assert order[0] == ("buzz_delivery_community", "id")
    assert sorted(t for t, _ in order[1:]) == sorted(m._meta.db_table for m in catalog_models())
    assert {col for _, col in order[1:]} == {"community_id"}


@pytest.mark.django_db
def test_a_constraint_name_with_a_shard_suffix_still_names_its_field(community, message_event, make_binding):
    """On Citus the violated key is ``delivery_run_workflow_same_community_102008``: the services still
    refuse with a ValidationError naming the binding's field, not a raw IntegrityError. On
    PostgreSQL the key is renamed so; on the cluster (which refuses renaming a distributed table's
    constraint) the real violation on the shard carries the suffix, which the test checks."""
    if not CITUS_MODE:
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE buzz_delivery_delivery_record RENAME CONSTRAINT delivery_run_workflow_same_community"
                " TO delivery_run_workflow_same_community_102008"
            )
    foreign_run = WorkflowRunFactory()  # another community
    with pytest.raises(ValidationError) as info:
        services.commit_deliveries(community.id, message_event, [make_binding(run_id=foreign_run.id)])
    assert set(info.value.message_dict) == {"bindings.workflow_id", "bindings.run_id"}  # one key, core 0036
    raw = info.value.__cause__.__cause__  # the driver's error, as the database named the key
    named = getattr(raw.diag, "constraint_name", None) or re.search(r'constraint "([^"]+)"', str(raw)).group(1)
    assert re.fullmatch(r"delivery_run_workflow_same_community_\d{6,}", named), named
    assert not WorkflowAgentDelivery.objects.filter(community_id=community.id).exists()


@pytest.mark.django_db
def test_the_reaper_runs_one_statement_per_community_with_work():
    busy = [CommunityFactory() for _ in range(3)]
    CommunityFactory()  # nothing to reap: not visited
    for community in busy:
        lapsed(community)
        lapsed(community)
    result = services.reap(batch_size=10)
    assert result.reclaimed == 6
    # One lapsed-lease batch and one overdue batch per community with work.
    assert result.batches == 2 * len(busy)


@pytest.mark.django_db(transaction=True)
def test_a_raw_sql_move_waits_for_an_open_writer_because_the_lock_is_in_the_trigger():
    """The move's side of the fence lives in the community row's trigger, not in Python: a
    plain UPDATE of deletion_state waits for a writer's open transaction like
    advance_community does (so it meets the writers on the community's node under Citus)."""
    community = CommunityFactory()
    wrote, release = threading.Event(), threading.Event()

    def writer() -> None:
        try:
            with transaction.atomic():
                WorkflowRunFactory(community=community)  # a write under the fence
                wrote.set()
                assert release.wait(30)
        finally:
            connection.close()

    def raw_move() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE buzz_delivery_community SET deletion_state = 'quiescing' WHERE id = %s", [community.id]
                )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        writing = pool.submit(writer)
        assert wrote.wait(15)
        moving = pool.submit(raw_move)
        try:
            with pytest.raises(TimeoutError):
                moving.result(timeout=1.0)
            assert Community.objects.get(id=community.id).deletion_state == "active"
        finally:
            release.set()
        writing.result(30)
        moving.result(30)
    assert Community.objects.get(id=community.id).deletion_state == "quiescing"


def test_what_the_citus_mode_leaves_out_or_skips_still_exists():
    """tests/citus_mode.py is the one place naming what the Citus mode does not run: each entry
    must name a module, or a test of a module, that exists (a renamed test would silently run
    again, or a removed one be kept as a reason)."""
    import ast
    from pathlib import Path

    from tests.citus_mode import LEFT_OUT, SKIPPED

    root = Path(__file__).resolve().parent.parent
    assert LEFT_OUT and SKIPPED
    for module in LEFT_OUT:
        assert (root / module).is_file(), module
    for nodeid, reason in SKIPPED.items():
        module, name = nodeid.split("::")
        tree = ast.parse((root / module).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, nodeid
        assert reason.strip(), nodeid
    assert not set(LEFT_OUT) & {nodeid.split("::")[0] for nodeid in SKIPPED}


def test_what_the_citus_mode_runs_fewer_repetitions_of_is_named_with_its_reason():
    """Each module of SHORTENED exists, has a reason, and asks :func:`repetitions` under its own
    name (a module that stopped asking would keep a stale reason; one asking under another name
    would be refused on the cluster)."""
    from pathlib import Path

    from tests.citus_mode import LEFT_OUT, SHORTENED

    root = Path(__file__).resolve().parent.parent
    assert SHORTENED
    for module, reason in SHORTENED.items():
        assert (root / module).is_file() and reason.strip(), module
        assert f'repetitions("{module}",' in (root / module).read_text(), module
        assert module not in LEFT_OUT, module

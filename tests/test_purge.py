"""Purging a fenced community: the service and ``manage.py purge_community`` (SPEC section 5)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from buzz_delivery import services
from buzz_delivery.catalog import catalog_models, deletion_catalog
from buzz_delivery.exceptions import CommunityNotFound, LifecycleError
from buzz_delivery.models import Community
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.conftest import without_context
from tests.lifecycle_support import (
    RAW_WRITES,
    community_snapshot,
    count_rows,
    fill_community,
    purge_settings,
    raw_write,
)

ROOT = Path(__file__).resolve().parent.parent
ZERO = dict.fromkeys(deletion_catalog(), 0)


@pytest.fixture
def fenced(community):
    """A fenced community with 3 workflows, runs, events and 4 deliveries (4 records, and 4 queue
    rows since stage 2 of issue 31: the deliveries are pending, so each has its live queue row)."""
    fill_community(community, rows=3)
    return advance_to(community, "fenced")


@pytest.fixture
def fenced_with_engine(community):
    """Like ``fenced``, plus 3 workflow engine definitions, runs, steps and approvals."""
    fill_community(community, rows=3, engine=True)
    return advance_to(community, "fenced")


@pytest.fixture
def bystanders():
    """An active and a fenced community with rows, which no purge of another community may touch."""
    active, other_fenced = CommunityFactory(), CommunityFactory()
    fill_community(active, rows=2, engine=True)
    fill_community(other_fenced, rows=2, engine=True)
    advance_to(other_fenced, "fenced")
    return active, other_fenced


def snapshots(communities) -> dict:
    return {c.id: community_snapshot(c.id) for c in communities}


def deletes_per_table(queries) -> list[str]:
    """The table of each DELETE statement, in the order they ran."""
    statements = [without_context(q["sql"]) for q in queries]
    return [re.match(r'DELETE FROM "?(\w+)"?', sql).group(1) for sql in statements if sql.startswith("DELETE")]


# --- the service -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["active", "quiescing"])
def test_purge_refuses_a_community_that_is_not_fenced(community, state, table_snapshot):
    fill_community(community, rows=1)
    advance_to(community, state)
    before = table_snapshot()
    with pytest.raises(LifecycleError, match=f"is {state}"):
        services.purge_community(community.id)
    assert table_snapshot() == before


@pytest.mark.django_db
def test_purge_empties_the_community_in_catalog_order_in_bounded_batches_then_tombstones_it(
    fenced_with_engine, bystanders
):
    fenced = fenced_with_engine
    expected = count_rows(fenced.id)
    assert all(n > 2 for n in expected.values())
    others_before = snapshots(bystanders)

    with CaptureQueriesContext(connection) as ctx:
        result = services.purge_community(fenced.id, batch_size=2)

    assert list(result.deleted) == list(deletion_catalog())
    assert result.deleted == expected
    assert (result.tombstoned, result.dry_run) == (True, False)
    assert count_rows(fenced.id) == ZERO
    # Each table: DELETE statements of at most 2 rows until one deletes fewer than 2.
    tables = deletes_per_table(ctx.captured_queries)
    per_table = Counter(tables)
    catalog_tables = [m._meta.db_table for m in catalog_models()]
    assert list(dict.fromkeys(tables)) == catalog_tables, "tables not emptied in catalog order"
    assert {m._meta.db_table: expected[m._meta.label] // 2 + 1 for m in catalog_models()} == per_table
    assert result.batches == len(tables)

    fenced.refresh_from_db()
    assert (fenced.deletion_state, fenced.fence_generation) == ("tombstone", 3)
    assert snapshots(bystanders) == others_before


@pytest.mark.django_db
def test_a_second_purge_is_a_no_op_returning_zero_counts(fenced, table_snapshot):
    services.purge_community(fenced.id)
    before = table_snapshot()
    again = services.purge_community(fenced.id)
    assert (again.deleted, again.total, again.tombstoned) == (ZERO, 0, True)
    assert table_snapshot() == before


@pytest.mark.django_db
def test_a_dry_run_counts_the_rows_and_writes_nothing(fenced, table_snapshot):
    before = table_snapshot()
    result = services.purge_community(fenced.id, dry_run=True)
    assert result.deleted == count_rows(fenced.id)
    # 23 = 16 + the 4 live deliveries' queue rows (a table of its own since issue 31, stage 2)
    # + 3 settle tally rows (core 0039)
    assert (result.total, result.dry_run, result.tombstoned, result.batches) == (23, True, False, 0)
    assert table_snapshot() == before


@pytest.mark.django_db
def test_purging_an_empty_fenced_community_tombstones_it(community):
    advance_to(community, "fenced")
    assert services.purge_community(community.id).deleted == ZERO
    community.refresh_from_db()
    assert community.deletion_state == "tombstone"


@pytest.mark.django_db
def test_bad_arguments_are_validation_errors_naming_the_argument(fenced, table_snapshot):
    before = table_snapshot()
    for kwargs, field in [
        ({"community_id": "nope"}, "community_id"),
        ({"community_id": fenced.id, "batch_size": 0}, "batch_size"),
        ({"community_id": fenced.id, "batch_size": "2"}, "batch_size"),
    ]:
        with pytest.raises(ValidationError) as err:
            services.purge_community(**kwargs)
        assert list(err.value.message_dict) == [field]
    with pytest.raises(CommunityNotFound):
        services.purge_community(uuid.uuid4())
    assert table_snapshot() == before


@pytest.mark.django_db
def test_the_purge_leaves_no_executor_identity_behind_in_the_callers_transaction(fenced, bystanders):
    _active, other_fenced = bystanders
    services.purge_community(fenced.id, batch_size=2)
    assert purge_settings() in {("", ""), (None, None)}
    before = community_snapshot(other_fenced.id)
    assert raw_write(RAW_WRITES["delivery"]["delete"], {"c": other_fenced.id}) == "BD001"
    assert community_snapshot(other_fenced.id) == before


@pytest.mark.django_db(transaction=True)
def test_a_purge_in_autocommit_commits_batch_by_batch_and_leaves_no_identity_behind(community):
    fill_community(community, rows=3)
    advance_to(community, "fenced")
    result = services.purge_community(community.id, batch_size=2)
    assert result.total == 23  # 16 + the 4 live deliveries' queue rows (issue 31, stage 2) + 3 tally rows
    assert purge_settings() in {("", ""), (None, None)}
    assert Community.objects.get(id=community.id).deletion_state == "tombstone"


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["quiescing", "fenced", "tombstone"])
def test_the_database_refuses_to_delete_a_retired_community_row_even_through_raw_sql(community, state):
    advance_to(community, state)
    failed = raw_write("DELETE FROM buzz_delivery_community WHERE id = %(c)s", {"c": community.id})
    assert failed is not None
    assert Community.objects.filter(id=community.id).exists()


@pytest.mark.django_db
def test_an_empty_active_community_row_can_still_be_deleted(community):
    assert raw_write("DELETE FROM buzz_delivery_community WHERE id = %(c)s", {"c": community.id}) is None
    assert not Community.objects.filter(id=community.id).exists()


# --- the management command -------------------------------------------------------------


class Terminal(io.StringIO):
    """Simulated interactive stdin."""

    def isatty(self) -> bool:
        return True


def run(*args, stdin=None):
    out, err = io.StringIO(), io.StringIO()
    kwargs = {"stdout": out, "stderr": err}
    if stdin is not None:
        kwargs["stdin"] = stdin
    call_command("purge_community", *args, **kwargs)
    return out.getvalue()


def table_lines(output: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(buzz_delivery_\w+)\s+(\d+)$", output, re.M)}


EXPECTED_TABLE = {
    "buzz_delivery_settle_tally": 3,  # settles' counts (core 0039), no key to anything: first
    "buzz_delivery_rate_limit": 3,
    "buzz_delivery_delivery_queue": 4,  # the 4 pending deliveries' live rows, before their records
    "buzz_delivery_delivery_record": 4,
    "buzz_delivery_workflow_run": 3,
    "buzz_delivery_event": 3,
    "buzz_delivery_workflow": 3,
}


@pytest.mark.django_db
def test_command_dry_run_prints_the_counts_per_table_and_writes_nothing(fenced, table_snapshot):
    before = table_snapshot()
    output = run(str(fenced.id), "--dry-run")
    assert table_lines(output) == EXPECTED_TABLE
    assert list(table_lines(output)) == list(EXPECTED_TABLE), "rows not listed in catalog order"
    assert f"Dry run: 23 rows of community {fenced.id} would be deleted; nothing written." in output
    assert table_snapshot() == before


@pytest.mark.django_db
def test_command_with_yes_purges_in_batches_and_prints_a_summary(fenced, bystanders):
    others_before = snapshots(bystanders)
    output = run(str(fenced.id), "--yes", "--batch-size", "2")
    assert table_lines(output) == EXPECTED_TABLE
    assert output.strip().splitlines()[-1] == (
        # 16 batches for the core's 7 tables (the queue's and the record's 4 rows take 3 each), one
        # (empty) batch for each sibling app table (the engine's).
        f"Purged community {fenced.id}: 23 rows deleted in {16 + len(deletion_catalog()) - 7} batches of at most 2; "
        "it is now tombstone."
    )
    assert count_rows(fenced.id) == ZERO
    fenced.refresh_from_db()
    assert fenced.deletion_state == "tombstone"
    assert snapshots(bystanders) == others_before


@pytest.mark.django_db
def test_command_asks_for_confirmation_on_a_terminal_and_purges_on_yes(fenced):
    output = run(str(fenced.id), stdin=Terminal("yes\n"))
    assert "Type 'yes' to continue" in output
    assert "23 rows deleted" in output
    assert count_rows(fenced.id) == ZERO


@pytest.mark.django_db
@pytest.mark.parametrize("answer", ["no\n", "\n", "", "y\n"])
def test_command_deletes_nothing_unless_the_answer_is_yes(fenced, table_snapshot, answer):
    before = table_snapshot()
    output = run(str(fenced.id), stdin=Terminal(answer))
    assert "Purge cancelled; nothing deleted." in output
    assert table_snapshot() == before


@pytest.mark.django_db
def test_command_refuses_without_yes_when_stdin_is_not_a_terminal(fenced, table_snapshot):
    before = table_snapshot()
    with pytest.raises(CommandError, match="stdin is not a terminal; pass --yes") as err:
        run(str(fenced.id), stdin=io.StringIO("yes\n"))
    assert err.value.returncode == 5
    assert table_snapshot() == before


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message", "returncode"),
    [
        (["not-a-uuid", "--yes"], "argument community_id: not a valid UUID: 'not-a-uuid'", 1),
        (["{id}", "--yes", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0", 1),
        (["{id}", "--yes", "--batch-size", "two"], "argument --batch-size: must be an integer, got 'two'", 1),
        (
            ["00000000-0000-0000-0000-000000000001", "--yes"],
            "no community with id 00000000-0000-0000-0000-000000000001",
            3,
        ),
    ],
)
def test_command_names_the_problem_with_its_arguments(fenced, table_snapshot, args, message, returncode):
    before = table_snapshot()
    with pytest.raises(CommandError) as err:
        run(*[a.format(id=fenced.id) for a in args])
    assert message in str(err.value)
    assert err.value.returncode == returncode
    assert table_snapshot() == before


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["active", "quiescing"])
def test_command_refuses_a_community_that_is_not_fenced(community, state, table_snapshot):
    fill_community(community, rows=1)
    advance_to(community, state)
    before = table_snapshot()
    with pytest.raises(CommandError, match=f"is {state}, not fenced") as err:
        run(str(community.id), "--yes")
    assert err.value.returncode == 4
    assert table_snapshot() == before


@pytest.mark.django_db
def test_command_on_a_tombstone_says_there_is_nothing_to_purge(fenced):
    services.purge_community(fenced.id)
    assert "already tombstone: nothing to purge" in run(str(fenced.id), "--yes")


@pytest.mark.django_db(transaction=True)
def test_command_as_a_process_exits_non_zero_without_hanging_when_stdin_is_not_a_terminal(community):
    fill_community(community, rows=1)
    advance_to(community, "fenced")
    db = connection.settings_dict
    # Host and port through libpq's own variables: HOST may be a socket folder (embedded server).
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@/{db['NAME']}",
        "PGHOST": str(db["HOST"] or ""),
        "PGPORT": str(db["PORT"] or ""),
        "PGPASSWORD": str(db["PASSWORD"] or ""),
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, str(ROOT / "manage.py"), "purge_community", str(community.id)]

    refused = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert refused.returncode == 5, refused.stderr
    assert "pass --yes" in refused.stderr
    assert sum(count_rows(community.id).values()) == 9  # 6 + the 2 live deliveries' queue rows + 1 tally row

    done = subprocess.run(
        [*command, "--yes"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "9 rows deleted" in done.stdout
    assert Community.objects.get(id=community.id).deletion_state == "tombstone"

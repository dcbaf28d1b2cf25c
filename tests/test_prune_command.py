"""``manage.py prune_deliveries`` and ``services.prune_deliveries`` (SPEC section 8)."""

from __future__ import annotations

import datetime as dt
import json
from io import StringIO

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from buzz_delivery import models, services
from buzz_delivery.management.commands.prune_deliveries import parse_age
from buzz_delivery.services.runlock import acquire_run_lease
from buzz_delivery.testing import CommunityFactory, Expr, advance_to, set_delivery_state
from tests.operator_support import claimed, lease_rows, parse_kv, pending, settled

pytestmark = pytest.mark.django_db

DAY = 86_400


def prune(*args: str) -> dict:
    out = StringIO()
    call_command("prune_deliveries", *args, "--json", stdout=out, stderr=StringIO())
    return json.loads(out.getvalue())


def exists(delivery: models.WorkflowAgentDelivery) -> bool:
    return models.WorkflowAgentDelivery.objects.filter(pk=delivery.pk).exists()


def test_prune_deletes_terminal_rows_older_than_the_cutoff_and_keeps_younger_ones(community):
    old = settled(community, "finished", age_seconds=31 * DAY)
    young = settled(community, "finished", age_seconds=29 * DAY)

    summary = prune("--older-than", "30d")

    assert summary["outcome"] == "ok" and summary["deleted"] == 1 and summary["finished"] == 1
    assert not exists(old) and exists(young)


def test_prune_never_deletes_pending_or_claimed_rows_however_old(community):
    waiting = pending(community)
    working, _ = claimed(community)
    # make them look ancient (every row, as before)
    set_delivery_state(Expr("true"), created_at=Expr("now() - interval '400 days'"))

    summary = prune("--older-than", "1s")

    assert summary["deleted"] == 0
    assert exists(waiting) and exists(working)


def test_prune_deletes_failed_and_expired_rows_too(community):
    failed = settled(community, "failed", age_seconds=2 * DAY)
    summary = prune("--older-than", "1d")
    assert summary["failed"] == 1 and not exists(failed)


def test_prune_dry_run_counts_and_deletes_nothing(community, table_snapshot):
    settled(community, "finished", age_seconds=10 * DAY)
    settled(community, "failed", age_seconds=10 * DAY)
    before = table_snapshot()

    summary = prune("--older-than", "7d", "--dry-run")

    assert summary["dry_run"] is True and summary["deleted"] == 2 and summary["batches"] == 0
    assert (summary["finished"], summary["failed"], summary["expired"]) == (1, 1, 0)
    assert table_snapshot() == before
    assert lease_rows() == []


def test_retain_gives_one_status_its_own_age(community):
    finished = settled(community, "finished", age_seconds=60 * DAY)
    failed = settled(community, "failed", age_seconds=60 * DAY)
    ancient_failure = settled(community, "failed", age_seconds=100 * DAY)

    summary = prune("--older-than", "30d", "--retain", "failed=90d")

    assert (summary["finished"], summary["failed"]) == (1, 1)
    assert not exists(finished) and exists(failed) and not exists(ancient_failure)


def test_status_limits_pruning_to_the_named_statuses(community):
    finished = settled(community, "finished", age_seconds=60 * DAY)
    failed = settled(community, "failed", age_seconds=60 * DAY)

    summary = prune("--older-than", "30d", "--status", "finished")

    assert summary["deleted"] == 1 and not exists(finished) and exists(failed)


def test_retain_of_a_status_that_is_not_pruned_is_refused(community):
    with pytest.raises(CommandError, match="not among the pruned statuses"):
        prune("--older-than", "30d", "--status", "finished", "--retain", "failed=90d")


def test_prune_skips_terminal_rows_of_a_fenced_community_and_reports_them(community):
    healthy = settled(community, "finished", age_seconds=40 * DAY)
    other = CommunityFactory()
    fenced_row = settled(other, "finished", age_seconds=40 * DAY)
    advance_to(other, "fenced")

    summary = prune("--older-than", "30d")

    assert summary["deleted"] == 1 and summary["skipped_fenced"] == 1
    assert not exists(healthy) and exists(fenced_row)


def test_prune_works_in_batches(community):
    rows = [settled(community, "finished", age_seconds=40 * DAY) for _ in range(5)]

    summary = prune("--older-than", "30d", "--batch-size", "2")

    assert summary["deleted"] == 5 and summary["batches"] >= 3
    assert not any(exists(row) for row in rows)


def test_prune_respects_max_batches(community):
    for _ in range(5):
        settled(community, "finished", age_seconds=40 * DAY)

    summary = prune("--older-than", "30d", "--batch-size", "2", "--max-batches", "1")

    assert summary["deleted"] == 2 and summary["batches"] == 1


def test_prune_prints_a_key_value_summary_by_default(community):
    settled(community, "finished", age_seconds=40 * DAY)
    out = StringIO()
    call_command("prune_deliveries", "--older-than", "30d", stdout=out)
    summary = parse_kv(out.getvalue().strip())
    assert summary["outcome"] == "ok" and summary["deleted"] == "1" and summary["dry_run"] == "false"


def test_prune_exits_0_and_deletes_nothing_while_another_prune_holds_the_lease(community):
    row = settled(community, "finished", age_seconds=40 * DAY)
    acquire_run_lease("prune_deliveries", 300, holder="other:1:x")

    summary = prune("--older-than", "30d")

    assert summary["outcome"] == "busy" and exists(row)


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * DAY), ("12h", 43_200), ("90m", 5400), ("3600s", 3600)])
def test_ages_accept_days_hours_minutes_and_seconds(text, seconds):
    assert parse_age(text) == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["30", "0d", "-1d", "1y", "d", "1.5h", ""])
def test_bad_ages_are_refused_by_the_command(text):
    with pytest.raises(CommandError, match="older-than"):
        prune("--older-than", text)


@pytest.mark.parametrize(
    "retention",
    [{}, {"pending": dt.timedelta(days=1)}, {"claimed": dt.timedelta(days=1)}, {"finished": dt.timedelta(0)}],
)
def test_the_service_refuses_bad_retention_naming_the_field_and_writes_nothing(community, table_snapshot, retention):
    settled(community, "finished", age_seconds=40 * DAY)
    before = table_snapshot()
    with pytest.raises(ValidationError) as error:
        services.prune_deliveries(retention)
    assert "retention" in error.value.message_dict
    assert table_snapshot() == before

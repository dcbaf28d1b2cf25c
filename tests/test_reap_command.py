"""``manage.py reap_deliveries`` and its overlap guard (SPEC section 8)."""

from __future__ import annotations

import json
import signal
import threading
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services.runlock import LeaseBusy, RunLease, acquire_run_lease
from buzz_delivery.testing import CommunityFactory, advance_to
from tests.conftest import BARRIER_TIMEOUT
from tests.operator_support import lapsed, lease_rows, manage, parse_kv, pending

pytestmark = pytest.mark.django_db


def reap(*args: str) -> str:
    out = StringIO()
    call_command("reap_deliveries", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def backdate_run_lease(name: str, seconds: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_delivery_maintenance_lease SET lease_until = now() - make_interval(secs => %s)"
            " WHERE name = %s",
            [seconds, name],
        )


def test_reap_prints_one_key_value_summary_line_and_reclaims_lapsed_leases(community):
    delivery = lapsed(community)

    lines = reap().splitlines()

    assert len(lines) == 1
    summary = parse_kv(lines[0])
    assert list(summary) == [
        "outcome",
        "reclaimed",
        "exhausted",
        "expired",
        "skipped_fenced",
        "skipped_busy",
        "batches",
        "dry_run",
        "duration_ms",
    ]
    assert summary["outcome"] == "ok"
    assert (summary["reclaimed"], summary["exhausted"], summary["expired"]) == ("1", "0", "0")
    assert summary["dry_run"] == "false"
    assert int(summary["batches"]) >= 1 and int(summary["duration_ms"]) >= 0
    after = models.WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert after.status == "pending" and after.lease_generation == delivery.lease_generation + 1


def test_reap_with_json_prints_one_json_object(community):
    lapsed(community)

    summary = json.loads(reap("--json"))

    assert summary["outcome"] == "ok" and summary["reclaimed"] == 1 and summary["dry_run"] is False
    assert set(summary) >= {"reclaimed", "exhausted", "expired", "skipped_fenced", "batches", "dry_run", "duration_ms"}


def test_reap_dry_run_counts_and_writes_nothing(community, table_snapshot):
    lapsed(community)
    lapsed(community)
    before = table_snapshot()

    summary = json.loads(reap("--dry-run", "--json"))

    assert summary["reclaimed"] == 2 and summary["dry_run"] is True
    assert table_snapshot() == before
    assert lease_rows() == []  # a dry run takes no lease either


@pytest.mark.parametrize("batch_size", ["1", "2", "1000"])
def test_a_dry_run_counts_the_batches_the_run_then_takes(community, batch_size):
    lapsed(community)
    lapsed(community)
    options = ("--json", "--batch-size", batch_size)

    dry = json.loads(reap("--dry-run", *options))
    done = json.loads(reap(*options))
    nothing_left = (json.loads(reap("--dry-run", *options)), json.loads(reap(*options)))

    assert done["reclaimed"] == dry["reclaimed"] == 2
    assert done["batches"] == dry["batches"] > 0
    assert [summary["batches"] for summary in nothing_left] == [0, 0]  # a no-op run and its dry run agree


def test_reap_skips_a_fenced_community_and_reports_it(community):
    healthy = lapsed(community)
    fenced = CommunityFactory()
    stuck = lapsed(fenced)
    advance_to(fenced, "fenced")

    summary = json.loads(reap("--json"))

    assert summary["reclaimed"] == 1 and summary["skipped_fenced"] == 1
    assert models.WorkflowAgentDelivery.objects.get(pk=healthy.pk).status == "pending"
    assert models.WorkflowAgentDelivery.objects.get(pk=stuck.pk).status == "claimed"


def test_reap_respects_max_batches(community):
    for _ in range(3):
        lapsed(community)

    summary = json.loads(reap("--batch-size", "1", "--max-batches", "2", "--json"))

    assert summary["reclaimed"] == 2 and summary["batches"] == 2
    assert models.WorkflowAgentDelivery.objects.filter(status="claimed").count() == 1


def test_a_long_reap_renews_its_lease_between_chunks_and_finishes_the_work(community):
    # 25 single-row batches span three renewal chunks (RENEW_EVERY_BATCHES = 10).
    for _ in range(25):
        lapsed(community)

    summary = json.loads(reap("--batch-size", "1", "--json"))

    assert summary["reclaimed"] == 25 and summary["batches"] >= 25
    assert not models.WorkflowAgentDelivery.objects.filter(status="claimed").exists()
    assert lease_rows() == []


def test_a_run_whose_lease_was_taken_over_stops_with_exit_code_3(community):
    for _ in range(12):
        lapsed(community)
    with connection.cursor() as cursor:  # another run takes the lease over during the first chunk
        cursor.execute(
            "CREATE FUNCTION test_steal_lease() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "UPDATE buzz_delivery_maintenance_lease SET holder = 'thief', lease_until = now() + interval '1 hour'; "
            "RETURN NULL; END $$;"
            "CREATE TRIGGER test_steal_lease AFTER UPDATE ON buzz_delivery_delivery_queue "
            "FOR EACH STATEMENT EXECUTE FUNCTION test_steal_lease()"
        )
    out = StringIO()

    with pytest.raises(CommandError) as failure:
        call_command("reap_deliveries", "--batch-size", "1", stdout=out, stderr=StringIO())

    assert failure.value.returncode == 3
    assert parse_kv(out.getvalue().strip())["outcome"] == "lease_lost"
    assert models.WorkflowAgentDelivery.objects.filter(status="claimed").count() == 2  # stopped after one chunk
    assert lease_rows() == [("reap_deliveries", "thief")]  # the new holder's lease is left alone


def test_reap_releases_its_lease_when_done(community):
    lapsed(community)
    reap()
    assert lease_rows() == []


def test_reap_takes_over_the_lapsed_lease_of_a_crashed_run(community):
    delivery = lapsed(community)
    crashed = acquire_run_lease("reap_deliveries", 60, holder="crashed-host:1:dead")
    assert isinstance(crashed, RunLease)
    backdate_run_lease("reap_deliveries", 1)

    summary = parse_kv(reap())

    assert summary["outcome"] == "ok" and summary["reclaimed"] == "1"
    assert models.WorkflowAgentDelivery.objects.get(pk=delivery.pk).status == "pending"


def test_reap_at_verbosity_0_prints_nothing(community):
    lapsed(community)
    assert reap("-v", "0") == ""


@pytest.mark.parametrize("args", [("--batch-size", "0"), ("--max-batches", "-1"), ("--lease-seconds", "x")])
def test_reap_refuses_bad_arguments(args):
    with pytest.raises(CommandError):
        reap(*args)


# --- real concurrency: committed rows, other connections, other processes ---------------


@pytest.mark.django_db(transaction=True)
def test_a_second_run_exits_0_saying_another_is_running_while_the_lease_is_held():
    community = CommunityFactory()
    delivery = lapsed(community)
    held = acquire_run_lease("reap_deliveries", 300, holder="other-host:42:abc")  # committed (autocommit)
    assert isinstance(held, RunLease)

    process = manage("reap_deliveries")
    out, err = process.communicate(timeout=60)

    assert process.returncode == 0, err
    summary = parse_kv(out.strip())
    assert summary["outcome"] == "busy" and summary["reason"] == "another_run_active"
    assert summary["holder"] == "other-host:42:abc"
    assert models.WorkflowAgentDelivery.objects.get(pk=delivery.pk).status == "claimed"  # nothing reaped
    assert lease_rows() == [("reap_deliveries", "other-host:42:abc")]  # the holder's lease untouched

    services.release_run_lease(held)
    process = manage("reap_deliveries")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert parse_kv(out.strip())["reclaimed"] == "1"


@pytest.mark.django_db(transaction=True)
def test_concurrent_acquirers_get_the_lease_exactly_once():
    contenders = 6
    barrier = threading.Barrier(contenders, timeout=BARRIER_TIMEOUT)
    results: list[object] = []
    lock = threading.Lock()

    def contend() -> None:
        try:
            barrier.wait(timeout=10)
            result = acquire_run_lease("reap_deliveries", 60)
            with lock:
                results.append(result)
        finally:
            connection.close()

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    winners = [r for r in results if isinstance(r, RunLease)]
    assert len(results) == contenders
    assert len(winners) == 1
    assert all(isinstance(r, LeaseBusy) and r.holder == winners[0].holder for r in results if r is not winners[0])


@pytest.mark.django_db(transaction=True)
def test_a_run_that_lost_its_lease_cannot_renew_or_release_the_new_holders_lease():
    first = acquire_run_lease("reap_deliveries", 60)
    backdate_run_lease("reap_deliveries", 1)
    second = acquire_run_lease("reap_deliveries", 60)
    assert isinstance(first, RunLease) and isinstance(second, RunLease)

    assert services.renew_run_lease(first, 60) is None
    assert services.release_run_lease(first) is False
    assert lease_rows() == [("reap_deliveries", second.holder)]
    assert isinstance(services.renew_run_lease(second, 60), RunLease)


@pytest.mark.django_db(transaction=True)
def test_a_failing_reap_exits_non_zero_and_releases_its_lease():
    community = CommunityFactory()
    lapsed(community)
    # A real database failure inside the reap statement (on the queue, which a reap back to pending writes).
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_reap_boom() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'boom from the test'; END $$;"
            "CREATE TRIGGER test_reap_boom BEFORE UPDATE ON buzz_delivery_delivery_queue "
            "FOR EACH ROW EXECUTE FUNCTION test_reap_boom()"
        )
    try:
        with pytest.raises(CommandError) as failure:
            reap()
        assert failure.value.returncode == 1
        assert "reap_deliveries failed" in str(failure.value)
        assert lease_rows() == []
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER test_reap_boom ON buzz_delivery_delivery_queue; DROP FUNCTION test_reap_boom()"
            )


def test_an_unreachable_database_exits_1():
    process = manage("reap_deliveries", database="postgres://postgres@127.0.0.1:1/nowhere")
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "reap_deliveries failed" in err


@pytest.mark.django_db(transaction=True)
def test_loop_mode_reaps_each_pass_and_stops_with_exit_0_on_sigterm():
    community = CommunityFactory()
    delivery = lapsed(community)
    process = manage("reap_deliveries", "--loop", "--interval", "0.2", "-v", "2")
    try:
        first = parse_kv(process.stdout.readline().strip())
        assert first["outcome"] == "ok" and first["reclaimed"] == "1"
        second = parse_kv(process.stdout.readline().strip())  # a second pass: it keeps looping
        assert second["outcome"] == "ok" and second["reclaimed"] == "0"
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "SIGTERM received" in err and "stopped on signal" in err
    assert models.WorkflowAgentDelivery.objects.get(pk=delivery.pk).status == "pending"
    assert lease_rows() == []


def test_pending_deliveries_are_not_touched_by_reap(community):
    delivery = pending(community)
    reap()
    after = models.WorkflowAgentDelivery.objects.get(pk=delivery.pk)
    assert (after.status, after.lease_generation) == ("pending", delivery.lease_generation)

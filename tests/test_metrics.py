"""The Prometheus endpoint (issue 17): ``/metrics`` of the example project, scraped with the
test client and parsed with the Prometheus text parser; its figures match the rows made here."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from buzz_delivery import metrics, services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services.runlock import acquire_run_lease
from buzz_delivery.services.workers import STALE_AFTER_SECONDS
from buzz_delivery.testing import DeliveryFactory, backdate, delete_delivery_rows, random32, set_delivery_state
from tests.operator_support import pending

pytestmark = pytest.mark.django_db


def scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels -> value} of one GET /metrics."""
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_deliveries_by_status_oldest_pending_and_lapsed_leases(make_binding, community):
    target = random32()
    ids = [DeliveryFactory(binding=make_binding(target_pubkey=target)).id for _ in range(5)]
    backdate(ids[0], created_at=90)  # the oldest pending one was committed 90 s ago
    claims = services.claim_deliveries(community.id, target, limit=3, lease_seconds=30)
    assert [c.lease.delivery_id for c in claims] == ids[:3]
    services.finish_delivery(claims[0].lease, "finished")
    services.finish_delivery(claims[1].lease, "failed", failure_code="bad_payload")
    backdate(ids[2], lease_until=1)  # the third lease lapsed (stand-in for time passing)

    found = scrape()

    by_status = {dict(labels)["status"]: value for labels, value in found["buzz_deliveries"].items()}
    assert by_status == {"pending": 2, "claimed": 1, "finished": 1, "failed": 1, "expired": 0}
    assert found["buzz_delivery_lapsed_leases"][()] == 1
    # the oldest *pending* one: ids[0] was claimed and finished, ids[3] is the oldest left
    assert 0 <= found["buzz_delivery_oldest_pending_age_seconds"][()] < 90
    assert found["buzz_counts_estimated"][(("table", "buzz_delivery_delivery"),)] == 0


def test_the_oldest_pending_age_is_read_on_the_database_clock(make_binding):
    (delivery,) = [DeliveryFactory(binding=make_binding())]
    backdate(delivery.id, created_at=90)

    assert scrape()["buzz_delivery_oldest_pending_age_seconds"][()] == pytest.approx(90, abs=1)


def test_workflow_runs_steps_and_agent_runs_by_state(community):
    from buzz_delivery.agents.models import AgentRun
    from buzz_delivery.workflows.models import Run, Step
    from buzz_delivery.workflows.testing import RunFactory
    from tests.agents_support import new_run

    RunFactory()
    RunFactory()
    new_run(community.id)

    found = scrape()

    runs = {dict(labels)["state"]: v for labels, v in found["buzz_workflow_runs"].items()}
    steps = {dict(labels)["state"]: v for labels, v in found["buzz_workflow_steps"].items()}
    agent_runs = {dict(labels)["state"]: v for labels, v in found["buzz_agent_runs"].items()}
    assert runs["running"] == Run.objects.filter(state="running").count() == 2
    assert sum(runs.values()) == 2
    assert steps["ready"] == Step.objects.filter(state="ready").count() == 2  # each diamond's root
    assert steps["pending"] == 6 and sum(steps.values()) == 8
    assert agent_runs["pending"] == AgentRun.objects.count() == 1


def test_live_and_stale_workers_and_their_heartbeat_age():
    live = services.WorkerIdentity(uuid.uuid4(), "delivery", "h1", 11, "run_delivery_worker")
    stale = services.WorkerIdentity(uuid.uuid4(), "agent", "h2", 22, "run_agent_worker")
    services.heartbeat_worker(live)
    services.heartbeat_worker(stale)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_delivery_worker SET last_heartbeat = last_heartbeat - make_interval(secs => %s) WHERE id = %s",
            [STALE_AFTER_SECONDS + 10, stale.id],
        )

    found = scrape()

    assert found["buzz_workers"] == {
        (("kind", "agent"), ("state", "stale")): 1,
        (("kind", "delivery"), ("state", "live")): 1,
    }
    ages = {dict(labels)["host"]: v for labels, v in found["buzz_worker_heartbeat_age_seconds"].items()}
    # the scrape reads the clock a moment after the heartbeats (statement time, not transaction time)
    assert 0 <= ages["h1"] < 5 and ages["h2"] == pytest.approx(STALE_AFTER_SECONDS + 10, abs=5)


def test_a_maintenance_run_holding_its_guard_shows_as_active():
    acquire_run_lease("reap_deliveries", 60)

    assert scrape()["buzz_maintenance_run_active"] == {(("job", "reap_deliveries"),): 1}


def test_above_the_cap_the_counts_are_the_planners_estimates(monkeypatch, make_binding):
    for _ in range(3):
        DeliveryFactory(binding=make_binding())
    monkeypatch.setattr(metrics, "EXACT_CAP", 1)

    found = scrape()

    assert found["buzz_counts_estimated"][(("table", "buzz_delivery_delivery"),)] == 1
    assert WorkflowAgentDelivery.objects.count() == 3
    assert set(dict(labels)["status"] for labels in found["buzz_deliveries"]) == {
        "pending", "claimed", "finished", "failed", "expired"
    }  # fmt: skip


def test_the_oldest_pending_age_walks_the_live_queues_age_index():
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned otherwise
        cursor.execute("EXPLAIN " + metrics.DELIVERY_LIVE, {"cap": 10, "walk": 10})
        plan = "\n".join(row[0] for row in cursor.fetchall())

    assert "delivery_queue_created_idx" in plan, plan  # issue 31, stage 2: the queue's (created_at, id)


def test_the_settle_rate_counts_the_last_minute_only(community):
    from tests.operator_support import settled

    settled(community)
    settled(community, "failed")
    settled(community, age_seconds=120)  # two minutes ago: outside the window

    found = scrape()["buzz_deliveries_settled_last_minute"]

    assert {dict(labels)["status"]: v for labels, v in found.items()} == {"finished": 1, "failed": 1, "expired": 0}


def test_the_settle_rate_probes_the_settle_tallys_key_per_community(community):
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned otherwise
        cursor.execute("EXPLAIN " + metrics.SETTLED_RECENTLY, {"seconds": 60})
        plan = "\n".join(row[0] for row in cursor.fetchall())

    assert "buzz_delivery_settle_tally_pkey" in plan, plan  # (community_id, at, id): core 0039


def test_reaper_runs_are_counted_with_their_last_outcome_and_time():
    from io import StringIO

    from django.core.management import call_command

    for _ in range(2):
        call_command("reap_deliveries", stdout=StringIO())
    call_command("reap_deliveries", "--dry-run", stdout=StringIO())  # a dry run is not a run
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM now())")
        (now,) = cursor.fetchone()

    found = scrape()

    job = (("job", "reap_deliveries"),)
    # Every other job of the installed apps has its sample too, 0 before its first pass.
    assert found["buzz_maintenance_runs_total"] == {
        job: 2,
        (("job", "prune_deliveries"),): 0,
        (("job", "reap_workflow_steps"),): 0,
        (("job", "reap_agent_runs"),): 0,
    }
    assert found["buzz_maintenance_last_run_ok"] == {job: 1}
    assert found["buzz_maintenance_last_run_timestamp_seconds"][job] == pytest.approx(float(now), abs=1)


def test_lease_losses_seen_by_the_reaper_are_counted_across_its_passes(make_binding, community):
    """A lapsed lease the reaper takes back is a lease loss the database saw: each pass adds its
    ``reclaimed`` and ``exhausted`` to the job's totals (in the upsert that counts the pass),
    exported as a counter."""
    from io import StringIO

    from django.core.management import call_command

    from buzz_delivery.models import MaintenanceRun

    target = random32()
    first, second = (DeliveryFactory(binding=make_binding(target_pubkey=target)).id for _ in range(2))
    assert WorkflowAgentDelivery.objects.get(id=first).max_attempts == 3

    def lapse_and_reap(n: int) -> None:
        claims = services.claim_deliveries(community.id, target, limit=n, lease_seconds=30)
        assert len(claims) == n
        # the holders died: their leases lapsed, no backoff left
        backdate([c.lease.delivery_id for c in claims], lease_until=1)
        call_command("reap_deliveries", stdout=StringIO())
        set_delivery_state([first, second], next_attempt_at=None)

    lapse_and_reap(2)  # both back to pending: 2 reclaimed
    call_command("reap_deliveries", "--dry-run", stdout=StringIO())  # a dry run adds nothing
    lapse_and_reap(1)  # the first one's second attempt: 1 reclaimed
    lapse_and_reap(1)  # its third and last: exhausted
    assert WorkflowAgentDelivery.objects.get(id=first).status == "failed"

    found = scrape()

    job = "reap_deliveries"
    lost = {dict(k)["outcome"]: v for k, v in found["buzz_leases_reclaimed_total"].items() if dict(k)["job"] == job}
    assert lost == {"retried": 3, "exhausted": 1}
    assert found["buzz_maintenance_runs_total"][(("job", job),)] == 3
    totals = MaintenanceRun.objects.get(name=job).totals
    assert (totals["reclaimed"], totals["exhausted"], totals["expired"]) == (3, 1, 0)
    assert "duration_ms" not in totals
    items = {dict(k)["item"]: v for k, v in found["buzz_maintenance_items_total"].items() if dict(k)["job"] == job}
    assert items["reclaimed"] == 3 and items["batches"] == totals["batches"] >= 3


def test_every_counter_has_samples_before_any_maintenance_pass():
    """40 reaper runs that bypassed the command left ``buzz_maintenance_runs_total`` without a
    sample, and an absent series alerts nobody: each job of the installed apps reads 0."""
    found = scrape()

    assert found["buzz_maintenance_runs_total"] == {
        (("job", job),): 0 for job in ("reap_deliveries", "prune_deliveries", "reap_workflow_steps", "reap_agent_runs")
    }
    lost = found["buzz_leases_reclaimed_total"]
    assert {dict(k)["job"] for k in lost} == {"reap_deliveries", "reap_workflow_steps", "reap_agent_runs"}
    assert set(lost.values()) == {0}


def test_the_oldest_pending_age_leaves_out_a_fenced_communitys_stranded_rows():
    """A fenced community's pending rows are never claimed until the purge removes them: counted
    in the oldest-pending age, an alert on it never cleared. They are passed over (and counted
    apart), while an active community's rows are still seen."""
    from buzz_delivery.testing import CommunityFactory

    fenced, active = CommunityFactory(name="leaving"), CommunityFactory(name="staying")
    stranded = [pending(fenced).id for _ in range(3)]
    waiting = pending(active).id
    backdate(stranded, created_at=3 * 3600)
    backdate(waiting, created_at=60)
    assert scrape()["buzz_delivery_oldest_pending_age_seconds"][()] == pytest.approx(3 * 3600, abs=2)
    services.advance_community(fenced.id, "quiescing")

    found = scrape()

    assert found["buzz_delivery_oldest_pending_age_seconds"][()] == pytest.approx(60, abs=2)
    assert found["buzz_delivery_fenced_pending"][()] == 3
    delete_delivery_rows(waiting)  # the active backlog drained: the alert clears
    assert scrape()["buzz_delivery_oldest_pending_age_seconds"][()] == 0


def test_the_oldest_pending_walk_is_bounded_past_a_fenced_communitys_rows(monkeypatch):
    """Past FENCED_WALK stranded rows the walk stops: the newest walked row stands for the answer
    (an over-estimate), so a scrape reads a bounded number of rows."""
    from buzz_delivery.testing import CommunityFactory

    monkeypatch.setattr(metrics, "FENCED_WALK", 2)
    fenced, active = CommunityFactory(name="leaving"), CommunityFactory(name="staying")
    stranded = [pending(fenced).id for _ in range(3)]
    pending(active)
    for minutes, row in zip((30, 20, 10), stranded, strict=True):
        backdate(row, created_at=minutes * 60)
    services.advance_community(fenced.id, "quiescing")

    assert scrape()["buzz_delivery_oldest_pending_age_seconds"][()] == pytest.approx(20 * 60, abs=2)


def test_metrics_are_open_by_default_and_closed_by_a_token(settings, django_user_model):
    token = "t" * 32
    assert Client().get("/metrics").status_code == 200
    settings.BUZZ_DELIVERY = {**settings.BUZZ_DELIVERY, "METRICS_TOKEN": token}

    refused = Client().get("/metrics")
    wrong = Client().get("/metrics", headers={"Authorization": "Bearer " + "x" * 32})
    right = Client().get("/metrics", headers={"Authorization": f"Bearer {token}"})
    staff, plain = Client(), Client()
    staff.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    plain.force_login(django_user_model.objects.create_user("someone"))

    assert (refused.status_code, refused["WWW-Authenticate"]) == (401, 'Bearer realm="metrics"')
    assert b"buzz_deliveries" not in refused.content
    assert wrong.status_code == 401 and plain.get("/metrics").status_code == 401
    assert right.status_code == 200 and b"buzz_deliveries" in right.content
    assert staff.get("/metrics").status_code == 200


def test_each_declared_concurrency_limit_shows_its_slots_held_and_the_keys_at_the_limit(make_binding, community):
    from django.test import override_settings

    full, half = random32(), random32()
    for target in (full, full, full, half, half):
        DeliveryFactory(binding=make_binding(target_pubkey=target))
    with override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": {"target": 2, "community": 10}}):
        assert len(services.claim_deliveries(community.id, full, limit=3, lease_seconds=30)) == 2  # the limit holds
        assert len(services.claim_deliveries(community.id, half, limit=1, lease_seconds=30)) == 1
        found = scrape()
    assert found["buzz_concurrency_limit"] == {(("kind", "community"),): 10, (("kind", "target"),): 2}
    assert found["buzz_concurrency_slots_held"] == {(("kind", "community"),): 3, (("kind", "target"),): 3}
    assert found["buzz_concurrency_slots_held_max"] == {(("kind", "community"),): 3, (("kind", "target"),): 2}
    assert found["buzz_concurrency_keys_at_limit"] == {(("kind", "community"),): 0, (("kind", "target"),): 1}
    assert "buzz_concurrency_limit" not in scrape()  # none declared: no samples

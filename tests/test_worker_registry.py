"""The live workers registry (issue 17): a worker process registers at start, beats while it
runs, deregisters on a clean exit; the admin lists the rows with a stale flag; the reaper prunes
rows whose heartbeat stopped."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest
from django.core.management import call_command
from django.db import connection

from buzz_delivery import services
from buzz_delivery.models import WorkerRegistration
from buzz_delivery.services.workers import PRUNE_AFTER_SECONDS, STALE_AFTER_SECONDS
from buzz_delivery.testing import random32
from buzz_delivery.worker.registry import Heartbeat


def _identity(**overrides) -> services.WorkerIdentity:
    fields = {"id": uuid.uuid4(), "kind": "delivery", "host": "h1", "pid": 4242, "name": "run_delivery_worker"}
    return services.WorkerIdentity(**{**fields, **overrides})


def _age(worker_id: uuid.UUID, seconds: float) -> None:
    """Stand-in for a process that stopped beating ``seconds`` ago (raw SQL, test only)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_delivery_worker SET last_heartbeat = now() - make_interval(secs => %s) WHERE id = %s",
            [seconds, worker_id],
        )


def _db_clock():
    """The test transaction's start and the database clock now (``buzz_delivery_now()``)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now(), buzz_delivery_now()")
        return cursor.fetchone()


@pytest.mark.django_db
def test_a_heartbeat_registers_then_moves_last_heartbeat_to_the_database_clock():
    worker = _identity(detail="community=x")

    services.heartbeat_worker(worker)
    row = WorkerRegistration.objects.get(id=worker.id)
    assert (row.kind, row.host, row.pid, row.detail) == ("delivery", "h1", 4242, "community=x")
    _age(worker.id, 50)
    services.heartbeat_worker(worker)

    row.refresh_from_db()
    started, clock = _db_clock()
    assert started <= row.last_heartbeat <= clock  # the database clock, not 50 s back
    assert WorkerRegistration.objects.count() == 1
    assert services.deregister_worker(worker.id) is True
    assert not WorkerRegistration.objects.exists()


@pytest.mark.django_db
def test_a_bad_identity_is_refused_before_any_sql():
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="kind"):
        _identity(kind="janitor")


@pytest.mark.django_db
def test_the_reaper_prunes_workers_that_stopped_beating_and_keeps_live_ones():
    live, quiet, dead = _identity(pid=1), _identity(pid=2), _identity(pid=3)
    for worker in (live, quiet, dead):
        services.heartbeat_worker(worker)
    _age(quiet.id, STALE_AFTER_SECONDS + 5)  # stale, but not yet pruned
    _age(dead.id, PRUNE_AFTER_SECONDS + 5)

    call_command("reap_deliveries", stdout=open(os.devnull, "w"))  # noqa: SIM115

    assert set(WorkerRegistration.objects.values_list("pid", flat=True)) == {1, 2}


@pytest.mark.django_db
def test_the_admin_lists_live_workers_with_their_heartbeat_and_a_stale_flag(admin_client):
    live, quiet = _identity(host="alive-host"), _identity(host="quiet-host")
    services.heartbeat_worker(live)
    services.heartbeat_worker(quiet)
    _age(quiet.id, STALE_AFTER_SECONDS + 5)

    page = admin_client.get("/admin/buzz_delivery/workerregistration/")
    stale_only = admin_client.get("/admin/buzz_delivery/workerregistration/?stale=yes")

    assert page.status_code == 200
    html = page.content.decode()
    assert "alive-host" in html and "quiet-host" in html
    assert html.count("⚠ stale, silent") == 1  # the stale warning, on the quiet one only
    assert html.count('<span class="bd-ok">live</span>') == 1
    assert "quiet-host" in stale_only.content.decode() and "alive-host" not in stale_only.content.decode()
    assert admin_client.get(f"/admin/buzz_delivery/workerregistration/{live.id}/delete/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_thread_keeps_beating_and_the_row_goes_at_a_clean_stop():
    with Heartbeat("workflow", "run_workflow_worker", "community=any", every=0.1) as beat:
        first = WorkerRegistration.objects.get(id=beat.identity.id)
        assert (first.host, first.pid) == (socket.gethostname(), os.getpid())
        deadline = time.monotonic() + 10
        while WorkerRegistration.objects.get(id=beat.identity.id).last_heartbeat == first.last_heartbeat:
            assert time.monotonic() < deadline, "no heartbeat after the first"
            time.sleep(0.05)

    assert not WorkerRegistration.objects.filter(id=beat.identity.id).exists()


@pytest.mark.django_db(transaction=True)
def test_a_delivery_worker_process_is_registered_while_it_runs_and_gone_after_sigterm(start_worker):
    target = random32()
    worker = start_worker(target, "--lease-seconds", "2")
    deadline = time.monotonic() + 30
    # Registered and running: the command registers before run_worker installs its SIGTERM
    # handler, and a signal in that window ends the process the default way (exit -15, the row
    # left for the reaper to prune); "started" is logged once the handler is in place.
    while not (rows := list(WorkerRegistration.objects.filter(pid=worker.proc.pid))) or (
        "started community=" not in worker.log()
    ):
        assert worker.proc.poll() is None and time.monotonic() < deadline, worker.log()
        time.sleep(0.1)

    (row,) = rows
    assert (row.kind, row.name, row.host) == ("delivery", "run_delivery_worker", socket.gethostname())
    assert f"target={target.hex()}" in row.detail

    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert not WorkerRegistration.objects.filter(pid=worker.proc.pid).exists()

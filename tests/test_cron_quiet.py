"""The maintenance commands are quiet on stderr under cron: with the example project's
``LOG_LEVEL=INFO`` a pass that did work prints its summary line on stdout and nothing on stderr
(cron mails whatever a job writes to stderr), while warnings and errors still go there."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services.workers import PRUNE_AFTER_SECONDS
from buzz_delivery.testing import CommunityFactory
from tests.operator_support import lapsed, manage, settled

pytestmark = pytest.mark.django_db(transaction=True)


def _run(*args: str) -> tuple[int, str, str]:
    previous = os.environ.get("LOG_LEVEL")
    os.environ["LOG_LEVEL"] = "INFO"  # the example project's default, said out loud
    try:
        process = manage(*args)
    finally:
        if previous is None:
            del os.environ["LOG_LEVEL"]
        else:
            os.environ["LOG_LEVEL"] = previous
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


def _stale_worker() -> uuid.UUID:
    worker = services.WorkerIdentity(id=uuid.uuid4(), kind="delivery", host="h1", pid=4242, name="run_delivery_worker")
    services.heartbeat_worker(worker)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_delivery_worker SET last_heartbeat = now() - make_interval(secs => %s) WHERE id = %s",
            [PRUNE_AFTER_SECONDS + 5, worker.id],
        )
    return worker.id


def test_reap_deliveries_json_that_reaped_and_pruned_writes_nothing_to_stderr():
    community = CommunityFactory()
    delivery = lapsed(community)
    worker = _stale_worker()

    code, out, err = _run("reap_deliveries", "--json")

    assert code == 0, err
    assert err == ""
    summary = json.loads(out)
    assert (summary["outcome"], summary["reclaimed"]) == ("ok", 1)
    assert models.WorkflowAgentDelivery.objects.get(pk=delivery.pk).status == "pending"
    assert not models.WorkerRegistration.objects.filter(id=worker).exists()


def test_prune_deliveries_json_that_deleted_rows_writes_nothing_to_stderr():
    community = CommunityFactory()
    old = settled(community, age_seconds=3 * 86400)

    code, out, err = _run("prune_deliveries", "--older-than", "1d", "--json")

    assert code == 0, err
    assert err == ""
    assert json.loads(out)["deleted"] == 1
    assert not models.WorkflowAgentDelivery.objects.filter(pk=old.pk).exists()


@pytest.mark.parametrize("command", ["reap_agent_runs", "reap_workflow_steps"])
def test_the_other_layers_reapers_write_nothing_to_stderr(command):
    code, out, err = _run(command, "--json")

    assert code == 0, err
    assert err == ""
    assert json.loads(out)["outcome"] == "ok"


def test_at_verbosity_2_the_reap_still_says_what_it_pruned_on_stderr():
    lapsed(CommunityFactory())
    _stale_worker()

    code, out, err = _run("reap_deliveries", "--json", "-v", "2")

    assert code == 0, err
    assert json.loads(out)["reclaimed"] == 1
    assert "pruned 1 stale workers" in err

"""A ``DeliveryBackend`` whose ``OPTIONS["COMMUNITY"]`` names no community: ``enqueue`` raises
``ImproperlyConfigured`` naming the setting, not the raw ``IntegrityError`` of the workflow's
foreign key, and writes nothing; ``run_task_worker`` logs ``community_not_found`` at start (and
starts all the same, as the other workers)."""

from __future__ import annotations

import io
import logging
import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction

from buzz_delivery import models
from buzz_delivery.exceptions import CommunityNotFound, in_chain
from buzz_delivery.tasks import DeliveryBackend, services
from buzz_delivery.tasks.models import TaskResult
from buzz_delivery.testing import CommunityFactory
from tests import tasks_support as t

# Every table an enqueue writes (services.enqueue_task): none may keep a row.
WRITTEN = (models.Workflow, models.WorkflowRun, models.Event, models.WorkflowAgentDelivery, TaskResult)


def rows() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in WRITTEN}


NONE_WRITTEN = {model.__name__: 0 for model in WRITTEN}


@pytest.mark.django_db(transaction=True)  # the workflow's key is deferred: judged at the commit
def test_enqueue_on_a_community_that_does_not_exist_names_the_setting_and_writes_nothing():
    missing = uuid.uuid4()
    backend = DeliveryBackend("default", {"QUEUES": ["default"], "OPTIONS": {"COMMUNITY": str(missing)}})
    with pytest.raises(ImproperlyConfigured) as refused:
        backend.enqueue(t.add, [1, 2], {})
    assert str(refused.value) == (
        f"TASKS['default']['OPTIONS']['COMMUNITY'] names no community: {missing} does not exist; "
        "create it, or set the id of one that does (docs/tasks.md)"
    )
    assert in_chain(refused.value, CommunityNotFound) is not None
    assert rows() == NONE_WRITTEN
    CommunityFactory(id=missing)  # once it exists, the same backend enqueues
    assert backend.enqueue(t.add, [1, 2], {}).status.name == "READY"
    assert rows() == {**NONE_WRITTEN, **{model.__name__: 1 for model in WRITTEN}}


@pytest.mark.django_db(transaction=True)
def test_the_service_raises_community_not_found_and_other_key_violations_stay_integrity_errors():
    missing = uuid.uuid4()
    with pytest.raises(CommunityNotFound, match=str(missing)):
        services.enqueue_task(
            missing, backend="default", queue_name="default", target_pubkey=services.queue_target("default"),
            task_path="tests.tasks_support.add", args=[1, 2],
        )  # fmt: skip
    assert rows() == NONE_WRITTEN
    with connection.cursor() as cursor:  # the constraint it translates is the workflow's community key
        cursor.execute(
            "SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint WHERE conname = %s",
            [services.WORKFLOW_COMMUNITY_FK],
        )
        assert cursor.fetchall() == [("buzz_delivery_workflow", "buzz_delivery_community")]
    assert not issubclass(CommunityNotFound, IntegrityError)


@pytest.fixture
def captured(caplog):
    """caplog's records of the buzz_delivery loggers (which the project keeps from the root)."""
    logger = logging.getLogger("buzz_delivery")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def _not_found(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "community_not_found" in r.getMessage()]


@pytest.mark.django_db(transaction=True)
def test_the_task_worker_on_a_community_that_does_not_exist_warns_and_starts(captured):
    options = {"idle_exit": 0.2, "poll_interval": 0.1, "stdout": io.StringIO(), "stderr": io.StringIO()}
    call_command("run_task_worker", **options)  # TASKS["default"]'s community, not created: exit 0
    assert _not_found(captured.records) == [
        f"community_not_found community={t.COMMUNITY}: no such community; the worker waits for it"
    ]
    captured.clear()
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    call_command("run_task_worker", **options)
    assert _not_found(captured.records) == []


def test_the_check_without_a_database_reads_nothing():
    """Not marked django_db: a query here would fail the test (pytest-django blocks it)."""
    from django.core import checks as django_checks

    assert "buzz_delivery.W103" not in {m.id for m in django_checks.run_checks()}


@pytest.mark.django_db
def test_check_database_warns_of_a_backend_whose_community_does_not_exist():
    from django.core import checks as django_checks

    found = [m for m in django_checks.run_checks(databases=["default"]) if m.id == "buzz_delivery.W103"]
    assert [m.msg for m in found] == [
        f"TASKS['default']['OPTIONS']['COMMUNITY'] names no community: {t.COMMUNITY} does not exist; "
        "create it, or set the id of one that does (docs/tasks.md)"
    ]
    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    assert "buzz_delivery.W103" not in {m.id for m in django_checks.run_checks(databases=["default"])}


@pytest.mark.django_db(transaction=True)
def test_inside_the_callers_transaction_enqueue_raises_and_the_callers_transaction_goes_on():
    """The workflow's key is deferred: inside a caller's transaction it would be judged at the
    caller's commit, a raw IntegrityError there. Enqueue raises instead, and the caller's
    transaction stays usable (its own writes commit)."""
    missing = uuid.uuid4()
    backend = DeliveryBackend("default", {"QUEUES": ["default"], "OPTIONS": {"COMMUNITY": str(missing)}})
    with transaction.atomic():
        mine = CommunityFactory()
        with pytest.raises(ImproperlyConfigured, match=r"\['COMMUNITY'\] names no community"):
            backend.enqueue(t.add, [1, 2], {})
    assert models.Community.objects.filter(id=mine.id).exists()  # the commit went through
    assert rows() == NONE_WRITTEN
    with transaction.atomic():  # created in the caller's transaction: it exists for the enqueue
        CommunityFactory(id=missing)
        backend.enqueue(t.add, [1, 2], {})
    assert rows() == {model.__name__: 1 for model in WRITTEN}


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_in_a_transaction_opened_by_turning_autocommit_off_raises_and_caches_nothing():
    """A caller that turned autocommit off (``transaction.set_autocommit(False)``) holds a
    transaction as an atomic block does: the deferred key is judged at its commit, past the
    enqueue, so the missing community is read first there too; and the community is not
    remembered as existing (it was not committed), so a later enqueue in an atomic block still
    raises ``CommunityNotFound`` rather than an ``IntegrityError`` at that block's commit."""
    missing = uuid.uuid4()

    def enqueue():
        return services.enqueue_task(
            missing, backend="default", queue_name="default", target_pubkey=services.queue_target("default"),
            task_path="tests.tasks_support.add", args=[1, 2],
        )  # fmt: skip

    transaction.set_autocommit(False)
    try:
        with pytest.raises(CommunityNotFound, match=str(missing)):
            enqueue()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert missing not in services._SEEN_COMMUNITIES
    with pytest.raises(CommunityNotFound, match=str(missing)), transaction.atomic():
        enqueue()
    assert rows() == NONE_WRITTEN

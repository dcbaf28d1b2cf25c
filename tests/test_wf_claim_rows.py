"""What the engine's claim builds from its rows (issue 31, the orchestrator's client CPU): the
``Step`` model instance without ``Model.__init__`` (as the core's claim of deliveries does,
tests/test_claim_rows.py) and the lease without re-validating the database's own values. Each
must be indistinguishable from what ``Model.from_db`` and the constructor build from the same
row."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.db.models.signals import post_init

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import claim_steps, complete_and_claim_steps
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.services.types import StepLease
from buzz_delivery.workflows.testing import diamond, function_step
from tests.wf_support import start

pytestmark = pytest.mark.django_db


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def _instance_state(instance: Step) -> tuple[dict, dict]:
    """What an instance holds: its ``__dict__`` but the state, and the state's own ``__dict__``
    (descriptor defaults appear once read, so they are read first)."""
    _ = instance._state.fields_cache
    _ = getattr(instance._state, "fetch_mode", None)
    values = {k: v for k, v in vars(instance).items() if k != "_state"}
    return values, dict(vars(instance._state))


def _reference(step: Step) -> Step:
    """``Model.from_db`` of the same claimed values (the history deferred)."""
    names = [f.attname for f in Step._meta.concrete_fields if f.attname != "history"]
    return Step.from_db(connection.alias, names, tuple(getattr(step, name) for name in names))


def test_a_claimed_step_is_the_instance_model_from_db_builds(community, workflow):
    for _ in range(2):
        start(workflow, diamond())
    claims = claim_steps(community.id, limit=10, lease_seconds=30)
    assert len(claims) == 2
    for claim in claims:
        built = claim.step
        reference = _reference(built)
        assert _instance_state(built) == _instance_state(reference)
        assert type(built._state) is type(reference._state)
        assert built.get_deferred_fields() == {"history"}
        stored = Step.objects.get(pk=built.pk)
        for name in wf_sql.STEP_ATTNAMES:
            assert getattr(built, name) == getattr(stored, name), name
            assert type(getattr(built, name)) is type(getattr(stored, name)), name
        # The deferred history loads on first access; the run through its foreign key.
        assert built.history == stored.history and built.run.pk == claim.lease.run_id


def test_a_claimed_lease_equals_the_one_its_constructor_builds(community, workflow):
    start(workflow, diamond())
    (claim,) = claim_steps(community.id, limit=10, lease_seconds=30)
    lease = claim.lease
    step = claim.step
    assert lease == StepLease(
        community_id=step.community_id,
        step_id=step.id,
        run_id=step.run_id,
        lease_generation=step.lease_generation,
        attempts=step.attempts,
        lease_until=step.lease_until,
    )
    assert lease.lease_until.tzinfo is dt.UTC and (lease.lease_generation, lease.attempts) == (1, 1)
    # And the batch completion's claims are built alike (the same rows, another statement).
    batch = complete_and_claim_steps(community.id, [(lease, None)], claim_limit=10)
    assert sorted(c.step.key for c in batch.claims) == ["step2", "step3"]
    for chained in batch.claims:
        assert _instance_state(chained.step) == _instance_state(_reference(chained.step))


def test_the_claim_builds_its_steps_without_model_init(community, workflow, monkeypatch):
    """The fast path is taken (``Model.__init__`` per field was the largest Python cost of a
    claim): no ``Step.__init__`` call for a claimed row."""
    start(workflow, diamond())
    start(workflow, diamond())
    inits = []
    original = Step.__init__

    def spy(self, *args, **kwargs):
        inits.append(args[:1])
        original(self, *args, **kwargs)

    monkeypatch.setattr(Step, "__init__", spy)
    claims = claim_steps(community.id, limit=10, lease_seconds=30)
    assert len(claims) == 2 and inits == []


def test_post_init_receivers_still_hear_of_claimed_steps(community, workflow):
    start(workflow, diamond())
    start(workflow, diamond())
    heard = []

    def receiver(sender, instance, **kwargs):
        heard.append(instance.pk)

    post_init.connect(receiver, sender=Step)
    try:
        heard.clear()
        claims = claim_steps(community.id, limit=10, lease_seconds=30)
    finally:
        post_init.disconnect(receiver, sender=Step)
    assert sorted(heard) == sorted(c.step.pk for c in claims) and len(heard) == 2
    for claim in claims:
        assert _instance_state(claim.step) == _instance_state(_reference(claim.step))


def test_claims_come_highest_priority_first_then_oldest_ready_then_by_id(community, workflow):
    runs = [start(workflow, {"steps": [function_step("a")]}) for _ in range(4)]
    Step.objects.filter(run_id=runs[1].pk).update(priority=5)
    Step.objects.filter(run_id=runs[3].pk).update(priority=5)
    claims = claim_steps(community.id, limit=10, lease_seconds=30)
    got = [c.lease.run_id for c in claims]
    assert got == [runs[1].pk, runs[3].pk, runs[0].pk, runs[2].pk]
    rows = [(c.step.priority, c.step.ready_at, c.step.id) for c in claims]
    assert rows == sorted(rows, key=lambda r: (-r[0], r[1], r[2]))

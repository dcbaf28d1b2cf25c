"""Concurrency limits by key for agent runs and workflow steps under real concurrency (issue 32):
six threads, each on its own connection, claim and settle under a limit of 2 per key while the
reaper runs, and an audit trigger counts the leased runs of the agent (the running steps of the
workflow, read through their runs, not through the slot columns) at every change: never more
than 2, and 2 reached."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections
from django.test import override_settings

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import claim_agent_runs, complete_run, reap_agent_runs
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import claim_steps, complete_step
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.testing import function_step
from tests.agents_support import new_run
from tests.wf_support import start

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 6
LIMIT = 2
AUDIT = """
CREATE TABLE flow_audit (kind text NOT NULL, held integer NOT NULL);
CREATE FUNCTION flow_audit_runs() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    -- A fresh snapshot per statement (READ COMMITTED): every committed claim and this one's.
    INSERT INTO flow_audit (kind, held)
    SELECT 'agent', count(*) FROM buzz_agents_run
    WHERE community_id = NEW.community_id AND agent_pubkey = NEW.agent_pubkey
      AND state IN ('running', 'waiting_tool');
    RETURN NULL;
END $$;
CREATE FUNCTION flow_audit_steps() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO flow_audit (kind, held)
    SELECT 'workflow', count(*) FROM buzz_workflows_step AS s
    JOIN buzz_workflows_run AS r ON r.community_id = s.community_id AND r.run_id = s.run_id
    WHERE s.community_id = NEW.community_id AND s.state = 'running'
      AND r.workflow_id = (SELECT w.workflow_id FROM buzz_workflows_run AS w
                           WHERE w.community_id = NEW.community_id AND w.run_id = NEW.run_id);
    RETURN NULL;
END $$;
CREATE TRIGGER flow_audit_runs_now AFTER UPDATE ON buzz_agents_run
    FOR EACH ROW EXECUTE FUNCTION flow_audit_runs();
CREATE CONSTRAINT TRIGGER flow_audit_runs AFTER UPDATE ON buzz_agents_run
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flow_audit_runs();
CREATE TRIGGER flow_audit_steps_now AFTER UPDATE ON buzz_workflows_step
    FOR EACH ROW EXECUTE FUNCTION flow_audit_steps();
CREATE CONSTRAINT TRIGGER flow_audit_steps AFTER UPDATE ON buzz_workflows_step
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flow_audit_steps();
"""
DROP_AUDIT = """
DROP TRIGGER IF EXISTS flow_audit_runs_now ON buzz_agents_run;
DROP TRIGGER IF EXISTS flow_audit_runs ON buzz_agents_run;
DROP TRIGGER IF EXISTS flow_audit_steps_now ON buzz_workflows_step;
DROP TRIGGER IF EXISTS flow_audit_steps ON buzz_workflows_step;
DROP FUNCTION IF EXISTS flow_audit_runs();
DROP FUNCTION IF EXISTS flow_audit_steps();
DROP TABLE IF EXISTS flow_audit;
"""


@pytest.fixture
def audit():
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)
        cursor.execute(AUDIT)
    yield
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)


def audited(kind: str) -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT max(held), count(*) FROM flow_audit WHERE kind = %s", [kind])
        return cursor.fetchone()


def hammer(work, reap, done) -> list[BaseException]:
    """``work(i)`` in THREADS threads, each on its own connection, and ``reap()`` in another,
    until ``done()``; the errors they raised."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(i: int) -> None:
        try:
            deadline = time.monotonic() + 45
            while not done() and time.monotonic() < deadline:
                work(i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    def reaper() -> None:
        try:
            while not stop.is_set():
                reap()
                time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    background = threading.Thread(target=reaper)
    background.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    background.join()
    return errors


def test_six_claimers_and_the_reaper_never_lease_more_runs_of_an_agent_than_its_limit(community, audit):
    agent = random32()
    ids = [new_run(community.id, agent) for _ in range(20)]
    holders: set[str] = set()

    def work(i: int) -> None:
        for claim in claim_agent_runs(community.id, [agent], worker_id=f"w{i}", limit=2, lease_seconds=30):
            holders.add(claim.lease.worker_id)
            time.sleep(0.01)
            complete_run(claim.lease, {"by": i})

    def done() -> bool:
        return AgentRun.objects.filter(id__in=ids, state="completed").count() == len(ids)

    with override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": {"agent": LIMIT}}):
        errors = hammer(work, reap_agent_runs, done)
    assert not errors, errors
    assert done()
    most, changes = audited("agent")
    assert changes >= 2 * len(ids)  # every claim and every settle was counted
    assert most == LIMIT  # reached, never exceeded
    assert len(holders) > 1  # the limit was shared between claimers


def test_six_claimers_and_the_reaper_never_run_more_steps_of_a_workflow_than_its_limit(community, audit):
    busy, other = WorkflowFactory(community=community), WorkflowFactory(community=community)
    runs = [start(busy, {"steps": [function_step(f"s{i}") for i in range(8)]}) for _ in range(2)]
    runs.append(start(other, {"steps": [function_step("x")]}))
    holders: set[str] = set()

    def work(i: int) -> None:
        for claim in claim_steps(community.id, limit=2, lease_seconds=30, holder=f"w{i}"):
            holders.add(claim.step.claimed_by)
            time.sleep(0.01)
            complete_step(claim.lease, {"by": i})

    def done() -> bool:
        return not Step.objects.filter(run_id__in=[r.pk for r in runs]).exclude(state="succeeded").exists()

    with override_settings(BUZZ_DELIVERY={"STEP_CONCURRENCY_LIMITS": {"workflow": LIMIT}}):
        errors = hammer(work, reap_workflow_steps, done)
    assert not errors, errors
    assert done()
    most, changes = audited("workflow")
    assert changes >= 2 * 17
    assert most == LIMIT
    assert len(holders) > 1

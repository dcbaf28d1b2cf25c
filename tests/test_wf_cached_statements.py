"""The engine's plan-cached statements (``buzz_delivery.workflows.services.cached``, issue 31):
the functions in the database run today's claim and batch completion, the services call them,
and the claim's cached (generic) plan reaches the steps through their keys."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from buzz_delivery import scaleout
from buzz_delivery.services import Settled
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.services import cached, claim_steps, complete_and_claim_steps, complete_steps
from buzz_delivery.workflows.testing import diamond
from tests.citus_support import CITUS_MODE
from tests.plan_support import database_function as _function
from tests.plan_support import generic_explain
from tests.wf_support import start

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("statement", cached.ALL, ids=lambda s: s.function)
def test_the_database_function_runs_todays_statement(statement):
    """A statement of workflows/services/sql.py changed without a migration re-creating its
    function fails here: add one that runs ``cached.<NAME>.create_sql()`` (frozen, as 0026 does)."""
    body, arguments, config = _function(statement.function)
    assert body == statement.body, f"{statement.function} is stale: write a migration with its create_sql()"
    with connection.cursor() as cursor:  # the catalog prints each type's canonical name
        cursor.execute("SELECT " + ", ".join(f"'{kind}'::regtype::text" for _, kind in statement.params))
        kinds = cursor.fetchone()
    assert arguments == ", ".join(f"p_{name} {kind}" for (name, _), kind in zip(statement.params, kinds, strict=True))
    signature = f"{statement.function}({', '.join(kind for _, kind in statement.params)})"
    assert (signature, "p_community_id") in scaleout.delegated_functions()
    if not CITUS_MODE:
        assert config == ["plan_cache_mode=force_generic_plan"]
        return
    assert config == ["plan_cache_mode=force_custom_plan"]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT distribution_argument_index, force_delegation FROM pg_dist_object"
            " WHERE classid = 'pg_proc'::regclass AND objid = %s::regprocedure",
            [signature],
        )
        assert cursor.fetchall() == [(0, True)]


def test_the_start_the_claim_and_the_batch_completion_go_through_the_functions(community):
    workflow = WorkflowFactory(community=community)
    with CaptureQueriesContext(connection) as queries:
        run = start(workflow, diamond())
        assert run.state == "running" and run.steps_left == 4 and run.input == {}
        first = claim_steps(community.id, limit=10, lease_seconds=30)
        assert [c.step.key for c in first] == ["step1"]
        batch = complete_and_claim_steps(community.id, [(first[0].lease, {"n": 1})], claim_limit=10)
        assert batch.outcomes == [Settled("succeeded")]
        assert sorted(c.step.key for c in batch.claims) == ["step2", "step3"]
        assert complete_steps(community.id, [(c.lease, None) for c in batch.claims]) == [Settled("succeeded")] * 2
    sent = " ".join(q["sql"] for q in queries.captured_queries)
    assert sent.count(cached.CREATE_RUN.function + "(") == 1
    assert sent.count(cached.CLAIM_STEPS.function + "(") == 2
    assert sent.count(cached.COMPLETE_STEPS.function + "(") == 2
    # The rows are the statement's: the claimed step as a model instance (its history deferred),
    # its lease, and its spec from the run's pinned definition.
    step = first[0].step
    assert (step.state, step.run_id, step.lease_generation, step.attempts) == ("running", run.pk, 1, 1)
    assert "history" in step.get_deferred_fields() and step.lease_until == first[0].lease.lease_until
    assert first[0].spec["kind"] == "function"


@pytest.mark.skipif(CITUS_MODE, reason="on Citus the functions plan each call (force_custom_plan)")
def test_the_claims_cached_plan_reaches_the_steps_through_their_keys(community):
    """The claim's generic plan (what its function caches) picks candidates through the ready
    index and updates them through the primary key, not a scan of the step table, with a backlog
    of ready and finished steps analyzed."""
    workflow = WorkflowFactory(community=community)
    for _ in range(500):  # a backlog: 500 ready steps, 1,500 pending (and some settled below)
        start(workflow, diamond())
    done = claim_steps(community.id, limit=100, lease_seconds=30)
    complete_steps(community.id, [(c.lease, None) for c in done])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_workflows_step")
        cursor.execute("ANALYZE buzz_workflows_run")
    params = {"community_id": community.id, "limit": 5, "lease_seconds": 30, "holder": "plan"}
    plan = "\n".join(row[0] for row in generic_explain(cached.CLAIM_STEPS, params))
    assert "Seq Scan on buzz_workflows_step" not in plan, plan
    assert "Seq Scan on buzz_workflows_run" not in plan, plan
    indexes = set(re.findall(r"Index (?:Only )?Scan (?:Backward )?(?:using|on) (\w+)", plan))
    assert "buzz_workflows_step_pkey" in indexes or "wf_step_id_idx" in indexes, plan

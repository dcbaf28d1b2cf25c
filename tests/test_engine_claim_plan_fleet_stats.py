"""The engine's claims (workflow steps, agent runs) reach the rows they locked by primary key in
their generic plans, whatever the planner estimates of the community, as the delivery claims do
(``tests/test_claim_plan_stale_stats.py``).

Many communities make the planner's estimate of one community's rows small (the table's rows
over the distinct communities). An UPDATE reaching its candidates by ``id = ANY (ARRAY(SELECT
...))`` (an array of unknown length: ten rows to the planner) then lost, in a generic plan, to
any index with a ``community_id`` prefix: every row of the claiming community read on every
claim, cheap for a small community and a read of all of a large one. A join with the candidates
alone fails the other way: the CTE's estimate in a generic plan is a tenth of the claimable rows
the planner expects, so with the table's own statistics and a large backlog a hash join read all
of the community's rows (every one of the table's, by a sequential scan; the agents' batch claim
did). Joined with both, the plan probes by key from the smaller estimate. Generic plans are what the
plan-cached functions run (``workflows/services/cached.py``) and what psycopg's prepared
statements run after five executions (``prepare_threshold``); the plain statements are prepared
here as those are. The fleet's statistics are set before any row is written (an ALTER TABLE
waits for no deferred trigger event of the test's transaction), then one community gets 20,000
claimable rows and the table is analysed; also with the table's own statistics.

Only the plan of the UPDATE's own scan of the claimed table is checked (not the candidates'): an
index probe by ``id`` (the primary key, ``community_id, id``, or the ``id`` index).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.db import connection

from buzz_delivery.agents.services import sql as agents_sql
from buzz_delivery.services.cached import CachedStatement
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.services import cached as wf_cached
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.testing import diamond
from tests.agents_support import new_run
from tests.citus_support import CITUS_MODE
from tests.plan_support import generic_explain
from tests.wf_support import start

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CITUS_MODE, reason="on Citus the functions plan each call (force_custom_plan)"),
]

STEP = "buzz_workflows_step"
RUN = "buzz_workflows_run"
AGENT_RUN = "buzz_agents_run"
ROWS = 20_000


def _plain(statement: str, params: tuple[tuple[str, str], ...]) -> CachedStatement:
    """A statement sent as it is (no function): prepared with the same parameter types, its
    generic plan is the one psycopg's prepared statement runs after ``prepare_threshold``."""
    return CachedStatement(function="plain", statement=statement, params=params, returns="", columns="")


_STEP_PARAMS = (("community_id", "uuid"), ("limit", "bigint"), ("lease_seconds", "float8"), ("holder", "text"))
_STEP_CAPS = (("cap_community", "integer"), ("cap_workflow", "integer"), ("cap_step", "integer"))
STEP_CLAIMS = {
    "claim_ready_cached": wf_cached.CLAIM_STEPS,
    "claim_ready_sends": _plain(wf_sql.CLAIM_READY_SENDS, _STEP_PARAMS),
    "claim_ready_under_limits": _plain(wf_sql.CLAIM_READY_STEPS_UNDER_LIMITS, (*_STEP_PARAMS, *_STEP_CAPS)),
}
_RUN_PARAMS = (
    ("community_id", "uuid"),
    ("agents", "bytea[]"),
    ("worker_id", "text"),
    ("limit", "bigint"),
    ("lease_seconds", "float8"),
)
_RUN_CAPS = (("cap_community", "integer"), ("cap_agent", "integer"))
RUN_CLAIMS = {
    "claim_pending": _plain(agents_sql.CLAIM_PENDING_RUNS, _RUN_PARAMS),
    "claim_pending_under_limits": _plain(agents_sql.CLAIM_PENDING_RUNS_UNDER_LIMITS, (*_RUN_PARAMS, *_RUN_CAPS)),
}


def fleet_statistics(*tables: str) -> None:
    """The statistics of a fleet: 4,000 communities (before the test writes any row)."""
    with connection.cursor() as cur:
        for table in tables:
            cur.execute(f"ALTER TABLE {table} ALTER COLUMN community_id SET (n_distinct = 4000)")


def clone(table: str, seed_id: Any, n: int, **overrides: str) -> None:
    """``n`` copies of the row ``seed_id`` of ``table`` (new ids; ``overrides``: column -> SQL
    expression over the seed ``t`` and ``g``, 1..n), then ANALYZE."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position",
            [table],
        )
        columns = [name for (name,) in cur.fetchall()]
        values = {"id": "gen_random_uuid()", **overrides}
        select = ", ".join(values.get(name, f"t.{name}") for name in columns)
        cur.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) SELECT {select}"
            f" FROM {table} AS t, generate_series(1, %s) AS g WHERE t.id = %s",
            [n, seed_id],
        )
        cur.execute(f"ANALYZE {table}")


def update_scan(plan: dict, table: str, alias: str) -> dict:
    """The node under the Update that scans ``table`` as ``alias`` (not in a CTE or an InitPlan)."""
    (update,) = [p for p in [plan["Plan"]] if p["Node Type"] == "ModifyTable"]
    stack = [p for p in update.get("Plans", []) if p.get("Parent Relationship") == "Outer"]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") == table and node.get("Alias") == alias:
            return node
        stack += [p for p in node.get("Plans", []) if p.get("Parent Relationship") not in ("InitPlan", "SubPlan")]
    raise AssertionError(f"no scan of {alias} under the Update: {json.dumps(plan)[:2000]}")


def assert_by_primary_key(statement: CachedStatement, params: dict[str, Any], table: str, alias: str) -> None:
    """The UPDATE's scan of ``table`` (or, for a bitmap heap scan, each of its bitmap index
    scans) probes an index by ``id``: the primary key (``community_id, id``) or the ``id``
    index, not either's community prefix alone (filtering the ids: every row of the community)."""
    ((plans,),) = generic_explain(statement, {name: params[name] for name, _ in statement.params}, "FORMAT JSON")
    (plan,) = plans
    scan = update_scan(plan, table, alias)
    nodes, probes = [scan], []
    while nodes:
        node = nodes.pop()
        if "Index Name" in node:
            probes.append((node["Index Name"], node.get("Index Cond") or ""))
        nodes += node.get("Plans", [])
    assert probes and all(re.search(r"(?<!\w)id = ", cond) for _, cond in probes), (
        f"the UPDATE scans {scan['Node Type']} on {probes} (filter {scan.get('Filter')}): the community's rows"
    )


@pytest.mark.parametrize("communities", ["fleet", "own"], ids=["fleet_statistics", "own_statistics"])
@pytest.mark.parametrize("name", list(STEP_CLAIMS))
def test_a_step_claim_in_a_large_community_updates_through_the_primary_key(community, name, communities):
    if communities == "fleet":
        fleet_statistics(STEP, RUN)
    run = start(WorkflowFactory(community=community), diamond())
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT id FROM {STEP} WHERE community_id = %s AND run_id = %s AND key = 'step1'", [community.id, run.pk]
        )
        ((seed,),) = cur.fetchall()
    clone(STEP, seed, ROWS, key="t.key || '-' || g")  # 20,000 ready steps of one run
    params = {
        "community_id": community.id,
        "limit": 50,
        "lease_seconds": 30,
        "holder": "plan",
        "cap_community": 100,
        "cap_workflow": None,
        "cap_step": None,
    }
    assert_by_primary_key(STEP_CLAIMS[name], params, STEP, "s")


@pytest.mark.parametrize("communities", ["fleet", "own"], ids=["fleet_statistics", "own_statistics"])
@pytest.mark.parametrize("name", list(RUN_CLAIMS))
def test_an_agent_run_claim_in_a_large_community_updates_through_the_primary_key(community, name, communities):
    if communities == "fleet":
        fleet_statistics(AGENT_RUN)
    agent = random32()
    seed = new_run(community.id, agent)
    clone(AGENT_RUN, seed, ROWS)  # 20,000 pending runs of one agent
    params = {
        "community_id": community.id,
        "agents": [agent],
        "worker_id": "plan",
        "limit": 50,
        "lease_seconds": 30,
        "cap_community": 100,
        "cap_agent": None,
    }
    assert_by_primary_key(RUN_CLAIMS[name], params, AGENT_RUN, "r")

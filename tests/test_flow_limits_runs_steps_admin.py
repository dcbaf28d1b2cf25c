"""The concurrency limits pages of agent runs and workflow steps (issue 32 follow-up,
``buzz_delivery/admin/concurrency.py``, ``AGENT_RUN_SLOTS`` in the agents' admin, ``STEP_SLOTS``
in the workflows'): each declared kind of ``AGENT_CONCURRENCY_LIMITS`` / ``STEP_CONCURRENCY_LIMITS``,
its maximum, per key the slots held by leased runs (running steps) and the waiters of a key at its
limit (its pending runs, its ready steps); read with statements that name their community (one
node on Citus); read-only; the view permission on the model."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from buzz_delivery.admin import concurrency
from buzz_delivery.agents.admin import AGENT_RUN_SLOTS
from buzz_delivery.agents.services import claim_agent_runs
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
from buzz_delivery.workflows.admin import STEP_SLOTS
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step
from tests.agents_support import new_run
from tests.citus_support import CITUS_MODE
from tests.wf_support import start

pytestmark = pytest.mark.django_db

RUNS_URL = "/admin/buzz_agents/agentrun/concurrency/"
STEPS_URL = "/admin/buzz_workflows/step/concurrency/"


def agent_limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": caps})


def step_limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"STEP_CONCURRENCY_LIMITS": caps})


def both_limits(agent: dict, step: dict):
    return override_settings(BUZZ_DELIVERY={"AGENT_CONCURRENCY_LIMITS": agent, "STEP_CONCURRENCY_LIMITS": step})


def claim_runs(community, agents, limit: int = 10) -> list:
    return claim_agent_runs(community.id, list(agents), worker_id="w", limit=limit, lease_seconds=30)


def parallel(n: int, prefix: str = "s") -> dict:
    return {"steps": [function_step(f"{prefix}{i}") for i in range(n)]}


def row_of(text: str, key: str) -> list[str]:
    """The cells of the page's table row whose key cell is ``key`` (as the page writes it)."""
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", text, re.S):
        if f"<code>{key}</code>" in row:
            return [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
    raise AssertionError(f"no row for {key}")


def snapshot() -> dict[str, list[tuple]]:
    out = {}
    with connection.cursor() as cursor:
        for table in ("buzz_agents_run", "buzz_workflows_step", "buzz_workflows_run"):
            cursor.execute(f"SELECT * FROM {table} ORDER BY 1")
            out[table] = cursor.fetchall()
    return out


def test_the_agent_run_page_shows_the_slots_leased_runs_hold_per_agent_and_the_pending_runs_of_an_agent_at_its_limit(
    community, admin_client
):
    busy, calm = random32(), random32()
    for agent, n in ((busy, 5), (calm, 1)):
        for _ in range(n):
            new_run(community.id, agent)
    with agent_limits(agent=2, community=10):
        assert len(claim_runs(community, [busy, calm])) == 3  # busy takes its 2 slots, calm its 1
        before = snapshot()
        page = admin_client.get(RUNS_URL)
        assert snapshot() == before  # read-only
    assert page.status_code == 200
    text = page.content.decode()
    assert "agent: at most 2 leased per key" in text and "community: at most 10 leased per key" in text
    assert row_of(text, busy.hex())[1:] == [busy.hex(), "2", "2", "3"]  # at the limit: 3 pending runs wait
    assert row_of(text, calm.hex())[1:] == [calm.hex(), "1", "2", ""]  # below it: no waiters shown
    assert row_of(text, "(the community)")[1:] == ["(the community)", "3", "10", ""]
    assert "3 slots held; 1 key at the limit, 3 waiters." in text


def test_an_agent_community_at_its_limit_counts_every_pending_run_of_the_community_as_a_waiter(community):
    agents = [random32(), random32()]
    for agent in agents:
        for _ in range(3):
            new_run(community.id, agent)
    with agent_limits(community=2):
        assert len(claim_runs(community, agents)) == 2
        use = concurrency.load_concurrency_use(AGENT_RUN_SLOTS)
    (kind,) = use.kinds
    (whole,) = kind.keys
    assert (kind.kind, whole.held, whole.limit, whole.waiters, whole.community_id) == (
        "community",
        2,
        2,
        4,
        community.id,
    )


def test_the_step_page_shows_the_running_steps_per_workflow_and_the_ready_steps_of_a_workflow_at_its_limit(
    community, admin_client
):
    one, two = WorkflowFactory(community=community), WorkflowFactory(community=community)
    start(one, parallel(5))
    start(two, parallel(1))
    with step_limits(workflow=2, community=10):
        assert len(claim_steps(community.id, limit=10, lease_seconds=30)) == 3
        before = snapshot()
        page = admin_client.get(STEPS_URL)
        assert snapshot() == before  # read-only
    assert page.status_code == 200
    text = page.content.decode()
    assert "workflow: at most 2 running per key" in text and "community: at most 10 running per key" in text
    assert row_of(text, str(one.id))[1:] == [str(one.id), "2", "2", "3"]  # 3 ready steps of one wait
    assert row_of(text, str(two.id))[1:] == [str(two.id), "1", "2", ""]
    assert row_of(text, "(the community)")[1:] == ["(the community)", "3", "10", ""]


def test_a_step_key_at_its_limit_counts_the_ready_steps_of_that_key_in_that_workflow_only(community):
    workflow, other = WorkflowFactory(community=community), WorkflowFactory(community=community)
    for _ in range(3):
        start(workflow, {"steps": [function_step("fetch"), function_step("store")]})
    start(other, {"steps": [function_step("fetch")]})
    with step_limits(step=1):
        taken = claim_steps(community.id, limit=10, lease_seconds=30)
        assert sorted((c.step.slot_workflow_id == workflow.id, c.step.key) for c in taken) == [
            (False, "fetch"),
            (True, "fetch"),
            (True, "store"),
        ]
        use = concurrency.load_concurrency_use(STEP_SLOTS)
    keys = {k.key: (k.held, k.limit, k.waiters) for k in use.kinds[0].keys}
    assert keys == {
        f"{workflow.id} / fetch": (1, 1, 2),
        f"{workflow.id} / store": (1, 1, 2),
        f"{other.id} / fetch": (1, 1, 0),  # its only fetch runs; the other workflow's do not wait for it
    }


def test_every_statement_after_the_walk_names_its_community():
    communities = [CommunityFactory() for _ in range(2)]
    agents = {}
    for c in communities:
        agents[c.id] = random32()
        for _ in range(3):
            new_run(c.id, agents[c.id])
        start(WorkflowFactory(community=c), {"steps": [function_step("a"), function_step("b")]})
    with both_limits(agent={"agent": 1, "community": 9}, step={"workflow": 1, "step": 5, "community": 9}):
        for c in communities:
            claim_runs(c, [agents[c.id]], limit=5)
            claim_steps(c.id, limit=5, lease_seconds=30)
        for source, kinds in ((AGENT_RUN_SLOTS, 2), (STEP_SLOTS, 3)):
            with CaptureQueriesContext(connection) as queries:
                use = concurrency.load_concurrency_use(source)
            assert use.communities == 2
            statements = [q["sql"] for q in queries.captured_queries]
            walk, rest = statements[0], statements[1:]
            assert "EXISTS" in walk
            assert len(rest) == 2 * kinds + 2  # per community: one per kind, one more for the kind at its limit
            for sql in rest:
                assert any(f"d.community_id = '{c.id.hex}'" in sql for c in communities), sql


@pytest.mark.skipif(not CITUS_MODE, reason="Citus mode only: the plans of the pages' per-community statements")
def test_on_citus_each_per_community_statement_runs_on_one_shard(community):
    for source in (AGENT_RUN_SLOTS, STEP_SLOTS):
        for kind in source.kinds:
            params = {"community_id": community.id, "rows": 5, "cap": 10, "keys": [], "keys_1": []}
            for statement in (concurrency.held_by_key(kind, source), concurrency.waiters_of(kind, source)):
                with connection.cursor() as cursor:
                    cursor.execute("EXPLAIN (COSTS OFF) " + statement, params)
                    plan = "\n".join(row[0] for row in cursor.fetchall())
                assert "Task Count: 1\n" in plan + "\n", plan


def test_with_no_limit_declared_each_page_says_so_and_names_its_setting(admin_client):
    with override_settings(BUZZ_DELIVERY={}):
        for url, setting in ((RUNS_URL, "AGENT_CONCURRENCY_LIMITS"), (STEPS_URL, "STEP_CONCURRENCY_LIMITS")):
            page = admin_client.get(url)
            assert page.status_code == 200
            text = page.content.decode()
            assert 'id="bd-no-limits"' in text and f'BUZZ_DELIVERY["{setting}"]' in text


def test_a_staff_user_without_the_view_permission_is_refused_and_one_with_it_is_not(client, django_user_model):
    user = django_user_model.objects.create_user("staff", password="x", is_staff=True)
    client.force_login(user)
    with both_limits(agent={"agent": 2}, step={"workflow": 2}):
        assert client.get(RUNS_URL).status_code == 403
        assert client.get(STEPS_URL).status_code == 403
        user.user_permissions.add(
            Permission.objects.get(codename="view_agentrun", content_type__app_label="buzz_agents")
        )
        user = django_user_model.objects.get(pk=user.pk)  # no cached permissions
        client.force_login(user)
        assert client.get(RUNS_URL).status_code == 200
        assert client.get(STEPS_URL).status_code == 403


def test_hostile_community_names_and_step_keys_are_escaped(admin_client):
    hostile = "<script>alert('x')</script>&"
    community = CommunityFactory(name=hostile)
    agent = random32()
    for _ in range(2):
        new_run(community.id, agent)
    workflow = WorkflowFactory(community=community)
    start(workflow, {"steps": [function_step("fetch")]})
    with both_limits(agent={"agent": 1}, step={"step": 1}):
        claim_runs(community, [agent])
        (step,) = claim_steps(community.id, limit=5, lease_seconds=30)
        # Stored as no definition would let it be (by hand): the page still writes it as text.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL session_replication_role = replica")
            cursor.execute(
                "UPDATE buzz_workflows_step SET key = %s WHERE community_id = %s AND id = %s",
                ["<b>k</b>\"'", community.id, step.step.id],
            )
            cursor.execute("SET LOCAL session_replication_role = origin")
        runs_page = admin_client.get(RUNS_URL).content.decode()
        steps_page = admin_client.get(STEPS_URL).content.decode()
    for text in (runs_page, steps_page):
        assert "<script>" not in text
        assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in text
    assert row_of(runs_page, agent.hex())[2:] == ["1", "1", "1"]  # the other run waits
    assert "<b>k</b>" not in steps_page
    assert row_of(steps_page, f"{workflow.id} / &lt;b&gt;k&lt;/b&gt;&quot;&#x27;")[2:] == ["1", "1", "0"]


def test_the_admin_index_and_the_lists_link_to_the_pages(admin_client):
    index = admin_client.get("/admin/").content.decode()
    assert RUNS_URL in index and STEPS_URL in index
    assert RUNS_URL in admin_client.get(reverse("admin:buzz_agents_agentrun_changelist")).content.decode()
    assert STEPS_URL in admin_client.get(reverse("admin:buzz_workflows_step_changelist")).content.decode()

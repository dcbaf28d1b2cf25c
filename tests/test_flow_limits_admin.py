"""The concurrency limits admin page (issue 32, ``buzz_delivery/admin/concurrency.py``): each
declared kind, its maximum, per key the slots held and the waiters of a key at its limit; read
with statements that name their community (one node on Citus); read-only."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from buzz_delivery import services
from buzz_delivery.admin import concurrency
from buzz_delivery.testing import (
    BindingFactory,
    CommunityFactory,
    EventFactory,
    WorkflowFactory,
    WorkflowRunFactory,
    random32,
)
from tests.citus_support import CITUS_MODE

pytestmark = pytest.mark.django_db

URL = "/admin/buzz_delivery/workflowagentdelivery/concurrency/"


def limits(**caps: int):
    return override_settings(BUZZ_DELIVERY={"CONCURRENCY_LIMITS": caps})


def commit(make_binding, message_event, target: bytes, n: int, **binding) -> list:
    bindings = [make_binding(target_pubkey=target, **binding) for _ in range(n)]
    return services.commit_deliveries(message_event.community_id, message_event, bindings)


def row_of(text: str, key: str) -> list[str]:
    """The cells of the page's table row whose key cell is ``key``."""
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", text, re.S):
        if f"<code>{key}</code>" in row:
            return [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
    raise AssertionError(f"no row for {key}")


def test_the_page_shows_each_kind_the_slots_held_per_key_and_the_waiters_of_a_key_at_its_limit(
    community, make_binding, message_event, admin_client, table_snapshot
):
    busy, calm = random32(), random32()
    commit(make_binding, message_event, busy, 5)
    commit(make_binding, message_event, calm, 2)
    with limits(target=2, community=10):
        assert len(services.claim_deliveries(community.id, busy, limit=10)) == 2
        assert len(services.claim_deliveries(community.id, calm, limit=1)) == 1
        before = table_snapshot()
        page = admin_client.get(URL)
        assert table_snapshot() == before  # read-only
    assert page.status_code == 200
    text = page.content.decode()
    assert "target: at most 2 claimed per key" in text and "community: at most 10 claimed per key" in text
    assert row_of(text, busy.hex())[1:] == [busy.hex(), "2", "2", "3"]  # at the limit: 3 waiting
    assert row_of(text, calm.hex())[1:] == [calm.hex(), "1", "2", ""]  # below it: no waiters shown
    assert row_of(text, "(the community)")[1:] == ["(the community)", "3", "10", ""]
    assert "3 slots held; 1 key at the limit, 3 waiters." in text


def test_a_community_and_a_workflow_at_their_limit_count_their_pending_deliveries_as_waiters(
    community, make_binding, message_event
):
    workflow = WorkflowFactory(community=community)
    run = WorkflowRunFactory(community=community, workflow=workflow)
    target = random32()
    commit(make_binding, message_event, target, 4, run=run)
    commit(make_binding, message_event, random32(), 2)
    with limits(community=2, workflow=1):
        assert len(services.claim_deliveries(community.id, target, limit=10)) == 1
        use = concurrency.load_concurrency_use()
    kinds = {k.kind: k for k in use.kinds}
    assert [k for k in kinds] == ["community", "workflow"]
    (whole,) = kinds["community"].keys
    assert (whole.held, whole.limit, whole.waiters, whole.at_limit) == (1, 2, None, False)
    (flow_key,) = kinds["workflow"].keys
    assert flow_key.key == str(workflow.id) and flow_key.community_id == community.id
    assert (flow_key.held, flow_key.limit, flow_key.waiters) == (1, 1, 3)  # the 3 others of that workflow wait

    with limits(community=1):
        use = concurrency.load_concurrency_use()
    (whole,) = use.kinds[0].keys
    assert (whole.held, whole.waiters) == (1, 5)  # every pending delivery of the community waits


def test_every_statement_after_the_walk_names_its_community(make_binding, message_event, community):
    others = []
    for _ in range(2):
        other = CommunityFactory()
        event = EventFactory(community=other)
        run = WorkflowRunFactory(community=other)
        target = random32()
        bindings = [BindingFactory(run=run, message_event=event, target_pubkey=target) for _ in range(3)]
        services.commit_deliveries(other.id, event, bindings)
        others.append((other, target))
    with limits(target=1, workflow=5, community=9):
        for other, target in others:
            services.claim_deliveries(other.id, target, limit=5)
        with CaptureQueriesContext(connection) as queries:
            use = concurrency.load_concurrency_use()
    assert use.communities == 2
    statements = [q["sql"] for q in queries.captured_queries]
    walk, rest = statements[0], statements[1:]
    assert "EXISTS" in walk
    assert len(rest) == 2 * 3 + 2  # per community: one per kind, one more for the target at its limit
    named = {other.id.hex for other, _ in others}
    for sql in rest:
        assert "d.community_id = '" in sql and any(f"d.community_id = '{c}'" in sql for c in named), sql


@pytest.mark.skipif(not CITUS_MODE, reason="Citus mode only: the plans of the page's per-community statements")
def test_on_citus_each_per_community_statement_runs_on_one_shard(community):
    params = {"community_id": community.id, "rows": 5, "cap": 10, "keys": []}
    for kind in concurrency.flow.KINDS:
        for statement in (concurrency.held_by_key(kind), concurrency.waiters_of(kind)):
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (COSTS OFF) " + statement, params)
                plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "Task Count: 1\n" in plan + "\n", plan


def test_with_no_limit_declared_the_page_says_so(admin_client):
    with limits():
        page = admin_client.get(URL)
    assert page.status_code == 200
    assert 'id="bd-no-limits"' in page.content.decode()


def test_a_staff_user_without_the_view_permission_is_refused(client, django_user_model):
    user = django_user_model.objects.create_user("staff", password="x", is_staff=True)
    client.force_login(user)
    with limits(target=2):
        assert client.get(URL).status_code == 403


def test_the_admin_index_links_to_the_page(admin_client):
    assert URL in admin_client.get("/admin/").content.decode()


def _docs_block(heading: str) -> str:
    """The first python block under ``heading`` in docs/flow-control.md."""
    import pathlib
    import re as re_

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "flow-control.md").read_text()
    section = text.split(heading + "\n", 1)[1]
    return re_.search(r"```python\n(.*?)```", section, re_.S).group(1)


def test_the_docs_example_runs(community, make_binding, message_event, capsys):
    target = random32()
    commit(make_binding, message_event, target, 3)
    with limits(target=2):
        services.claim_deliveries(community.id, target, limit=5)
    exec(compile(_docs_block("### Admin"), "docs/flow-control.md", "exec"), {})
    assert f"target {community.name} {target.hex()} 2 2 1" in capsys.readouterr().out

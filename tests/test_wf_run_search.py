"""Run tags and the admin's run search (issue 33): tags set at start_run (inherited by child runs
and restarts, refused by name when bad, nothing written), and the search box by tag, input
field, id prefix, state and workflow, terms ANDed."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from buzz_delivery.services import Cause
from buzz_delivery.testing import WorkflowFactory, random32
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.search import run_search
from buzz_delivery.workflows.services import cancel_run, restart_run, start_run
from buzz_delivery.workflows.testing import function_step, run_until_idle
from tests.wf_support import counts, start

pytestmark = pytest.mark.django_db
ONE_STEP = {"steps": [function_step("a")]}


def search(text: str) -> set:
    """The run ids the admin's changelist shows for ``q=text``."""
    user = User.objects.create_superuser(f"admin{User.objects.count()}")
    client = Client()
    client.force_login(user)
    response = client.get(reverse("admin:buzz_workflows_run_changelist"), {"q": text})
    assert response.status_code == 200
    return {row.pk for row in response.context["cl"].result_list}


def test_tags_are_set_at_start_and_carried_by_child_runs_and_restarts(community):
    child = WorkflowFactory(community=community)
    start(child, ONE_STEP)
    parent_wf = WorkflowFactory(community=community)
    run = start(
        parent_wf,
        {"steps": [{"key": "sub", "kind": "sub_workflow", "workflow": str(child.id)}]},
        tags=["customer:42", "env=prod"],
    )
    assert Run.objects.get(pk=run.pk).tags == ["customer:42", "env=prod"]
    run_until_idle(community.id)
    assert Run.objects.get(parent_run_id=run.pk).tags == ["customer:42", "env=prod"]
    cancel_run(community.id, run.pk)
    assert restart_run(community.id, run.pk).tags == ["customer:42", "env=prod"]


@pytest.mark.parametrize(
    "tags",
    ["customer:42", ["a b"], [""], ["x" * 101], ["a", "a"], [f"t{i}" for i in range(21)], [1], ["nul\x00"]],
)
def test_bad_tags_are_refused_by_name_and_nothing_is_written(community, tags):
    workflow = WorkflowFactory(community=community)
    start(workflow, ONE_STEP)
    before = counts()
    with pytest.raises(ValidationError) as exc:
        start_run(community.id, workflow.id, {}, cause=Cause.event(random32()), tags=tags)
    assert "tags" in exc.value.message_dict
    assert counts() == before


def test_the_admin_searches_runs_by_tag_input_field_id_prefix_state_and_workflow(community):
    orders, other = WorkflowFactory(community=community, name="orders"), WorkflowFactory(community=community)
    a = start(orders, ONE_STEP, {"order": {"id": 42}, "region": "eu"}, tags=["customer:1", "vip"])
    b = start(orders, ONE_STEP, {"order": {"id": 43}, "region": "eu"}, tags=["customer:2"])
    c = start(other, ONE_STEP, {"order": {"id": 42}, "region": "us"}, tags=["customer:1"])
    cancel_run(community.id, b.pk)

    assert search("tag:customer:1") == {a.pk, c.pk}
    assert search("vip") == {a.pk}  # a bare word is a tag
    assert search("input.order.id=42") == {a.pk, c.pk}
    assert search('input.order.id="42"') == set()  # JSON: the string "42" is not the number 42
    assert search("input.region=eu") == {a.pk, b.pk}
    assert search("input.order.id=42 input.region=us") == {c.pk}
    assert search(str(b.pk)) == {b.pk}
    assert search(str(b.pk)[:23]) >= {b.pk}
    assert search("state:canceled") == {b.pk}
    assert search(f"workflow:{other.id}") == {c.pk}
    assert search("workflow:orders tag:customer:1") == {a.pk}
    assert search("tag:nobody") == set()
    assert search("") == {a.pk, b.pk, c.pk}


def test_an_id_prefix_is_a_range_of_the_primary_key_up_to_the_last_id():
    import uuid

    assert str(run_search("0193a5")) == str(run_search("0193-A5"))
    low, high = (value for _, value in run_search("0193a5").children)
    assert (str(low), str(high)) == ("0193a500-0000-0000-0000-000000000000", "0193a600-0000-0000-0000-000000000000")
    top = run_search("ff")  # no upper bound past the last id
    assert top.children == [("pk__gte", uuid.UUID("ff000000-0000-0000-0000-000000000000"))]

"""Code-first definitions (issue 33): the builder writes the same validated, content-hashed JSON
a user would write by hand, infers dependencies from references, names registered functions by
the function itself, and refuses a bad definition naming the step and field, writing nothing."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows import Definition, Each, ref, workflow_function
from buzz_delivery.workflows.definition import content_hash, validate_definition
from buzz_delivery.workflows.services import publish_definition
from tests.wf_support import counts

T = "ab" * 32


@workflow_function("test.builder.load")
def load(input: dict, context: object) -> dict:
    return {"lines": [1, 2]}


HAND_WRITTEN = {
    "steps": [
        {
            "key": "load",
            "kind": "function",
            "function": "test.builder.load",
            "input": {"id": {"$ref": "input.order_id"}},
        },
        {
            "key": "paid",
            "kind": "wait_event",
            "event": "payment",
            "event_key": ["order", {"$ref": "input.order_id"}],
            "wait_timeout_seconds": 3600,
            "on_timeout": "skip_dependents",
        },
        {
            "key": "pack",
            "kind": "map",
            "depends_on": ["paid", "load"],
            "over": {"$ref": "steps.load.output.lines"},
            "do": {"kind": "function", "function": "noop", "input": {"line": {"$ref": "item"}}},
            "tolerate_failures": 0,
        },
        {"key": "cool", "kind": "sleep", "depends_on": ["pack"], "seconds": 30},
        {
            "key": "tell",
            "kind": "send_message",
            "depends_on": ["cool"],
            "targets": [T],
            "content": "packed",
            "when": {"ref": "steps.pack.output", "exists": True, "not": True},
            "on_error": "continue",
        },
    ]
}


def built() -> Definition:
    flow = Definition()
    loaded = flow.function("load", load, input={"id": ref.input("order_id")})
    paid = flow.wait_event(
        "paid",
        event="payment",
        event_key=["order", ref.input("order_id")],
        wait_timeout_seconds=3600,
        on_timeout="skip_dependents",
    )
    pack = flow.map(
        "pack", over=loaded.output("lines"), do=Each.function("noop", input={"line": ref.item()}), after=[paid]
    )
    cool = flow.sleep("cool", seconds=30, after=[pack])
    flow.send_message(
        "tell", [bytes.fromhex(T)], "packed", after=[cool], when=~pack.output().exists(), on_error="continue"
    )
    return flow


def test_the_builder_writes_the_hand_written_json_with_the_same_content_hash():
    flow = built()
    assert flow.build() == validate_definition(HAND_WRITTEN)
    assert content_hash(flow.build()) == content_hash(validate_definition(HAND_WRITTEN))


@pytest.mark.django_db
def test_a_built_definition_publishes_as_the_hand_written_version(community):
    workflow = WorkflowFactory(community=community)
    first = publish_definition(community.id, workflow.id, built())
    again = publish_definition(community.id, workflow.id, HAND_WRITTEN)
    assert again.pk == first.pk and first.version == 1


def test_a_reference_adds_a_dependency_unless_it_is_an_ancestor_already():
    flow = Definition()
    a = flow.function("a", "noop")
    b = flow.function("b", "noop", after=[a])
    c = flow.function("c", "noop", after=[b], input={"x": a.output("v")})  # a is b's ancestor: no edge
    flow.function("d", "noop", input={"x": c.output(), "y": ref.step("a", "w")})
    steps = {s["key"]: s for s in flow.to_json()["steps"]}
    assert steps["c"]["depends_on"] == ["b"]
    assert steps["d"]["depends_on"] == ["c"]
    assert "depends_on" not in steps["a"]
    flow.build()


def test_a_function_that_was_never_registered_is_refused_by_the_builder():
    def plain(input: dict, context: object) -> dict:
        return {}

    with pytest.raises(TypeError, match="not registered"):
        Definition().function("a", plain)


def test_sleep_until_a_datetime_is_written_as_iso_text():
    flow = Definition()
    flow.sleep("z", until=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    assert flow.build()["steps"][0]["until"] == "2030-01-01T00:00:00+00:00"


def test_map_of_a_sub_workflow_and_of_send_message():
    flow = Definition()
    flow.map("each_run", over=ref.input("xs"), do=Each.sub_workflow(uuid.UUID(int=1), input={"x": ref.item()}))
    flow.map("each_send", over=ref.input("xs"), do=Each.send_message([ref.item("agent")], ref.item("text")))
    steps = flow.build()["steps"]
    assert steps[1]["do"] == {
        "kind": "send_message",
        "targets": [{"$ref": ["item", "agent"]}],
        "content": {"$ref": ["item", "text"]},
        "await": "delivered",
        "tolerate_failures": 0,
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("build", "field", "step"),
    [
        (lambda f: f.sleep("nap"), "steps[0].seconds", "'nap'"),
        (lambda f: f.wait_event("w", event="bad name", event_key="k"), "steps[0].event", "'w'"),
        (lambda f: f.map("m", over=ref.input("xs"), do=Each.function("bad name")), "steps[0].do.function", "'m'"),
        (lambda f: (f.function("a", "noop"), f.function("a", "noop")), "steps[1].key", "'a'"),
        (lambda f: f.function("a", "noop", after=["ghost"]), "steps[0].depends_on", "'ghost'"),
    ],
)
def test_a_bad_built_definition_names_the_step_and_field_and_writes_nothing(community, build, field, step):
    workflow = WorkflowFactory(community=community)
    flow = Definition()
    build(flow)
    before = counts()
    with pytest.raises(ValidationError) as exc:
        publish_definition(community.id, workflow.id, flow)
    assert list(exc.value.message_dict) == [field]
    assert step in exc.value.messages[0]
    assert counts() == before

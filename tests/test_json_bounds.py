"""Every JSON value a service stores is bounded (issue 27): nested at most 100 levels (so every
reader, the admin's included, can load it back) and holding only text PostgreSQL can store. A
value out of bounds is a ValidationError naming the argument, before any SQL; nothing is written."""

from __future__ import annotations

import uuid

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery import jsonbounds
from buzz_delivery.agents.services import complete_run, intake_event, journal_call, record_call_result
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.services import publish_definition
from tests.agents_support import AGENT, claim, counts, new_run

pytestmark = pytest.mark.django_db


def nested(depth: int, leaf: object = None) -> object:
    value: object = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_the_bounds_judge_any_depth_without_recursion():
    jsonbounds.check(nested(jsonbounds.MAX_DEPTH, "x"))  # 100 levels of lists: fine
    for value in (nested(jsonbounds.MAX_DEPTH + 1), nested(100_000), {"k": "\ud800"}, {"\udfff": 1}, ["a\x00b"]):
        with pytest.raises(jsonbounds.JSONRefused):
            jsonbounds.check(value)
    for text in ('{"a": 1, "a": 2}', "[NaN]", "[" * 100_000 + "]" * 100_000, '"\\ud800"'):
        with pytest.raises(jsonbounds.JSONRefused):
            jsonbounds.loads(text)
    assert jsonbounds.loads('{"a": [1, "\\ud83d\\ude00"]}') == {"a": [1, "\U0001f600"]}


@pytest.mark.parametrize(
    ("key", "call"),
    [
        ("args", lambda lease: journal_call(lease, "t", {"q": "\ud800"})),
        ("args", lambda lease: journal_call(lease, "t", nested(150))),
        ("compensation", lambda lease: journal_call(lease, "t", {}, compensation={"function": "\udfff"})),
        ("output", lambda lease: complete_run(lease, nested(930))),
        ("output", lambda lease: complete_run(lease, {"x": "\udc00"})),
    ],
)
def test_an_agent_run_value_out_of_bounds_is_refused_by_name(community, key, call):
    lease = claim(community.id, new_run(community.id))
    before = counts()
    with pytest.raises(ValidationError) as raised:
        call(lease)
    assert key in raised.value.message_dict
    assert counts() == before


def test_a_call_result_out_of_bounds_is_refused_by_name(community):
    lease = claim(community.id, new_run(community.id))
    seq = journal_call(lease, "t", {}).seq
    before = counts()
    for output in (nested(200), ["\ud800"]):
        with pytest.raises(ValidationError) as raised:
            record_call_result(lease, seq, ok=True, output=output)
        assert "output" in raised.value.message_dict
    assert counts() == before


def test_an_intake_payload_and_a_definition_out_of_bounds_are_refused_by_name(community):
    before = counts()
    with pytest.raises(ValidationError) as raised:
        intake_event(community.id, "t", uuid.uuid4().hex, {"deep": nested(150)}, AGENT)
    assert "payload" in raised.value.message_dict
    assert counts() == before
    workflow = WorkflowFactory(community=community)
    step = {"key": "a", "kind": "function", "function": "noop", "input": {"x": nested(150)}}
    with pytest.raises(ValidationError) as raised:
        publish_definition(community.id, workflow.id, {"steps": [step]})
    assert "definition" in raised.value.message_dict

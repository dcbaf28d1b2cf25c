"""Definition validation and bad input (SPEC section 11): a bad definition raises
ValidationError naming the step and the field, and nothing is written."""

from __future__ import annotations

import uuid

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery.services import Cause
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, advance_to, random32
from buzz_delivery.workflows.exceptions import IdempotencyConflict
from buzz_delivery.workflows.models import DefinitionVersion
from buzz_delivery.workflows.services import claim_steps, fail_step, publish_definition, start_run
from buzz_delivery.workflows.testing import function_step
from tests.lifecycle_support import raw_write
from tests.wf_support import counts, start

pytestmark = pytest.mark.django_db

T = "ab" * 32
OK = function_step("a")

BAD_DEFINITIONS = [
    ("not an object", [], "definition", None),
    ("no steps", {"steps": []}, "definition", None),
    ("extra top-level key", {"steps": [OK], "x": 1}, "definition", None),
    ("blank key", {"steps": [function_step("  ")]}, "steps[0].key", None),
    ("key too long", {"steps": [function_step("k" * 65)]}, "steps[0].key", None),
    ("duplicate key", {"steps": [OK, function_step("a")]}, "steps[1].key", "'a'"),
    ("unknown kind", {"steps": [{"key": "a", "kind": "shell"}]}, "steps[0].kind", "'a'"),
    ("unknown field", {"steps": [{**OK, "colour": "red"}]}, "steps[0].colour", "'a'"),
    ("field of another kind", {"steps": [{**OK, "targets": [T]}]}, "steps[0].targets", "'a'"),
    ("missing dependency", {"steps": [function_step("a", depends_on=["zz"])]}, "steps[0].depends_on", "'zz'"),
    ("self dependency", {"steps": [function_step("a", depends_on=["a"])]}, "steps[0].depends_on", "'a'"),
    (
        "cycle",
        {"steps": [function_step("a", depends_on=["b"]), function_step("b", depends_on=["a"])]},
        "depends_on",
        "cycle",
    ),
    ("bad on_error", {"steps": [function_step("a", on_error="explode")]}, "steps[0].on_error", "'a'"),
    ("bad retry", {"steps": [function_step("a", retry={"max_attempts": 0})]}, "steps[0].retry.max_attempts", None),
    (
        "cap below base",
        {"steps": [function_step("a", retry={"base_seconds": 5, "cap_seconds": 1})]},
        "steps[0].retry.cap_seconds",
        None,
    ),
    ("bad timeout", {"steps": [function_step("a", timeout_seconds=0)]}, "steps[0].timeout_seconds", None),
    ("bad function name", {"steps": [function_step("a", "no spaces allowed")]}, "steps[0].function", None),
    (
        "input reference to a non-ancestor",
        {"steps": [OK, function_step("b", input={"x": {"$ref": "steps.a.output"}})]},
        "steps[1].input",
        "'b'",
    ),
    (
        "bad reference root",
        {"steps": [function_step("a", input={"x": {"$ref": "env.HOME"}})]},
        "steps[0].input.x",
        None,
    ),
    (
        "when on a non-ancestor",
        {"steps": [OK, function_step("b", when={"ref": "steps.a.output", "exists": True})]},
        "steps[1].when.ref",
        "'b'",
    ),
    (
        "when with two operators",
        {"steps": [function_step("a", when={"ref": "input", "equals": 1, "exists": True})]},
        "steps[0].when",
        None,
    ),
    ("no targets", {"steps": [{"key": "s", "kind": "send_message", "targets": []}]}, "steps[0].targets", "'s'"),
    (
        "bad target",
        {"steps": [{"key": "s", "kind": "send_message", "targets": ["AB" * 32]}]},
        "steps[0].targets[0]",
        None,
    ),
    (
        "duplicate target",
        {"steps": [{"key": "s", "kind": "send_message", "targets": [T, T]}]},
        "steps[0].targets",
        None,
    ),
    (
        "unknown await",
        {"steps": [{"key": "s", "kind": "send_message", "targets": [T], "await": "agent_runs"}]},
        "steps[0].await",
        "'delivered' or 'agent_run'",
    ),
    (
        "tolerance above targets",
        {"steps": [{"key": "s", "kind": "send_message", "targets": [T], "tolerate_failures": 2}]},
        "steps[0].tolerate_failures",
        None,
    ),
    (
        "bad sub_workflow",
        {"steps": [{"key": "w", "kind": "sub_workflow", "workflow": "nope"}]},
        "steps[0].workflow",
        None,
    ),
    (
        "unknown sub_workflow",
        {"steps": [{"key": "w", "kind": "sub_workflow", "workflow": str(uuid.uuid4())}]},
        "steps[0].workflow",
        "no such workflow",
    ),
    ("approval without deadline", {"steps": [{"key": "ok", "kind": "approval"}]}, "steps[0].deadline_seconds", None),
    # sleep, wait_event, map (issue 33)
    ("sleep without a time", {"steps": [{"key": "z", "kind": "sleep"}]}, "steps[0].seconds", "'z'"),
    (
        "sleep twice",
        {"steps": [{"key": "z", "kind": "sleep", "seconds": 1, "until": "2030-01-01T00:00:00Z"}]},
        "steps[0].seconds",
        "exactly one",
    ),
    ("negative sleep", {"steps": [{"key": "z", "kind": "sleep", "seconds": -1}]}, "steps[0].seconds", "'z'"),
    (
        "naive until",
        {"steps": [{"key": "z", "kind": "sleep", "until": "2030-01-01T00:00:00"}]},
        "steps[0].until",
        "UTC offset",
    ),
    ("until not a time", {"steps": [{"key": "z", "kind": "sleep", "until": "tomorrow"}]}, "steps[0].until", "'z'"),
    (
        "sleep on a non-ancestor",
        {"steps": [OK, {"key": "z", "kind": "sleep", "seconds": {"$ref": "steps.a.output.s"}}]},
        "steps[1].seconds",
        "'z'",
    ),
    (
        "event without a name",
        {"steps": [{"key": "e", "kind": "wait_event", "event_key": "k"}]},
        "steps[0].event",
        "'e'",
    ),
    (
        "event name with spaces",
        {"steps": [{"key": "e", "kind": "wait_event", "event": "a b", "event_key": "k"}]},
        "steps[0].event",
        None,
    ),
    (
        "event without a key",
        {"steps": [{"key": "e", "kind": "wait_event", "event": "paid"}]},
        "steps[0].event_key",
        "'e'",
    ),
    (
        "event key part of another type",
        {"steps": [{"key": "e", "kind": "wait_event", "event": "paid", "event_key": ["order", 1.5]}]},
        "steps[0].event_key[1]",
        None,
    ),
    (
        "unknown timeout policy",
        {"steps": [{"key": "e", "kind": "wait_event", "event": "paid", "event_key": "k", "on_timeout": "retry"}]},
        "steps[0].on_timeout",
        "'e'",
    ),
    (
        "event key from an item outside a map",
        {"steps": [{"key": "e", "kind": "wait_event", "event": "paid", "event_key": {"$ref": "item.id"}}]},
        "steps[0].event_key",
        None,
    ),
    (
        "map over a literal",
        {"steps": [{"key": "m", "kind": "map", "over": [1, 2], "do": {"kind": "function", "function": "noop"}}]},
        "steps[0].over",
        "'m'",
    ),
    (
        "map of an approval",
        {"steps": [{"key": "m", "kind": "map", "over": {"$ref": "input.xs"}, "do": {"kind": "approval"}}]},
        "steps[0].do",
        "'m'",
    ),
    (
        "map do with a step's own field",
        {
            "steps": [
                {
                    "key": "m",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "function", "function": "noop", "depends_on": []},
                }
            ]
        },
        "steps[0].do.depends_on",
        None,
    ),
    (
        "map do with a bad target",
        {
            "steps": [
                {
                    "key": "m",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "send_message", "targets": ["x"]},
                }
            ]
        },
        "steps[0].do.targets[0]",
        None,
    ),
    (
        "map do input on a non-ancestor",
        {
            "steps": [
                OK,
                {
                    "key": "m",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "function", "function": "noop", "input": {"a": {"$ref": "steps.a.output"}}},
                },
            ]
        },
        "steps[1].do",
        "'m'",
    ),
    (
        "map key too long",
        {
            "steps": [
                {
                    "key": "m" * 60,
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "function", "function": "noop"},
                }
            ]
        },
        "steps[0].key",
        "room for",
    ),
    (
        "a step keyed like a map's element",
        {
            "steps": [
                {
                    "key": "m",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "function", "function": "noop"},
                },
                function_step("m[3]"),
            ]
        },
        "steps[1].key",
        "element of map step 'm'",
    ),
    (
        "map of an unknown workflow",
        {
            "steps": [
                {
                    "key": "m",
                    "kind": "map",
                    "over": {"$ref": "input.xs"},
                    "do": {"kind": "sub_workflow", "workflow": str(uuid.uuid4())},
                }
            ]
        },
        "steps[0].do.workflow",
        "no such workflow",
    ),
]


@pytest.mark.parametrize(
    ("case", "definition", "field", "mention"), BAD_DEFINITIONS, ids=[c[0] for c in BAD_DEFINITIONS]
)
def test_a_bad_definition_names_the_step_and_field_and_writes_nothing(community, case, definition, field, mention):
    workflow = WorkflowFactory(community=community)
    before = counts()
    with pytest.raises(ValidationError) as exc:
        publish_definition(community.id, workflow.id, definition)
    keys = list(exc.value.message_dict)
    assert len(keys) == 1 and keys[0].endswith(field), keys
    if mention:
        assert mention in exc.value.messages[0]
    assert counts() == before


def test_identical_content_returns_the_existing_version(community):
    workflow = WorkflowFactory(community=community)
    first = publish_definition(community.id, workflow.id, {"steps": [OK]})
    again = publish_definition(community.id, workflow.id, {"steps": [dict(reversed(list(OK.items())))]})
    assert again.pk == first.pk and first.version == 1
    second = publish_definition(community.id, workflow.id, {"steps": [OK, function_step("b")]})
    assert second.version == 2 and second.content_hash != first.content_hash
    assert len(bytes(first.definition_event_id)) == 32
    assert bytes(first.definition_event_id) != bytes(second.definition_event_id)


def test_definition_versions_are_immutable_in_the_database(community):
    from django.db import DatabaseError, connection, transaction

    workflow = WorkflowFactory(community=community)
    version = publish_definition(community.id, workflow.id, {"steps": [OK]})
    with pytest.raises(DatabaseError, match="immutable"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_workflows_definition SET version = 9 WHERE id = %s", [version.id])


def test_another_communitys_workflow_is_refused(community):
    other = WorkflowFactory(community=CommunityFactory())
    with pytest.raises(ValidationError) as exc:
        publish_definition(community.id, other.id, {"steps": [OK]})
    assert "workflow_id" in exc.value.message_dict
    assert DefinitionVersion.objects.count() == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input": [1]}, "input"),
        ({"input": {"x": float("nan")}}, "input"),
        ({"cause": "event"}, "cause"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"version": 0}, "version"),
        ({"version": 7}, "version"),
        ({"workflow_id": "nope"}, "workflow_id"),
        ({"community_id": 5}, "community_id"),
    ],
)
def test_bad_start_arguments_are_refused_by_name_before_anything_is_written(community, kwargs, field):
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [OK]})
    before = counts()
    args = {
        "community_id": community.id,
        "workflow_id": workflow.id,
        "input": {},
        "cause": Cause.event(random32()),
        **kwargs,
    }
    with pytest.raises(ValidationError) as exc:
        start_run(args.pop("community_id"), args.pop("workflow_id"), args.pop("input"), **args)
    assert field in exc.value.message_dict
    assert counts() == before


def test_an_idempotency_key_returns_the_first_run_or_conflicts(community):
    workflow = WorkflowFactory(community=community)
    first = start(workflow, {"steps": [OK]}, {"x": 1}, idempotency_key="k1")
    again = start_run(community.id, workflow.id, {"x": 1}, cause=Cause.event(random32()), idempotency_key="k1")
    assert again.pk == first.pk
    with pytest.raises(IdempotencyConflict):
        start_run(community.id, workflow.id, {"x": 2}, cause=Cause.event(random32()), idempotency_key="k1")


def test_bad_step_arguments_are_refused_by_name(community):
    workflow = WorkflowFactory(community=community)
    start(workflow, {"steps": [OK]})
    [claim] = claim_steps(community.id, lease_seconds=30)
    for kwargs, field in (
        ({"lease": "x"}, "lease"),
        ({"failure_code": ""}, "failure_code"),
        ({"failure_code": "x" * 65}, "failure_code"),
    ):
        args = {"lease": claim.lease, "failure_code": "boom", **kwargs}
        with pytest.raises(ValidationError) as exc:
            fail_step(**args)
        assert field in exc.value.message_dict
    for kwargs, field in (({"limit": 0}, "limit"), ({"lease_seconds": 0}, "lease_seconds")):
        with pytest.raises(ValidationError) as exc:
            claim_steps(community.id, **kwargs)
        assert field in exc.value.message_dict


ENGINE_RAW_WRITES = {
    "definition": "UPDATE buzz_workflows_definition SET created_at = created_at WHERE community_id = %(c)s",
    "run": "UPDATE buzz_workflows_run SET input = input WHERE community_id = %(c)s",
    "step": "UPDATE buzz_workflows_step SET position = position WHERE community_id = %(c)s",
    "approval": "UPDATE buzz_workflows_approval SET prompt = prompt WHERE community_id = %(c)s",
    "schedule": "UPDATE buzz_workflows_schedule SET enabled = enabled WHERE community_id = %(c)s",
    "delete approval": "DELETE FROM buzz_workflows_approval WHERE community_id = %(c)s",
}


@pytest.mark.parametrize("state", ["quiescing", "fenced"])
def test_the_write_fence_refuses_raw_writes_to_every_engine_table(community, state):
    from tests.lifecycle_support import fill_community

    fill_community(community, rows=1, engine=True)
    advance_to(community, state)
    for name, sql in ENGINE_RAW_WRITES.items():
        if name == "definition":
            assert raw_write(sql, {"c": community.id}) is not None  # immutable as well as fenced
            continue
        assert raw_write(sql, {"c": community.id}) == "BD001", name


def test_primary_and_unique_keys_of_engine_tables_lead_with_community_id():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT con.conname, a.attname
            FROM pg_constraint con
            JOIN pg_class c ON c.oid = con.conrelid
            JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = con.conkey[1]
            WHERE c.relname LIKE 'buzz_workflows_%%' AND con.contype IN ('p', 'u')
            """
        )
        rows = cursor.fetchall()
        cursor.execute(
            """
            SELECT i.indexrelid::regclass::text, a.attname FROM pg_index i
            JOIN pg_class c ON c.oid = i.indrelid
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
            WHERE c.relname LIKE 'buzz_workflows_%%' AND i.indisunique
            """
        )
        rows += cursor.fetchall()
    assert rows
    assert [name for name, first in rows if first != "community_id"] == []

"""Helpers for the lifecycle, write-fence and purge tests (SPEC section 5)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connection, transaction

from buzz_delivery import models
from buzz_delivery.services.db import sqlstate_of
from buzz_delivery.testing import (
    BindingFactory,
    DeliveryFactory,
    EventFactory,
    Expr,
    WorkflowFactory,
    WorkflowRunFactory,
    delete_delivery_rows,
    insert_delivery_rows,
    set_delivery_state,
)

# Every community-scoped table, as named in the database.
TABLES = {
    "workflow": models.Workflow._meta.db_table,
    "run": models.WorkflowRun._meta.db_table,
    "event": models.Event._meta.db_table,
    "delivery": models.DeliveryRecord._meta.db_table,
    "rate_limit": models.RateLimit._meta.db_table,
}
SCOPED_MODELS = (models.Workflow, models.WorkflowRun, models.Event, models.DeliveryRecord, models.RateLimit)

_RANDOM32 = "decode(md5(random()::text) || md5(random()::text), 'hex')"

# One raw write per table and operation, each touching rows of community %(c)s only: SQL text,
# or for the delivery table a call of its test helper given the parameters.
RAW_WRITES: dict[str, dict[str, str | Callable[[dict[str, Any]], object]]] = {
    "workflow": {
        "insert": "INSERT INTO buzz_delivery_workflow (id, community_id, name) "
        "VALUES (gen_random_uuid(), %(c)s, 'raw')",
        "update": "UPDATE buzz_delivery_workflow SET name = name || '!' WHERE community_id = %(c)s",
        "delete": "DELETE FROM buzz_delivery_workflow WHERE community_id = %(c)s",
    },
    "run": {
        "insert": "INSERT INTO buzz_delivery_workflow_run (id, community_id, workflow_id) "
        "SELECT gen_random_uuid(), community_id, id FROM buzz_delivery_workflow WHERE community_id = %(c)s "
        "LIMIT 1",
        "update": "UPDATE buzz_delivery_workflow_run SET created_at = buzz_delivery_plus_seconds(created_at, -1) "
        "WHERE community_id = %(c)s",
        "delete": "DELETE FROM buzz_delivery_workflow_run WHERE community_id = %(c)s",
    },
    "event": {
        "insert": "INSERT INTO buzz_delivery_event (community_id, event_id, created_at, kind, pubkey, content, tags) "
        f"VALUES (%(c)s, {_RANDOM32}, now(), 1, {_RANDOM32}, 'raw', '[]')",
        "update": "UPDATE buzz_delivery_event SET content = content || '!' WHERE community_id = %(c)s",
        "delete": "DELETE FROM buzz_delivery_event WHERE community_id = %(c)s",
    },
    # Through the test helpers (buzz_delivery.testing), the one path to the delivery's row.
    "delivery": {
        "insert": lambda p: insert_delivery_rows(
            [
                "id",
                "community_id",
                "workflow_id",
                "run_id",
                "step_id",
                "target_pubkey",
                "definition_event_id",
                "message_event_id",
                "cause_kind",
                "cause_event_id",
                "cause_scheduled_for",
                "cause_webhook_invocation_id",
            ],
            "SELECT gen_random_uuid(), community_id, workflow_id, run_id, step_id || '-raw', target_pubkey, "
            "definition_event_id, message_event_id, cause_kind, cause_event_id, cause_scheduled_for, "
            "cause_webhook_invocation_id FROM buzz_delivery_delivery WHERE community_id = %(c)s LIMIT 1",
            p,
        ),
        "update": lambda p: set_delivery_state(
            Expr("community_id = %s", [p["c"]]), created_at=Expr("buzz_delivery_plus_seconds(created_at, -1)")
        ),
        "delete": lambda p: delete_delivery_rows(Expr("community_id = %s", [p["c"]])),
    },
    "rate_limit": {
        "insert": "INSERT INTO buzz_delivery_rate_limit (id, community_id, key, window_start, used, granted, taken_at) "
        "VALUES (gen_random_uuid(), %(c)s, 'raw-' || md5(random()::text), now(), 1, true, now())",
        "update": "UPDATE buzz_delivery_rate_limit SET used = used + 1 WHERE community_id = %(c)s",
        "delete": "DELETE FROM buzz_delivery_rate_limit WHERE community_id = %(c)s",
    },
}


def fill_community(community: models.Community, rows: int = 3, *, engine: bool = False) -> dict[str, int]:
    """Give ``community`` ``rows`` workflows, runs, events and settle tally rows and ``rows + 1``
    deliveries (with ``engine``, also one workflow engine definition, run, step and approval per
    workflow).

    Returns the row count per catalog model label (every catalog model, zeros included)."""
    workflows = WorkflowFactory.create_batch(rows, community=community)
    runs = [WorkflowRunFactory(community=community, workflow=w) for w in workflows]
    events = EventFactory.create_batch(rows, community=community)
    for i in range(rows + 1):
        DeliveryFactory(binding=BindingFactory(run=runs[i % rows], message_event=events[i % rows]))
    _fill_tally(community, rows)
    _fill_rate_limits(community, rows)
    if engine:
        _fill_engine(community, workflows)
        _fill_agents(community, workflows)
        _fill_gateway(community, rows)
        _fill_tasks(community, rows)
    return count_rows(community.id)


def _fill_tally(community: models.Community, rows: int) -> None:
    """``rows`` settle tally rows, as ``rows`` settling statements of a minute ago would have left."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {models.SETTLE_TALLY_TABLE} (community_id, at, status, n)"
            " SELECT %s, buzz_delivery_now() - make_interval(secs => 60 + g), 'finished', g"
            " FROM generate_series(1, %s) AS g",
            [community.id, rows],
        )


def _fill_rate_limits(community: models.Community, rows: int) -> None:
    """``rows`` rate limit windows (one key each), through the take statement."""
    from django.test import override_settings

    from buzz_delivery.services import ratelimits

    keys = [f"fill-{i}" for i in range(rows)]
    with override_settings(BUZZ_DELIVERY={"RATE_LIMITS": {k: {"limit": 10, "period": 60} for k in keys}}):
        for key in keys:
            ratelimits.take(community.id, key)


def _fill_tasks(community: models.Community, rows: int) -> None:
    """``rows`` django.tasks results (and their deliveries), when ``buzz_delivery.tasks`` is installed."""
    from django.apps import apps

    if not apps.is_installed("buzz_delivery.tasks"):
        return
    from buzz_delivery.tasks import services

    for i in range(rows):
        services.enqueue_task(
            community.id,
            backend="fill",
            queue_name="default",
            target_pubkey=services.queue_target("default"),
            task_path="tests.fill.task",
            args=[i],
        )


def _fill_gateway(community: models.Community, rows: int) -> None:
    """``rows`` gateway enrollments (one agent key each), when ``buzz_delivery.gateway`` is installed."""
    from django.apps import apps

    if not apps.is_installed("buzz_delivery.gateway"):
        return
    from buzz_delivery.gateway.services import enroll
    from buzz_delivery.testing import random32

    for _ in range(rows):
        enroll(community.id, random32(), enrolled_by="fill_community")


def _fill_engine(community: models.Community, workflows: list[models.Workflow]) -> None:
    """One definition, run, step, approval, schedule and sent event of the workflow engine per
    workflow (each run is a core run too), when ``buzz_delivery.workflows`` is installed."""
    from django.apps import apps

    if not apps.is_installed("buzz_delivery.workflows"):
        return
    from buzz_delivery.services import Cause
    from buzz_delivery.testing import random32
    from buzz_delivery.workflows.services import create_schedule, publish_definition, send_event, start_run
    from buzz_delivery.workflows.testing import run_until_idle

    for w in workflows:
        publish_definition(community.id, w.id, {"steps": [{"key": "ok", "kind": "approval", "deadline_seconds": 60}]})
        start_run(community.id, w.id, {}, cause=Cause.event(random32()))
        create_schedule(community.id, w.id, "0 0 * * *")
        send_event(community.id, "fill", str(w.id), {"w": str(w.id)})
    run_until_idle(community.id)


def _fill_agents(community: models.Community, workflows: list[models.Workflow]) -> None:
    """Per workflow, when ``buzz_delivery.agents`` is installed: a run whose send_message step
    awaits agent runs (a step wait), an intake-started agent run with one journaled call and one
    chunk of streamed output, and an
    agent's policy (plus the community's own)."""
    from django.apps import apps

    if not apps.is_installed("buzz_delivery.agents"):
        return
    from buzz_delivery.agents.services import claim_agent_runs, intake_event, journal_call
    from buzz_delivery.agents.services.output import emit_output
    from buzz_delivery.agents.services.policy import set_policy
    from buzz_delivery.services import Cause
    from buzz_delivery.testing import random32
    from buzz_delivery.workflows.services import publish_definition, start_run
    from buzz_delivery.workflows.testing import run_until_idle, send_step

    agent = random32()
    set_policy(community.id, max_tool_calls=1000, updated_by="fill_community")
    for w in workflows:
        set_policy(community.id, random32(), max_cost=10, updated_by="fill_community")
        step = send_step("ask", [random32()], **{"await": "agent_run"})
        version = publish_definition(community.id, w.id, {"steps": [step]})
        start_run(community.id, w.id, {}, cause=Cause.event(random32()), version=version.version)
        intake_event(community.id, "test", uuid.uuid4().hex, {}, agent)
    run_until_idle(community.id)
    for claim in claim_agent_runs(community.id, [agent], worker_id="fill", limit=100):
        journal_call(claim.lease, "tool", {})
        emit_output(claim.lease, "streamed")  # a chunk of its output stream


def count_rows(community_id: uuid.UUID) -> dict[str, int]:
    """Rows of ``community_id`` per catalog model label (sibling apps' included)."""
    from buzz_delivery.catalog import catalog_models

    return {m._meta.label: m._base_manager.filter(community_id=community_id).count() for m in catalog_models()}


def community_snapshot(community_id: uuid.UUID) -> dict[str, list[tuple[Any, ...]]]:
    """Every column of every row of one community, the community row included."""
    out = {}
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM buzz_delivery_community WHERE id = %s", [community_id])
        out["buzz_delivery_community"] = cursor.fetchall()
        from buzz_delivery.catalog import catalog_models

        for table in [m._meta.db_table for m in catalog_models()]:
            cursor.execute(f"SELECT * FROM {table} WHERE community_id = %s ORDER BY 1", [community_id])
            out[table] = cursor.fetchall()
    return out


def sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE behind a Django database error (ours, when Citus relayed a
    trigger's error from a worker as XX000)."""
    return sqlstate_of(exc)


def raw_write(sql: str | Callable[[dict[str, Any]], object], params: dict[str, Any]) -> str | None:
    """Run one raw statement (or a delivery test helper's) in a savepoint; return the SQLSTATE
    it failed with, or None."""
    try:
        with transaction.atomic():
            if callable(sql):
                sql(params)
            else:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
    except DatabaseError as exc:
        return sqlstate(exc) or "unknown"
    return None


def identify_as_purge_executor(community_id: uuid.UUID | str, fence_generation: int | str) -> None:
    """Set the two transaction-local settings the write fence reads (as the purge executor
    does: ``SET LOCAL``, which Citus propagates to the workers)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SET LOCAL buzz_delivery.purge_community = '{uuid.UUID(str(community_id))}'; "
            f"SET LOCAL buzz_delivery.purge_fence_generation = '{int(fence_generation)}'"
        )


def purge_settings() -> tuple[str | None, str | None]:
    """The purge executor settings as this connection sees them now."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('buzz_delivery.purge_community', true), "
            "current_setting('buzz_delivery.purge_fence_generation', true)"
        )
        return cursor.fetchone()

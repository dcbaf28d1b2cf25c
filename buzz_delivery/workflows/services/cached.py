"""The engine's hottest statements, each behind a plan-caching PL/pgSQL function (issue 31), as
the core's lease statements are (:mod:`buzz_delivery.services.cached`, whose module docstring
says why: a statement sent unprepared is parsed and planned on every run, psycopg's prepared
statements do not survive a transaction-mode pooler, a function's plans stay with the backend).

The claim of ready steps and the batch completion run once per orchestrator round; their
parse and plan cost as much as a third of their execution (``bench/results/engine-server-cpu.md``).
The function bodies are the statements of :mod:`buzz_delivery.workflows.services.sql` with each
``%(name)s`` renamed ``p_name``; the workflows migration that creates them (``0026``) holds a
frozen copy, and ``tests/test_wf_cached_statements.py`` compares the database's bodies with
today's statements, so a changed statement without a new migration fails the suite.

On Citus each is delegated to the worker of the community its first argument names
(``buzz_delivery.scaleout``, listed by the app's ``buzz_delegated_functions``).
"""

from __future__ import annotations

from buzz_delivery.services.cached import CachedStatement
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.services import sql

# The claim's rows: the step columns but the history (as the statement returns them), then the
# run's definition id. Output columns are named ``o_<column>`` (``position`` may not name a
# function parameter; no name can clash with a column the body reads).


def _sql_type(field: object) -> str:
    """The column's type without its length (a function's result types carry none)."""
    from django.db import connection

    kind = str(field.db_type(connection))  # type: ignore[attr-defined]
    base, _, rest = kind.partition("(")
    if rest:  # varchar(64), varchar(64)[]
        return base + rest.partition(")")[2]
    return kind


_CLAIM_RETURNS = (
    "TABLE(" + ", ".join(f"o_{f.column} {_sql_type(f)}" for f in sql._CLAIM_FIELDS) + ", o_definition_id uuid)"
)
_CLAIM_COLUMNS = ", ".join(f"d.o_{f.column}" for f in sql._CLAIM_FIELDS) + ", d.o_definition_id"
_CLAIM_PARAMS = (
    ("community_id", "uuid"),
    ("limit", "bigint"),
    ("lease_seconds", "float8"),
    ("holder", "text"),
)

CLAIM_STEPS = CachedStatement(
    function="buzz_workflows_claim_ready",
    statement=sql.CLAIM_READY_STEPS,
    params=_CLAIM_PARAMS,
    returns=_CLAIM_RETURNS,
    columns=_CLAIM_COLUMNS,
)

COMPLETE_STEPS = CachedStatement(
    function="buzz_workflows_complete_steps",
    statement=sql.COMPLETE_MANY_IF_CURRENT_GENERATION,
    params=(
        ("community_id", "uuid"),
        ("step_ids", "uuid[]"),
        ("lease_generations", "bigint[]"),
        ("outputs", "jsonb[]"),
    ),
    returns="TABLE(o_id uuid)",
    columns="d.o_id",
)

# The start of a run (the core run, the engine run, its steps; one per run started): the run's
# columns, then the NOTIFY's (void, as text: a function's result column cannot be void).
_RUN_RETURNS = (
    "TABLE(" + ", ".join(f"o_{f.column} {_sql_type(f)}" for f in Run._meta.concrete_fields) + ", o_notified text)"
)
_RUN_COLUMNS = ", ".join(f"d.o_{f.column}" for f in Run._meta.concrete_fields) + ", d.o_notified"
_NOTIFY = "pg_notify('buzz_workflows', %(community_id)s::text) FROM run"
assert sql.CREATE_RUN.count(_NOTIFY) == 1

CREATE_RUN = CachedStatement(
    function="buzz_workflows_create_run",
    statement=sql.CREATE_RUN.replace(_NOTIFY, "pg_notify('buzz_workflows', %(community_id)s::text)::text FROM run"),
    params=(
        ("community_id", "uuid"),
        ("run_id", "uuid"),
        ("workflow_id", "uuid"),
        ("definition_id", "uuid"),
        ("input", "jsonb"),
        ("cause_kind", "text"),
        ("cause_event_id", "bytea"),
        ("cause_scheduled_for", "timestamptz"),
        ("cause_webhook_invocation_id", "uuid"),
        ("idempotency_key", "text"),
        ("parent_run_id", "uuid"),
        ("parent_step_key", "text"),
        ("depth", "integer"),
        ("restart_of_id", "uuid"),
        ("steps_total", "integer"),
        ("deadline_seconds", "float8"),
        ("steps", "jsonb"),
        ("tags", "text[]"),
        ("trace_context", "jsonb"),
        ("priority", "integer"),
        ("latest", "boolean"),
    ),
    returns=_RUN_RETURNS,
    columns=_RUN_COLUMNS,
    prelude=sql.LATEST_VERSION_CHECK_IN_FUNCTION,
)

ALL = (CLAIM_STEPS, COMPLETE_STEPS, CREATE_RUN)

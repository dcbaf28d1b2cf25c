"""Runs: start, read, cancel, restart (SPEC section 11 "Run", "Cancel", "Restart")."""

from __future__ import annotations

import json
import uuid
from contextlib import nullcontext
from typing import Any, cast

from django.db import IntegrityError, connection, transaction
from django.db.models import F

from buzz_delivery import services as core
from buzz_delivery import tracing
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import PRIORITY_MAX, PRIORITY_MIN, new_uuid7
from buzz_delivery.services import AlreadyTerminal, Cause
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, retry_deadlocks, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.exceptions import IdempotencyConflict, RunNotFound, RunNotRestartable
from buzz_delivery.workflows.models import MAX_TAGS, TAG_MAX_CHARS, DefinitionVersion, Run, Step
from buzz_delivery.workflows.services import cached, sql
from buzz_delivery.workflows.services.common import canonical_json, json_argument
from buzz_delivery.workflows.services.types import Canceled, RunView
from buzz_delivery.workflows.states import RUN_TERMINAL

# Definition versions are immutable: each is read once per process (bounded like the
# orchestrator's cache of their steps). Which version is the latest is checked on every start,
# by the start's own statement (``sql.CREATE_RUN`` with ``latest``) against the latest this
# process last saw of the workflow (``_LATEST``); it is read (``sql.LATEST_VERSION``) only when
# this process has not seen one yet or the check refused it (issue 31: the read was a statement
# and a transaction of its own on every start).
_VERSIONS: dict[uuid.UUID, DefinitionVersion] = {}
_LATEST: dict[tuple[uuid.UUID, uuid.UUID], DefinitionVersion] = {}


def _version(community: uuid.UUID, workflow: uuid.UUID, version: int | None) -> DefinitionVersion:
    params = {"community_id": community, "workflow_id": workflow, "version": version}
    rows = fetch_all(sql.PINNED_VERSION if version is not None else sql.LATEST_VERSION, params)
    if not rows:
        if version is not None:
            raise v.invalid("version", f"workflow has no version {version}")
        raise v.invalid("workflow_id", "no published definition for this workflow in this community")
    found = _VERSIONS.get(rows[0][0])
    if found is None:
        found = DefinitionVersion.objects.get(community_id=community, id=rows[0][0])
        if len(_VERSIONS) >= 10_000:
            _VERSIONS.clear()
        _VERSIONS[found.pk] = found
    if version is None:
        if len(_LATEST) >= 10_000:
            _LATEST.clear()
        _LATEST[(community, workflow)] = found
    return found


class _NotLatest(Exception):
    """The start's statement found another version latest than the one it was given: it wrote
    nothing."""


def _step_template(version: DefinitionVersion) -> tuple[list[dict[str, Any]], bool]:
    """The step rows a run of ``version`` starts with (without ids), and whether a root step has
    a ``when`` (it is released by ``buzz_workflows_release`` after the insert)."""
    steps = version.content["steps"]
    settings = get_settings()
    dependents: dict[str, list[str]] = {s["key"]: [] for s in steps}
    for s in steps:
        for dep in s["depends_on"]:
            dependents[dep].append(s["key"])
    rows = [
        {
            "key": s["key"],
            "kind": s["kind"],
            "state": "pending" if s["depends_on"] or s.get("when") is not None else "ready",
            "position": i,
            "depends_on": s["depends_on"],
            "dependents": dependents[s["key"]],
            "deps_total": len(s["depends_on"]),
            "on_error": s["on_error"],
            "when_cond": s.get("when"),
            "max_attempts": s["retry"].get("max_attempts", settings.max_attempts),
            "backoff_base_seconds": s["retry"].get("base_seconds", settings.backoff_base_seconds),
            "backoff_cap_seconds": s["retry"].get("cap_seconds", settings.backoff_cap_seconds),
            "timeout_seconds": s.get("timeout_seconds"),
            "tolerate_failures": s.get("tolerate_failures", 0),
        }
        for i, s in enumerate(steps)
    ]
    return rows, any(not s["depends_on"] and s.get("when") is not None for s in steps)


def _cause_columns(cause: Cause) -> dict[str, Any]:
    return {
        "cause_kind": cause.kind,
        "cause_event_id": cause.event_id,
        "cause_scheduled_for": cause.scheduled_for,
        "cause_webhook_invocation_id": cause.webhook_invocation_id,
    }


def cause_of(run: Run) -> Cause:
    """The :class:`Cause` a run was started with."""
    return Cause(
        kind=run.cause_kind,  # type: ignore[arg-type]
        event_id=bytes(run.cause_event_id) if run.cause_event_id is not None else None,
        scheduled_for=run.cause_scheduled_for,
        webhook_invocation_id=run.cause_webhook_invocation_id,
    )


@tenant_scoped
def create_run(
    community: uuid.UUID,
    version: DefinitionVersion,
    input_value: dict[str, Any],
    cause: Cause,
    *,
    run_id: uuid.UUID | None = None,
    idempotency_key: str | None = None,
    parent: tuple[Run, str] | None = None,
    restart_of: Run | None = None,
    deadline_seconds: int | None = None,
    tags: list[str] | None = None,
    priority: int | None = None,
    latest: bool = False,
) -> Run:
    """Insert the core run, the engine run and its steps, and release the root steps, in the
    caller's transaction (one statement, plus the release of root steps that have a ``when``).
    ``tags`` None: the parent's (a child run), the restarted run's, or none. Internal: the
    public entry points validate first. ``priority`` None: the parent's, the restarted run's, or 0
    (issue 32); its steps take it. ``latest``: the run is of the workflow's latest version and
    ``version`` is the latest this process saw: the statement checks it; when another is
    latest now, it is read and the run started on it."""
    source = parent[0] if parent else restart_of
    if tags is None:
        tags = list(source.tags) if source is not None else []
    if priority is None:
        priority = source.priority if source is not None else 0
    run_id = run_id or cast(uuid.UUID, new_uuid7())
    with tracing_work.workflow_run_span(community, version.workflow_id, run_id, parent[0].pk if parent else None):
        # The context of its creation (a child run's: the parent's step span, or the parent's
        # stored context carried on where this process does not trace).
        trace = tracing.current_or(parent[0].trace_context if parent else None)
        arguments: dict[str, Any] = {
            "run_id": run_id,
            "trace": trace,
            "idempotency_key": idempotency_key,
            "parent": parent,
            "restart_of": restart_of,
            "deadline_seconds": deadline_seconds,
            "tags": tags,
            "priority": priority,
        }
        try:
            return _insert_run(community, version, input_value, cause, latest=latest, **arguments)
        except _NotLatest:
            # Published since this process last looked: start on the version latest now, as a
            # read then the insert did on every start before (a publish between them is the
            # same race it always was).
            version = _version(community, version.workflow_id, None)
            return _insert_run(community, version, input_value, cause, latest=False, **arguments)


def _insert_run(
    community: uuid.UUID,
    version: DefinitionVersion,
    input_value: dict[str, Any],
    cause: Cause,
    *,
    run_id: uuid.UUID,
    trace: dict[str, str] | None,
    idempotency_key: str | None,
    parent: tuple[Run, str] | None,
    restart_of: Run | None,
    deadline_seconds: int | None,
    tags: list[str],
    priority: int,
    latest: bool,
) -> Run:
    template, release_roots = _step_template(version)
    steps = [{**row, "id": str(new_uuid7())} for row in template]
    params = {
        "run_id": run_id,
        "community_id": community,
        "workflow_id": version.workflow_id,
        "definition_id": version.pk,
        "input": json.dumps(input_value),
        **_cause_columns(cause),
        "idempotency_key": idempotency_key,
        "parent_run_id": parent[0].pk if parent else None,
        "parent_step_key": parent[1] if parent else None,
        "depth": parent[0].depth + 1 if parent else 0,
        "restart_of_id": restart_of.pk if restart_of else None,
        "steps_total": len(steps),
        "deadline_seconds": deadline_seconds,
        "steps": json.dumps(steps),
        "tags": tags,
        "trace_context": json.dumps(trace) if trace else None,
        "priority": priority,
        "latest": latest,
    }
    if release_roots:
        with transaction.atomic():
            rows = fetch_all(cached.CREATE_RUN.call, params)  # sql.CREATE_RUN, plan-cached
            if not rows:
                raise _NotLatest  # nothing written
            fetch_all(sql.RELEASE_ROOT_STEPS, {"community_id": community, "run_id": run_id})
    else:
        rows = fetch_all(cached.CREATE_RUN.call, params)  # one statement (sql.CREATE_RUN, plan-cached)
        if not rows:
            raise _NotLatest  # nothing written
    run = Run.from_db(connection.alias, sql.RUN_ATTNAMES, rows[0][:-1])
    run.input = input_value  # the cursor gives jsonb as text; the model holds the value
    run.trace_context = trace
    run.definition = version
    return run


@tenant_scoped
def expire_deliveries_of_ended_runs(community: uuid.UUID, run_ids: list[Any]) -> int:
    """Expire (core service) the pending deliveries of those runs that ended ``failed`` or
    ``canceled`` and still carry ``deliveries_to_expire``, and of their child runs, in the
    caller's transaction, and clear the mark of those whose tree has none left pending (see
    :func:`clear_deliveries_to_expire`). Returns how many deliveries were expired."""
    if not run_ids:
        return 0
    ended = [row[0] for row in fetch_all(sql.ENDED_RUNS, {"community_id": community, "run_ids": list(run_ids)})]
    total = 0
    trees: dict[Any, list[Any]] = {}
    for rid in ended:
        trees[rid] = [row[0] for row in fetch_all(sql.RUN_AND_DESCENDANTS, {"community_id": community, "run_id": rid})]
        for tree_id in trees[rid]:
            total += core.expire_run_deliveries(community, tree_id)
    clear_deliveries_to_expire(community, trees)
    return total


def clear_deliveries_to_expire(community: uuid.UUID, trees: dict[Any, list[Any]]) -> None:
    """Clear ``deliveries_to_expire`` of each run of ``trees`` (run: the runs whose deliveries
    it expired) whose runs have no ``pending`` delivery left. The expiry gives up on a row locked
    for about two seconds (``core.expire_run_deliveries``): such a run keeps its mark, and the
    maintenance's next pass expires what it left, instead of leaving it pending for good."""
    if not trees:
        return
    left = core.run_deliveries_left(community, sorted({r for tree in trees.values() for r in tree}))
    done = [rid for rid, tree in trees.items() if left.isdisjoint(tree)]
    if done:
        fetch_all(sql.DELIVERIES_EXPIRED, {"community_id": community, "run_ids": done})


def valid_tags(tags: Any) -> list[str]:
    """``tags`` checked: a list of at most 20 distinct strings of 1..100 characters, none with
    whitespace (the admin's search splits on it). Raises ``ValidationError`` keyed ``tags``."""
    if tags is None:
        return []
    if not isinstance(tags, list | tuple) or len(tags) > MAX_TAGS:
        raise v.invalid("tags", f"must be a list of at most {MAX_TAGS} strings")
    out: list[str] = []
    for i, tag in enumerate(tags):
        if not isinstance(tag, str) or not 1 <= len(tag) <= TAG_MAX_CHARS or any(c.isspace() for c in tag):
            raise v.invalid("tags", f"tags[{i}]: must be 1..{TAG_MAX_CHARS} characters without whitespace")
        out.append(v.storable_text(tag, "tags"))
    if len(set(out)) != len(out):
        raise v.invalid("tags", "names a tag twice")
    return out


@tenant_scoped
def start_run(
    community_id: uuid.UUID | str,
    workflow_id: uuid.UUID | str,
    input: dict[str, Any],
    *,
    cause: Cause,
    idempotency_key: str | None = None,
    version: int | None = None,
    deadline_seconds: int | None = None,
    tags: list[str] | None = None,
    priority: int = 0,
) -> Run:
    """Start a run of the workflow's latest version (or ``version``), pinned to that version.

    ``input``: a JSON object (at most 1,000,000 bytes). ``cause``: a core :class:`Cause`.
    ``idempotency_key``: 1..200 characters; a second start with the same key returns the first
    run when the input is equal, else raises :class:`IdempotencyConflict`. ``deadline_seconds``
    (1..366 days, None = none): the maintenance fails the run (``run_deadline``) once it is
    still running that long after its start (database clock). ``tags``: the run's labels for
    search (at most 20 distinct strings of 1..100 characters without whitespace; its child runs
    and restarts carry them too). ``priority`` (-10..10, default 0; issue 32): its steps are
    claimed higher first, and the deliveries its steps send take it; its child runs and restarts
    carry it. The root steps are
    ``ready`` (or ``skipped`` by their ``when``) when this returns; orchestrators are woken by a
    NOTIFY at commit. Returns the engine :class:`Run` (``run.pk`` is the core run's id).

    Raises ``ValidationError`` keyed ``community_id``, ``workflow_id``, ``input``, ``cause``,
    ``idempotency_key``, ``version``, ``deadline_seconds``, ``tags`` or ``priority`` before anything is written;
    :class:`~buzz_delivery.exceptions.CommunityNotWritable` when the community is not active.
    SPEC section 11.
    """
    community = v.uuid_value(community_id, "community_id")
    workflow = v.uuid_value(workflow_id, "workflow_id")
    if not isinstance(input, dict):
        raise v.invalid("input", f"must be a JSON object, not {type(input).__name__}")
    input_value = json.loads(json_argument(input, "input"))
    if not isinstance(cause, Cause):
        raise v.invalid("cause", f"must be a Cause, not {type(cause).__name__}")
    if idempotency_key is not None:
        idempotency_key = v.optional_text(idempotency_key, "idempotency_key", 200)
        if not idempotency_key:
            raise v.invalid("idempotency_key", "must not be empty")
    if version is not None:
        version = v.int_in_range(version, "version", 1, 2**31 - 1)
    if deadline_seconds is not None:
        deadline_seconds = v.int_in_range(deadline_seconds, "deadline_seconds", 1, 366 * 86400)
    run_tags = valid_tags(tags)
    rank = v.int_in_range(priority, "priority", PRIORITY_MIN, PRIORITY_MAX)
    latest = version is None
    pinned = (_LATEST.get((community, workflow)) if latest else None) or _version(community, workflow, version)

    def existing() -> Run | None:
        found = Run.objects.filter(
            community_id=community, workflow_id=workflow, idempotency_key=idempotency_key
        ).first()
        if found is not None and canonical_json(found.input) != canonical_json(input_value):
            raise IdempotencyConflict(f"idempotency key {idempotency_key!r} was used with another input")
        return found

    if idempotency_key is not None and (found := existing()) is not None:
        return found
    # In autocommit the insert is one statement, atomic on its own; inside the caller's
    # transaction a savepoint keeps a duplicate key from aborting it (the lookup below).
    try:
        in_transaction = connection.in_atomic_block or not connection.get_autocommit()
        with transaction.atomic() if in_transaction else nullcontext(), translated_errors():
            return create_run(
                community,
                pinned,
                input_value,
                cause,
                idempotency_key=idempotency_key,
                deadline_seconds=deadline_seconds,
                tags=run_tags,
                priority=rank,
                latest=latest,
            )
    except IntegrityError:
        if idempotency_key is not None and (found := existing()) is not None:
            return found
        raise


@tenant_scoped
def get_run(community_id: uuid.UUID | str, run_id: uuid.UUID | str) -> RunView | None:
    """The engine run and its steps (definition order), or None. Scoped read. SPEC section 11."""
    community = v.uuid_value(community_id, "community_id")
    rid = v.uuid_value(run_id, "run_id")
    run = Run.objects.filter(community_id=community, run_id=rid).first()
    if run is None:
        return None
    rows = Step.objects.filter(community_id=community, run_id=rid)  # a map step before its items, in order
    return RunView(run=run, steps=list(rows.order_by("position", F("item_index").asc(nulls_first=True))))


@retry_deadlocks
@tenant_scoped
def cancel_run(community_id: uuid.UUID | str, run_id: uuid.UUID | str) -> Canceled | AlreadyTerminal:
    """Cancel a running run in one transaction: the run becomes ``canceled``, every non-terminal
    step ``canceled`` with generation + 1 (holders get ``LeaseLost`` at their next renew or
    complete), pending approvals ``expired``, child runs canceled recursively, and the pending
    deliveries of the run and its children ``expired`` through the core's fenced
    :func:`buzz_delivery.services.expire_run_deliveries`. Nothing is left "cancelling". The
    core rows of the whole run tree it is in, from its root, are locked first, in run id order,
    when more than one: a multi-run batch settle's lock order (``sql.core_runs_of_trees``). Its
    parent's step fails with it, and under ``on_error: fail_run`` the parent ends too, its own
    parent's step with it, each canceling its other children, up to the root.

    Returns :class:`Canceled` (runs ended, deliveries expired) or ``AlreadyTerminal(state)``.
    Raises ``ValidationError`` keyed ``community_id``/``run_id``, :class:`RunNotFound`, or
    :class:`~buzz_delivery.exceptions.CommunityNotWritable`. SPEC section 11 "Cancel".
    """
    community = v.uuid_value(community_id, "community_id")
    rid = v.uuid_value(run_id, "run_id")
    params = {"community_id": community, "run_id": rid}
    with transaction.atomic(), translated_errors():
        fetch_all(sql.LOCK_CORE_RUNS_OF_TREE, params)  # a multi-run settle's order, from the root
        tree = [row[0] for row in fetch_all(sql.RUN_AND_DESCENDANTS, params)]
        live = list(
            Run.objects.filter(community_id=community, run_id__in=tree)
            .exclude(state__in=RUN_TERMINAL)
            .values_list("run_id", flat=True)
        )
        rows = fetch_all(
            sql.END_RUN_IF_ACTIVE, {**params, "state": "canceled", "failure_code": None, "failure_message": None}
        )
        if rows[0][0] is None:
            raise CommunityNotWritable(f"community {community} is not active; its runs cannot be canceled")
        if not rows[0][0]:
            state = Run.objects.filter(community_id=community, run_id=rid).values_list("state", flat=True).first()
            if state is None:
                raise RunNotFound(f"no workflow run {rid} in community {community}")
            return AlreadyTerminal(state)
        expired = sum(core.expire_run_deliveries(community, r) for r in live)
        clear_deliveries_to_expire(community, {r: [r] for r in live})
    return Canceled(runs=len(live), deliveries=expired)


@tenant_scoped
def restart_run(community_id: uuid.UUID | str, run_id: uuid.UUID | str, *, from_failure: bool = True) -> Run:
    """Start a new run of an ended run's pinned version, input and cause (``restart_of`` = it).

    With ``from_failure`` the steps that succeeded in the old run, and whose ancestors all
    succeeded, keep their outputs (recorded ``succeeded`` at once, in definition order; the
    Advance trigger releases what follows); the rest run again. The old run is untouched.
    Returns the new :class:`Run`. Raises ``ValidationError`` keyed ``community_id``/``run_id``,
    :class:`RunNotFound`, :class:`RunNotRestartable` (the run has not ended), or
    :class:`~buzz_delivery.exceptions.CommunityNotWritable`. SPEC section 11 "Restart".
    """
    community = v.uuid_value(community_id, "community_id")
    rid = v.uuid_value(run_id, "run_id")
    if not isinstance(from_failure, bool):
        raise v.invalid("from_failure", "must be True or False")
    old = Run.objects.filter(community_id=community, run_id=rid).first()
    if old is None:
        raise RunNotFound(f"no workflow run {rid} in community {community}")
    # Looked up on (community_id, id), not joined on the definition's id alone (a join Citus
    # would have to repartition, SPEC 15); a primary-key probe here.
    old.definition = DefinitionVersion.objects.get(community_id=community, id=old.definition_id)
    if old.state not in RUN_TERMINAL:
        raise RunNotRestartable(f"run {rid} is {old.state}; only an ended run is restarted")
    kept: dict[str, Any] = {}
    order: list[str] = []
    if from_failure:
        old_steps = {s.key: s for s in Step.objects.filter(community_id=community, run_id=rid)}
        order = _topological(old.definition.content["steps"])
        for key in order:
            step = old_steps.get(key)
            if step and step.state == "succeeded" and all(dep in kept for dep in step.depends_on):
                kept[key] = step.output
    with transaction.atomic(), translated_errors():
        new = create_run(community, old.definition, old.input, cause_of(old), restart_of=old)
        for key in order:
            if key in kept:
                fetch_all(
                    sql.KEEP_SUCCEEDED_STEP,
                    {"community_id": community, "run_id": new.pk, "key": key, "output": json.dumps(kept[key])},
                )
    new.refresh_from_db()
    return new


def _topological(steps: list[dict[str, Any]]) -> list[str]:
    done: list[str] = []
    deps = {s["key"]: s["depends_on"] for s in steps}

    def visit(key: str) -> None:
        if key in done:
            return
        for dep in deps[key]:
            visit(dep)
        done.append(key)

    for s in steps:
        visit(s["key"])
    return done

"""Step leases (SPEC section 11 "Step"): claim, renew, complete, fail, park.

Each transition is one fenced statement (community, step id, generation, ``running``,
``lease_until >= now`` on the database clock, community active), judged by the rows it
returns; a batch (``renew_steps``, ``complete_steps``, ``fail_steps``) is one statement fencing
each of its rows alike, judged row by row.
A statement that can end a step first locks the step's run row (the engine's lock
order: run, then steps), and the Advance trigger counts the step in the same transaction.
When nothing matched, the step is read at the holder's generation: terminal there is
``AlreadyTerminal`` (the true holder's retry), anything else ``LeaseLost``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import operator
import uuid
from collections.abc import Sequence
from typing import Any, cast

from django.db import connection, transaction
from django.db.models.base import DEFERRED, ModelState
from django.db.models.signals import post_init, pre_init

from buzz_delivery import backoff
from buzz_delivery.models import HOLDER_MAX_CHARS
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled, flow, leases
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import (
    atomic_within_bound,
    fetch_all,
    int_array,
    retry_deadlocks,
    translated_errors,
    uuid_array,
)
from buzz_delivery.services.tenancy import fleet_scoped, tenant_scoped
from buzz_delivery.usercode import in_transaction
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.models import DefinitionVersion, Step
from buzz_delivery.workflows.services import cached, sql
from buzz_delivery.workflows.services.common import BadJSON, json_text
from buzz_delivery.workflows.services.runs import expire_deliveries_of_ended_runs
from buzz_delivery.workflows.services.types import (
    CompletedBatch,
    RenewOutcome,
    StepClaim,
    StepFailure,
    StepLease,
    StepOutcome,
    StepRenewed,
)
from buzz_delivery.workflows.states import STEP_TERMINAL

MAX_CLAIM = 1000
MAX_ATTEMPTS = 100  # a lease's attempts (StepLease's bound, and a definition's max_attempts)


def _lease_seconds(value: float | None) -> float:
    return v.lease_seconds(get_settings().lease_seconds if value is None else value)


def _lease(value: Any) -> StepLease:
    if not isinstance(value, StepLease):
        raise v.invalid("lease", f"must be a StepLease, not {type(value).__name__}")
    return value


def _params(lease: StepLease, **extra: Any) -> dict[str, Any]:
    return {
        "community_id": lease.community_id,
        "step_id": lease.step_id,
        "run_id": lease.run_id,
        "lease_generation": lease.lease_generation,
        "attempts": lease.attempts,
        **extra,
    }


def _missed(params: dict[str, Any], still_fine: str | None = None) -> StepOutcome:
    rows = fetch_all(sql.STEP_AT_GENERATION, params)
    if rows and rows[0][0] in STEP_TERMINAL:
        return AlreadyTerminal(rows[0][0])
    if rows and still_fine is not None and rows[0][0] == still_fine:
        return Settled(still_fine)
    return LeaseLost()


@tenant_scoped
def claim_steps(
    community_id: uuid.UUID | str,
    *,
    limit: int = 1,
    lease_seconds: float | None = None,
    holder: str | None = None,
    sends_only: bool = False,
) -> list[StepClaim]:
    """Claim up to ``limit`` (1..1000) ready steps of one community, oldest ready first, past
    their backoff gate, with ``FOR UPDATE SKIP LOCKED`` (concurrent claimers never share or wait
    on a step). Each winner: ``running``, generation + 1, attempts + 1, lease ``lease_seconds``
    (default ``BUZZ_WORKFLOWS['LEASE_SECONDS']``, within the core's lease bounds) from the
    database clock. A community that is not active has nothing claimable. ``holder``: who
    claims (at most 200 characters, e.g. ``host:pid:orchestrator``), recorded as ``claimed_by``
    and in the step's history; None = unnamed.

    Under the operator's ``STEP_CONCURRENCY_LIMITS`` (docs/flow-control.md) a claim takes at
    most as many as leave every declared key (the community, a workflow, a step key of a
    workflow) within its maximum of running steps; the rest stay ready.

    ``sends_only``: claim only ``send_message`` steps (issue 31: an orchestrator claims them
    ahead of its step threads, whose room they do not need; its completer sends them in bulk).
    Under declared limits it claims nothing: the ordinary claim takes those sends within the
    limits.

    Returns the claims (possibly none). Raises ``ValidationError`` keyed ``community_id``,
    ``limit``, ``lease_seconds``, ``holder`` or ``sends_only`` before SQL, and ``ImproperlyConfigured`` naming
    the field for a bad ``STEP_CONCURRENCY_LIMITS`` (nothing written). SPEC section 11.
    """
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "limit": v.int_in_range(limit, "limit", 1, MAX_CLAIM),
        "lease_seconds": _lease_seconds(lease_seconds),
        "holder": v.optional_text(holder, "holder", HOLDER_MAX_CHARS),
    }
    if not isinstance(sends_only, bool):
        raise v.invalid("sends_only", "must be true or false")
    limits = flow.declared_step_limits()
    if sends_only:
        if limits:
            return []
        with translated_errors():
            return _claims_from_rows(fetch_all(sql.CLAIM_READY_SENDS, params))
    with translated_errors():
        rows = _claim_ready(params, limits)
    return _claims_from_rows(rows)


def _claim_ready(params: dict[str, Any], limits: dict[str, int]) -> list[tuple[Any, ...]]:
    """The claim statement's rows: the plain claim, or with ``limits`` declared the claim that
    takes slots, under the community's step-claim lock (services/flow.py)."""
    if not limits:
        return fetch_all(cached.CLAIM_STEPS.call, params)  # sql.CLAIM_READY_STEPS, plan-cached
    return flow.claim_holding_slots(
        sql.CLAIM_READY_STEPS_UNDER_LIMITS,
        {**params, **flow.all_caps(limits, flow.STEP_KINDS)},
        flow.STEP_CLAIM_LOCK_NAMESPACE,
        "wf_step_slot_",
    )


_STEP_ALL_ATTNAMES = [f.attname for f in Step._meta.concrete_fields]
_HISTORY_AT = _STEP_ALL_ATTNAMES.index("history")
_CLAIMED_ATTNAMES = _STEP_ALL_ATTNAMES[:_HISTORY_AT] + _STEP_ALL_ATTNAMES[_HISTORY_AT + 1 :]
assert _CLAIMED_ATTNAMES == sql.STEP_ATTNAMES, "the claim returns every step column but the history, in order"
_CLAIMED = len(_CLAIMED_ATTNAMES)
_READY_AT = sql.STEP_ATTNAMES.index("ready_at")
_STEP_ID = sql.STEP_ATTNAMES.index("id")
_PRIORITY = sql.STEP_ATTNAMES.index("priority")
_SPEC = sql.STEP_ATTNAMES.index("spec")
_BY_AGE = operator.itemgetter(_READY_AT, _STEP_ID)
_BY_PRIORITY = operator.itemgetter(_PRIORITY)
# The fast path below copies what ``Model.from_db`` does (as the core's claim of deliveries
# does, services/leases.py, on the Djangos it knows: ``leases.FAST_ROWS``): the claimed fields
# into ``__dict__`` as ``Model.__init__`` puts them (the history left out: deferred), a fresh
# ``ModelState`` with ``adding`` off and ``db`` set.
_new = object.__new__
_set = object.__setattr__


def _fast_steps() -> bool:
    """Whether claimed step rows may skip ``Model.from_db``: a Django whose ``from_db`` this path
    knows, and no ``pre_init``/``post_init`` receivers for ``Step`` (asked once per claim)."""
    return leases.FAST_ROWS and not (pre_init.has_listeners(Step) or post_init.has_listeners(Step))


def _claims_from_rows(rows: list[tuple[Any, ...]]) -> list[StepClaim]:
    """The claims of a claim statement's rows (every step column but the history, then the
    run's definition id), highest priority first, then oldest ready, then by id. Built without a
    Python call per object: the step as ``Model.from_db`` builds it (the history deferred), the
    lease's and the claim's slots set as :meth:`StepLease.from_database` and ``StepClaim(...)``
    set them (tests/test_wf_claim_rows.py compares them)."""
    # Two stable sorts (C key functions) give the order of one by (-priority, ready_at, id).
    rows = sorted(rows, key=_BY_AGE)
    rows.sort(key=_BY_PRIORITY, reverse=True)
    fast = _fast_steps()
    names = _CLAIMED_ATTNAMES
    alias = "default"
    utc = dt.UTC
    claims: list[StepClaim] = []
    append = claims.append
    for row in rows:
        if fast:
            step = _new(Step)
            step.__dict__.update(zip(names, row[:_CLAIMED], strict=True))
            state = ModelState()
            state.adding = False
            state.db = alias
            step._state = state
        else:
            step = Step.from_db(alias, _STEP_ALL_ATTNAMES, (*row[:_HISTORY_AT], DEFERRED, *row[_HISTORY_AT:-1]))
        # A map's element carries its own spec (jsonb, as text from the cursor); the definition's
        # steps are cached per version.
        spec = row[_SPEC]
        if isinstance(spec, str):
            spec = step.spec = json.loads(spec)
        if spec is None:
            spec = definition_steps(row[-1])[step.key]
        until = step.lease_until
        if until is None or until.tzinfo is not utc or not 0 < step.attempts <= MAX_ATTEMPTS:
            # What the constructor validates (and refuses) the database's row may hold.
            lease = StepLease(
                community_id=step.community_id,
                step_id=step.id,
                run_id=step.run_id,
                lease_generation=step.lease_generation,
                attempts=step.attempts,
                lease_until=cast(dt.datetime, until),
            )
        else:
            lease = StepLease.from_database(
                step.community_id, step.id, step.run_id, step.lease_generation, step.attempts, until
            )
        claim = _new(StepClaim)
        _set(claim, "lease", lease)
        _set(claim, "step", step)
        _set(claim, "spec", spec)
        append(claim)
    return claims


_DEFINITIONS: dict[uuid.UUID, dict[str, dict[str, Any]]] = {}


def definition_steps(definition_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """The steps of a definition version by key; versions are immutable, so they are cached
    per process (bounded: the cache is emptied beyond 10,000 versions)."""
    found = _DEFINITIONS.get(definition_id)
    if found is None:
        content = DefinitionVersion.objects.values_list("content", flat=True).get(id=definition_id)
        found = {s["key"]: s for s in content["steps"]}
        if len(_DEFINITIONS) >= 10_000:
            _DEFINITIONS.clear()
        _DEFINITIONS[definition_id] = found
    return found


@fleet_scoped
def communities_with_ready_steps(limit: int = 100, after: uuid.UUID | None = None) -> list[uuid.UUID]:
    """Communities that have claimable steps now, at most ``limit``, in round-robin order: those
    whose id sorts after ``after`` first, then the others from the first (a plain read;
    orchestrators of "all" communities walk them and claim per community, each walk starting
    after the community the last one ended at)."""
    params = {
        "limit": v.int_in_range(limit, "limit", 1, 10_000),
        "after": None if after is None else v.uuid_value(after, "after"),
    }
    return [row[0] for row in fetch_all(sql.COMMUNITIES_WITH_READY_STEPS, params)]


@tenant_scoped
def steps_left_waiting(community_id: uuid.UUID | str, seconds: float, limit: int = 1) -> int:
    """How many steps of the community (at most ``limit``, 1..1000) have been claimable
    ``seconds`` (0..3600) or more: ready since then, or their backoff over since then (a plain
    read). A following orchestrator (issue 31) claims only what the leading one left waiting
    that long. Raises ``ValidationError`` keyed ``community_id``, ``seconds`` or ``limit``."""
    params = {
        "community_id": v.uuid_value(community_id, "community_id"),
        "seconds": v.seconds_in_range(seconds, "seconds", 0, 3600),
        "limit": v.int_in_range(limit, "limit", 1, MAX_CLAIM),
    }
    with translated_errors():
        return int(fetch_all(sql.STEPS_LEFT_WAITING, params)[0][0])


@tenant_scoped
def renew_step(lease: StepLease, lease_seconds: float | None = None) -> StepRenewed | LeaseLost:
    """Extend a current step lease to now + ``lease_seconds`` (database clock). Never bumps the
    generation. Returns :class:`StepRenewed` or ``LeaseLost`` (expired, reclaimed, canceled,
    community not active). Raises ``ValidationError`` keyed ``lease``/``lease_seconds``. SPEC 11."""
    lease = _lease(lease)
    params = _params(lease, lease_seconds=_lease_seconds(lease_seconds))
    with translated_errors():
        rows = fetch_all(sql.RENEW_IF_CURRENT_GENERATION, params)
    if not rows:
        return LeaseLost()
    return StepRenewed(
        StepLease(lease.community_id, lease.step_id, lease.run_id, lease.lease_generation, lease.attempts, rows[0][0])
    )


@retry_deadlocks
@tenant_scoped
def renew_steps(
    community_id: uuid.UUID | str, leases: Sequence[StepLease], lease_seconds: float | None = None
) -> list[RenewOutcome]:
    """:func:`renew_step` for many leases of one community in one statement (an orchestrator's
    renewal round): ``UPDATE ... FROM unnest`` fenced per row by (step id, generation) exactly as
    the single renewal fences its row. ``leases``: 0..1000, each of ``community_id``, each lease
    at most once. Returns one outcome per lease, in order: :class:`StepRenewed` (new
    ``lease_until``, database clock) or ``LeaseLost`` (expired, reclaimed, ended, canceled,
    community not active). Raises ``ValidationError`` keyed ``community_id``, ``leases``,
    ``leases[i]``, ``lease`` or ``lease_seconds`` before SQL. SPEC section 11."""
    community = v.uuid_value(community_id, "community_id")
    if not isinstance(leases, Sequence) or len(leases) > MAX_CLAIM:
        raise v.invalid("leases", f"must be a sequence of at most {MAX_CLAIM} step leases")
    checked = _leases_of(community, leases, "leases")
    seconds = _lease_seconds(lease_seconds)
    if not checked:
        return []
    ordered = sorted(checked, key=lambda lease: (lease.step_id, lease.lease_generation))  # one lock order
    params = {
        "community_id": community,
        "lease_seconds": seconds,
        "step_ids": [lease.step_id for lease in ordered],
        "lease_generations": [lease.lease_generation for lease in ordered],
    }
    with translated_errors():
        rows = fetch_all(sql.RENEW_MANY_IF_CURRENT_GENERATION, params)
    until = {(step_id, generation): lease_until for step_id, generation, lease_until in rows}
    outcomes: list[RenewOutcome] = []
    for lease in checked:
        renewed = until.get((lease.step_id, lease.lease_generation))
        if renewed is None:
            outcomes.append(LeaseLost())
        else:
            outcomes.append(StepRenewed(dataclasses.replace(lease, lease_until=renewed)))
    return outcomes


def _leases_of(community: uuid.UUID, leases: Sequence[Any], name: str) -> list[StepLease]:
    """``leases`` checked: each a lease of ``community``, none twice (``ValidationError`` keyed
    ``name[i]``, or ``lease`` for what is not a lease)."""
    checked: list[StepLease] = []
    seen: set[tuple[uuid.UUID, int]] = set()
    for i, value in enumerate(leases):
        lease = _lease(value)
        if lease.community_id != community:
            raise v.invalid(f"{name}[{i}]", "lease of another community")
        if (lease.step_id, lease.lease_generation) in seen:
            raise v.invalid(f"{name}[{i}]", "the same lease twice")
        seen.add((lease.step_id, lease.lease_generation))
        checked.append(lease)
    return checked


@retry_deadlocks
@tenant_scoped
def release_steps(community_id: uuid.UUID | str, leases: Sequence[StepLease]) -> int:
    """Hand back claims of one community that their holder never started (an orchestrator's
    local queue it cannot serve): each step whose lease is current goes back to ``ready`` in
    its place in the queue, the attempt its claim took given back and its generation bumped
    (the lease is fenced), in one statement; the other orchestrators are woken (NOTIFY).
    ``leases``: 0..1000, each of ``community_id``. Returns how many were handed back (a lease
    already lost is not). Raises ``ValidationError`` keyed ``community_id``, ``leases`` or
    ``lease`` before SQL. SPEC section 11 "Orchestrator"."""
    community = v.uuid_value(community_id, "community_id")
    if not isinstance(leases, Sequence) or len(leases) > MAX_CLAIM:
        raise v.invalid("leases", f"must be a sequence of at most {MAX_CLAIM} step leases")
    checked = [_lease(lease) for lease in leases]
    if any(lease.community_id != community for lease in checked):
        raise v.invalid("leases", "a lease of another community")
    if not checked:
        return 0
    params = {
        "community_id": community,
        "step_ids": [lease.step_id for lease in checked],
        "lease_generations": [lease.lease_generation for lease in checked],
    }
    with transaction.atomic(), translated_errors():
        released = len(fetch_all(sql.RELEASE_MANY_IF_CURRENT_GENERATION, params))
        if released:
            fetch_all(sql.NOTIFY_IF_READY_LEFT, {"community_id": community})
    return released


@retry_deadlocks
@tenant_scoped
def complete_step(lease: StepLease, output: Any = None) -> StepOutcome:
    """Record the step ``succeeded`` with ``output`` (JSON), if the lease is current; Advance
    runs in the same transaction.

    An output that is not storable JSON or larger than ``BUZZ_WORKFLOWS['MAX_OUTPUT_BYTES']``
    does not raise: the step is recorded ``failed`` with failure code ``output_not_json`` or
    ``output_too_large`` (no retry) and ``Settled("failed")`` is returned.

    Returns ``Settled("succeeded")``, ``AlreadyTerminal(state)`` (the same holder already ended
    it) or ``LeaseLost``. Raises ``ValidationError`` keyed ``lease``. SPEC section 11.
    """
    lease = _lease(lease)
    try:
        text = json_text(output, get_settings().max_output_bytes)
    except BadJSON as exc:
        return fail_step(lease, exc.code, failure_message=f"step output {exc}", retryable=False)
    params = _params(lease, output=text)
    with atomic_within_bound(), translated_errors():
        fetch_all(sql.LOCK_RUN, params)
        rows = fetch_all(sql.COMPLETE_IF_CURRENT_GENERATION, params)
        if rows:
            return Settled(rows[0][0])
        return _missed(params)


@tenant_scoped
def complete_steps(community_id: uuid.UUID | str, completions: Sequence[tuple[StepLease, Any]]) -> list[StepOutcome]:
    """:func:`complete_step` for many leases of one community: one transaction takes the runs
    that are free now (in id order, ``SKIP LOCKED``: it never waits for a run, so two batches,
    a cancel or a fan-in cannot deadlock with it on those locks) and completes their steps with
    one ``UPDATE ... FROM unnest`` fenced per row by (step id, generation), Advance per row; the
    steps of runs that were locked are then completed one at a time (:func:`complete_step`).

    ``completions``: 0..1000 (lease, output) pairs, each lease of ``community_id``, each step
    at most once. Returns one outcome per pair, in order, as :func:`complete_step` would: an
    output that is not storable JSON fails its step (``Settled("failed")``, through
    :func:`fail_step`, before the batch); a lease the statement did not settle is judged by the
    fenced read (``AlreadyTerminal`` or ``LeaseLost``). Raises ``ValidationError`` keyed
    ``community_id``, ``completions``, ``completions[i]`` or ``lease`` before SQL. SPEC 11.
    """
    batch = complete_and_claim_steps(community_id, completions)
    return [
        outcome if outcome is not None else complete_step(lease, output)
        for (lease, output), outcome in zip(completions, batch.outcomes, strict=True)
    ]


@tenant_scoped
def complete_and_claim_steps(
    community_id: uuid.UUID | str,
    completions: Sequence[tuple[StepLease, Any]],
    *,
    claim_limit: int = 0,
    lease_seconds: float | None = None,
    holder: str | None = None,
) -> CompletedBatch:
    """The batch of :func:`complete_steps`, then, in the same transaction, :func:`claim_steps`
    of up to ``claim_limit`` (0..1000) ready steps of the community, oldest ready first (the
    steps the completions released among them): they are claimed by their completer without a
    wake-up or a claim round trip of their own. With ``claim_limit`` > 0 the releases in this
    transaction do not NOTIFY; the transaction NOTIFYs once, at commit, when ready steps are
    left that it did not claim. ``lease_seconds`` and ``holder`` as for :func:`claim_steps`.

    Returns :class:`CompletedBatch`: ``outcomes`` as :func:`complete_steps`, except ``None``
    for a pair whose run another transaction held locked (not attempted: complete it again,
    e.g. with :func:`complete_step`), and ``claims``. Nothing runs after the transaction's
    commit, so a caller that gets no exception owns every claim. Raises ``ValidationError``
    keyed ``community_id``, ``completions``, ``completions[i]``, ``lease``, ``claim_limit``,
    ``lease_seconds`` or ``holder`` before SQL. SPEC section 11.
    """
    community = v.uuid_value(community_id, "community_id")
    if not isinstance(completions, Sequence) or len(completions) > MAX_CLAIM:
        raise v.invalid("completions", f"must be a sequence of at most {MAX_CLAIM} (lease, output) pairs")
    claim_params = {
        "community_id": community,
        "limit": v.int_in_range(claim_limit, "claim_limit", 0, MAX_CLAIM),
        "lease_seconds": _lease_seconds(lease_seconds),
        "holder": v.optional_text(holder, "holder", HOLDER_MAX_CHARS),
    }
    limits = flow.declared_step_limits() if claim_params["limit"] else {}
    limit = get_settings().max_output_bytes
    texts: list[str | BadJSON] = []
    seen: set[uuid.UUID] = set()
    for i, pair in enumerate(completions):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise v.invalid(f"completions[{i}]", "must be a (lease, output) pair")
        lease = _lease(pair[0])
        if lease.community_id != community:
            raise v.invalid(f"completions[{i}]", "lease of another community")
        if lease.step_id in seen:
            raise v.invalid(f"completions[{i}]", "the same step twice")
        seen.add(lease.step_id)
        try:
            texts.append(json_text(pair[1], limit))
        except BadJSON as exc:
            texts.append(exc)
    outcomes: dict[uuid.UUID, StepOutcome] = {}
    # Outputs that are not storable fail their steps first, each on its own (its run's lock
    # would break the batch's id order).
    for (lease, _output), text in zip(completions, texts, strict=True):
        if isinstance(text, BadJSON):
            outcomes[lease.step_id] = fail_step(
                lease, text.code, failure_message=f"step output {text}", retryable=False
            )
    good = [(pair[0], text) for pair, text in zip(completions, texts, strict=True) if isinstance(text, str)]
    claims: list[StepClaim] = []
    if good or claim_params["limit"]:
        settled, claims = _complete_and_claim(community, good, claim_params, limits)
        outcomes.update(settled)
    return CompletedBatch([outcomes.get(lease.step_id) for lease, _ in completions], claims)


@retry_deadlocks
def _complete_and_claim(
    community: uuid.UUID, good: list[tuple[StepLease, str]], claim_params: dict[str, Any], limits: dict[str, int]
) -> tuple[dict[uuid.UUID, StepOutcome], list[StepClaim]]:
    """The transaction of :func:`complete_and_claim_steps` (run again whole when PostgreSQL
    aborts it as a deadlock's victim): the outcomes it settled, and its claims."""
    outcomes: dict[uuid.UUID, StepOutcome] = {}
    claims: list[StepClaim] = []
    # Releases NOTIFY at most once, after the claim (only completions release). The deferral is
    # ``SET LOCAL``: it ends with the transaction's commit, so only inside a caller's own
    # transaction (or savepoint) is it undone by a statement of its own.
    defer = bool(claim_params["limit"] and good)
    undefer = defer and in_transaction(connection)
    with atomic_within_bound(), translated_errors():
        if defer:
            fetch_all(sql.DEFER_NOTIFY, {})
        if good:
            # The arrays as their text (db.uuid_array, int_array, _jsonb_array): psycopg's array
            # dumper quotes every element through regular expressions. The statement locks the
            # runs in id order (its ORDER BY).
            lock = {"community_id": community, "run_ids": uuid_array({lease.run_id for lease, _ in good})}
            free = {row[0] for row in fetch_all(sql.LOCK_FREE_RUNS, lock)}
            batch = [(lease, text) for lease, text in good if lease.run_id in free]
            params = {
                "community_id": community,
                "step_ids": uuid_array([lease.step_id for lease, _ in batch]),
                "lease_generations": int_array([lease.lease_generation for lease, _ in batch]),
                "outputs": _jsonb_array([text for _, text in batch]),
            }
            settled = {row[0] for row in fetch_all(cached.COMPLETE_STEPS.call, params)}
            for lease, _ in batch:
                outcomes[lease.step_id] = Settled("succeeded") if lease.step_id in settled else _missed(_params(lease))
        if claim_params["limit"]:
            claims = _claims_from_rows(_claim_ready(claim_params, limits))
            fetch_all(sql.NOTIFY_IF_READY_LEFT, {"community_id": community})
        if undefer:
            fetch_all(sql.UNDEFER_NOTIFY, {})  # a caller's own transaction goes on notifying
    return outcomes, claims


def _jsonb_array(texts: list[str]) -> str:
    """JSON texts as the text of a ``jsonb[]`` (the statement casts it): each element quoted,
    its backslashes and double quotes escaped (array input's rules), so no text can reach the
    array's syntax, and none is NULL (JSON ``null`` is the quoted text ``"null"``)."""
    return "{" + ",".join(['"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"' for t in texts]) + "}"


def backoff_seconds(attempts: int, base: float, cap: float) -> float:
    """Delay before the next attempt after attempt number ``attempts`` failed: base * 2**(n-1), capped."""
    return float(min(cap, base * (2 ** min(attempts - 1, 30))))


def retry_delay(attempts: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """:func:`backoff_seconds` with equal jitter (within [1/2, 1] of it, :mod:`buzz_delivery.backoff`),
    and not less than ``retry_after`` when given."""
    return max(backoff.jittered(backoff_seconds(attempts, base, cap)), retry_after or 0.0)


@retry_deadlocks
@tenant_scoped
def fail_step(
    lease: StepLease,
    failure_code: str,
    *,
    failure_message: str | None = None,
    retryable: bool = True,
    retry_after: float | None = None,
) -> StepOutcome:
    """Record a failed attempt, if the lease is current. With attempts left and ``retryable``
    the step returns to ``ready`` after its backoff (``Settled("ready")``; the backoff is
    computed from the attempt the lease holds, with jitter: :func:`retry_delay`; not before
    ``retry_after`` seconds, 0..7 days, when given: a provider's Retry-After); otherwise it ends ``failed``
    (``Settled("failed")``) with ``failure_code``, or ``attempts_exhausted`` when retries ran
    out, and its ``on_error`` applies (Advance, same transaction).

    ``failure_code``: 1..64 characters; ``failure_message``: at most 10,000. Returns also
    ``AlreadyTerminal(state)`` or ``LeaseLost``. Raises ``ValidationError`` keyed ``lease``,
    ``failure_code`` or ``failure_message`` before SQL. SPEC section 11 "Retries".
    """
    lease = _lease(lease)
    code = v.optional_text(failure_code, "failure_code", 64)
    if not code:
        raise v.invalid("failure_code", "must not be empty")
    message = v.optional_text(failure_message, "failure_message", 10_000)
    if not isinstance(retryable, bool):
        raise v.invalid("retryable", "must be True or False")
    after = backoff.argument(retry_after)
    params = _params(lease, failure_code=code, failure_message=message)
    with atomic_within_bound(), translated_errors():
        fetch_all(sql.LOCK_RUN, params)
        policy = fetch_all(sql.STEP_RETRY_POLICY, params)
        if not policy:
            return LeaseLost()
        _attempts, max_attempts, base, cap = policy[0]
        if retryable and lease.attempts < max_attempts:
            params["delay_seconds"] = retry_delay(lease.attempts, base, cap, after)
            rows = fetch_all(sql.RETRY_IF_CURRENT_GENERATION, params)
            if rows:
                return Settled(rows[0][0])
            return _missed(params, still_fine="ready")
        if retryable:
            params["failure_code"] = "attempts_exhausted"
            params["failure_message"] = f"{code}: {message or ''}".strip()[:10_000]
        rows = fetch_all(sql.FAIL_IF_CURRENT_GENERATION, params)
        if rows:
            # Under on_error fail_run the run has ended: its pending deliveries go too.
            expire_deliveries_of_ended_runs(lease.community_id, [lease.run_id])
            return Settled(rows[0][0])
        return _missed(params)


def _failure(value: Any, name: str) -> tuple[StepFailure, str, str | None, float | None]:
    """A :class:`StepFailure` checked as :func:`fail_step` checks its arguments: the failure, its
    code, message and ``retry_after``."""
    if not isinstance(value, StepFailure):
        raise v.invalid(name, f"must be a StepFailure, not {type(value).__name__}")
    _lease(value.lease)
    code = v.optional_text(value.failure_code, "failure_code", 64)
    if not code:
        raise v.invalid("failure_code", "must not be empty")
    message = v.optional_text(value.failure_message, "failure_message", 10_000)
    if not isinstance(value.retryable, bool):
        raise v.invalid("retryable", "must be True or False")
    return value, code, message, backoff.argument(value.retry_after)


@tenant_scoped
def fail_steps(community_id: uuid.UUID | str, failures: Sequence[StepFailure]) -> list[StepOutcome]:
    """:func:`fail_step` for many failed attempts of one community: :func:`fail_steps_skip_locked`,
    then the steps of runs another transaction held locked one at a time (:func:`fail_step`).
    Returns one outcome per failure, in order, as :func:`fail_step` would. Raises as
    :func:`fail_steps_skip_locked`. SPEC section 11 "Retries"."""
    outcomes = fail_steps_skip_locked(community_id, failures)
    return [
        outcome
        if outcome is not None
        else fail_step(
            f.lease,
            f.failure_code,
            failure_message=f.failure_message,
            retryable=f.retryable,
            retry_after=f.retry_after,
        )
        for f, outcome in zip(failures, outcomes, strict=True)
    ]


@tenant_scoped
def fail_steps_skip_locked(community_id: uuid.UUID | str, failures: Sequence[StepFailure]) -> list[StepOutcome | None]:
    """Record many failed attempts of one community in one transaction, as :func:`fail_step`
    records one: it takes the runs that are free now (id order, ``SKIP LOCKED``: it never waits
    for a run), reads the steps' retry policies at their generations (one statement), then
    retries with one ``UPDATE ... FROM unnest`` the steps with attempts left that are
    ``retryable`` (each its own backoff with jitter from the attempt its lease holds, not before
    its ``retry_after``: :func:`retry_delay`) and ends the others ``failed`` with another
    (``attempts_exhausted`` when retries ran out), each row fenced by its own lease, Advance
    per row; the pending deliveries of runs that ended go too.

    ``failures``: 0..1000 :class:`StepFailure`, each lease of ``community_id``, each step at
    most once. Returns one outcome per failure, in order: ``Settled("ready")``,
    ``Settled("failed")``, ``AlreadyTerminal(state)`` or ``LeaseLost`` as :func:`fail_step`
    would, or ``None`` for a failure whose run another transaction held locked (not attempted:
    record it again, e.g. with :func:`fail_step`). Raises ``ValidationError`` keyed
    ``community_id``, ``failures``, ``failures[i]``, ``lease``, ``failure_code``,
    ``failure_message``, ``retryable`` or ``retry_after`` before SQL. SPEC section 11 "Retries".
    """
    community = v.uuid_value(community_id, "community_id")
    if not isinstance(failures, Sequence) or len(failures) > MAX_CLAIM:
        raise v.invalid("failures", f"must be a sequence of at most {MAX_CLAIM} step failures")
    checked = [_failure(value, f"failures[{i}]") for i, value in enumerate(failures)]
    seen: set[uuid.UUID] = set()
    for i, (failure, *_rest) in enumerate(checked):
        if failure.lease.community_id != community:
            raise v.invalid(f"failures[{i}]", "lease of another community")
        if failure.lease.step_id in seen:
            raise v.invalid(f"failures[{i}]", "the same step twice")
        seen.add(failure.lease.step_id)
    if not checked:
        return []
    outcomes = _fail_batch(community, checked)
    return [outcomes.get(failure.lease.step_id) for failure, *_rest in checked]


@retry_deadlocks
def _fail_batch(
    community: uuid.UUID, checked: list[tuple[StepFailure, str, str | None, float | None]]
) -> dict[uuid.UUID, StepOutcome]:
    """The transaction of :func:`fail_steps_skip_locked` (run again whole when PostgreSQL aborts
    it as a deadlock's victim): the outcomes of the failures whose runs it took."""
    outcomes: dict[uuid.UUID, StepOutcome] = {}
    with atomic_within_bound(), translated_errors():
        run_ids = sorted({failure.lease.run_id for failure, *_rest in checked})
        free = {row[0] for row in fetch_all(sql.LOCK_FREE_RUNS, {"community_id": community, "run_ids": run_ids})}
        batch = sorted((c for c in checked if c[0].lease.run_id in free), key=lambda c: c[0].lease.step_id)
        if not batch:
            return outcomes
        leases = [failure.lease for failure, *_rest in batch]
        fence = {
            "community_id": community,
            "step_ids": [lease.step_id for lease in leases],
            "lease_generations": [lease.lease_generation for lease in leases],
        }
        policies = {row[0]: row[1:] for row in fetch_all(sql.STEP_RETRY_POLICIES, fence)}
        retries: list[tuple[StepLease, str, str | None, float]] = []
        ends: list[tuple[StepLease, str, str | None]] = []
        for failure, code, message, after in batch:
            lease = failure.lease
            policy = policies.get(lease.step_id)
            if policy is None:
                outcomes[lease.step_id] = LeaseLost()
                continue
            max_attempts, base, cap = policy
            if failure.retryable and lease.attempts < max_attempts:
                retries.append((lease, code, message, retry_delay(lease.attempts, base, cap, after)))
            elif failure.retryable:
                ends.append((lease, "attempts_exhausted", f"{code}: {message or ''}".strip()[:10_000]))
            else:
                ends.append((lease, code, message))
        if retries:
            params = {
                "community_id": community,
                "step_ids": [lease.step_id for lease, *_ in retries],
                "lease_generations": [lease.lease_generation for lease, *_ in retries],
                "attempt_numbers": [lease.attempts for lease, *_ in retries],
                "failure_codes": [code for _, code, _, _ in retries],
                "failure_messages": [message for _, _, message, _ in retries],
                "delays": [delay for *_, delay in retries],
            }
            retried = {row[0] for row in fetch_all(sql.RETRY_MANY_IF_CURRENT_GENERATION, params)}
            for lease, *_ in retries:
                outcomes[lease.step_id] = (
                    Settled("ready") if lease.step_id in retried else _missed(_params(lease), still_fine="ready")
                )
        if ends:
            params = {
                "community_id": community,
                "step_ids": [lease.step_id for lease, *_ in ends],
                "lease_generations": [lease.lease_generation for lease, *_ in ends],
                "failure_codes": [code for _, code, _ in ends],
                "failure_messages": [message for _, _, message in ends],
            }
            failed = {row[0] for row in fetch_all(sql.FAIL_MANY_IF_CURRENT_GENERATION, params)}
            for lease, *_ in ends:
                outcomes[lease.step_id] = Settled("failed") if lease.step_id in failed else _missed(_params(lease))
            # Under on_error fail_run those runs have ended: their pending deliveries go too.
            ended = sorted({lease.run_id for lease, *_ in ends if lease.step_id in failed})
            expire_deliveries_of_ended_runs(community, ended)
    return outcomes


@tenant_scoped
def park_step(
    lease: StepLease,
    *,
    expected: int | None = None,
    child_run_id: uuid.UUID | None = None,
    wait_seconds: float | None = None,
) -> StepOutcome:
    """Release the lease and park the step ``waiting`` (on ``expected`` deliveries, a child run
    or an approval), in the caller's transaction. ``wait_seconds``: the wait timeout (None =
    none). Returns ``Settled("waiting")`` (also for the holder's repeat), ``AlreadyTerminal`` or
    ``LeaseLost``. Internal to the executor; SPEC section 11 "send_message"."""
    lease = _lease(lease)
    params = _params(lease, expected=expected, child_run_id=child_run_id, wait_seconds=wait_seconds)
    with translated_errors():
        rows = fetch_all(sql.PARK_IF_CURRENT_GENERATION, params)
    if rows:
        return Settled(rows[0][0])
    return _missed(params, still_fine="waiting")


@tenant_scoped
def park_step_returning_deadline(lease: StepLease, *, wait_seconds: float) -> tuple[StepOutcome, Any]:
    """:func:`park_step` that also returns the wait deadline it set (database clock)."""
    params = _params(lease, expected=None, child_run_id=None, wait_seconds=wait_seconds)
    with translated_errors():
        rows = fetch_all(sql.PARK_IF_CURRENT_GENERATION, params)
    if rows:
        return Settled(rows[0][0]), rows[0][1]
    return _missed(params, still_fine="waiting"), None


@tenant_scoped
def park_sends(community_id: uuid.UUID | str, parks: Sequence[tuple[StepLease, int, float | None]]) -> set[uuid.UUID]:
    """:func:`park_step` of many send_message steps of one community in one statement, in the
    caller's transaction: each (lease, expected deliveries, wait seconds or None) fenced by its
    own lease, the step rows locked in id order. Returns the ids of the steps it parked; a step
    not among them was not touched (judge it with :func:`park_outcome`). Raises
    ``ValidationError`` keyed ``parks[i]`` before SQL. Internal to the executor; SPEC 11."""
    community = v.uuid_value(community_id, "community_id")
    for i, (lease, _expected, _seconds) in enumerate(parks):
        if _lease(lease).community_id != community:
            raise v.invalid(f"parks[{i}]", "lease of another community")
    if not parks:
        return set()
    params = {
        "community_id": community,
        "step_ids": [lease.step_id for lease, _, _ in parks],
        "lease_generations": [lease.lease_generation for lease, _, _ in parks],
        "expected": [expected for _, expected, _ in parks],
        "wait_seconds": [seconds for _, _, seconds in parks],
    }
    with translated_errors():
        return {row[0] for row in fetch_all(sql.PARK_SENDS_IF_CURRENT_GENERATION, params)}


@tenant_scoped
def park_outcome(lease: StepLease) -> StepOutcome:
    """The outcome of a park that did not settle ``lease``'s step (the fenced read):
    ``Settled("waiting")`` for the holder's repeat, ``AlreadyTerminal`` or ``LeaseLost``."""
    return _missed(_params(_lease(lease)), still_fine="waiting")

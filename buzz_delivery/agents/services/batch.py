"""Batched forms of the run holder's transitions, for the event-loop worker (SPEC 12, 15).

Each function takes many runs of ONE community and sends one statement for all of them (the
``*_MANY_*`` statements of :mod:`~buzz_delivery.agents.services.sql`, in Citus router form), each
row fenced by its own lease exactly as the single form is. It returns one typed outcome per
item, in order: a run the statement did not match is judged on its own as the single form judges
a miss (``missed``, ``budget_or_missed``), so the outcomes are those the single calls would give.

The caller prepares each item first (``prepare_*``: the single form's validation, a
``ValidationError`` keyed by the argument before any SQL), so one bad item never reaches a batch.
Every item of a batch names a different run. A batch the database refuses raises; the caller
then replays its items one at a time with the single forms (``replay_*``), so nothing about one
run keeps the others of its batch from their outcome.

    >>> from buzz_delivery.agents.services import batch  # doctest: +SKIP
    >>> calls = [batch.prepare_call(lease, "search", {"q": "x"}) for lease in leases]  # doctest: +SKIP
    >>> batch.journal_calls(community_id, calls)  # [Journaled(1, 'run:1'), LeaseLost(), ...]  # doctest: +SKIP
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from buzz_delivery.agents.conf import MAX_COST_UNITS, get_settings
from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.agents.services import journal, runs, sql
from buzz_delivery.agents.services.common import (
    in_flight_or_missed,
    json_value,
    lease_params,
    lease_value,
    missed,
    sha256_json,
)
from buzz_delivery.agents.services.types import (
    AgentClaim,
    AgentLease,
    AlreadyRecorded,
    AlreadyTerminal,
    Blocked,
    BudgetExceeded,
    CallsInFlight,
    Finished,
    Journaled,
    LeaseLost,
    Recorded,
    Renewed,
    Unwinding,
)
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import atomic_within_bound, fetch_all, retry_deadlocks, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped

MAX_BATCH = 500

JournalOutcome = Journaled | Blocked | BudgetExceeded | AlreadyTerminal | LeaseLost
RecordOutcome = Recorded | AlreadyRecorded | AlreadyTerminal | LeaseLost
CompleteOutcome = Finished | CallsInFlight | AlreadyTerminal | LeaseLost
FailOutcome = Finished | Unwinding | AlreadyTerminal | LeaseLost


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """A validated ``journal_call`` of one run (``params``: its statement's values)."""

    lease: AgentLease
    params: dict[str, Any]
    raw: tuple[str, Any, int, dict[str, Any] | None, bool]  # for the single form's replay


@dataclass(frozen=True, slots=True)
class PreparedResult:
    """A validated ``record_call_result`` of one run."""

    lease: AgentLease
    params: dict[str, Any]
    raw: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    """A validated ``complete_run`` of one run."""

    lease: AgentLease
    output_text: str
    output_hash: bytes
    raw: Any


def prepare_call(
    lease: AgentLease,
    tool_name: str,
    args: Any,
    *,
    cost: int = 0,
    compensation: dict[str, Any] | None = None,
    destructive: bool = False,
    scope: str = "",
    index: int | None = None,
) -> PreparedCall:
    """Validate one ``journal_call`` as the single form does (``ValidationError`` keyed
    ``lease``, ``tool_name``, ``args``, ``cost``, ``compensation``, ``destructive``, ``scope`` or ``index``)."""
    lease = lease_value(lease)
    if not isinstance(destructive, bool):
        raise v.invalid("destructive", "must be a bool")
    if compensation is not None and not isinstance(compensation, dict):
        raise v.invalid("compensation", "must be a dict or None")
    params = {
        "tool_name": journal._tool_name(tool_name),
        "args": json_value(args, "args", journal.MAX_ARGS_BYTES),
        "input_hash": sha256_json(args),
        "cost": v.int_in_range(cost, "cost", 0, MAX_COST_UNITS),
        "compensation": None if compensation is None else json_value(compensation, "compensation", 100_000),
        "destructive": destructive,
        "entry_id": new_uuid7(),
        **journal.scope_params(scope, index),
    }
    return PreparedCall(lease, params, (tool_name, args, cost, compensation, destructive))


def prepare_result(
    lease: AgentLease,
    seq: int,
    *,
    ok: bool,
    output: Any = None,
    error: str | None = None,
    latency_ms: int | None = None,
    uncertain: bool = False,
) -> PreparedResult:
    """Validate one ``record_call_result`` as the single form does."""
    lease = lease_value(lease)
    if not isinstance(ok, bool):
        raise v.invalid("ok", "must be a bool")
    if uncertain and ok:
        raise v.invalid("uncertain", "only a failed call can be uncertain")
    params = {
        "seq": v.int_in_range(seq, "seq", 1, 10**9),
        "status": "succeeded" if ok else "failed",
        "uncertain": bool(uncertain),
        "output": json_value(output, "output", get_settings().max_output_bytes) if ok else None,
        "output_hash": sha256_json(output) if ok else None,
        "error": v.optional_text(error, "error", 10_000),
        "latency_ms": None if latency_ms is None else v.int_in_range(latency_ms, "latency_ms", 0, 2**31 - 1),
    }
    raw = {"ok": ok, "output": output, "error": error, "latency_ms": latency_ms, "uncertain": uncertain}
    return PreparedResult(lease, params, raw)


def prepare_completion(lease: AgentLease, output: Any) -> PreparedCompletion:
    """Validate one ``complete_run`` as the single form does (``output`` JSON within the cap)."""
    lease = lease_value(lease)
    text = json_value(output, "output", get_settings().max_output_bytes)
    return PreparedCompletion(lease, text, sha256_json(output), output)


@dataclass(frozen=True, slots=True)
class PreparedFailure:
    """A validated ``fail_run`` of one run."""

    lease: AgentLease
    failure_code: str
    failure_message: str | None


def prepare_failure(lease: AgentLease, failure_code: str, failure_message: str | None = None) -> PreparedFailure:
    """Validate one ``fail_run`` as the single form does (``ValidationError`` keyed ``lease``,
    ``failure_code``: 1..64 characters, or ``failure_message``: at most 10,000)."""
    lease = lease_value(lease)
    code = v.optional_text(failure_code, "failure_code", 64)
    if not code or not code.strip():
        raise v.invalid("failure_code", "must be 1..64 characters")
    return PreparedFailure(lease, code, v.optional_text(failure_message, "failure_message", 10_000))


@dataclass(frozen=True, slots=True)
class NotNext:
    """``begin_compensation``'s ``None`` in a batch: the entry is not the next to undo (or is
    done already); the run's fence holds."""


@dataclass(frozen=True, slots=True)
class PreparedCompensation:
    """A validated ``begin_compensation`` (``ok`` None) or ``finish_compensation`` of one run."""

    lease: AgentLease
    seq: int
    ok: bool | None = None
    error: str | None = None


def prepare_compensation_begin(lease: AgentLease, seq: int) -> PreparedCompensation:
    """Validate one ``begin_compensation`` as the single form does (``lease``, ``seq``)."""
    return PreparedCompensation(lease_value(lease), v.int_in_range(seq, "seq", 1, 10**9))


def prepare_compensation_finish(
    lease: AgentLease, seq: int, *, ok: bool, error: str | None = None
) -> PreparedCompensation:
    """Validate one ``finish_compensation`` as the single form does (``ok``, ``seq``, ``error``)."""
    if not isinstance(ok, bool):
        raise v.invalid("ok", "must be a bool")
    lease = lease_value(lease)
    return PreparedCompensation(
        lease, v.int_in_range(seq, "seq", 1, 10**9), ok, v.optional_text(error, "error", 10_000)
    )


def _transaction(needed: bool) -> AbstractContextManager[Any]:
    """A transaction when a batch writes in more than one statement; else nothing: the batch's
    one write (every row fenced by its own lease, a workflow step's count by its trigger) is
    atomic by itself in autocommit, and saves the BEGIN and COMMIT round trips (SPEC 15: one
    fenced statement per transition). Inside a caller's transaction it is that transaction."""
    return atomic_within_bound() if needed else nullcontext()


def _common(community_id: Any, leases: Sequence[AgentLease]) -> dict[str, Any]:
    community = v.uuid_value(community_id, "community_id")
    if len(leases) > MAX_BATCH:
        raise v.invalid("items", f"at most {MAX_BATCH} runs a batch")
    workers = {lease.worker_id for lease in leases}
    if len(workers) > 1:
        raise v.invalid("items", "every lease of a batch must be held by one worker")
    if any(lease.community_id != community for lease in leases):
        raise v.invalid("items", "a lease of another community")
    if len({lease.run_id for lease in leases}) != len(leases):
        raise v.invalid("items", "the same run twice")
    return {
        "community_id": community,
        "worker_id": next(iter(workers), ""),
        "run_ids": [lease.run_id for lease in leases],
        "generations": [lease.lease_generation for lease in leases],
    }


@tenant_scoped
def heartbeat_runs(
    community_id: uuid.UUID | str, leases: Sequence[AgentLease], lease_seconds: float | None = None
) -> list[Renewed | AlreadyTerminal | LeaseLost]:
    """:func:`~buzz_delivery.agents.services.heartbeat` of many runs of one community, one
    statement; one outcome per lease, in order."""
    leases = [lease_value(lease) for lease in leases]
    params = _common(community_id, leases)
    params["lease_seconds"] = v.lease_seconds(get_settings().lease_seconds if lease_seconds is None else lease_seconds)
    if not leases:
        return []
    with translated_errors():
        renewed = {row[0]: row[1] for row in fetch_all(sql.HEARTBEAT_MANY_IF_CURRENT, params)}
        out: list[Renewed | AlreadyTerminal | LeaseLost] = []
        for lease in leases:
            until = renewed.get(lease.run_id)
            if until is not None:
                out.append(
                    Renewed(
                        AgentLease(lease.community_id, lease.run_id, lease.lease_generation, until, lease.worker_id)
                    )
                )
            else:
                out.append(missed(lease_params(lease)))
    return out


@tenant_scoped
def journal_calls(community_id: uuid.UUID | str, calls: Sequence[PreparedCall]) -> list[JournalOutcome]:
    """:func:`~buzz_delivery.agents.services.journal_call` of many runs of one community (one
    prepared call each), in one transaction: one statement spends each run's slot within its
    budgets and journals its entry ``pending``. A shadow run's destructive call is journaled by
    the single form (``Blocked``). One outcome per call, in order."""
    params = _common(community_id, [c.lease for c in calls])
    blocked_ones = [c for c in calls if c.params["destructive"]]
    batched = [c for c in calls if not c.params["destructive"]]
    params.update(
        run_ids=[c.lease.run_id for c in batched],
        generations=[c.lease.lease_generation for c in batched],
        entry_ids=[c.params["entry_id"] for c in batched],
        tool_names=[c.params["tool_name"] for c in batched],
        input_hashes=[c.params["input_hash"] for c in batched],
        args=[c.params["args"] for c in batched],
        costs=[c.params["cost"] for c in batched],
        destructives=[False for _ in batched],
        compensations=[c.params["compensation"] for c in batched],
        scopes=[c.params["scope"] for c in batched],
        scope_indexes=[c.params["scope_index"] for c in batched],
    )
    outcomes: dict[uuid.UUID, JournalOutcome] = {}
    # One transaction for the whole batch (the single forms' savepoints inside it): a batch
    # that raises wrote nothing, so its replay one call at a time journals each call once. Not
    # autocommit even with one write: the reads that judge the runs it missed come after it, and
    # one of them failing would leave the write committed under a batch that raised, whose
    # replay would journal those calls (and spend their budgets) a second time.
    with atomic_within_bound(), translated_errors():
        for c in blocked_ones:  # destructive: the single form decides shadow blocking
            outcomes[c.lease.run_id] = replay_call(c)
        if batched:
            rows = fetch_all(sql.JOURNAL_MANY_IF_CURRENT_AND_WITHIN_BUDGET, params)
            for run_id, seq, key in rows:
                outcomes[run_id] = Journaled(seq, key)
            for c in batched:
                if c.lease.run_id not in outcomes:
                    outcomes[c.lease.run_id] = journal.budget_or_missed(lease_params(c.lease, cost=c.params["cost"]))
    return [outcomes[c.lease.run_id] for c in calls]


def replay_call(call: PreparedCall) -> JournalOutcome:
    """The single form of one prepared call."""
    tool_name, args, cost, compensation, destructive = call.raw
    return journal.journal_call(
        call.lease,
        tool_name,
        args,
        cost=cost,
        compensation=compensation,
        destructive=destructive,
        scope=call.params["scope"],
        index=call.params["scope_index"],
    )


@tenant_scoped
def record_results(community_id: uuid.UUID | str, results: Sequence[PreparedResult]) -> list[RecordOutcome]:
    """:func:`~buzz_delivery.agents.services.record_call_result` of many runs of one community
    (one pending entry each), in one transaction and one statement. One outcome per result."""
    params = _common(community_id, [r.lease for r in results])
    params.update(
        seqs=[r.params["seq"] for r in results],
        statuses=[r.params["status"] for r in results],
        uncertains=[r.params["uncertain"] for r in results],
        outputs=[r.params["output"] for r in results],
        output_hashes=[r.params["output_hash"] for r in results],
        errors=[r.params["error"] for r in results],
        latencies=[r.params["latency_ms"] for r in results],
        keys=[journal.idempotency_key(r.lease.run_id, r.params["seq"]) for r in results],
    )
    if not results:
        return []
    out: list[RecordOutcome] = []
    with _transaction(False), translated_errors():  # one statement writes; the rest reads
        done = {row[0]: row[1] for row in fetch_all(sql.RECORD_MANY_IF_CURRENT, params)}
        for r in results:
            status = done.get(r.lease.run_id)
            if status is not None:
                out.append(Recorded(status))
                continue
            one = lease_params(r.lease, seq=r.params["seq"])
            outcome = missed(one)
            if isinstance(outcome, LeaseLost) and journal._fence_holds(one):
                entry = fetch_all(sql.ENTRY_STATUS, one)
                if entry:
                    out.append(AlreadyRecorded(entry[0][0]))
                    continue
            out.append(outcome)
    return out


def replay_result(result: PreparedResult) -> RecordOutcome:
    """The single form of one prepared result."""
    return journal.record_call_result(result.lease, result.params["seq"], **result.raw)


@tenant_scoped
def complete_runs(community_id: uuid.UUID | str, completions: Sequence[PreparedCompletion]) -> list[CompleteOutcome]:
    """:func:`~buzz_delivery.agents.services.complete_run` of many runs of one community, in
    one transaction and one statement (a workflow step awaiting a run counts it in the same
    transaction, per row, as for the single form). One outcome per completion, in order: a run
    with the holder's own calls in flight is that row's :class:`CallsInFlight` (nothing written
    for it, the others unaffected), as the single form answers."""
    params = _common(community_id, [c.lease for c in completions])
    params.update(outputs=[c.output_text for c in completions], output_hashes=[c.output_hash for c in completions])
    if not completions:
        return []
    # One statement writes; the rest reads. A call journaled meanwhile sets its run 'waiting_tool'
    # with its entry, and the statement's lock of that row re-checks state = 'running' on the new
    # version (as complete_run): no lock statement of its own first. Its runs' workflow runs'
    # core rows come first in the statement, in run id order (sql.SOURCES: a multi-run settle's order).
    with _transaction(False), translated_errors():
        done = {row[0] for row in fetch_all(sql.COMPLETE_MANY_IF_CURRENT, params)}
        return [
            Finished("completed") if c.lease.run_id in done else in_flight_or_missed(lease_params(c.lease))
            for c in completions
        ]


def replay_completion(completion: PreparedCompletion) -> CompleteOutcome:
    """The single form of one prepared completion."""
    return runs.complete_run(completion.lease, completion.raw)


@retry_deadlocks
@tenant_scoped
def fail_runs(community_id: uuid.UUID | str, failures: Sequence[PreparedFailure]) -> list[FailOutcome]:
    """:func:`~buzz_delivery.agents.services.fail_run` of many runs of one community, in one
    transaction and one statement (``FAIL_MANY_IF_CURRENT``: each run fenced by its own lease,
    its pending calls closed failed and uncertain, then ended or marked unwinding with its own
    failure code and message, as the single form does). One outcome per failure, in order:
    :class:`Finished` (``failed``, or ``cancelled``/``timeout`` for a run that unwound for that),
    :class:`Unwinding` with its entries to compensate, highest ``seq`` first (one read for every
    unwinding run of the batch), or, for a run the statement did not match, what the single form
    answers (``AlreadyTerminal``, ``LeaseLost``)."""
    params = _common(community_id, [f.lease for f in failures])
    params.update(
        failure_codes=[f.failure_code for f in failures], failure_messages=[f.failure_message for f in failures]
    )
    if not failures:
        return []
    # One transaction: the reads after the statement (the seqs to undo, the runs it missed) see
    # its writes, and a batch that raises wrote nothing (its replay fails each run once).
    with atomic_within_bound(), translated_errors():
        # The runs' rows first, in id order, in a statement of their own (as fail_run does): the
        # judging statement then reads a snapshot that holds every call journaled before it. Their
        # workflow runs' core rows before them, in run id order (sql.SOURCES: a multi-run settle's).
        fetch_all(sql.LOCK_RUNS, params)
        done = {row[0]: row[1] for row in fetch_all(sql.FAIL_MANY_IF_CURRENT, params)}
        unwinding = [run_id for run_id, state in done.items() if state == "unwinding"]
        seqs: dict[uuid.UUID, list[int]] = {run_id: [] for run_id in unwinding}
        if unwinding:
            for run_id, seq in fetch_all(sql.OUTSTANDING_SEQS_MANY, {**params, "run_ids": unwinding}):
                seqs[run_id].append(seq)
        out: list[FailOutcome] = []
        for f in failures:
            state = done.get(f.lease.run_id)
            if state is None:
                out.append(missed(lease_params(f.lease)))
            elif state == "unwinding":
                out.append(Unwinding(tuple(seqs[f.lease.run_id])))
            else:
                out.append(Finished(state))
    return out


def replay_failure(failure: PreparedFailure) -> FailOutcome:
    """The single form of one prepared failure."""
    return runs.fail_run(failure.lease, failure.failure_code, failure.failure_message)


BeginOutcome = dict[str, Any] | NotNext | AlreadyTerminal | LeaseLost


@tenant_scoped
def begin_compensations(community_id: uuid.UUID | str, items: Sequence[PreparedCompensation]) -> list[BeginOutcome]:
    """:func:`~buzz_delivery.agents.services.begin_compensation` of many unwinding runs of one
    community (one entry each), in one transaction and one statement, each run fenced by its own
    lease and each entry begun only if it is its run's next to undo. One outcome per item, in
    order: the entry's ``{"compensation", "args", "output", "key"}``, :class:`NotNext` (the single
    form's None), ``AlreadyTerminal`` or ``LeaseLost``."""
    params = _common(community_id, [i.lease for i in items])
    params["seqs"] = [i.seq for i in items]
    if not items:
        return []
    with atomic_within_bound(), translated_errors():
        begun = {row[0]: row[1:] for row in fetch_all(sql.BEGIN_COMPENSATIONS_IF_CURRENT_AND_LAST, params)}
        out: list[BeginOutcome] = []
        for i in items:
            row = begun.get(i.lease.run_id)
            if row is not None:
                compensation, args, output = row
                out.append(
                    {
                        "compensation": journal._loaded(compensation),
                        "args": journal._loaded(args),
                        "output": journal._loaded(output),
                        "key": journal.compensation_key(i.lease.run_id, i.seq),
                    }
                )
                continue
            one = lease_params(i.lease, seq=i.seq)
            out.append(NotNext() if journal._fence_holds(one) else missed(one))
    return out


def replay_compensation_begin(item: PreparedCompensation) -> BeginOutcome:
    """The single form of one prepared begin (its None as :class:`NotNext`)."""
    outcome = journal.begin_compensation(item.lease, item.seq)
    return NotNext() if outcome is None else outcome


@tenant_scoped
def finish_compensations(community_id: uuid.UUID | str, items: Sequence[PreparedCompensation]) -> list[RecordOutcome]:
    """:func:`~buzz_delivery.agents.services.finish_compensation` of many unwinding runs of one
    community (one entry each), in one transaction and one statement, each run fenced by its own
    lease. One outcome per item, in order: ``Recorded``, ``AlreadyRecorded`` (the fence holds and
    the entry is no longer ``compensating``), ``AlreadyTerminal`` or ``LeaseLost``."""
    params = _common(community_id, [i.lease for i in items])
    params.update(
        seqs=[i.seq for i in items],
        compensation_statuses=["compensated" if i.ok else "compensation_failed" for i in items],
        errors=[i.error for i in items],
    )
    if not items:
        return []
    with atomic_within_bound(), translated_errors():
        done = {row[0]: row[1] for row in fetch_all(sql.FINISH_COMPENSATIONS_IF_CURRENT, params)}
        out: list[RecordOutcome] = []
        for i in items:
            status = done.get(i.lease.run_id)
            if status is not None:
                out.append(Recorded(status))
                continue
            one = lease_params(i.lease, seq=i.seq)
            if journal._fence_holds(one):
                entry = fetch_all(sql.ENTRY_STATUS, one)
                out.append(AlreadyRecorded(entry[0][1] if entry else "unknown"))
            else:
                out.append(missed(one))
    return out


def replay_compensation_finish(item: PreparedCompensation) -> RecordOutcome:
    """The single form of one prepared finish."""
    assert item.ok is not None, "a finish is prepared with ok"
    return journal.finish_compensation(item.lease, item.seq, ok=item.ok, error=item.error)


@tenant_scoped
def journals_of(community_id: uuid.UUID | str, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, list[JournalEntry]]:
    """The journal entries of ``run_ids`` (one community), one query: what resuming runs replay."""
    community = v.uuid_value(community_id, "community_id")
    out: dict[uuid.UUID, list[JournalEntry]] = {run_id: [] for run_id in run_ids}
    if run_ids:
        for entry in JournalEntry.objects.filter(community_id=community, run_id__in=list(run_ids)):
            out[entry.run_id].append(entry)
    return out


def resumed(claim: AgentClaim) -> bool:
    """Whether a claimed run may have a journal to replay (it has used calls, or is unwinding):
    a run that has neither has an empty journal, and no read."""
    return bool(claim.run.tool_calls_used or claim.run.unwinding)

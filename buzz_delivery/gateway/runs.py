"""The gateway's agent-run endpoints (SPEC sections 12 and 14): thin views over
:mod:`buzz_delivery.agents.services`, mounted only when ``buzz_delivery.agents`` is installed.

Same checks, in the same order, as the delivery endpoints (:func:`~buzz_delivery.gateway.views.endpoint`):
405, 413, NIP-98 (401), fields (400), then enrollment (403) and scope (404: a run of another key
looks exactly like a missing one, checked before any service is called: a run's
``agent_pubkey`` never changes), then the service's typed outcome: a lost lease is 409
``lease_lost`` (``reason: "cancelled"`` when a cancel fenced the holder); every other outcome is
a 200 naming it (``already_terminal``, ``budget_exceeded``, ``unwinding``...). The signer's key is
the only agent a claim serves. The holder's ``worker_id`` is part of the run lease (the fence);
a request that leaves it null uses ``gateway:<first 16 hex digits of the key>``.
"""

from __future__ import annotations

import random
import time
import uuid
from contextlib import nullcontext
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from buzz_delivery.agents import services as agents
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import batch
from buzz_delivery.gateway import limits, present, schema
from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.conf import get_settings
from buzz_delivery.gateway.errors import GatewayError, bad_request
from buzz_delivery.gateway.schema import (
    ACCEPT,
    APPROVAL,
    BATCH_CALLS,
    BATCH_COMPENSATION_BEGIN,
    BATCH_COMPENSATION_FINISH,
    BATCH_COMPLETE,
    BATCH_FAIL,
    BATCH_HEARTBEAT,
    BATCH_RESULTS,
    BATCH_STEPS,
    CALL,
    COMPENSATION_BEGIN,
    COMPENSATION_FINISH,
    COMPLETE,
    FAIL,
    HEARTBEAT,
    RESULT,
    RUN_CLAIM,
    RUN_EMIT,
    RUN_OUTPUT,
)
from buzz_delivery.gateway.views import (
    _communities,
    _field_of,
    _lease,
    _lost_or_not_found,
    _require_enrolled,
    endpoint,
    parse_uuid,
)
from buzz_delivery.gateway.wake import hub
from buzz_delivery.services import AlreadyTerminal, LeaseLost


def worker_of(pubkey: bytes, worker_id: str | None) -> str:
    """The holder name of a request: its ``worker_id``, or ``gateway:<16 hex of the key>`` when
    null; a blank one is a 400 naming ``worker_id``."""
    if worker_id is None:
        return f"gateway:{pubkey.hex()[:16]}"
    if not worker_id.strip() or "\x00" in worker_id:
        raise bad_request("worker_id", "must name the holder (1..200 characters, not blank)")
    return worker_id


def _run_not_found() -> GatewayError:
    return GatewayError("not_found", "no such agent run for this key in that community")


def _own_run(community_id: uuid.UUID, run_id: uuid.UUID, pubkey: bytes, request: HttpRequest) -> AgentRun:
    """The signer's run, after the enrollment check (403: as the request's admission read it),
    or 404."""
    _require_enrolled(community_id, pubkey, request)
    run = agents.get_agent_run(community_id, run_id)
    if run is None or bytes(run.agent_pubkey) != pubkey:
        raise _run_not_found()
    return run


def _require_own_run(community_id: uuid.UUID, run_id: uuid.UUID, pubkey: bytes, request: HttpRequest) -> None:
    """As :func:`_own_run` with one narrow read (every holder request pays it)."""
    _require_enrolled(community_id, pubkey, request)
    if agents.get_run_agent(community_id, run_id) != pubkey:
        raise _run_not_found()


def _run_lease(
    request: HttpRequest, community_id: uuid.UUID, run_id: uuid.UUID, pubkey: bytes, data: dict[str, Any]
) -> agents.AgentLease:
    worker = worker_of(pubkey, data["worker_id"])
    _require_own_run(community_id, run_id, pubkey, request)
    # lease_until is informational (the database judges expiry by its own clock).
    return agents.AgentLease(community_id, run_id, data["lease_generation"], timezone.now(), worker)


def _common(outcome: Any) -> JsonResponse:
    """The outcomes every holder transition shares: ``already_terminal`` (200) and 409."""
    if isinstance(outcome, AlreadyTerminal):
        return JsonResponse({"outcome": "already_terminal", "state": outcome.status})
    assert isinstance(outcome, LeaseLost), outcome
    raise GatewayError(
        "lease_lost", "the run's lease is no longer current: drop the work", outcome="lease_lost", reason=outcome.reason
    )


def _budget(outcome: agents.BudgetExceeded) -> JsonResponse:
    return JsonResponse(
        {"outcome": "budget_exceeded", "budget": outcome.budget, "used": outcome.used, "cap": outcome.cap}
    )


@endpoint("POST", ACCEPT)
def accept(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, delivery_id: uuid.UUID):
    """Settle a held delivery ``finished`` and create its agent run in one transaction
    (``agents.services.accept_delivery``). 200 ``{"outcome": "accepted", "run_id"}``, or 200
    ``{"outcome": "already_terminal", "status"}`` (the delivery was settled before), or 200
    ``{"outcome": "run_ended", "workflow_state"}`` (its workflow run was canceled or ended while it was
    held: the delivery settled ``failed``, no run created); 403; 404 no such delivery for this
    key; 409 lease lost."""
    _require_enrolled(community_id, pubkey, request)
    lease = _lease(community_id, delivery_id, pubkey, data["lease_generation"])
    outcome = agents.accept_delivery(
        lease,
        input=data["input"],
        shadow=data["shadow"],
        max_tool_calls=data["max_tool_calls"],
        max_cost=data["max_cost"],
        max_attempts=data["max_attempts"],
        timeout_seconds=data["timeout_seconds"],
    )
    if isinstance(outcome, agents.Accepted):
        return JsonResponse({"outcome": "accepted", "run_id": str(outcome.run_id)})
    if isinstance(outcome, agents.RunEnded):  # the delivery settled failed: no run was created
        return JsonResponse({"outcome": "run_ended", "workflow_state": outcome.state})
    if isinstance(outcome, AlreadyTerminal):
        return JsonResponse({"outcome": "already_terminal", "status": outcome.status})
    raise _lost_or_not_found(community_id, delivery_id, pubkey)


def _claim_round(communities: list[uuid.UUID], pubkey: bytes, worker: str, data: dict[str, Any]) -> list[Any]:
    order = list(communities)
    random.shuffle(order)
    claims: list[agents.AgentClaim] = []
    for community in order:
        claims += agents.claim_agent_runs(
            community,
            [pubkey],
            worker_id=worker,
            limit=data["limit"] - len(claims),
            lease_seconds=data["lease_seconds"],
        )
        if len(claims) >= data["limit"]:
            break
    return claims


@endpoint("POST", RUN_CLAIM)
def claim(request: HttpRequest, pubkey: bytes, data: dict[str, Any]) -> JsonResponse:
    """Claim up to ``limit`` pending runs of the signer across every active community it is
    enrolled in (``agents.services.claim_agent_runs``, one statement per community, a random
    community first); with ``wait_seconds`` > 0, long-poll until one is claimable (woken by the
    ``buzz_agents`` hints of those communities, polling every ``POLL_SECONDS``) or the wait
    ends. 200 ``{"claims": [{"run", "lease"}]}`` (possibly empty); 403 when enrolled nowhere."""
    worker = worker_of(pubkey, data["worker_id"])
    communities = _communities(request, pubkey)
    if not communities:
        raise GatewayError("not_enrolled", "this key is not enrolled in any active community")
    wait = float(data["wait_seconds"])
    if wait <= 0:
        claims = _claim_round(communities, pubkey, worker, data)
    else:
        deadline = time.monotonic() + wait
        poll = get_settings().poll_seconds
        # Registered before the first claim: a run committed between an empty claim and the
        # sleep still sets the event, so the sleep ends at once.
        with limits.long_poll(pubkey, communities), hub.waiter(*(f"runs:{c}" for c in communities)) as woken:
            claims = _claim_round(communities, pubkey, worker, data)
            while not claims:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                woken.wait(min(poll, remaining))
                woken.clear()
                communities = [c for c in gateway.enrolled_communities(pubkey) if c in communities]
                if not communities:
                    break
                claims = _claim_round(communities, pubkey, worker, data)
    return JsonResponse(
        {"claims": [{"run": present.run_of(c.run), "lease": present.run_lease_of(c.lease)} for c in claims]}
    )


@endpoint("GET")
def read(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """One of the signer's runs with its journal in ``seq`` order (what a resumed handler
    replays). 200 ``{"run", "journal"}``; 403; 404."""
    run = _own_run(community_id, run_id, pubkey, request)
    journal = agents.get_journal(community_id, run_id)
    return JsonResponse({"run": present.run_of(run), "journal": [present.journal_entry_of(e) for e in journal]})


@endpoint("POST", HEARTBEAT)
def heartbeat(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Renew the run lease (``agents.services.heartbeat``). 200 ``{"outcome": "renewed",
    "lease"}`` / ``already_terminal``; 409 lease lost (``reason: "cancelled"`` after a cancel)."""
    outcome = agents.heartbeat(_run_lease(request, community_id, run_id, pubkey, data), data["lease_seconds"])
    if isinstance(outcome, agents.Renewed):
        return JsonResponse({"outcome": "renewed", "lease": present.run_lease_of(outcome.lease)})
    return _common(outcome)


@endpoint("POST", CALL)
def call(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Journal a tool call before making it (``agents.services.journal_call``). 200
    ``{"outcome": "journaled", "seq", "idempotency_key"}``, ``{"outcome": "blocked", "seq",
    "reason"}`` (shadow mode: do not make it), ``{"outcome": "budget_exceeded", "budget", "used",
    "cap"}`` (nothing journaled) or ``already_terminal``; 409 lease lost."""
    lease = _run_lease(request, community_id, run_id, pubkey, data)
    outcome = agents.journal_call(
        lease,
        data["tool_name"],
        data["args"],
        cost=data["cost"],
        compensation=data["compensation"],
        destructive=data["destructive"],
        scope=data["scope"],
        index=data["index"],
    )
    if isinstance(outcome, agents.Journaled):
        return JsonResponse({"outcome": "journaled", "seq": outcome.seq, "idempotency_key": outcome.idempotency_key})
    if isinstance(outcome, agents.Blocked):
        return JsonResponse({"outcome": "blocked", "seq": outcome.seq, "reason": outcome.reason})
    if isinstance(outcome, agents.BudgetExceeded):
        return _budget(outcome)
    return _common(outcome)


def _recorded(outcome: Any) -> JsonResponse:
    if isinstance(outcome, agents.Recorded):
        return JsonResponse({"outcome": "recorded", "status": outcome.status})
    if isinstance(outcome, agents.AlreadyRecorded):
        return JsonResponse({"outcome": "already_recorded", "status": outcome.status})
    return _common(outcome)


@endpoint("POST", RESULT)
def result(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Record a journaled call's result (``agents.services.record_call_result``). 200
    ``{"outcome": "recorded" | "already_recorded", "status"}`` (a retry gets the first answer) or
    ``already_terminal``; 409 lease lost."""
    lease = _run_lease(request, community_id, run_id, pubkey, data)
    outcome = agents.record_call_result(
        lease,
        data["seq"],
        ok=data["ok"],
        output=data["output"],
        error=data["error"],
        latency_ms=data["latency_ms"],
        uncertain=data["uncertain"],
    )
    return _recorded(outcome)


@endpoint("POST", APPROVAL)
def approval(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Park the run on an engine approval (``agents.services.request_approval``): the lease is
    released. 200 ``{"outcome": "approval_requested", "approval_id", "seq"}``,
    ``{"outcome": "calls_in_flight", "seqs"}`` (the holder's own calls ``seqs`` are journaled and
    not yet recorded: nothing written, the lease holds, ask again once they are recorded),
    ``budget_exceeded`` or ``already_terminal``; 409 lease lost. Once decided, claim the run
    again: its journal entry ``seq`` holds the decision."""
    lease = _run_lease(request, community_id, run_id, pubkey, data)
    outcome = agents.request_approval(
        lease,
        prompt=data["prompt"],
        deadline_seconds=data["deadline_seconds"],
        scope=data["scope"],
        index=data["index"],
    )
    if isinstance(outcome, agents.ApprovalRequested):
        return JsonResponse(
            {"outcome": "approval_requested", "approval_id": str(outcome.approval_id), "seq": outcome.seq}
        )
    if isinstance(outcome, agents.CallsInFlight):
        return JsonResponse({"outcome": "calls_in_flight", "seqs": list(outcome.seqs)})
    if isinstance(outcome, agents.BudgetExceeded):
        return _budget(outcome)
    return _common(outcome)


@endpoint("POST", COMPLETE)
def complete(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """End the run ``completed`` with ``output`` (``agents.services.complete_run``). 200
    ``{"outcome": "finished", "state": "completed"}``, ``{"outcome": "calls_in_flight", "seqs"}``
    (the holder's own calls ``seqs`` are journaled under its lease and not yet recorded: nothing
    written, the lease holds, complete again once they are recorded) or ``already_terminal`` (the
    holder's retry); 409 lease lost (also while the run is unwinding)."""
    outcome = agents.complete_run(_run_lease(request, community_id, run_id, pubkey, data), data["output"])
    if isinstance(outcome, agents.Finished):
        return JsonResponse({"outcome": "finished", "state": outcome.state})
    if isinstance(outcome, agents.CallsInFlight):
        return JsonResponse({"outcome": "calls_in_flight", "seqs": list(outcome.seqs)})
    return _common(outcome)


class _Kind:
    """One kind of batched step: how an item is prepared (before any SQL), sent (one fenced
    statement for all), replayed one run at a time (when the database refuses the statement)
    and answered."""

    __slots__ = ("prepare", "present_one", "replay", "send", "send_in_savepoint")

    def __init__(self, prepare: Any, send: Any, replay: Any, present_one: Any, send_in_savepoint: bool = True) -> None:
        self.prepare, self.send, self.replay = prepare, send, replay
        self.present_one, self.send_in_savepoint = present_one, send_in_savepoint


def _prepare_items(
    kind: _Kind, items: list[dict[str, Any]], name: str, community_id: uuid.UUID, worker: str, seen: set[uuid.UUID]
) -> list[Any]:
    """Each item of list ``name`` checked and prepared, before any SQL: a bad one is a 400
    naming it (``runs[2].output``); a run already in ``seen`` (this request) too."""
    prepared = []
    for i, item in enumerate(items):
        run_id = parse_uuid(f"{name}[{i}].run_id", item["run_id"])
        if run_id in seen:
            raise bad_request(f"{name}[{i}].run_id", "appears twice in the batch")
        seen.add(run_id)
        lease = agents.AgentLease(community_id, run_id, item["lease_generation"], timezone.now(), worker)
        try:
            prepared.append(kind.prepare(lease, item))
        except ValidationError as exc:
            raise bad_request(f"{name}[{i}].{_field_of(exc)}", "; ".join(exc.messages)) from None
    return prepared


def _own(request: HttpRequest, community_id: uuid.UUID, pubkey: bytes, prepared: list[Any]) -> set[uuid.UUID]:
    """The runs of ``prepared`` that are the signer's (one read with the enrollment check: 403;
    the community must be among those the request's admission read: enrolled when it signed)."""
    _require_enrolled(community_id, pubkey, request)
    own = gateway.own_runs_if_enrolled(community_id, pubkey, [p.lease.run_id for p in prepared])
    if own is None:
        raise GatewayError("not_enrolled", "this key is not enrolled in that community")
    return own


def _execute(kind: _Kind, community_id: uuid.UUID, prepared: list[Any], own: set[uuid.UUID]) -> list[dict[str, Any]]:
    """ONE statement for the signer's items of ``prepared``, each row fenced by its own lease
    generation; one answer per item in order (``not_found`` for a run not the signer's). A
    statement the database refuses wrote nothing; its items are then sent one at a time."""
    mine = [p for p in prepared if p.lease.run_id in own]
    try:
        # Inside the request's transaction (one_transaction) a savepoint, unless ``send`` makes
        # its own: a batch the database refuses then leaves it usable for the one-run forms.
        # None for a kind with nothing to send (a steps request's empty kinds): two round trips
        # to the database for nothing, in the request's chain.
        saved = mine and kind.send_in_savepoint and connection.in_atomic_block
        with transaction.atomic() if saved else nullcontext():
            outcomes = kind.send(community_id, mine) if mine else []
    except DatabaseError:
        outcomes = [kind.replay(p) for p in mine]
    by_run = {p.lease.run_id: o for p, o in zip(mine, outcomes, strict=True)}
    results = []
    for p in prepared:
        row: dict[str, Any] = {"run_id": str(p.lease.run_id)}
        outcome = by_run.get(p.lease.run_id)
        if outcome is None:
            row["outcome"] = "not_found"
        elif isinstance(outcome, AlreadyTerminal):
            row.update(outcome="already_terminal", state=outcome.status)
        elif isinstance(outcome, LeaseLost):
            row.update(outcome="lease_lost", reason=outcome.reason)
        else:
            row.update(kind.present_one(outcome))
        results.append(row)
    return results


def _batch(
    request: HttpRequest,
    pubkey: bytes,
    data: dict[str, Any],
    community_id: uuid.UUID,
    prepare: Any,
    send: Any,
    replay: Any,
    present_one: Any,
    send_in_savepoint: bool = True,
) -> JsonResponse:
    """The shape of every batch endpoint: each item checked and prepared before any SQL (a bad
    one is a 400 naming it, ``runs[2].output``, and nothing is written), the scope of all its
    runs read at once (a run of another key is ``not_found``, as a missing one), then ONE
    statement for the batch, each row fenced by its own lease generation. A batch the database
    refuses wrote nothing; its items are then sent one at a time with the single forms."""
    kind = _Kind(prepare, send, replay, present_one, send_in_savepoint)
    prepared = _prepare_items(kind, data["runs"], "runs", community_id, worker_of(pubkey, data["worker_id"]), set())
    own = _own(request, community_id, pubkey, prepared)
    return JsonResponse({"results": _execute(kind, community_id, prepared, own)})


def _finished(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, agents.CallsInFlight):
        return {"outcome": "calls_in_flight", "seqs": list(outcome.seqs)}
    return {"outcome": "finished", "state": outcome.state}


@endpoint("POST", BATCH_COMPLETE, one_transaction=True)
def complete_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """End many of the signer's runs in one community ``completed``, each under its own lease
    (``agents.services.batch.complete_runs``: one fenced statement). 200 ``{"results":
    [{"run_id", "outcome", ...}]}`` in request order, each outcome what the one-run complete
    answers: ``finished`` (``state``), ``calls_in_flight`` (``seqs``: that run's own calls not
    yet recorded, nothing written for it), ``already_terminal``, ``lease_lost`` (``reason``:
    ``cancelled`` after a cancel) or ``not_found`` (no such run for this key); 400 naming the bad
    item (nothing written); 403 not enrolled there."""
    return _batch_of(request, _COMPLETE, pubkey, data, community_id)


def _journaled(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, agents.Journaled):
        return {"outcome": "journaled", "seq": outcome.seq, "idempotency_key": outcome.idempotency_key}
    if isinstance(outcome, agents.Blocked):
        return {"outcome": "blocked", "seq": outcome.seq, "reason": outcome.reason}
    return {"outcome": "budget_exceeded", "budget": outcome.budget, "used": outcome.used, "cap": outcome.cap}


@endpoint("POST", BATCH_CALLS, one_transaction=True)
def call_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Journal one tool call for each of many runs in one community before making them
    (``agents.services.batch.journal_calls``: one fenced statement within each run's budgets).
    200 ``{"results": [...]}`` in request order, each what the one-run ``calls`` answers
    (``journaled``, ``blocked``, ``budget_exceeded``, ``already_terminal``, ``lease_lost``) or
    ``not_found``; 400 naming the bad item (nothing written); 403."""

    return _batch_of(request, _CALLS, pubkey, data, community_id)


def _recorded_row(outcome: Any) -> dict[str, Any]:
    kind = "recorded" if isinstance(outcome, agents.Recorded) else "already_recorded"
    return {"outcome": kind, "status": outcome.status}


@endpoint("POST", BATCH_HEARTBEAT)
def heartbeat_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Renew many run leases of one community (``agents.services.batch.heartbeat_runs``: one
    fenced statement, each row judged by its own generation). 200 ``{"results": [...]}`` in
    request order: ``{"outcome": "renewed", "lease"}``, ``already_terminal``, ``lease_lost``
    (``reason: "cancelled"`` after a cancel) or ``not_found``; 400 naming the bad item; 403."""
    seconds = data["lease_seconds"]

    def send(community: uuid.UUID, leases: list[agents.AgentLease]) -> list[Any]:
        return batch.heartbeat_runs(community, leases, seconds)

    def renewed(outcome: Any) -> dict[str, Any]:
        return {"outcome": "renewed", "lease": present.run_lease_of(outcome.lease)}

    return _batch(
        request,
        pubkey, data, community_id, lambda lease, item: _Held(lease), lambda c, held: send(c, [h.lease for h in held]),
        lambda held: agents.heartbeat(held.lease, seconds), renewed,
    )  # fmt: skip


class _Held:
    """A lease to renew, shaped like the prepared items of the other batches (``.lease``)."""

    __slots__ = ("lease",)

    def __init__(self, lease: agents.AgentLease) -> None:
        self.lease = lease


@endpoint("POST", BATCH_RESULTS, one_transaction=True)
def result_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Record one journaled call's result for each of many runs in one community
    (``agents.services.batch.record_results``: one fenced statement). 200 ``{"results": [...]}``
    in request order, each what the one-run ``results`` answers (``recorded`` /
    ``already_recorded`` with the status, ``already_terminal``, ``lease_lost``) or ``not_found``;
    400 naming the bad item (nothing written); 403."""

    return _batch_of(request, _RESULTS, pubkey, data, community_id)


def _prepare_call(lease: agents.AgentLease, item: dict[str, Any]) -> batch.PreparedCall:
    return batch.prepare_call(
        lease, item["tool_name"], item["args"], cost=item["cost"], compensation=item["compensation"],
        destructive=item["destructive"], scope=item["scope"], index=item["index"],
    )  # fmt: skip


def _prepare_result(lease: agents.AgentLease, item: dict[str, Any]) -> batch.PreparedResult:
    return batch.prepare_result(
        lease, item["seq"], ok=item["ok"], output=item["output"], error=item["error"],
        latency_ms=item["latency_ms"], uncertain=item["uncertain"],
    )  # fmt: skip


_COMPLETE = _Kind(
    lambda lease, item: batch.prepare_completion(lease, item["output"]),
    batch.complete_runs, batch.replay_completion, _finished,
)  # fmt: skip
# journal_calls runs in a transaction (a savepoint in the request's) of its own.
_CALLS = _Kind(_prepare_call, batch.journal_calls, batch.replay_call, _journaled, send_in_savepoint=False)
_RESULTS = _Kind(_prepare_result, batch.record_results, batch.replay_result, _recorded_row)
# The kinds a steps request takes, in the order it applies them: a result recorded before the
# next call is journaled, both before a run completes.
STEP_KINDS = (("results", _RESULTS), ("calls", _CALLS), ("complete", _COMPLETE))


def _batch_of(
    request: HttpRequest, kind: _Kind, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID
) -> JsonResponse:
    return _batch(
        request,
        pubkey,
        data,
        community_id,
        kind.prepare,
        kind.send,
        kind.replay,
        kind.present_one,
        kind.send_in_savepoint,
    )


@endpoint("POST", BATCH_STEPS, one_transaction=True)
def steps_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """The steps of many runs of one community, of mixed kinds, in one request and one
    transaction (issue 29: runs of one worker drift to different steps): ``results``, ``calls``
    and ``complete``, each list exactly the items of that kind's batch route, applied in that
    order (each kind one fenced statement, each row under its own lease). A run appears at most
    once in the request. 200 ``{"results": [...], "calls": [...], "complete": [...]}``, each list
    in request order and each answer what that kind's batch route answers; 400 naming the bad
    item (``calls[1].tool_name``; nothing written); 403 not enrolled there."""
    worker = worker_of(pubkey, data["worker_id"])
    most = schema.steps_limit()[1]
    if not 1 <= sum(len(data[name]) for name, _ in STEP_KINDS) <= most:
        raise bad_request("body", f"must hold 1..{int(most)} items in all (results, calls, complete)")
    seen: set[uuid.UUID] = set()
    prepared = {name: _prepare_items(kind, data[name], name, community_id, worker, seen) for name, kind in STEP_KINDS}
    own = _own(request, community_id, pubkey, [p for items in prepared.values() for p in items])
    answers = {name: _execute(kind, community_id, prepared[name], own) for name, kind in STEP_KINDS}
    return JsonResponse(answers)


@endpoint("POST", FAIL)
def fail(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Fail the run (``agents.services.fail_run``). 200 ``{"outcome": "finished", "state":
    "failed"}``, ``{"outcome": "unwinding", "seqs"}`` (compensate those entries, highest first,
    through the compensation endpoints, then fail again) or ``already_terminal``; 409 lease lost."""
    lease = _run_lease(request, community_id, run_id, pubkey, data)
    outcome = agents.fail_run(lease, data["failure_code"], data["failure_message"])
    if isinstance(outcome, agents.Finished):
        return JsonResponse({"outcome": "finished", "state": outcome.state})
    if isinstance(outcome, agents.Unwinding):
        return JsonResponse({"outcome": "unwinding", "seqs": list(outcome.seqs)})
    return _common(outcome)


def _failed(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, agents.Unwinding):
        return {"outcome": "unwinding", "seqs": list(outcome.seqs)}
    return {"outcome": "finished", "state": outcome.state}


@endpoint("POST", BATCH_FAIL)
def fail_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Fail many of the signer's runs in one community, each under its own lease and with its
    own ``failure_code`` / ``failure_message`` (``agents.services.batch.fail_runs``: one fenced
    statement). 200 ``{"results": [...]}`` in request order, each what the one-run ``fail``
    answers: ``finished`` (``state``), ``unwinding`` (``seqs`` to compensate, highest first),
    ``already_terminal``, ``lease_lost`` (``reason``) or ``not_found``; 400 naming the bad item
    (nothing written); 403."""
    return _batch(
        request,
        pubkey, data, community_id,
        lambda lease, item: batch.prepare_failure(lease, item["failure_code"], item["failure_message"]),
        batch.fail_runs, batch.replay_failure, _failed,
    )  # fmt: skip


@endpoint("POST", COMPENSATION_BEGIN)
def compensation_begin(
    request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID
):
    """Begin (or resume) the compensation of entry ``seq`` of an unwinding run, allowed only for
    the highest one not yet compensated (``agents.services.begin_compensation``). 200
    ``{"outcome": "begun", "compensation", "args", "output", "key"}`` (``key``: the
    compensation's own idempotency key), ``{"outcome": "not_next"}`` or ``already_terminal``;
    409 lease lost."""
    outcome = agents.begin_compensation(_run_lease(request, community_id, run_id, pubkey, data), data["seq"])
    if outcome is None:
        return JsonResponse({"outcome": "not_next"})
    if isinstance(outcome, dict):
        return JsonResponse({"outcome": "begun", **outcome})
    return _common(outcome)


@endpoint("POST", COMPENSATION_FINISH)
def compensation_finish(
    request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID
):
    """Record the compensation of entry ``seq``: ``compensated`` or ``compensation_failed``
    (``agents.services.finish_compensation``). 200 ``{"outcome": "recorded" |
    "already_recorded", "status"}`` or ``already_terminal``; 409 lease lost."""
    lease = _run_lease(request, community_id, run_id, pubkey, data)
    return _recorded(agents.finish_compensation(lease, data["seq"], ok=data["ok"], error=data["error"]))


def _begun(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, batch.NotNext):
        return {"outcome": "not_next"}
    return {"outcome": "begun", **outcome}


@endpoint("POST", BATCH_COMPENSATION_BEGIN)
def compensation_begin_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Begin (or resume) the compensation of one entry for each of many unwinding runs of one
    community (``agents.services.batch.begin_compensations``: one fenced statement, each entry
    begun only if it is its run's highest not yet compensated). 200 ``{"results": [...]}`` in
    request order, each what the one-run ``compensations/begin`` answers (``begun`` with
    ``compensation``, ``args``, ``output``, ``key``; ``not_next``; ``already_terminal``;
    ``lease_lost``) or ``not_found``; 400 naming the bad item (nothing written); 403."""
    return _batch(
        request,
        pubkey, data, community_id, lambda lease, item: batch.prepare_compensation_begin(lease, item["seq"]),
        batch.begin_compensations, batch.replay_compensation_begin, _begun,
    )  # fmt: skip


@endpoint("POST", BATCH_COMPENSATION_FINISH)
def compensation_finish_batch(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID):
    """Record the compensation of one entry for each of many unwinding runs of one community
    (``agents.services.batch.finish_compensations``: one fenced statement). 200 ``{"results":
    [...]}`` in request order, each what the one-run ``compensations/finish`` answers
    (``recorded`` / ``already_recorded`` with the status, ``already_terminal``, ``lease_lost``) or
    ``not_found``; 400 naming the bad item (nothing written); 403."""
    return _batch(
        request,
        pubkey, data, community_id,
        lambda lease, item: batch.prepare_compensation_finish(lease, item["seq"], ok=item["ok"], error=item["error"]),
        batch.finish_compensations, batch.replay_compensation_finish, _recorded_row,
    )  # fmt: skip


@endpoint("POST", RUN_EMIT)
def emit(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """Append a chunk to the run's output stream under the run lease (``agents.services.emit_output``,
    a remote ``ctx.emit``). 200 ``{"outcome": "emitted", "seq"}``, ``{"outcome": "too_large",
    "field", "used", "size", "cap"}`` (past the run's ``MAX_STREAM_BYTES``; nothing written) or
    ``already_terminal``; 400 names ``chunk`` (empty, NUL, over ``MAX_CHUNK_BYTES``); 409 lease lost."""
    outcome = agents.emit_output(_run_lease(request, community_id, run_id, pubkey, data), data["chunk"])
    if isinstance(outcome, agents.Emitted):
        return JsonResponse({"outcome": "emitted", "seq": outcome.seq})
    if isinstance(outcome, agents.TooLarge):
        return JsonResponse(
            {"outcome": "too_large", "field": outcome.field, "used": outcome.used, "size": outcome.size,
             "cap": outcome.cap}
        )  # fmt: skip
    return _common(outcome)


# How often a long-polling output read looks again (an emit carries no wake-up hint).
OUTPUT_POLL_SECONDS = 0.25


def _output_page(community_id: uuid.UUID, run_id: uuid.UUID, data: dict[str, Any]) -> agents.OutputPage:
    return agents.read_output(community_id, run_id, after=data["after"], limit=data["limit"])


@endpoint("POST", RUN_OUTPUT)
def output(request: HttpRequest, pubkey: bytes, data: dict[str, Any], community_id: uuid.UUID, run_id: uuid.UUID):
    """The streamed output of one of the signer's runs (``ctx.emit``; ``agents.services.read_output``):
    the chunks after seq ``after``, at most ``limit``; with ``wait_seconds`` > 0 and nothing yet,
    long-poll (looking again every quarter second) until a chunk arrives, the run ends or the
    wait does. 200 ``{"chunks": [{"seq", "chunk"}], "after", "terminal", "done"}``: ``after`` is
    the last seq returned (pass it back), ``done`` true once the run is terminal and every chunk
    has been returned; 403; 404 (another key's run looks like a missing one)."""
    _require_own_run(community_id, run_id, pubkey, request)
    page = _output_page(community_id, run_id, data)
    wait = float(data["wait_seconds"])
    if not page.chunks and not page.terminal and wait > 0:
        deadline = time.monotonic() + wait
        with limits.long_poll(pubkey, [community_id]):
            while not page.chunks and not page.terminal:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                time.sleep(min(OUTPUT_POLL_SECONDS, remaining))
                page = _output_page(community_id, run_id, data)
    chunks = [{"seq": c.seq, "chunk": c.chunk} for c in page.chunks]
    return JsonResponse(
        {
            "chunks": chunks,
            "after": chunks[-1]["seq"] if chunks else data["after"],
            "terminal": page.terminal,
            "done": page.terminal and len(chunks) < data["limit"],
        }
    )

"""A remote agent-run worker over the gateway: ``run_agent_worker``'s runtime over HTTP.

Needs no Django. ``python -m buzz_delivery.gateway.client work-runs --url URL --key-file FILE
--handler pkg.mod:handler`` claims the key's agent runs (long-poll) across its communities and
runs ``handler(ctx) -> output`` for each, where ``ctx`` behaves like the in-process
:class:`buzz_delivery.agents.runtime.Context`: ``ctx.call(tool_name, fn, args, *,
compensate=None, reconcile=None, destructive=False, cost=0)`` journals the call through the API
before making it and records its result; on resume (a run claimed again) succeeded calls
return their recorded output from the journal and are not made again, a pending one is
reconciled (``reconcile(args, key)``: its output, or :data:`NOT_MADE`) or recorded uncertain;
``ctx.request_approval(prompt, deadline_seconds)`` parks the run; ``ctx.cancelled`` says a
cancel fenced it. Returning completes the run; raising fails it, and the compensations
(``compensate(args, output, key)``, registered with :func:`compensation`; the journal keeps
its name, which is looked up in this process's registry and never imported) run in reverse
order through the compensation endpoints. An unwinding run (cancelled, timed out,
exhausted, or a failed one whose holder died) runs no handler: only its compensations.
Held leases are renewed in the background; SIGTERM/SIGINT drain within ``--shutdown-grace``.
Unless ``--no-accept``, the deliveries addressed to the key are accepted into runs first
(:mod:`buzz_delivery.gateway.remote_accept`), so no inbox of your own is needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx

from buzz_delivery import backoff, journal_scope
from buzz_delivery.agents import compensations
from buzz_delivery.exceptions import in_chain
from buzz_delivery.gateway.client import (
    CLAIM_RETRY_BASE,
    CLAIM_RETRY_MOST,
    EXIT_ABANDONED,
    EXIT_ERROR,
    EXIT_OK,
    FAILURE_MESSAGE_MAX_CHARS,
    MAX_ACCEPT_BATCH,
    MAX_CONCURRENCY,
    GatewayClient,
    GatewayHTTPError,
    RemoteRunClaim,
    RemoteRunLease,
    RunOutcome,
    checked_count,
    checked_handler,
    checked_seconds,
    claim_retry_wait,
    describe,
    failure_code,
    storable,
    unreachable_for_long,
)
from buzz_delivery.inflight import InFlightCalls, when_quiet

logger = logging.getLogger("buzz_delivery.gateway.remote_runs")
T = TypeVar("T")

NOT_MADE = object()  # a reconcile hook's answer: the call never reached the tool
SUMMARY_KEYS = ("claimed", "completed", "failed", "compensated", "compensation_failed", "parked", "lost", "renewed",
                "errors", "abandoned", "accepted", "accept_errors")  # fmt: skip


class RemoteRunError(Exception):
    """Base of what stops a remote handler; ``failure_code`` is what the run records."""

    failure_code = "handler_error"


class RunAborted(RemoteRunError):
    """The run lease is lost (reclaimed, cancelled, given up): stop; nothing more is written."""

    failure_code = "lease_lost"


class ToolCallFailed(RemoteRunError):
    """A journaled call failed (its error is on the journal entry)."""

    failure_code = "tool_call_failed"


class UncertainCall(RemoteRunError):
    """A call left pending by a dead holder had no reconcile hook: marked uncertain."""

    failure_code = "uncertain_call"


class BudgetExhausted(RemoteRunError):
    """A call past the run's budget was refused (nothing journaled)."""

    failure_code = "budget_exceeded"


class ReplayMismatch(RemoteRunError):
    """On resume the handler asked for another call than the journal holds at that position."""

    failure_code = "replay_mismatch"


class NestedCall(RemoteRunError):
    """``ctx.call`` from inside another ``ctx.call``'s tool (or reconcile) function of the same
    run on the same thread: refused at once, nothing journaled. A resumed run replays the outer
    call without running its function, so the nested call's entry would never be consumed (the
    next call would meet it at its position: ``ReplayMismatch``). Calls a tool runs on threads of
    its own are not nested."""

    failure_code = "nested_call"

    def __init__(self, tool_name: str, outer_seq: int) -> None:
        self.tool_name = tool_name
        self.outer_seq = outer_seq
        super().__init__(
            f"ctx.call({tool_name!r}) from inside the tool function of call {outer_seq} of the same run: "
            "a replayed call does not run its tool function again; make it before or after that call"
        )


class ApprovalExpired(RemoteRunError):
    """The approval the run waited on expired without a decision."""

    failure_code = "approval_expired"


class OutputLimitExceeded(RemoteRunError):
    """``ctx.emit``: the chunk would take the run's streamed output past its bound (nothing written)."""

    failure_code = "stream_too_large"


class ApprovalBlockedByCalls(RemoteRunError):
    """``ctx.request_approval`` could not park the run: calls ``seqs`` of this holder are
    journaled and not recorded (asked from inside a ``ctx.call`` of the same thread, or a call
    left unrecorded with none of the handler's running). Nothing written, the lease holds."""

    def __init__(self, seqs: tuple[int, ...], why: str) -> None:
        self.seqs = seqs
        super().__init__(f"request_approval: call(s) {', '.join(map(str, seqs))} of this run are in flight ({why})")


APPROVAL_RETRY_SECONDS = 0.05  # request_approval: how often it looks again for its calls in flight
# request_approval: how long the gateway may see a call in flight that no call of the handler
# runs (its result being recorded as the park read, normally well under a second)
APPROVAL_SETTLE_SECONDS = 10.0
# A failing run (and request_approval) waits for its calls in flight under the journal lock this
# long at first (then twice as long each round, the lock let go in between for a call a tool in
# flight waits for), as the thread runtime's.
QUIET_HOLD_SECONDS = 0.5


# Refusals of a runtime request that reach the handler as they are (RemoteRunContext._runtime):
# the item's own fault (400, 413) or a route this gateway lacks (404, 405). Any other failure of
# a runtime request leaves the run to its lease.
HANDLER_SEES = frozenset({400, 404, 405, 413})


class BatchAnswerError(RuntimeError):
    """The gateway's answer to a batch did not match it (no run may take it)."""


class _Parked(BaseException):
    """Internal: the run parked on an approval; the handler stops here. A ``BaseException``, as
    the in-process runtimes' (docs/agents.md "A park the handler catches"): ``except Exception``
    around the park lets it through; one that still catches it cannot unpark the run (the turn
    ends ``parked`` by :attr:`RemoteRunContext.parked`)."""


def input_hash(args: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``args``, as the server journals it."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


# The compensations this process may run, by name (issue 27): one registry with the in-process
# runtime's (buzz_delivery.agents.compensations), so a handler module serves both workers. A
# descriptor comes back from the server, where anyone holding the key may have written it: its
# name is looked up there, never imported.
compensation = compensations.compensation
compensation_name = compensations.name_of
registered_compensation = compensations.resolve
dotted = compensations.dotted
UNREGISTERED = compensations.UNREGISTERED


class RemoteRunContext:
    """What a remote handler gets for one claimed run: ``run`` (the API's JSON), ``input``,
    ``lease`` (renewed in the background), :meth:`call`, :meth:`request_approval`, :meth:`emit`,
    :attr:`cancelled`, :meth:`scope`.

    Replay by scope as the in-process runtime (docs/agents.md "Resume"): each call and approval
    is sent with its replay key (``scope``, ``index``) once the run has an entry outside the root
    scope; until then a root call's index is its seq, and the key is left out (a gateway from
    before scopes answers such a run as ever; one of a run with scopes refuses the field: 400)."""

    journal_scopes = True  # calls are replayed by scope (ctx.scope): integrations may run them at once
    scope = staticmethod(journal_scope.scoped)

    def __init__(self, client: GatewayClient, claim: RemoteRunClaim, batcher: RunBatcher | None = None) -> None:
        self.client = client
        self.batcher = batcher
        self.run = claim.run
        self.lease = claim.lease
        self.input = claim.run["input"]
        self.lost = threading.Event()
        self._cancelled = threading.Event()
        self.failure_code: str | None = None  # set when the run is failed (for the worker's line)
        # The approval this turn parked on, once written: every later call raises _Parked again
        # and the turn ends parked, whatever the handler does after (it may catch _Parked).
        self.parked: Any = None
        self._positions = journal_scope.Positions()
        # A run that has spent no call and is not unwinding has an empty journal: no read (as
        # the in-process runtime's batch.resumed).
        fresh = not claim.run.get("tool_calls_used") and not claim.run.get("unwinding")
        # A read: a 503 or 429 of the gateway's own is read again (_again), not the run given up
        # before its handler starts (its lease lapsed, the reaper counted an attempt: on the last,
        # failed/attempts_exhausted and compensated; many runs resumed together meet the key's
        # bound on requests in flight).
        journal = (
            [] if fresh else _again(lambda: client.read_run(claim.lease.community_id, claim.lease.run_id))["journal"]
        )
        self._journal = {(e.get("scope") or "", e.get("index") or e["seq"]): e for e in journal}
        self._scoped = any(scope for scope, _ in self._journal)  # send replay keys (see the class doc)
        self._inside = threading.local()  # .scopes: the scopes of this thread's calls' bodies
        self.replayed = 0
        # ctx.emit: the chunks the run had when claimed (a resumed handler's first emits are these).
        self._emitted_before = int(claim.run.get("output_chunks") or 0)
        self._emit_pos = 0
        self._emitting = threading.Lock()
        self._journaling = threading.Lock()  # parallel ctx.call: one journal position at a time
        # Calls of this handler journaled (or being journaled) and not yet recorded: an approval
        # request waits for them (the run cannot park with one of its own calls in flight).
        self._calls = InFlightCalls()

    @property
    def cancelled(self) -> bool:
        """True once a heartbeat learnt the run was cancelled (the handler should stop)."""
        return self._cancelled.is_set()

    def tools_journaled(self) -> list[tuple[str, str]]:
        """``(scope, tool_name)`` of each tool call the run had journaled when it was claimed, by
        replay key (as the in-process runtime's)."""
        return [(k[0], str(e.get("tool_name"))) for k, e in sorted(self._journal.items()) if e.get("kind") == "tool"]

    def journaled_cost(self, scope: str) -> int | None:
        """As the in-process runtime's (``Context.journaled_cost``)."""
        entries = self._journal.items()
        first = min(
            ((k[1], e.get("cost")) for k, e in entries if k[0] == scope and e.get("kind") == "tool"), default=None
        )
        return None if first is None else int(first[1] or 0)

    def mark_lost(self, reason: str | None) -> None:
        """The lease is gone (``reason`` ``cancelled`` when a cancel fenced it)."""
        self.lost.set()
        if reason == "cancelled":
            self._cancelled.set()

    def _check(self) -> None:
        if self.parked is not None:  # the park was swallowed: nothing more under a released lease
            raise _Parked(self.parked)
        if self.lost.is_set():
            raise RunAborted("the run's lease was lost")

    @contextlib.contextmanager
    def _runtime(self, what: str) -> Iterator[None]:
        """The block's requests are the runtime's: one the gateway could not answer (a dropped
        connection, a timeout, a 5xx, a 429 past its retries, a key no longer enrolled) marks the
        run lost and raises :class:`RunAborted`, so the handler's failure is not recorded for
        it: its lease lapses and it resumes from its journal (as the in-process runtime does when
        its database connection fails). A 400 or 413 (this item's own fault, e.g. a chunk the
        gateway refuses) and a 404 or 405 (a gateway without that route: claimed again, the run
        would meet it again) reach the handler as they are (:data:`HANDLER_SEES`)."""
        try:
            yield
        except GatewayHTTPError as exc:
            if exc.status in HANDLER_SEES:
                raise
            self._runtime_failed(what, exc)
        except (httpx.HTTPError, BatchAnswerError) as exc:
            self._runtime_failed(what, exc)

    def _runtime_failed(self, what: str, exc: Exception) -> None:
        run_id = self.lease.run_id
        logger.warning("gateway_error run=%s (%s): %s; the run is left to its lease", run_id, what, describe(exc))
        self.mark_lost("gateway_error")
        raise RunAborted(f"cannot {what}: {describe(exc)}") from exc

    def _gone(self, outcome: Any, what: str) -> RunAborted:
        self.mark_lost(outcome.data.get("reason"))
        return RunAborted(f"cannot {what}: {outcome.outcome}")

    def call(
        self,
        tool_name: str,
        fn: Callable[[Any, str], Any],
        args: Any,
        *,
        compensate: Callable[[Any, Any, str], Any] | None = None,
        reconcile: Callable[[Any, str], Any] | None = None,
        destructive: bool = False,
        cost: int = 0,
    ) -> Any:
        """Journal, make and record one tool call (or replay it from the journal); returns its
        output (None for a shadow-blocked call). A call from inside another call's function on the
        same thread raises :class:`NestedCall` (nothing journaled)."""
        self._check()
        outer = self._calls.outer()
        scopes = getattr(self._inside, "scopes", ())
        # Nested in any call of this thread (not only the innermost: the thread bridge serves
        # another scope's call from inside one's serving, and that one's body may ask); a call in
        # a scope outside them all is allowed.
        if outer is not None and journal_scope.within(journal_scope.current(), scopes):
            raise NestedCall(tool_name, outer)
        return self._call(tool_name, fn, args, compensate, reconcile, destructive, cost)

    def _await_calls(self) -> None:
        self._calls.wait_for_others(self._check, APPROVAL_RETRY_SECONDS)

    def _fail_when_quiet(self, code: str, message: str) -> RunOutcome:
        """Fail the run (the gateway's answer: ``finished``, ``unwinding``...) once none of the
        other threads' calls is in flight, written under the journal lock: a call journaled
        after the wait for the calls in flight and before the failure (a thread the handler left
        behind) was closed uncertain and its compensation run while its tool still ran (the undo
        before the effect, which stayed); one that asks after the failure is refused. The calls
        are waited for under the lock, a while at a time (``QUIET_HOLD_SECONDS``, doubled each
        round), as the thread runtime's ``Context._fail_when_quiet``: waited for outside it, a
        thread calling again and again journaled in each gap (the failure closed that call
        uncertain, the thread runtime's was held off while it called); held until they end, a
        tool waiting for a call of another thread would wait for ever (that call is let in
        between two rounds). Raises :class:`RunAborted` or ``_Parked`` (a leftover thread parked
        the run meanwhile)."""

        def fail() -> RunOutcome:
            self._check()  # a leftover thread parked the run (or it was lost) meanwhile
            text = storable(message, FAILURE_MESSAGE_MAX_CHARS)
            return _send_fail(self.client, self.batcher, self.lease, code, text)

        return self._when_quiet(fail)

    def _when_quiet(self, then: Callable[[], T], at_once: Callable[[], bool] | None = None) -> T:
        """``then()`` under the journal lock once the other threads' calls ended (or ``at_once()``),
        :func:`~buzz_delivery.inflight.when_quiet`; a lease lost meanwhile raises :class:`RunAborted`."""
        hold, every = QUIET_HOLD_SECONDS, APPROVAL_RETRY_SECONDS
        return when_quiet(self._journaling, self._calls, self._check, self.lost, then, at_once, hold=hold, every=every)

    def _call(
        self,
        tool_name: str,
        fn: Callable[[Any, str], Any],
        args: Any,
        compensate: Callable[[Any, Any, str], Any] | None,
        reconcile: Callable[[Any, str], Any] | None,
        destructive: bool,
        cost: int,
    ) -> Any:
        scope = journal_scope.current_key()  # a deep path by its stable key
        with self._journaling:
            # Parked (or lost) while it waited for the lock (the park is written under it): it
            # raises as every later call does, nothing taken, no request sent.
            self._check()
            index = self._positions.take(scope)
            entry = self._journal.get((scope, index))
            outcome: Any = None
            if entry is None:
                descriptor = compensations.descriptor(compensate)
                key = self._key(scope, index)
                body = {"tool_name": tool_name, "args": args, "cost": cost, "compensation": descriptor,
                        "destructive": destructive, **key}  # fmt: skip
                with self._runtime("journal"):
                    outcome = (
                        self.batcher.send("calls", self.lease, body)
                        if self.batcher
                        else self.client.journal_call(
                            self.lease, tool_name, args, cost=cost, compensation=descriptor, destructive=destructive,
                            **key,
                        )
                    )  # fmt: skip
            self._calls.enter(entry["seq"] if entry is not None else int(outcome.data.get("seq") or 0))
        inside = journal_scope.inside_call(scope, index)
        self._inside.scopes = (*getattr(self._inside, "scopes", ()), inside)
        try:
            with journal_scope.entered(inside):
                return self._called(entry, outcome, tool_name, fn, args, reconcile)
        finally:
            self._inside.scopes = self._inside.scopes[:-1]
            self._calls.leave()

    def _key(self, scope: str, index: int) -> dict[str, Any]:
        """The replay key sent with a new entry (the journal lock held): none while every entry
        of the run is in the root scope (a root call's index is then its seq)."""
        self._scoped = self._scoped or bool(scope)
        return {"scope": scope, "index": index} if self._scoped else {}

    def _called(
        self,
        entry: Any,
        outcome: Any,
        tool_name: str,
        fn: Callable[[Any, str], Any],
        args: Any,
        reconcile: Callable[[Any, str], Any] | None,
    ) -> Any:
        """The call once it holds its journal position: replayed, or made and recorded."""
        if entry is not None:
            return self._replay(entry, tool_name, fn, args, reconcile)
        if outcome.outcome == "blocked":
            return None
        if outcome.outcome == "budget_exceeded":
            raise BudgetExhausted(f"{outcome.data['budget']} budget exhausted")
        if outcome.outcome != "journaled":
            raise self._gone(outcome, "journal")
        return self._make(outcome.data["seq"], outcome.data["idempotency_key"], fn, args)

    def emit(self, chunk: str) -> int | None:
        """Append ``chunk`` to the run's output stream under the run lease (as the in-process
        ``ctx.emit``); returns its ``seq``, None for an empty chunk. On resume the chunks the run
        already has are not sent again. Raises :class:`OutputLimitExceeded` or :class:`RunAborted`;
        a bad chunk is the server's 400 (``GatewayHTTPError`` naming ``chunk``)."""
        if isinstance(chunk, str) and not chunk:
            return None
        self._check()
        with self._emitting:
            if self._emit_pos < self._emitted_before:
                self._emit_pos += 1
                return self._emit_pos
            with self._runtime("emit"):
                outcome = _again(lambda: self.client.emit(self.lease, chunk), REFUSED_FOR_LOAD)
            if outcome.outcome == "emitted":
                self._emit_pos = int(outcome.data["seq"])
                return self._emit_pos
        if outcome.outcome == "too_large":
            data = outcome.data
            raise OutputLimitExceeded(f"{data['field']}: {data['used']} + {data['size']} bytes is over {data['cap']}")
        raise self._gone(outcome, "emit")

    def _make(self, seq: int, key: str, fn: Callable[[Any, str], Any], args: Any) -> Any:
        started = time.monotonic()
        try:
            output = fn(args, key)
        except Exception as exc:
            if self.lost.is_set() and in_chain(exc, RunAborted) is not None:
                # The runtime aborted inside the tool (its own ctx.emit or ctx.call could not be
                # answered, or its lease went): the tool did not fail, it was stopped. The call
                # stays pending (reconciled or uncertain on resume), not recorded failed: a
                # resumed run would replay that failure, fail and compensate. A tool that failed
                # on its own once the run was abandoned (the lease still holds) records its true
                # failure, as a success would.
                raise RunAborted(f"the run was lost during call {seq}") from exc
            # Storable and cut (NUL escaped): text the gateway refuses would leave the call pending.
            self._record(seq, started, ok=False, error=_error_text(exc))
            raise ToolCallFailed(f"{seq}: {exc}") from exc
        self._record(seq, started, ok=True, output=output)
        return output

    def _record(self, seq: int, started: float, **kwargs: Any) -> None:
        latency = int((time.monotonic() - started) * 1000)
        with self._runtime(f"record call {seq}"):
            if self.batcher is not None:
                body = {"seq": seq, "ok": kwargs["ok"], "output": kwargs.get("output"), "error": kwargs.get("error"),
                        "latency_ms": latency, "uncertain": kwargs.get("uncertain", False)}  # fmt: skip
                outcome = self.batcher.send("results", self.lease, body)
            else:
                outcome = self.client.record_result(self.lease, seq, latency_ms=latency, **kwargs)
        if outcome.outcome not in ("recorded", "already_recorded"):
            raise self._gone(outcome, f"record call {seq}")

    def _replay(self, entry: dict[str, Any], tool_name: str, fn: Any, args: Any, reconcile: Any) -> Any:
        if entry["kind"] != "tool" or entry["tool_name"] != tool_name or entry["input_hash"] != input_hash(args):
            raise ReplayMismatch(f"call {entry['seq']} was {entry['kind']} {entry['tool_name']!r}, now {tool_name!r}")
        if entry["status"] == "succeeded":
            self.replayed += 1
            return entry["output"]
        if entry["status"] == "failed":
            if entry["blocked_reason"]:
                return None
            raise ToolCallFailed(f"{entry['seq']}: {entry['error']}")
        if reconcile is None:
            self._record(entry["seq"], time.monotonic(), ok=False, uncertain=True, error="uncertain: no reconcile hook")
            raise UncertainCall(f"call {entry['seq']} ({tool_name}) may or may not have happened")
        started = time.monotonic()
        found = reconcile(args, entry["idempotency_key"])
        if found is NOT_MADE:
            return self._make(entry["seq"], entry["idempotency_key"], fn, args)
        self._record(entry["seq"], started, ok=True, output=found)
        return found

    def request_approval(self, prompt: str = "", deadline_seconds: int = 86400) -> dict[str, Any]:
        """Park the run on an approval (the handler stops); when the run resumes, returns
        ``{"decision", "decided_by"}``. Raises :class:`ApprovalExpired` if it expired. Called
        while other calls of the handler are in flight (tools run in parallel), it first waits for
        them to be recorded (while the lease holds), then parks; from inside a ``ctx.call`` of
        the same thread it raises :class:`ApprovalBlockedByCalls` (nothing written)."""
        self._check()
        # The calls in flight are waited for under the journal lock, a while at a time (as the
        # failure's, _fail_when_quiet): waited for outside it, a thread calling again and again
        # took the lock in each gap and the approval waited as long as it called; held until they
        # end, a call nested in one in flight (on threads its tool starts and waits for) journals
        # under that lock, and the approval kept the call it waits for from ending (the run hung,
        # its heartbeat keeping the lease): the lock is let go between two rounds. The park itself
        # is under the lock, as a call's journaling: the approval's position is the seq the
        # gateway gives it.
        scope = journal_scope.current_key()  # a deep path by its stable key

        def at_once() -> bool:
            # Replayed, or from inside a call of this thread (the gateway names the call): at once.
            return self._journal.get((scope, self._positions.peek(scope))) is not None or bool(self._calls.own())

        def park() -> tuple[dict[str, Any] | None, Any]:
            index = self._positions.take(scope)
            entry = self._journal.get((scope, index))
            return entry, None if entry is not None else self._park(prompt, deadline_seconds, self._key(scope, index))

        entry, outcome = self._when_quiet(park, at_once)
        if entry is not None:
            if entry["kind"] != "approval":
                raise ReplayMismatch(f"entry {entry['seq']} is a {entry['tool_name']!r} call, not an approval")
            if entry["status"] == "succeeded":
                self.replayed += 1
                return dict(entry["output"] or {})
            if entry["status"] == "failed":
                raise ApprovalExpired("the approval expired without a decision")
            raise RunAborted("the approval is still pending")
        if outcome.outcome == "approval_requested":
            self.parked = outcome.data["approval_id"]
            raise _Parked(self.parked)
        if outcome.outcome == "budget_exceeded":
            raise BudgetExhausted("tool_calls budget exhausted")
        raise self._gone(outcome, "request an approval")

    def _park(self, prompt: str, deadline_seconds: int, key: dict[str, Any]) -> RunOutcome:
        """``approval`` (none of the handler's other calls in flight, the journal lock held);
        while the gateway still sees one (``calls_in_flight``: its result being recorded as the
        park read), ask again shortly."""
        settle: float | None = None
        while True:
            self._check()
            with self._runtime("request an approval"):
                outcome: RunOutcome = _again(
                    lambda: self.client.request_approval(self.lease, prompt, deadline_seconds, **key), REFUSED_FOR_LOAD
                )
            if outcome.outcome != "calls_in_flight":
                return outcome
            seqs = tuple(int(seq) for seq in outcome.data.get("seqs") or ())
            if self._calls.own():
                raise ApprovalBlockedByCalls(seqs, "asked from inside a ctx.call of this thread")
            if settle is None:
                settle = time.monotonic() + APPROVAL_SETTLE_SECONDS
            elif time.monotonic() > settle:
                raise ApprovalBlockedByCalls(seqs, "never recorded, no call of the handler running")
            if self.lost.wait(APPROVAL_RETRY_SECONDS):
                raise RunAborted("the run's lease was lost while its calls were in flight")


def _error_text(exc: BaseException) -> str:
    """``Type: text`` of ``exc`` as the gateway stores it: storable (NUL escaped) and cut."""
    return storable(f"{type(exc).__name__}: {describe(exc)}", FAILURE_MESSAGE_MAX_CHARS)


def _send(
    client: GatewayClient, batcher: RunBatcher | None, lease: RemoteRunLease, action: str, body: dict[str, Any]
) -> RunOutcome:
    """The one-run ``action`` through the batcher (batched with other runs') when there is one."""
    if batcher is not None:
        return batcher.send(action, lease, body)
    return client._run_post(lease, action, **body)


def _send_fail(
    client: GatewayClient, batcher: RunBatcher | None, lease: RemoteRunLease, code: str, message: str | None = None
) -> RunOutcome:
    """``fail`` through the batcher (batched with other runs' failures) when there is one."""
    return _send(client, batcher, lease, "fail", {"failure_code": code, "failure_message": message})


def unwind(client: GatewayClient, lease: RemoteRunLease, seqs: list[int], batcher: RunBatcher | None = None) -> str:
    """Run the compensations ``seqs`` (highest first) through the API, stopping at the first that
    fails, then fail the run again; every request through ``batcher`` when given (batched with
    other runs' compensations and failures). Returns ``compensated``, ``compensation_failed`` or
    ``lost``."""
    result = "compensated"
    for seq in seqs:
        began = _send(client, batcher, lease, "compensations/begin", {"seq": seq})
        if began.outcome == "not_next":
            continue
        if began.outcome != "begun":
            return "lost"
        function = registered_compensation(began.data.get("compensation"))
        try:
            if function is None:
                raise LookupError(compensations.unregistered_error(began.data.get("compensation")))
            function(began.data["args"], began.data["output"], began.data["key"])
        except Exception as exc:
            logger.warning("compensation_failed run=%s seq=%s: %s", lease.run_id, seq, exc)
            error = _error_text(exc)  # storable: a refused finish would leave the run to lapse
            failed = _send(client, batcher, lease, "compensations/finish", {"seq": seq, "ok": False, "error": error})
            if failed.outcome not in ("recorded", "already_recorded"):
                return "lost"
            result = "compensation_failed"
            break
        done = _send(client, batcher, lease, "compensations/finish", {"seq": seq, "ok": True, "error": None})
        if done.outcome not in ("recorded", "already_recorded"):
            return "lost"
    final = _send_fail(client, batcher, lease, "compensated")
    if final.outcome == "unwinding":
        return unwind(client, lease, final.data["seqs"], batcher)
    return result if final.outcome in ("finished", "already_terminal") else "lost"


Item = tuple[str, RemoteRunLease, dict[str, Any], "Future[RunOutcome]"]
# The actions one steps request (``POST .../runs/steps``) takes together, in the order it applies them.
STEP_ACTIONS = ("results", "calls", "complete")
# How long a flush (and the claimer) waits for the runs it expects. Waiting ends as soon as they
# have all sent (or left), so this only bounds the wait for a straggler: at 5 ms a K = 1 worker
# on a loaded machine (load 12) still split a step of its 8 runs into 7 + 1 in a third of its
# requests (1.3 requests a run); at 20 ms none (1.0).
LINGER = 0.02
_WAKE: Any = object()  # queued by RunBatcher.leave: a lingering flush looks again


class RunBatcher:
    """Sends the journal writes, completions, failures and compensations of a worker's runs in
    batches (issue 29): each run thread's :meth:`send` waits while one thread sends whatever is
    queued, one request per (action, community) (``POST .../runs/calls|results|complete|fail``
    and ``.../runs/compensations/begin|finish``: one fenced statement there, each run judged by
    its own lease). The runs of one worker drift to different steps, so the results, calls and
    completions queued for one community go in ONE request (``.../runs/steps``, one transaction)
    when more than one of these kinds is queued; a gateway without that route (404/405) gets
    the per-kind requests, and is not asked again. A batch the gateway refuses as a whole
    (400/413: one bad item) is sent again per kind, then one run per request, so each run gets
    the answer its own request would give; a batch that cannot be sent at all raises in every
    run thread of it."""

    def __init__(
        self, client: GatewayClient, max_batch: int = 100, linger: float = LINGER, expected_for: float = 0.05
    ) -> None:
        self.client, self.max_batch, self.linger, self.expected_for = client, max_batch, linger, expected_for
        # The runs expected to send soon, with when they became so: those a flush answered
        # and those just claimed (:meth:`expect`), until each sends again or :meth:`leave`s. While
        # some are expected, a flush waits up to ``linger`` for them: else the runs of a worker
        # split into cohorts, each catching the flush of the others' step and sending its own
        # next, two requests a step of the worker's runs (a count of "threads answered", kept
        # before, was spent by the other cohort's sends). A run that has not sent within
        # ``expected_for`` seconds (a slow tool call) is no longer waited for.
        self._awaited: dict[str, float] = {}
        self._awaited_lock = threading.Condition()
        self.steps = True  # False once the gateway answered the steps route 404/405 (an older one)
        self._queue: queue.Queue[Item | None] = queue.Queue()  # and _WAKE markers
        self._thread = threading.Thread(target=self._loop, name="run-batcher", daemon=True)
        self._thread.start()

    def send(self, action: str, lease: RemoteRunLease, body: dict[str, Any]) -> RunOutcome:
        """As the one-run endpoint ``action`` (``calls``, ``results``, ``complete``, ``fail``,
        ``compensations/begin``, ``compensations/finish``), batched."""
        future: Future[RunOutcome] = Future()
        with self._awaited_lock:
            self._awaited.pop(lease.run_id, None)
            self._awaited_lock.notify_all()
        self._queue.put((action, lease, body, future))
        return future.result()

    def expect(self, run_ids: list[str]) -> None:
        """The claimer's runs ``run_ids`` are about to start: a flush waits (up to ``linger``) for
        their first steps, so runs claimed together send together."""
        now = time.monotonic()
        with self._awaited_lock:
            for run_id in run_ids:
                self._awaited[run_id] = now

    def leave(self, run_id: str) -> None:
        """Run ``run_id`` reached its resting point: it sends nothing more, wait no longer for it."""
        with self._awaited_lock:
            if self._awaited.pop(run_id, None) is None:
                return
            self._awaited_lock.notify_all()
        self._queue.put(_WAKE)  # a flush lingering for it decides again

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` until no run the last flush answered is still turning (each has
        sent again or left): the claimer's cue that the slots of runs ended together are free
        together, so it claims for all of them in one request."""
        deadline = time.monotonic() + timeout
        with self._awaited_lock:
            while self._expected():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._awaited_lock.wait(remaining)

    def _expected(self) -> bool:
        """Whether some run is expected to send soon (under ``_awaited_lock``)."""
        horizon = time.monotonic() - self.expected_for
        for run_id, since in list(self._awaited.items()):
            if since < horizon:
                del self._awaited[run_id]
        return bool(self._awaited)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                return
            items = [] if item is _WAKE else [item]
            deadline = time.monotonic() + self.linger
            while len(items) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    with self._awaited_lock:
                        expected = self._expected()
                    remaining = deadline - time.monotonic()
                    if not items or not expected or remaining <= 0:
                        break
                    try:
                        more = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                if more is None:
                    stop = True
                    break
                if more is not _WAKE:
                    items.append(more)
            if not items:
                continue
            now = time.monotonic()
            with self._awaited_lock:  # their threads send nothing before they are answered below
                for one in items:
                    self._awaited[one[1].run_id] = now
            groups: dict[tuple[str, str, str], list[list[Item]]] = defaultdict(list)
            for one in items:
                action = "steps" if self.steps and one[0] in STEP_ACTIONS else one[0]
                batches = groups[(action, one[1].community_id, one[1].worker_id)]
                # No run twice in one batch (a run thread sends one at a time; kept safe anyway).
                if not batches or any(x[1].run_id == one[1].run_id for x in batches[-1]):
                    batches.append([])
                batches[-1].append(one)
            for batches in groups.values():
                for group in batches:
                    try:
                        self._send_steps(group) if group[0][0] in STEP_ACTIONS else self._send(group)
                    except Exception as exc:  # never leave a run thread waiting on its answer
                        for *_, future in group:
                            if not future.done():
                                future.set_exception(exc)

    def _send_steps(self, group: list[Item]) -> None:
        """A group of :data:`STEP_ACTIONS` items (no run twice): one steps request when it holds
        more than one kind, else that kind's batch request."""
        kinds: dict[str, list[Item]] = defaultdict(list)
        for one in group:
            kinds[one[0]].append(one)
        if len(kinds) == 1:
            self._send(group)
            return
        try:
            body = {kind: [(x[1], x[2]) for x in items] for kind, items in kinds.items()}
            answers = _again(lambda: self.client.run_steps(body))
        except GatewayHTTPError as exc:
            if exc.status in (404, 405):
                self.steps = False  # a gateway older than the steps route: per kind from now on
            if exc.status not in (400, 404, 405, 413):
                for *_, future in group:
                    future.set_exception(exc)
                return
            for items in kinds.values():  # each kind on its own (a bad item: then each run on its own)
                self._send(items)
            return
        except Exception as exc:  # the gateway unreachable: every run of the batch hears it
            for *_, future in group:
                future.set_exception(exc)
            return
        for kind, items in kinds.items():
            outcomes = answers.get(kind, [])
            if len(outcomes) != len(items):  # not the gateway's answer to this batch: no run may take it
                error = BatchAnswerError(f"the gateway answered {len(outcomes)} {kind} outcomes to {len(items)} runs")
                for *_, future in items:
                    future.set_exception(error)
                continue
            for (*_, future), outcome in zip(items, outcomes, strict=True):
                future.set_result(outcome)

    def _send(self, group: list[Item]) -> None:
        action = group[0][0]
        items = [(lease, body) for _, lease, body, _ in group]
        try:
            if action in STEP_ACTIONS:  # a request in one transaction: a 503 or 429 kept nothing
                outcomes = _again(lambda: self.client.run_batch(action, items))
            else:
                outcomes = self.client.run_batch(action, items)
        except GatewayHTTPError as exc:
            # 404/405: a gateway older than this batch route (fail, compensations: no route, or
            # its read route took the path; a batch route answers no 404): each run on its own.
            if exc.status not in (404, 405) and (exc.status not in (400, 413) or len(group) == 1):
                for *_, future in group:
                    future.set_exception(exc)
                return
            for _, lease, body, future in group:  # one bad item refused the batch: each on its own
                try:
                    future.set_result(self.client._run_post(lease, action, **body))
                except Exception as one:
                    future.set_exception(one)
            return
        except Exception as exc:  # the gateway unreachable: every run of the batch hears it
            for *_, future in group:
                future.set_exception(exc)
            return
        if len(outcomes) != len(group):  # not the gateway's answer to this batch: no run may take it
            error = BatchAnswerError(f"the gateway answered {len(outcomes)} outcomes to a batch of {len(group)} runs")
            for *_, future in group:
                future.set_exception(error)
            return
        for (*_, future), outcome in zip(group, outcomes, strict=True):
            future.set_result(outcome)


# A step batch (``calls``, ``results``, ``complete``, ``steps``: one transaction with the request's
# event id) answered 503 (its transaction could not commit: nothing kept) or 429 (refused as a
# whole before any write) is sent again, signed anew, this many times, backing off from
# ``AGAIN_BACKOFF`` seconds; before, every run of the batch raised and its lease was left to lapse.
# The gateway's own refusals only (its JSON ``code``): a 503 a proxy answers (not JSON: Envoy's
# "upstream reset before headers", say) may come after the gateway committed the request.
AGAIN_STATUSES = ((429, "too_many_requests"), (503, "unavailable"))
# What a request that is not one transaction with its event id (an emit, an approval request)
# is sent again after: the gateway's 429 only, refused before any write (a 503 may come after
# its write was kept). Before, the run was marked lost: its lease lapsed and the reaper counted
# an attempt (on the last: failed/attempts_exhausted, compensated) for a burst over the bound.
REFUSED_FOR_LOAD = ((429, "too_many_requests"),)
AGAIN_TIMES = 3
AGAIN_BACKOFF = 0.05
# The longest wait before sending a step batch again, whatever its 429's Retry-After asks (the
# runs' leases keep running meanwhile).
AGAIN_MOST = 5.0


def _again(send: Callable[[], Any], statuses: tuple[tuple[int, str], ...] = AGAIN_STATUSES) -> Any:
    """``send()``, again while the gateway answers a step batch (or a read) 503 or 429 (see
    :data:`AGAIN_TIMES`); ``statuses``: the refusals sent again."""
    for attempt in range(AGAIN_TIMES + 1):
        try:
            return send()
        except GatewayHTTPError as exc:
            if (exc.status, exc.code) not in statuses or attempt == AGAIN_TIMES:
                raise
            logger.warning("step_batch_again status=%s attempt=%d: %s", exc.status, attempt + 1, exc)
            time.sleep(backoff.again_delay(AGAIN_BACKOFF, attempt, exc.retry_after, most=AGAIN_MOST))
    raise AssertionError("unreachable")


def _parked_turn(lease: Any, approval_id: Any, ended: str | None) -> str:
    """``parked``, as the in-process runtimes' ``parked_turn``: a handler that caught its park
    and then ``ended`` otherwise is logged ``park_swallowed`` (its output or error dropped)."""
    if ended is not None:
        logger.warning(
            "park_swallowed run=%s approval=%s: the handler caught the park and %s; the run stays parked",
            lease.run_id,
            approval_id,
            ended,
        )
    return "parked"


def _unless_parked(ctx: Any, outcome: str) -> str:
    """``outcome``, or ``parked`` when it is ``lost`` because a thread the handler left behind
    parked the run after the handler ended (the turn's end refused, or its wait for that thread's
    calls met the park): never ``_Parked`` out of :func:`run_remote_claim`, never a parked run
    counted lost (as the in-process runtime's ``_unless_parked``)."""
    parked = getattr(ctx, "parked", None)
    if outcome != "lost" or parked is None:
        return outcome
    logger.info(
        "parked_after_handler run=%s approval=%s: a thread the handler left parked the run", ctx.lease.run_id, parked
    )
    return "parked"


def _ended_by(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {describe(exc)[:200]}"


def run_remote_claim(
    client: GatewayClient,
    claim: RemoteRunClaim,
    handler: Callable[[Any], Any],
    ctx: Any = None,
    batcher: RunBatcher | None = None,
) -> str:
    """Run one claimed run to its next resting point: ``completed``, ``failed``, ``compensated``,
    ``compensation_failed``, ``parked`` or ``lost``. ``batcher``: send the journal writes, the
    completion and the failures through it (batched with other runs') instead of one request each."""
    lease = claim.lease
    if claim.run["unwinding"]:
        if ctx is not None:
            ctx.failure_code = claim.run["failure_code"] or "unwinding"
        outcome = _send_fail(client, batcher, lease, claim.run["failure_code"] or "unwinding")
        if outcome.outcome == "unwinding":
            return unwind(client, lease, outcome.data["seqs"], batcher)
        return "failed" if outcome.outcome == "finished" else "lost"
    ctx = ctx or RemoteRunContext(client, claim, batcher)
    try:
        output = handler(ctx)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: this run's end, never the worker's
        parked = getattr(ctx, "parked", None)  # judged by the context's record, not by _Parked
        if parked is not None:
            return _parked_turn(lease, parked, None if isinstance(exc, _Parked) else _ended_by(exc))
        if isinstance(exc, _Parked):  # a context of the caller's own, without the record
            return "parked"
        if isinstance(exc, RunAborted):
            return "lost"
        if ctx.lost.is_set():
            return "lost"
        # A call the handler started on another thread is recorded first: failed under it, the
        # call was marked uncertain and compensated while the tool still ran. (The failure waits
        # again under the journal lock, _fail: a leftover thread may journal a call meanwhile.)
        try:
            ctx._await_calls()
        except (RunAborted, _Parked):  # _Parked: a thread the handler left parked the run meanwhile
            return _unless_parked(ctx, "lost")
        if isinstance(exc, RemoteRunError):
            code = failure_code(exc.failure_code, "handler_error")
        else:
            code = "handler_error" if isinstance(exc, Exception) else "handler_aborted"
        ctx.failure_code = code
        return _fail(ctx, code, f"{type(exc).__name__}: {describe(exc)}", batcher)
    parked = getattr(ctx, "parked", None)
    if parked is not None:  # it returned after swallowing its park: the run waits all the same
        return _parked_turn(lease, parked, "returned")
    # A call the handler started on another thread and did not wait for is recorded first:
    # completed under it, the call's result could never be recorded (and with it alone in flight
    # the run is not 'running': the completion was refused, the run run again).
    try:
        ctx._await_calls()
    except (RunAborted, _Parked):
        return _unless_parked(ctx, "lost")
    if ctx.lost.is_set():
        return "lost"
    problem = _unstorable_output(output)
    if problem is not None:
        ctx.failure_code = "output_not_json"
        return _fail(ctx, "output_not_json", f"the handler's output {problem}", batcher)
    # While the gateway still sees calls of this holder in flight (a thread the handler left
    # behind journaled one after it returned), wait for them and ask again, for a bounded time,
    # then fail the run (its calls closed uncertain): never a run lost silently.
    settle = time.monotonic() + APPROVAL_SETTLE_SECONDS
    while True:
        try:
            done = (
                batcher.send("complete", ctx.lease, {"output": output})
                if batcher
                else client.complete_run(ctx.lease, output)
            )
        except GatewayHTTPError as exc:
            if exc.status != 400:
                raise
            ctx.failure_code = "output_refused"
            return _fail(ctx, "output_refused", f"the gateway refused the output: {exc}", batcher)
        if done.outcome != "calls_in_flight":
            return "completed" if done.outcome == "finished" else _unless_parked(ctx, "lost")
        if time.monotonic() > settle:
            break
        try:
            ctx._await_calls()
        except (RunAborted, _Parked):
            return _unless_parked(ctx, "lost")
        if ctx.lost.wait(APPROVAL_RETRY_SECONDS):
            return "lost"
    ctx.failure_code = "calls_in_flight"
    seqs = ", ".join(str(seq) for seq in done.data.get("seqs") or ())
    message = f"call(s) {seqs} of this run were never recorded; cannot complete"
    return _fail(ctx, "calls_in_flight", message, batcher)


def _fail(ctx: RemoteRunContext, code: str, message: str, batcher: RunBatcher | None = None) -> str:
    """Fail the run once none of the handler's calls is in flight, under the journal lock
    (:meth:`RemoteRunContext._fail_when_quiet`), then unwind its compensations outside it
    (through ``ctx.client``, the client it was claimed with, and ``batcher``)."""
    try:
        failed = ctx._fail_when_quiet(code, message)
    except (RunAborted, _Parked):  # _Parked: a thread the handler left parked the run meanwhile
        return _unless_parked(ctx, "lost")
    if failed.outcome == "unwinding":
        return unwind(ctx.client, ctx.lease, failed.data["seqs"], batcher)
    return "failed" if failed.outcome == "finished" else _unless_parked(ctx, "lost")


def _unstorable_output(output: Any) -> str | None:
    """Why the server could not store ``output`` as JSON, or None."""
    try:
        text = json.dumps(output, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return f"is not JSON: {describe(exc)}"
    if "\\u0000" in text.replace("\\\\", ""):
        return "holds a NUL character, which jsonb cannot store"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate code point"
    return None


class RemoteRunWorker:
    """The loop of ``work-runs``: one claimer claims as many runs as ``concurrency`` threads are
    free for (long-poll ``wait_seconds``), the threads run them, their journal writes and
    completions go in batches (:class:`RunBatcher`), one thread renews every held lease each
    ``renew_every`` seconds.
    ``linger``: how long the batcher and the claimer wait at most for runs still turning
    around (:class:`RunBatcher`). :meth:`request_stop` drains within ``shutdown_grace``;
    ``run()`` returns the summary."""

    def __init__(
        self,
        client: GatewayClient,
        handler: Callable[[Any], Any],
        *,
        concurrency: int = 1,
        lease_seconds: float | None = None,
        wait_seconds: float = 5.0,
        renew_every: float = 10.0,
        worker_id: str | None = None,
        max_runs: int | None = None,
        idle_exit: float | None = None,
        shutdown_grace: float = 30.0,
        accept: bool = True,
        accept_batch: int = 50,
        linger: float = LINGER,
    ) -> None:
        # Checked as the command line checks them (a worker built in code is held to the same).
        checked_handler(handler)
        concurrency = checked_count(concurrency, "concurrency", 1, MAX_CONCURRENCY)
        accept_batch = checked_count(accept_batch, "accept_batch", 1, MAX_ACCEPT_BATCH)
        if max_runs is not None:
            max_runs = checked_count(max_runs, "max_runs", 1)
        if lease_seconds is not None:
            lease_seconds = checked_seconds(lease_seconds, "lease_seconds")
        wait_seconds = checked_seconds(wait_seconds, "wait_seconds", zero=True)
        renew_every = checked_seconds(renew_every, "renew_every")
        if idle_exit is not None:
            idle_exit = checked_seconds(idle_exit, "idle_exit")
        shutdown_grace = checked_seconds(shutdown_grace, "shutdown_grace", zero=True)
        linger = checked_seconds(linger, "linger", zero=True)
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id.strip() or len(worker_id) > 200):
            raise ValueError(f"worker_id must be None or 1..200 characters, not blank, got {str(worker_id)[:80]!r}")
        self.client, self.handler, self.concurrency, self.linger = client, handler, concurrency, linger
        self.accept, self.accept_batch = accept, accept_batch
        self.lease_seconds, self.wait_seconds, self.renew_every = lease_seconds, wait_seconds, renew_every
        self.worker_id, self.max_runs, self.idle_exit, self.shutdown_grace = (
            worker_id,
            max_runs,
            idle_exit,
            shutdown_grace,
        )
        self.stop = threading.Event()
        self.reason = "stopped"
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._held: dict[str, RemoteRunContext] = {}
        self._reached = time.monotonic()  # when a claim last got through (or the start)
        self._last_work = time.monotonic()
        self.internal_error: str | None = None
        self.batcher: RunBatcher | None = None
        self._ready: queue.Queue[RemoteRunClaim] = queue.Queue()
        self._busy = 0  # runs claimed and not yet worked to their resting point
        self._slot_free = threading.Event()
        self._claimer: threading.Thread | None = None

    def request_stop(self, reason: str) -> None:
        """Stop claiming; in-flight runs reach their resting point (drain)."""
        if not self.stop.is_set():
            self.reason = reason
            self.stop.set()

    def _guarded(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException:  # never silent: the run stops with exit 1 (see run())
                logger.exception("worker_error: a worker thread stopped")
                with self._lock:
                    self.internal_error = "internal_error: a worker thread stopped"
                self.request_stop("internal_error")

        return run

    def _claim_loop(self) -> None:
        """One claimer for every run thread: claims as many runs as there are free threads in
        one request (long-poll), so the run threads start together and their journal writes
        share batches."""
        retrying = backoff.Retrying(CLAIM_RETRY_BASE, CLAIM_RETRY_MOST)
        while not self.stop.is_set():
            with self._lock:
                if self.max_runs is not None and self.counts["claimed"] >= self.max_runs:
                    self.request_stop("max_runs")
                    return
                want = self.concurrency - self._busy
                if self.max_runs is not None:
                    want = min(want, self.max_runs - self.counts["claimed"])
            if want <= 0:
                if self._slot_free.wait(0.5) and self.batcher is not None:
                    # Runs answered together end together: claim once for all their slots
                    # (else one claim per slot freed first, and the runs claimed apart step apart).
                    self.batcher.settle(self.batcher.linger)
                self._slot_free.clear()
                continue
            claims: list[RemoteRunClaim] | None
            try:
                claims = self.client.claim_runs(
                    min(want, 100),
                    wait_seconds=self.wait_seconds,
                    lease_seconds=self.lease_seconds,
                    worker_id=self.worker_id,
                )
            except Exception as exc:  # the gateway is unreachable or refused: retry later (backoff)
                logger.warning("claim_error: %s", exc)
                with self._lock:
                    self.counts["errors"] += 1
                self.stop.wait(claim_retry_wait(retrying, exc, self.idle_exit))
                # No run could be claimed: idle, as an empty claim is (--idle-exit), once no claim
                # has got through for UNREACHABLE_IDLE_SECONDS (a gateway's restart is not a drain).
                claims = None
            else:
                self._reached = time.monotonic()
                retrying.reset()
            if not claims:
                with self._lock:
                    idle = self._busy == 0 and (claims is not None or unreachable_for_long(self._reached))
                if idle and self.idle_exit is not None and time.monotonic() - self._last_work > self.idle_exit:
                    self.request_stop("idle")
                continue
            with self._lock:
                self.counts["claimed"] += len(claims)
                self._busy += len(claims)
                self._last_work = time.monotonic()
            if self.batcher is not None:
                self.batcher.expect([claim.lease.run_id for claim in claims])
            for claim in claims:
                self._ready.put(claim)

    def _run_loop(self) -> None:
        """A run thread: works the claimed runs handed to it; after a stop, drains what was
        claimed (those leases are held) and returns."""
        while True:
            try:
                claim = self._ready.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set() and not self._more_to_come():
                    return
                continue
            try:
                self._work(claim)
            finally:
                with self._lock:
                    self._busy -= 1
                if self.batcher is not None:
                    self.batcher.leave(claim.lease.run_id)
                self._slot_free.set()

    def _more_to_come(self) -> bool:
        claimer = self._claimer
        return (claimer is not None and claimer.is_alive()) or not self._ready.empty()

    def _work(self, claim: RemoteRunClaim) -> None:
        try:
            ctx = RemoteRunContext(self.client, claim, self.batcher)
            with self._lock:
                self._held[claim.lease.run_id] = ctx
            try:
                result = run_remote_claim(self.client, claim, self.handler, ctx, self.batcher)
            finally:
                with self._lock:
                    self._held.pop(claim.lease.run_id, None)
        except BaseException as exc:  # the gateway unreachable mid-run, a refused request: that lease lapses
            logger.warning("run_error run=%s: %s", claim.lease.run_id, describe(exc))
            result = "errors"
        else:  # the worker's own line per run at -v 1, as run_agent_worker's (completed run=...)
            if ctx.failure_code is not None and result != "lost":  # failed (or unwound): say why
                logger.info("%s run=%s code=%r", result, claim.lease.run_id, ctx.failure_code)
            else:
                logger.info("%s run=%s", result, claim.lease.run_id)
        with self._lock:
            self.counts[result] += 1
            self._last_work = time.monotonic()

    def _renew_loop(self, done: threading.Event) -> None:
        while not done.wait(self.renew_every):
            with self._lock:
                held = list(self._held.values())
            groups: dict[tuple[str, str], list[RemoteRunContext]] = defaultdict(list)
            for ctx in held:
                groups[(ctx.lease.community_id, ctx.lease.worker_id)].append(ctx)
            for ctxs in groups.values():
                for start in range(0, len(ctxs), 100):  # one request per community (100 a batch)
                    self._renew(ctxs[start : start + 100])

    def _renew(self, ctxs: list[RemoteRunContext]) -> None:
        try:
            outcomes = self.client.heartbeat_runs([ctx.lease for ctx in ctxs], self.lease_seconds)
        except Exception as exc:  # never let the renewer die: every lease would lapse
            logger.warning("heartbeat_error runs=%d: %s", len(ctxs), exc)
            return
        for ctx, outcome in zip(ctxs, outcomes, strict=True):
            if outcome.outcome == "renewed" and outcome.lease is not None:
                ctx.lease = outcome.lease
                with self._lock:
                    self.counts["renewed"] += 1
            else:
                ctx.mark_lost(outcome.data.get("reason"))

    def _start_acceptor(self) -> Any:
        if not self.accept:
            return None
        from buzz_delivery.gateway.remote_accept import RemoteAcceptor

        def worked() -> None:
            with self._lock:
                self._last_work = time.monotonic()

        acceptor = RemoteAcceptor(
            self.client,
            stop=self.stop,
            batch=self.accept_batch,
            wait_seconds=self.wait_seconds,
            lease_seconds=self.lease_seconds,
            on_work=worked,
        )
        acceptor.start()
        return acceptor

    def run(self) -> dict[str, Any]:
        """Run until stopped; returns ``{key: count for SUMMARY_KEYS} | {"reason"}``."""
        done = threading.Event()
        self.batcher = RunBatcher(self.client, linger=self.linger)
        renewer = threading.Thread(target=self._renew_loop, args=(done,), name="run-renewer", daemon=True)
        renewer.start()
        self._claimer = threading.Thread(target=self._guarded(self._claim_loop), name="run-claimer", daemon=True)
        self._claimer.start()
        threads = [
            threading.Thread(target=self._guarded(self._run_loop), name=f"run-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for t in threads:
            t.start()
        acceptor = self._start_acceptor()
        stopped_at: float | None = None
        while any(t.is_alive() for t in threads):
            if self.stop.is_set():
                stopped_at = stopped_at if stopped_at is not None else time.monotonic()
                if time.monotonic() - stopped_at > self.shutdown_grace:
                    # The claimer's long-poll may still bring runs: wait for it, so they are
                    # counted abandoned below rather than left unseen to lapse.
                    if self._claimer is not None:
                        self._claimer.join(timeout=self.wait_seconds + self.client.timeout)
                    with self._lock:
                        abandoned = list(self._held.values())
                        self._held.clear()
                        self.counts["abandoned"] += len(abandoned)
                        while not self._ready.empty():  # claimed, never started: their leases lapse
                            self._ready.get_nowait()
                            self.counts["abandoned"] += 1
                    for ctx in abandoned:
                        ctx.mark_lost("abandoned")
                    break
            for t in threads:
                t.join(timeout=0.1)
        done.set()
        renewer.join(timeout=5)
        self.batcher.close()
        if acceptor is not None:
            acceptor.join(timeout=self.wait_seconds + self.client.timeout)
            self.counts["accepted"] = acceptor.counts["accepted"]
            self.counts["accept_errors"] = acceptor.counts["errors"]  # deliveries whose accept failed
            self.counts["errors"] += acceptor.counts["claim_errors"]  # its claims, as the runs' claims
        summary: dict[str, Any] = {k: self.counts.get(k, 0) for k in SUMMARY_KEYS}
        summary["reason"] = self.internal_error or self.reason
        if self.internal_error:
            summary["exit_code"] = EXIT_ERROR
        else:
            summary["exit_code"] = EXIT_ABANDONED if summary["abandoned"] else EXIT_OK
        return summary

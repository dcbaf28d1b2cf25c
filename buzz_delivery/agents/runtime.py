"""The agent runtime (SPEC 12 "Runtime"): handlers ``handler(ctx) -> output`` given by dotted path.

:class:`Context` is what a handler gets: ``ctx.call(tool_name, fn, args, *, compensate=None,
reconcile=None, destructive=False, cost=0)`` journals a call before making it and records its
result; ``ctx.request_approval(prompt, deadline_seconds)`` parks the run (the handler is
stopped) and, once decided, returns the decision when the run is resumed; ``ctx.cancelled``
says a cancel fenced the run (the heartbeat learnt it); ``ctx.emit(chunk)`` appends text to the
run's output stream under its lease (readers follow it live: ``services.stream_output``).

Resume: a handler is re-run from the start whenever its run is claimed again (after a reclaim
or an approval); call ``k`` of scope ``S`` (``ctx.scope``, :mod:`buzz_delivery.journal_scope`; the
root scope ``""`` unless the code entered one) is the journal entry keyed ``(S, k)``, so calls of
different scopes replay whatever order they arrive in. A succeeded entry returns
its recorded output without calling ``fn``; a pending one (its holder crashed after
journaling) is reconciled with ``reconcile(args, key)`` (its output, or :data:`NOT_MADE` to make
the call now with the same key), else marked uncertain and the run fails, compensating it too.

Tools: ``fn(args, key) -> output`` (JSON), ``key`` the journal's idempotency key.
Compensations: ``compensate(args, output, key)``, a function registered with
:func:`buzz_delivery.agents.compensations.compensation` (the journal stores its registered name;
the worker that unwinds looks the name up in its own registry and never imports it); run in
reverse order on failure.

User code (the handler, its tools, reconcile hooks and compensations) runs on a connection of
its own (:class:`~buzz_delivery.usercode.UserConnection`), never the one the runtime journals and
settles on: a handler that leaves a transaction open, turns autocommit off, sets a session
``statement_timeout`` or has its connection terminated cannot make a journal entry or a
completion wait in (or vanish with) its transaction; what it left open is rolled back and the
run fails with ``transaction_left_open``. Whatever the handler raises (a ``BaseException``
included: ``handler_aborted``) or returns (output that is not storable JSON:
``output_not_json``/``output_too_large``) ends that run with a storable failure code, never the
worker. A runtime statement whose connection fails leaves the run to its lease (``lost``: the
reaper reclaims it and it resumes from its journal). Several threads of one handler may call
``ctx.call`` at once (their entries are journaled one at a time; each thread that calls at the
same time as others should enter a scope of its own, ``with ctx.scope(name):``, for its calls to
replay whatever the timing).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, OperationalError, connections

from buzz_delivery import journal_scope
from buzz_delivery.agents import compensations
from buzz_delivery.agents import services as s
from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.exceptions import (
    AgentError,
    ApprovalBlockedByCalls,
    ApprovalExpired,
    BudgetExhausted,
    NestedCall,
    OutputLimitExceeded,
    ReplayMismatch,
    RunAborted,
    ToolCallFailed,
    UncertainCall,
)
from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.agents.services import batch
from buzz_delivery.agents.services.common import sha256_json
from buzz_delivery.agents.services.output import chunk_value
from buzz_delivery.exceptions import in_chain
from buzz_delivery.inflight import InFlightCalls, when_quiet
from buzz_delivery.lockwaits import tried_last
from buzz_delivery.services import ratelimits
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded, node_lost
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work
from buzz_delivery.usercode import TRANSACTION_LEFT_OPEN, UserCode, UserConnection, discard_connection, in_transaction
from buzz_delivery.worker.handlers import describe, storable_text
from buzz_delivery.worker.renewer import lock_wait_ms
from buzz_delivery.workflows.services.common import BadJSON, json_text

logger = logging.getLogger("buzz_delivery.agents")
T = TypeVar("T")

NOT_MADE = object()  # a reconcile hook's answer: the call never reached the tool

FAILURE_CODE_MAX_CHARS = 64
FAILURE_MESSAGE_MAX_CHARS = 10_000
HANDLER_ABORTED = "handler_aborted"  # the handler raised a BaseException (SystemExit, ...)


def failure_code_of(exc: BaseException) -> str:
    """The failure code a run records for a handler that raised ``exc``: an
    :class:`AgentError`'s own ``failure_code`` made storable (1..64 characters), else
    ``handler_error`` (``handler_aborted`` for a ``BaseException`` that is not an ``Exception``)."""
    default = "handler_error" if isinstance(exc, Exception) else HANDLER_ABORTED
    if not isinstance(exc, AgentError):
        return default
    try:
        code = exc.failure_code
    except BaseException:
        return default
    text = storable_text(code, FAILURE_CODE_MAX_CHARS) if isinstance(code, str) else ""
    return text if text.strip() else default


def failure_message_of(exc: BaseException) -> str:
    """``Type: text`` of ``exc``, storable and bounded, even when its ``str()`` raises."""
    return storable_text(f"{type(exc).__name__}: {describe(exc)}", FAILURE_MESSAGE_MAX_CHARS)


def _messages(exc: ValidationError) -> str:
    return "; ".join(str(m) for m in exc.messages)


# A wait for a rate limit sleeps in slices of at most this, to notice a lost lease meanwhile.
RATE_WAIT_SLICE_SECONDS = 0.5
APPROVAL_RETRY_SECONDS = 0.05  # request_approval: how often it looks again for its calls in flight
# request_approval: how long the server may see a call in flight that no call of the handler runs
# (its result being recorded as the park read, normally well under a second)
APPROVAL_SETTLE_SECONDS = 10.0
# A failing run waits for its calls in flight under the journal lock this long at first (then twice
# as long each round, the lock let go in between for a call a tool in flight waits for).
QUIET_HOLD_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class RatePlan:
    """What a call with a ``rate_key`` takes: ``before`` units before it is journaled, and
    ``after(output)`` units charged once it succeeded (a callable weight), if any."""

    spec: ratelimits.RateLimitSpec
    before: int
    after: Callable[[Any], int] | None

    def units_after(self, output: Any) -> int:
        assert self.after is not None
        units = self.after(output)
        if isinstance(units, bool) or not isinstance(units, int) or not 0 <= units <= ratelimits.MAX_LIMIT:
            raise ValidationError(
                {"weight": f"weight(output) must return an int within 0..{ratelimits.MAX_LIMIT}, got {units!r}"}
            )
        return units


def ratelimits_plan(rate_key: str | None, weight: Any) -> RatePlan | None:
    """Validate a call's ``rate_key`` and ``weight`` before anything is journaled: None without
    a key; an undeclared key or a weight that is neither an int in ``0..limit`` nor a callable
    raises ``ValidationError`` naming the field."""
    if rate_key is None:
        return None
    spec = ratelimits.rate_limit_of(rate_key)
    if callable(weight):
        return RatePlan(spec=spec, before=0, after=weight)
    return RatePlan(spec=spec, before=ratelimits.check_weight(weight, spec), after=None)


class _Parked(BaseException):
    """Internal: the run parked on an approval; the handler stops here. A ``BaseException``, as
    ``asyncio.CancelledError`` is: ``except Exception`` around the park (a tool wrapper, a retry
    library) lets it through. One that still catches it cannot unpark the run: the runtime judges
    by its own record (``Context.parked``), so the turn ends ``parked`` (docs/agents.md)."""


class Context:
    """What a handler gets for one claimed run: ``run`` (the row as claimed), ``input``,
    ``shadow``, :meth:`call`, :meth:`request_approval`, :attr:`cancelled`, and ``lease`` (the
    current :class:`~buzz_delivery.agents.services.AgentLease`, renewed in the background)."""

    journal_scopes = True  # calls are replayed by scope (ctx.scope): integrations may run them at once

    @tenant_scoped
    def __init__(self, claim: s.AgentClaim) -> None:
        self.run = claim.run
        self.lease = claim.lease
        self.input = claim.run.input
        self.shadow = claim.run.shadow
        self.lost = threading.Event()
        self._cancelled = threading.Event()
        self._positions = journal_scope.Positions()  # each scope's last call (docs/agents.md "Resume")
        self._journal = {
            e.replay_key: e
            for e in JournalEntry.objects.filter(community_id=claim.lease.community_id, run_id=claim.lease.run_id)
        }
        self.replayed = 0
        self.failure_code: str | None = None  # set by run_claim when it fails the run (for the worker's line)
        # The approval this turn parked on, once written: every later call raises _Parked again
        # and the turn ends parked, whatever the handler does after (it may catch _Parked).
        self.parked: Any = None
        self.lane: UserConnection | None = None  # set by run_claim: the user's connection
        self._journaling = threading.Lock()  # parallel ctx.call: one journal write at a time
        # Calls of this handler journaled (or being journaled) and not yet recorded: an approval
        # request waits for them (the run cannot park with one of its own calls in flight).
        self._calls = InFlightCalls()
        self._inside = threading.local()  # .scopes: the scopes of this thread's calls' bodies, innermost last
        self.rate_waits = 0  # how many times a call waited for its rate limit (under _counting)
        self._counting = threading.Lock()
        # ctx.emit: chunks the run had when claimed (a resumed handler's first emits are these).
        self._emitted_before = claim.run.output_chunks
        self._emit_pos = 0
        self._emitting = threading.Lock()

    @contextlib.contextmanager
    def _runtime(self) -> Iterator[None]:
        """The block's statements are the runtime's: on its own connection, never the user's. One
        whose connection fails marks the run lost (its lease lapses; it resumes from the journal)."""
        with self.lane.runtime() if self.lane is not None else contextlib.nullcontext():
            try:
                yield
            except DatabaseError as exc:
                db = connections[DEFAULT_DB_ALIAS]
                if in_transaction(db):
                    raise  # a caller's transaction (a test's): not ours to judge
                logger.warning("db_error run=%s: %s; the run is left to its lease", self.run.id, describe(exc))
                discard_connection(db)
                self.mark_lost("db_error")
                raise RunAborted(f"the runtime's database connection failed: {describe(exc)}") from exc

    @property
    def cancelled(self) -> bool:
        """True once a heartbeat learnt the run was cancelled (the handler should stop)."""
        return self._cancelled.is_set()

    @staticmethod
    def scope(name: str) -> contextlib.AbstractContextManager[str]:
        """A replay scope for calls made at the same time: ``with ctx.scope(name):`` makes the
        block's calls the calls of scope ``name`` (inside the scope current where it is
        created: create it where a thread is started, enter it in that thread), each replayed
        by its index in that scope whatever the other scopes' calls did meanwhile (docs/agents.md
        "Resume", "Parallel calls"). One ``with`` per object; raises ``ValueError`` for a blank name."""
        return journal_scope.scoped(name)

    def tools_journaled(self) -> list[tuple[str, str]]:
        """``(scope, tool_name)`` of each tool call the run had journaled when it was claimed, by
        replay key (an integration tells by them how an earlier release journaled the run)."""
        return [(k[0], e.tool_name) for k, e in sorted(self._journal.items()) if e.kind == "tool"]

    def journaled_cost(self, scope: str) -> int | None:
        """The cost the first tool call journaled in ``scope`` (a key) was charged with, when the
        run had one there when it was claimed (an integration tells by it which call an earlier
        release charged a model response's usage with); else None."""
        first = min(
            ((k[1], e.cost) for k, e in self._journal.items() if k[0] == scope and e.kind == "tool"), default=None
        )
        return None if first is None else first[1]

    def mark_lost(self, reason: str) -> None:
        self.lost.set()
        if reason == "cancelled":
            self._cancelled.set()

    def _check(self) -> None:
        if self.parked is not None:  # the park was swallowed: nothing more under a released lease
            raise _Parked(self.parked)
        if self.lost.is_set():
            raise RunAborted("the run's lease was lost")

    @tracing_work.tool_call_span
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
        rate_key: str | None = None,
        weight: int | Callable[[Any], int] = 1,
    ) -> Any:
        """Journal, make and record one tool call (or replay it); returns its output (None for
        a shadow-blocked call). Raises :class:`ToolCallFailed`, :class:`BudgetExhausted`,
        :class:`UncertainCall`, :class:`ReplayMismatch` or :class:`RunAborted`.

        ``rate_key``: a key of ``BUZZ_DELIVERY["RATE_LIMITS"]`` (docs/flow-control.md). Before
        the call is journaled it takes ``weight`` units of that key (an int), waiting (sleeping
        the seconds the database says, then taking again) while the key's window is full; a
        ``weight`` that is a callable ``weight(output) -> int`` is charged after the call from
        its output (the call itself waits only while the window is over its limit). The wait
        is taken with the journal lock let go (the run's other threads' calls, its approval and
        its end go on meanwhile): the call keeps the index it took when called and is journaled
        at it once its units are granted. Units taken for a call whose tool is then never made
        (its journal write refused, or shadow-blocked) are given back to their window. A
        replayed call takes nothing. An undeclared key or a bad weight raises
        ``ValidationError`` before anything is journaled."""
        rate = ratelimits_plan(rate_key, weight)
        self._check()
        self._refuse_nested(tool_name)
        return self._call(tool_name, fn, args, compensate, reconcile, destructive, cost, rate)

    def _call(
        self,
        tool_name: str,
        fn: Callable[[Any, str], Any],
        args: Any,
        compensate: Callable[[Any, Any, str], Any] | None,
        reconcile: Callable[[Any, str], Any] | None,
        destructive: bool,
        cost: int,
        rate: RatePlan | None,
    ) -> Any:
        scope = journal_scope.current_key()  # a deep path by its stable key
        with self._journaling:
            # Parked (or lost) while it waited for the lock (the park is written under it): it
            # raises as every later call does, nothing taken, no statement sent.
            self._check()
            # The index is the call's from here, whatever the wait below: a resumed handler makes
            # the scope's calls in the same order and replays each from its own entry (an index
            # taken once the units were granted went to whichever call of the scope came next).
            index = self._positions.take(scope)
            entry = self._journal.get((scope, index))
            outcome: Any = None
            descriptor = None if entry is not None else compensations.descriptor(compensate)  # ValueError
            waits = entry is None and rate is not None
            if waits:  # its input checked before its take: bad input spends nothing of the window
                batch.prepare_call(
                    self.lease,
                    tool_name,
                    args,
                    cost=cost,
                    compensation=descriptor,
                    destructive=destructive,
                    scope=scope,
                    index=index,
                )
            else:
                if entry is None:
                    outcome = self._journal_call(tool_name, args, cost, descriptor, destructive, scope, index)
                self._calls.enter(entry.seq if entry is not None else getattr(outcome, "seq", 0))
        give_back: tuple[RatePlan, ratelimits.Granted] | None = None
        if waits:
            # A new call with a rate limit: its units taken with the journal lock let go, so the
            # run's other calls, its approval and its end do not wait for the provider's window;
            # its entry is written at its index once they are granted.
            assert rate is not None
            granted = self._take_rate(rate)
            with self._journaling:
                try:
                    self._check()
                except (RunAborted, _Parked):  # lost, or parked by another thread, during the take
                    self._give_back(rate, granted)  # nothing journaled: its units go back
                    raise
                outcome = self._journal_call(tool_name, args, cost, descriptor, destructive, scope, index)
                self._calls.enter(getattr(outcome, "seq", 0))
            if not isinstance(outcome, s.Journaled):
                give_back = (rate, granted)
        inside = journal_scope.inside_call(scope, index)
        self._inside.scopes = (*getattr(self._inside, "scopes", ()), inside)
        try:
            # Refused, or shadow-blocked: its tool is never made, its units go back. Inside the
            # try: a give-back that raises (the key's limit lowered in the settings since the
            # take) still counts the call out of flight, or the run's end waited for it for ever.
            if give_back is not None:
                self._give_back(*give_back)
            with journal_scope.entered(inside):
                return self._called(entry, outcome, tool_name, fn, args, reconcile, rate)
        finally:
            self._inside.scopes = self._inside.scopes[:-1]
            self._calls.leave()

    def _journal_call(
        self, tool_name: str, args: Any, cost: int, descriptor: Any, destructive: bool, scope: str, index: int
    ) -> Any:
        """The new call at ``(scope, index)`` journaled (the journal lock held): its outcome."""
        with self._runtime():
            return s.journal_call(
                self.lease,
                tool_name,
                args,
                cost=cost,
                compensation=descriptor,
                destructive=destructive,
                scope=scope,
                index=index,
            )

    def _refuse_nested(self, tool_name: str) -> None:
        """A call from inside one of this run's calls' tool (or reconcile) function on the same
        thread: :class:`NestedCall`, nothing journaled. A resumed run replays the outer call from
        the journal without running its function, so the nested call's entry would never be
        consumed. Calls a tool runs on threads of its own are not nested: allowed; so is a call
        made on this thread in a scope outside the call's own (an integration serving the calls
        of several scopes at once from the handler's thread, each in its tool call's scope)."""
        outer = self._calls.outer()
        scopes = getattr(self._inside, "scopes", ())
        # Nested in any call of this thread (not only the innermost: the thread bridge serves
        # another scope's call from inside one's serving, and that one's body may ask); a call in
        # a scope outside them all is allowed.
        if outer is not None and journal_scope.within(journal_scope.current(), scopes):
            raise NestedCall(tool_name, outer)

    def _called(
        self,
        entry: Any,
        outcome: Any,
        tool_name: str,
        fn: Callable[[Any, str], Any],
        args: Any,
        reconcile: Callable[[Any, str], Any] | None,
        rate: RatePlan | None,
    ) -> Any:
        """The call once it holds its journal position: replayed, or made and recorded."""
        if entry is not None:
            return self._replay(entry, tool_name, fn, args, reconcile)
        if isinstance(outcome, s.Blocked):
            return None
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted ({outcome.used}/{outcome.cap})")
        if not isinstance(outcome, s.Journaled):
            self.lost.set()
            raise RunAborted(f"cannot journal: {outcome}")
        output = self._make(outcome.seq, outcome.idempotency_key, fn, args)
        if rate is not None and rate.after is not None:
            units = rate.units_after(output)
            with self._runtime():
                ratelimits.charge(self.lease.community_id, rate.spec.key, units)
        return output

    def _take_rate(self, rate: RatePlan) -> ratelimits.Granted:
        """Take ``rate``'s units before the call, sleeping through each :class:`Wait` (never a
        failure of the run); a lease lost meanwhile stops the wait (:class:`RunAborted`)."""
        while True:
            with self._runtime():
                outcome = ratelimits.take(self.lease.community_id, rate.spec.key, rate.before)
            if isinstance(outcome, ratelimits.Granted):
                return outcome
            with self._counting:  # calls of several threads wait at once
                self.rate_waits += 1
            deadline = time.monotonic() + outcome.seconds
            while (left := deadline - time.monotonic()) > 0:
                if self.lost.wait(min(left, RATE_WAIT_SLICE_SECONDS)):
                    raise RunAborted("the run's lease was lost while waiting for its rate limit")
            self._check()

    def _give_back(self, rate: RatePlan, granted: ratelimits.Granted) -> None:
        """The units a call took for a tool it never made (its journal write refused: the run
        ended, parked or cancelled, its lease lost, a budget; shadow-blocked; or the run lost
        before it was journaled) given back to the window they were taken in
        (``ratelimits.give_back``: not carried over once the window moved on), as the delivery
        worker gives back a claim's units it did not use. A failure only logs: the units stay
        spent for this window (never granted twice)."""
        if rate.before <= 0:
            return
        with self.lane.runtime() if self.lane is not None else contextlib.nullcontext():
            try:
                ratelimits.give_back(self.lease.community_id, rate.spec.key, rate.before, granted.window_start)
            except DatabaseError as exc:
                db = connections[DEFAULT_DB_ALIAS]
                if in_transaction(db):
                    raise  # a caller's transaction (a test's): not ours to judge
                logger.info("rate_give_back_refused run=%s key=%s: %s", self.run.id, rate.spec.key, describe(exc))
                if isinstance(exc, (OperationalError, InterfaceError)):
                    discard_connection(db)

    def emit(self, chunk: str) -> int | None:
        """Append ``chunk`` (text, at most ``MAX_CHUNK_BYTES`` of UTF-8, no NUL) to the run's
        output stream, under the run's current lease as a journal entry is; returns its ``seq``
        (gapless from 1). An empty chunk writes nothing (None). Resume: emit ``n`` of a handler
        re-run after a reclaim or an approval is chunk ``n``; those the run already has are not
        written again (as ``ctx.call`` replays its journal). Raises ``ValidationError`` (field
        ``chunk``), :class:`OutputLimitExceeded` (the run's ``MAX_STREAM_BYTES``; nothing
        written) or :class:`RunAborted` (the lease was lost: nothing written)."""
        if isinstance(chunk, str) and not chunk:
            return None
        chunk_value(chunk, get_settings().max_chunk_bytes)
        self._check()
        with self._emitting:
            if self._emit_pos < self._emitted_before:
                self._emit_pos += 1
                return self._emit_pos
            with self._runtime():
                outcome = s.emit_output(self.lease, chunk)
            if isinstance(outcome, s.Emitted):
                self._emit_pos = outcome.seq
                return outcome.seq
        if isinstance(outcome, s.TooLarge):
            raise OutputLimitExceeded(f"{outcome.field}: {outcome.used} + {outcome.size} bytes is over {outcome.cap}")
        self.mark_lost(getattr(outcome, "reason", "") or "lost")
        raise RunAborted(f"cannot emit: {outcome}")

    def _make(self, seq: int, key: str, fn: Callable[[Any, str], Any], args: Any) -> Any:
        started = time.monotonic()
        try:
            output = fn(args, key)
        except Exception as exc:
            if self.lost.is_set() and in_chain(exc, RunAborted) is not None:
                # The runtime aborted inside the tool (its own ctx.emit or ctx.call met a failed
                # connection or a lost lease): the tool did not fail, it was stopped. The call
                # stays pending (reconciled or uncertain on resume), not recorded failed: a
                # resumed run would replay that failure, fail and compensate. A tool that failed
                # on its own once the run was marked lost (the handler deadline, the shutdown
                # grace: the lease still holds) records its true failure, as a success would.
                raise RunAborted(f"the run was lost during call {seq}") from exc
            self._record(seq, ok=False, error=failure_message_of(exc), started=started)
            raise ToolCallFailed(f"{seq}: {describe(exc)}") from exc
        return self._record_output(seq, output, started)

    def _record_output(self, seq: int, output: Any, started: float) -> Any:
        """Record call ``seq`` succeeded with ``output``; an output that cannot be stored records
        the call failed and uncertain (it was made: it is compensated like a succeeded one)."""
        try:
            self._record(seq, ok=True, output=output, started=started)
        except ValidationError as exc:
            error = f"uncertain: the tool's output cannot be stored: {_messages(exc)}"
            self._record(seq, ok=False, uncertain=True, error=storable_text(error, 10_000), started=started)
            raise ToolCallFailed(f"{seq}: {error}") from None
        return output

    def _record(self, seq: int, *, started: float, **kwargs: Any) -> None:
        latency = int((time.monotonic() - started) * 1000)
        with self._runtime():
            outcome = s.record_call_result(self.lease, seq, latency_ms=latency, **kwargs)
        if not isinstance(outcome, (s.Recorded, s.AlreadyRecorded)):
            self.lost.set()
            raise RunAborted(f"cannot record call {seq}: {outcome}")

    def _replay(self, entry: JournalEntry, tool_name: str, fn: Any, args: Any, reconcile: Any) -> Any:
        if entry.kind != "tool" or entry.tool_name != tool_name or bytes(entry.input_hash) != sha256_json(args):
            raise ReplayMismatch(f"call {entry.seq} was {entry.kind} {entry.tool_name!r}, now {tool_name!r}")
        if entry.status == "succeeded":
            self.replayed += 1
            return entry.output
        if entry.status == "failed":
            if entry.blocked_reason:
                return None
            raise ToolCallFailed(f"{entry.seq}: {entry.error}")
        # pending: its holder crashed between journaling and recording.
        if reconcile is None:
            self._record(
                entry.seq, ok=False, uncertain=True, error="uncertain: no reconcile hook", started=time.monotonic()
            )
            raise UncertainCall(f"call {entry.seq} ({tool_name}) may or may not have happened")
        started = time.monotonic()
        try:
            found = reconcile(args, entry.idempotency_key)
        except Exception as exc:  # cannot tell: uncertain, compensated with the others
            error = storable_text(f"uncertain: the reconcile hook raised {failure_message_of(exc)}", 10_000)
            self._record(entry.seq, ok=False, uncertain=True, error=error, started=started)
            raise UncertainCall(f"call {entry.seq} ({tool_name}): {error}") from exc
        if found is NOT_MADE:
            return self._make(entry.seq, entry.idempotency_key, fn, args)
        return self._record_output(entry.seq, found, started)

    def _await_calls(self) -> None:
        """Wait until none of this handler's calls is in flight but this thread's own (the other
        threads' run on, their lease renewed by the heartbeat); a lease lost meanwhile stops the
        wait (:class:`RunAborted`)."""
        self._calls.wait_for_others(self._check, APPROVAL_RETRY_SECONDS)
        self._check()

    def _fail_when_quiet(self, code: str, message: str) -> Any:
        """``fail_run`` once none of the other threads' calls is in flight, written under the
        journal lock: a call journaled after the wait for the calls in flight and before the
        failure (a thread the handler left behind) was closed uncertain and its compensation run
        while its tool still ran (the undo before the effect, which stayed); one that asks after
        the failure is refused. The calls are waited for under the lock, a while at a time
        (``QUIET_HOLD_SECONDS``, doubled each round), as the event-loop runtime's ``quiet()``:
        waited for outside it, a thread calling again and again took the lock in each gap and
        the run never failed while it called; held until they end, a tool waiting for a call of
        another thread would wait for ever (that call is let in between two rounds:
        :func:`~buzz_delivery.inflight.when_quiet`)."""

        def fail() -> Any:
            self._check()  # a leftover thread parked the run (or it was lost) meanwhile
            return _settle(s.fail_run, self.lease, code, message)

        return self._when_quiet(fail)

    def _when_quiet(self, then: Callable[[], T], at_once: Callable[[], bool] | None = None) -> T:
        """``then()`` under the journal lock once the other threads' calls ended (or ``at_once()``),
        :func:`~buzz_delivery.inflight.when_quiet`; a lease lost meanwhile raises :class:`RunAborted`."""
        hold, every = QUIET_HOLD_SECONDS, APPROVAL_RETRY_SECONDS
        return when_quiet(self._journaling, self._calls, self._check, self.lost, then, at_once, hold=hold, every=every)

    def request_approval(self, prompt: str = "", deadline_seconds: int = 86400) -> dict[str, Any]:
        """Ask a human (the engine's approvals queue). The first time, parks the run and stops
        the handler; when the run resumes, returns ``{"decision": "approved"|"rejected",
        "decided_by"}``. Called while other calls of the handler are in flight (tools run in
        parallel), it first waits for them to be recorded (while the lease holds), then parks.
        Raises :class:`ApprovalExpired` if it expired, :class:`ApprovalBlockedByCalls` when called
        from inside a ``ctx.call`` of this thread (nothing written), :class:`BudgetExhausted`,
        :class:`ReplayMismatch` or :class:`RunAborted`."""
        self._check()
        # The calls in flight are waited for under the journal lock, a while at a time (as the
        # failure's, _fail_when_quiet): waited for outside it, a thread calling again and again
        # took the lock in each gap and the approval waited as long as it called; held until they
        # end, a call nested in one in flight (on its thread, or on threads its tool starts and
        # waits for) journals under that lock, and the approval kept the call it waits for from
        # ending (the run hung, its heartbeat keeping the lease): the lock is let go between two
        # rounds. The park itself is under the lock, as a call's journaling: the approval's
        # position is the seq the server gives it.
        scope = journal_scope.current_key()  # a deep path by its stable key

        def at_once() -> bool:
            # Replayed, or from inside a call of this thread (the server names the call): at once.
            return self._journal.get((scope, self._positions.peek(scope))) is not None or bool(self._calls.own())

        def park() -> tuple[JournalEntry | None, Any]:
            index = self._positions.take(scope)
            entry = self._journal.get((scope, index))
            return entry, None if entry is not None else self._park(prompt, deadline_seconds, scope, index)

        entry, outcome = self._when_quiet(park, at_once)
        if entry is not None:
            if entry.kind != "approval":
                raise ReplayMismatch(f"entry {entry.seq} is a {entry.tool_name!r} call, not an approval")
            if entry.status == "succeeded":
                self.replayed += 1
                return dict(entry.output or {})
            if entry.status == "failed":
                raise ApprovalExpired("the approval expired without a decision")
            raise RunAborted("the approval is still pending")
        if isinstance(outcome, s.ApprovalRequested):
            self.parked = outcome.approval_id
            raise _Parked(outcome.approval_id)
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted")
        self.lost.set()
        raise RunAborted(f"cannot request an approval: {outcome}")

    def _park(self, prompt: str, deadline_seconds: int, scope: str, index: int) -> Any:
        """``request_approval`` (none of the handler's other calls in flight, the journal lock
        held); while the server still sees one (its result being recorded as the park read), ask again shortly."""
        settle: float | None = None
        while True:
            self._check()
            with self._runtime():
                outcome = s.request_approval(
                    self.lease, prompt=prompt, deadline_seconds=deadline_seconds, scope=scope, index=index
                )
            if not isinstance(outcome, s.CallsInFlight):
                return outcome
            if self._calls.own():
                raise ApprovalBlockedByCalls(outcome.seqs, "asked from inside a ctx.call of this thread")
            if settle is None:
                settle = time.monotonic() + APPROVAL_SETTLE_SECONDS
            elif time.monotonic() > settle:
                raise ApprovalBlockedByCalls(outcome.seqs, "never recorded, no call of the handler running")
            if self.lost.wait(APPROVAL_RETRY_SECONDS):
                raise RunAborted("the run's lease was lost while its calls were in flight")


@tenant_scoped
def unwind(lease: s.AgentLease, seqs: tuple[int, ...], lane: UserConnection | None = None) -> str:
    """Run the compensations ``seqs`` (highest first) under ``lease``, each once, stopping at the
    first that fails; then end the run ``failed``. Returns ``compensated``,
    ``compensation_failed`` or ``lost``. Each compensation is user code: it runs on ``lane``
    (the user's connection), and one that raises (anything) or leaves a transaction open fails."""
    if lane is None:
        lane = UserConnection()
        try:
            return unwind(lease, seqs, lane)
        finally:
            lane.close()
    result = "compensated"
    for seq in seqs:
        began = s.begin_compensation(lease, seq)
        if began is None:
            continue
        if not isinstance(began, dict):
            return "lost"
        # The descriptor is data anyone holding the agent's key may have written: its name is
        # looked up in this process's registry, never imported (issue 27).
        function = compensations.resolve(began["compensation"])
        error: str | None = None
        call = UserCode(lease.community_id)  # the user's code, as the handler's: the login's role
        try:
            if function is None:
                raise LookupError(compensations.unregistered_error(began["compensation"]))
            with lane, call, tracing_work.compensation_span(lease, seq):
                function(began["args"], began["output"], began["key"])
        except BaseException as exc:  # SystemExit included: this compensation's failure, never the worker's
            error = failure_message_of(exc)
        if call.left_open is not None:
            error = f"{TRANSACTION_LEFT_OPEN}: the compensation left its connection with {call.left_open}"
        if error is not None:
            logger.warning("compensation_failed run=%s seq=%s: %s", lease.run_id, seq, error)
            if not isinstance(
                s.finish_compensation(lease, seq, ok=False, error=error),
                (s.Recorded, s.AlreadyRecorded),
            ):
                return "lost"
            result = "compensation_failed"
            break
        if not isinstance(s.finish_compensation(lease, seq, ok=True), (s.Recorded, s.AlreadyRecorded)):
            return "lost"
    final = s.fail_run(lease, "compensated")
    if isinstance(final, s.Unwinding):  # a compensation was left by someone else: go again
        return unwind(lease, final.seqs, lane)
    return result if isinstance(final, (s.Finished, s.AlreadyTerminal)) else "lost"


@tenant_scoped
@tracing_work.agent_run_span
def run_claim(
    claim: s.AgentClaim,
    handler: Callable[[Context], Any],
    ctx: Context | None = None,
    lane: UserConnection | None = None,
) -> str:
    """Run one claimed run to its next resting point and say which: ``completed``, ``failed``,
    ``compensated``, ``compensation_failed``, ``parked`` (approval), ``lost`` (lease lost, or a
    runtime statement's connection failed: the lease is left to lapse). ``lane``: the thread's
    :class:`~buzz_delivery.usercode.UserConnection` (a worker keeps one per thread; without it,
    one is opened for this call and closed after)."""
    own = lane is None
    lane = lane or UserConnection()
    try:
        return _run_claim(claim, handler, ctx, lane)
    except DatabaseError as exc:
        db = connections[DEFAULT_DB_ALIAS]
        if in_transaction(db):
            raise
        logger.warning("db_error run=%s: %s; the run is left to its lease", claim.lease.run_id, describe(exc))
        discard_connection(db)
        return "lost"
    finally:
        if own:
            lane.close()


def _run_claim(
    claim: s.AgentClaim, handler: Callable[[Context], Any], ctx: Context | None, lane: UserConnection
) -> str:
    lease = claim.lease
    if claim.run.unwinding:
        if ctx is not None:
            ctx.failure_code = claim.run.failure_code or "unwinding"
        outcome = s.fail_run(lease, claim.run.failure_code or "unwinding")
        if isinstance(outcome, s.Unwinding):
            return unwind(lease, outcome.seqs, lane)
        return "failed" if isinstance(outcome, s.Finished) else "lost"
    ctx = ctx or Context(claim)
    ctx.lane = lane
    call = UserCode(lease.community_id)  # the user's code: the login's role (SPEC 13), its own connection
    failure: tuple[str, str] | None = None
    output: Any = None
    try:
        with lane, call:
            output = handler(ctx)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError...: this run's end
        if ctx.parked is not None:
            return parked_turn(ctx.lease, ctx.parked, None if isinstance(exc, _Parked) else ended_by(exc))
        if isinstance(exc, RunAborted) or ctx.lost.is_set():
            return "lost"
        failure = (failure_code_of(exc), failure_message_of(exc))
    if ctx.parked is not None:
        return parked_turn(ctx.lease, ctx.parked, ended_by(None))
    if ctx.lost.is_set():
        return "lost"
    if call.left_open is not None:
        failure = (
            TRANSACTION_LEFT_OPEN,
            f"the handler left its database connection with {call.left_open}; nothing it wrote there is kept",
        )
    # A call the handler started on another thread and did not wait for is recorded first:
    # completed under it, the call's result could never be recorded (and with it alone in flight
    # the run is not 'running': the completion was refused, the run run again); failed under it,
    # the call was marked uncertain and its compensation run while the tool still ran (the undo
    # before the effect, which stayed).
    try:
        ctx._await_calls()
    except (RunAborted, _Parked):  # _Parked: a thread the handler left parked the run meanwhile
        return _unless_parked(ctx)
    if failure is None:
        try:
            done = _complete(ctx, output)
        except ValidationError as exc:  # not storable JSON: this run's failure, never the worker's
            failure = _unstorable(output, exc)
        except (RunAborted, _Parked):
            return _unless_parked(ctx)
        else:
            if isinstance(done, s.CallsInFlight):  # never recorded: failed (uncertain), not lost
                seqs = ", ".join(map(str, done.seqs))
                failure = ("calls_in_flight", f"call(s) {seqs} of this run were never recorded; cannot complete")
            else:
                return "completed" if isinstance(done, s.Finished) else _unless_parked(ctx)
    code, message = failure
    ctx.failure_code = code
    try:
        failed = ctx._fail_when_quiet(code, message)
    except (RunAborted, _Parked):
        return _unless_parked(ctx)
    if isinstance(failed, s.Unwinding):
        return unwind(ctx.lease, failed.seqs, lane)
    return "failed" if isinstance(failed, s.Finished) else _unless_parked(ctx)


def _unless_parked(ctx: Context) -> str:
    """``lost``, or ``parked`` when a thread the handler left behind parked the run after the
    handler ended (the turn's completion or failure was then refused, or its wait for that
    thread's calls met the park): never ``_Parked`` out of :func:`run_claim` (into the worker's
    loop, which it stopped), never a parked run counted lost."""
    if ctx.parked is None:
        return "lost"
    logger.info(
        "parked_after_handler run=%s approval=%s: a thread the handler left parked the run",
        ctx.lease.run_id,
        ctx.parked,
    )
    return "parked"


def parked_turn(lease: s.AgentLease, approval_id: Any, ended: str | None) -> str:
    """``parked``: the turn of a run whose park was written ends parked, judged by the runtime's
    record, not by ``_Parked`` reaching it. A handler that caught it (``except Exception`` around
    the park, a framework's tool wrapper, a retry library) and then ``ended`` otherwise
    (``returned``, ``raised ...``) is logged ``park_swallowed``; its output or error is dropped
    (the run waits for its approval, its lease released: nothing more is written under it)."""
    if ended is not None:
        logger.warning(
            "park_swallowed run=%s approval=%s: the handler caught the park and %s; the run stays parked",
            lease.run_id,
            approval_id,
            ended,
        )
    return "parked"


def ended_by(exc: BaseException | None) -> str:
    """How a handler that swallowed its park ended, for ``park_swallowed``."""
    return "returned" if exc is None else f"raised {type(exc).__name__}: {str(exc)[:200]}"


def _complete(ctx: Context, output: Any) -> Any:
    """``complete_run``; while the server still sees calls of this holder in flight (a thread the
    handler left behind journaled one after the handler returned), wait for them and ask again,
    for at most ``APPROVAL_SETTLE_SECONDS``; then the last :class:`CallsInFlight` is returned
    (the caller fails the run: its calls closed uncertain, never a run lost silently)."""
    settle = time.monotonic() + APPROVAL_SETTLE_SECONDS
    while True:
        done = _settle(s.complete_run, ctx.lease, output)
        if not isinstance(done, s.CallsInFlight) or time.monotonic() > settle:
            return done
        ctx._await_calls()
        if ctx.lost.wait(APPROVAL_RETRY_SECONDS):
            raise RunAborted("the run's lease was lost while its calls were in flight")


def _settle(service: Callable[..., Any], *args: Any) -> Any:
    """``complete_run``/``fail_run`` (fenced, and answered ``AlreadyTerminal`` to the true
    holder's retry), tried once more on a fresh connection when the runtime's was lost under it
    (a restart, a terminated backend; on Citus a worker's connection lost before the COMMIT, an
    ``InternalError``, :func:`~buzz_delivery.services.db.node_lost`): a first try that was kept
    after all is answered ``AlreadyTerminal`` to the second."""
    try:
        return service(*args)
    except DatabaseError as exc:
        if not isinstance(exc, (OperationalError, InterfaceError)) and not node_lost(exc):
            raise
        db = connections[DEFAULT_DB_ALIAS]
        if in_transaction(db):
            raise
        logger.warning("db_error: %s; reconnecting once", describe(exc))
        discard_connection(db)
        return service(*args)


def _unstorable(output: Any, exc: ValidationError) -> tuple[str, str]:
    """(failure code, message) of a handler output ``complete_run`` refused."""
    try:
        json_text(output, get_settings().max_output_bytes)
    except BadJSON as bad:
        return bad.code, storable_text(f"the handler's output {bad}", FAILURE_MESSAGE_MAX_CHARS)
    except BaseException:
        pass
    return "output_not_json", storable_text(f"the handler's output was refused: {_messages(exc)}", 10_000)


class Heartbeat(threading.Thread):
    """Renews every held run lease each ``every`` seconds on its own connection; a renewal that
    returns ``LeaseLost`` marks that context lost (and cancelled, if a cancel fenced it). With
    ``handler_timeout``, a context held longer than that is marked lost (``timed_out``) and no
    longer renewed: its lease lapses and the run is reclaimed elsewhere.

    ``bound_lock_waits`` (a worker serving several communities): each renewal waits for a lock
    at most :func:`~buzz_delivery.worker.renewer.lock_wait_ms` (``SET LOCAL lock_timeout``, see
    :func:`~buzz_delivery.services.db.lock_waits_bounded`). One that waited longer (its
    community's rows are locked: a lifecycle move of that community waiting behind a long
    transaction of the community's own code, say) changed nothing; that community's other
    renewals are left for the next round and the other communities' go on, so what one
    community holds never lets the run leases of another lapse. A worker of one community keeps
    the one-statement renewal."""

    def __init__(
        self,
        *,
        every: float,
        lease_seconds: float,
        handler_timeout: float | None = None,
        bound_lock_waits: bool = False,
    ) -> None:
        super().__init__(name="agent-heartbeat", daemon=True)
        self.every = every
        self.lease_seconds = lease_seconds
        self.handler_timeout = handler_timeout
        self.lock_wait_ms = lock_wait_ms(lease_seconds) if bound_lock_waits else None
        self.held: dict[Any, Context] = {}
        self.since: dict[Any, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.renewed = 0
        self.timed_out = 0

    def hold(self, ctx: Context) -> None:
        """Renew ``ctx``'s lease from now on (its handler deadline starts now)."""
        with self.lock:
            self.held[ctx.lease.run_id] = ctx
            self.since[ctx.lease.run_id] = time.monotonic()

    def release(self, ctx: Context) -> None:
        """Stop renewing ``ctx``'s lease."""
        with self.lock:
            self.held.pop(ctx.lease.run_id, None)
            self.since.pop(ctx.lease.run_id, None)

    def release_all(self) -> list[Context]:
        """Stop renewing every lease; returns the contexts that were held."""
        with self.lock:
            contexts = list(self.held.values())
            self.held.clear()
            self.since.clear()
        return contexts

    def _overdue(self) -> list[Context]:
        if self.handler_timeout is None:
            return []
        now = time.monotonic()
        with self.lock:
            late = [rid for rid, t in self.since.items() if now - t > self.handler_timeout]
            contexts = [self.held.pop(rid) for rid in late]
            for rid in late:
                self.since.pop(rid, None)
        return contexts

    def run(self) -> None:
        # Deadlines are checked every quarter second at most; leases renewed every ``every``.
        tick = self.every if self.handler_timeout is None else min(self.every, 0.25)
        next_renewal = time.monotonic() + self.every
        try:
            while not self.stop.wait(tick):
                for ctx in self._overdue():
                    logger.warning("handler_timeout run=%s: its lease is left to lapse", ctx.lease.run_id)
                    ctx.mark_lost("timed_out")
                    self.timed_out += 1
                if time.monotonic() < next_renewal:
                    continue
                next_renewal = time.monotonic() + self.every
                with self.lock:
                    contexts = list(self.held.values())
                waited: set[Any] = set()  # communities whose renewal waited past the lock bound
                for ctx in contexts:
                    if ctx.lease.community_id in waited:
                        continue  # its community's rows are locked: tried again next round
                    try:
                        with lock_waits_bounded(self.lock_wait_ms):
                            outcome = s.heartbeat(ctx.lease, self.lease_seconds)
                    except Exception as exc:  # a lost connection: try again next round
                        if lock_wait_timed_out(exc):
                            waited.add(ctx.lease.community_id)
                            with self.lock:
                                tried_last(self.held, ctx.lease.run_id)
                            logger.warning(
                                "heartbeat_lock_wait community=%s run=%s: waited past %s ms for a lock (a "
                                "lifecycle move of its community, or a long transaction); its renewals wait a "
                                "round, the others go on",
                                ctx.lease.community_id,
                                ctx.lease.run_id,
                                self.lock_wait_ms,
                            )
                            continue
                        logger.warning("heartbeat_error run=%s: %s", ctx.lease.run_id, exc)
                        connections["default"].close()
                        continue
                    if isinstance(outcome, s.Renewed):
                        ctx.lease = outcome.lease
                        self.renewed += 1
                    else:
                        reason = getattr(outcome, "reason", "")
                        logger.info("lease_lost run=%s reason=%s", ctx.lease.run_id, reason)
                        ctx.mark_lost(reason)
        finally:
            connections.close_all()

"""The agent runtime (SPEC 12 "Runtime"): handlers ``handler(ctx) -> output`` given by dotted path.

:class:`Context` is what a handler gets: ``ctx.call(tool_name, fn, args, *, compensate=None,
reconcile=None, destructive=False, cost=0)`` journals a call before making it and records its
result; ``ctx.request_approval(prompt, deadline_seconds)`` parks the run (the handler is
stopped) and, once decided, returns the decision when the run is resumed; ``ctx.cancelled``
says a cancel fenced the run (the heartbeat learnt it).

Resume: a handler is re-run from the start whenever its run is claimed again (after a reclaim
or an approval); position ``n`` of its calls is journal entry ``n``. A succeeded entry returns
its recorded output without calling ``fn``; a pending one (its holder crashed after
journaling) is reconciled with ``reconcile(args, key)`` (its output, or :data:`NOT_MADE` to make
the call now with the same key), else marked uncertain and the run fails, compensating it too.

Tools: ``fn(args, key) -> output`` (JSON), ``key`` the journal's idempotency key.
Compensations: ``compensate(args, output, key)``, a function registered with
:func:`buzz_delivery.agents.compensations.compensation` (the journal stores its registered name;
the worker that unwinds looks the name up in its own registry and never imports it); run in
reverse order on failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from buzz_delivery.agents import compensations
from buzz_delivery.agents import services as s
from buzz_delivery.agents.exceptions import (
    AgentError,
    ApprovalExpired,
    BudgetExhausted,
    ReplayMismatch,
    RunAborted,
    ToolCallFailed,
    UncertainCall,
)
from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.agents.services.common import sha256_json
from buzz_delivery.services import tenancy
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work

logger = logging.getLogger("buzz_delivery.agents")

NOT_MADE = object()  # a reconcile hook's answer: the call never reached the tool


class _Parked(Exception):
    """Internal: the run parked on an approval; the handler stops here."""


class Context:
    """What a handler gets for one claimed run: ``run`` (the row as claimed), ``input``,
    ``shadow``, :meth:`call`, :meth:`request_approval`, :attr:`cancelled`, and ``lease`` (the
    current :class:`~buzz_delivery.agents.services.AgentLease`, renewed in the background)."""

    @tenant_scoped
    def __init__(self, claim: s.AgentClaim) -> None:
        self.run = claim.run
        self.lease = claim.lease
        self.input = claim.run.input
        self.shadow = claim.run.shadow
        self.lost = threading.Event()
        self._cancelled = threading.Event()
        self._pos = 0
        self._journal = {
            e.seq: e
            for e in JournalEntry.objects.filter(community_id=claim.lease.community_id, run_id=claim.lease.run_id)
        }
        self.replayed = 0

    @property
    def cancelled(self) -> bool:
        """True once a heartbeat learnt the run was cancelled (the handler should stop)."""
        return self._cancelled.is_set()

    def mark_lost(self, reason: str) -> None:
        self.lost.set()
        if reason == "cancelled":
            self._cancelled.set()

    def _check(self) -> None:
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
    ) -> Any:
        """Journal, make and record one tool call (or replay it); returns its output (None for
        a shadow-blocked call). Raises :class:`ToolCallFailed`, :class:`BudgetExhausted`,
        :class:`UncertainCall`, :class:`ReplayMismatch` or :class:`RunAborted`."""
        self._check()
        self._pos += 1
        entry = self._journal.get(self._pos)
        if entry is not None:
            return self._replay(entry, tool_name, fn, args, reconcile)
        descriptor = compensations.descriptor(compensate)  # ValueError when not registered
        outcome = s.journal_call(
            self.lease, tool_name, args, cost=cost, compensation=descriptor, destructive=destructive
        )
        if isinstance(outcome, s.Blocked):
            return None
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted ({outcome.used}/{outcome.cap})")
        if not isinstance(outcome, s.Journaled):
            self.lost.set()
            raise RunAborted(f"cannot journal: {outcome}")
        return self._make(outcome.seq, outcome.idempotency_key, fn, args)

    def _make(self, seq: int, key: str, fn: Callable[[Any, str], Any], args: Any) -> Any:
        started = time.monotonic()
        try:
            output = fn(args, key)
        except Exception as exc:
            self._record(seq, ok=False, error=f"{type(exc).__name__}: {exc}", started=started)
            raise ToolCallFailed(f"{seq}: {exc}") from exc
        self._record(seq, ok=True, output=output, started=started)
        return output

    def _record(self, seq: int, *, started: float, **kwargs: Any) -> None:
        latency = int((time.monotonic() - started) * 1000)
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
        found = reconcile(args, entry.idempotency_key)
        if found is NOT_MADE:
            return self._make(entry.seq, entry.idempotency_key, fn, args)
        self._record(entry.seq, ok=True, output=found, started=started)
        return found

    def request_approval(self, prompt: str = "", deadline_seconds: int = 86400) -> dict[str, Any]:
        """Ask a human (the engine's approvals queue). The first time, parks the run and stops
        the handler; when the run resumes, returns ``{"decision": "approved"|"rejected",
        "decided_by"}``. Raises :class:`ApprovalExpired` if it expired, :class:`BudgetExhausted`,
        :class:`ReplayMismatch` or :class:`RunAborted`."""
        self._check()
        self._pos += 1
        entry = self._journal.get(self._pos)
        if entry is not None:
            if entry.kind != "approval":
                raise ReplayMismatch(f"entry {entry.seq} is a {entry.tool_name!r} call, not an approval")
            if entry.status == "succeeded":
                self.replayed += 1
                return dict(entry.output or {})
            if entry.status == "failed":
                raise ApprovalExpired("the approval expired without a decision")
            raise RunAborted("the approval is still pending")
        outcome = s.request_approval(self.lease, prompt=prompt, deadline_seconds=deadline_seconds)
        if isinstance(outcome, s.ApprovalRequested):
            raise _Parked(outcome.approval_id)
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted")
        self.lost.set()
        raise RunAborted(f"cannot request an approval: {outcome}")


@tenant_scoped
def unwind(lease: s.AgentLease, seqs: tuple[int, ...]) -> str:
    """Run the compensations ``seqs`` (highest first) under ``lease``, each once, stopping at the
    first that fails; then end the run ``failed``. Returns ``compensated``,
    ``compensation_failed`` or ``lost``."""
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
        try:
            if function is None:
                raise LookupError(compensations.unregistered_error(began["compensation"]))
            # The user's code, as the handler's: the login's role.
            with tenancy.handler(lease.community_id), tracing_work.compensation_span(lease, seq):
                function(began["args"], began["output"], began["key"])
        except Exception as exc:
            logger.warning("compensation_failed run=%s seq=%s: %s", lease.run_id, seq, exc)
            if not isinstance(
                s.finish_compensation(lease, seq, ok=False, error=f"{type(exc).__name__}: {exc}"),
                (s.Recorded, s.AlreadyRecorded),
            ):
                return "lost"
            result = "compensation_failed"
            break
        if not isinstance(s.finish_compensation(lease, seq, ok=True), (s.Recorded, s.AlreadyRecorded)):
            return "lost"
    final = s.fail_run(lease, "compensated")
    if isinstance(final, s.Unwinding):  # a compensation was left by someone else: go again
        return unwind(lease, final.seqs)
    return result if isinstance(final, (s.Finished, s.AlreadyTerminal)) else "lost"


@tenant_scoped
@tracing_work.agent_run_span
def run_claim(claim: s.AgentClaim, handler: Callable[[Context], Any], ctx: Context | None = None) -> str:
    """Run one claimed run to its next resting point and say which: ``completed``, ``failed``,
    ``compensated``, ``compensation_failed``, ``parked`` (approval), ``lost`` (lease lost)."""
    lease = claim.lease
    if claim.run.unwinding:
        outcome = s.fail_run(lease, claim.run.failure_code or "unwinding")
        if isinstance(outcome, s.Unwinding):
            return unwind(lease, outcome.seqs)
        return "failed" if isinstance(outcome, s.Finished) else "lost"
    ctx = ctx or Context(claim)
    try:
        with tenancy.handler(lease.community_id):  # the user's code: the login's role (SPEC 13)
            output = handler(ctx)
    except _Parked:
        return "parked"
    except RunAborted:
        return "lost"
    except Exception as exc:
        code = exc.failure_code if isinstance(exc, AgentError) else "handler_error"
        if ctx.lost.is_set():
            return "lost"
        failed = s.fail_run(ctx.lease, code, f"{type(exc).__name__}: {exc}"[:10_000])
        if isinstance(failed, s.Unwinding):
            return unwind(ctx.lease, failed.seqs)
        return "failed" if isinstance(failed, s.Finished) else "lost"
    if ctx.lost.is_set():
        return "lost"
    done = s.complete_run(ctx.lease, output)
    return "completed" if isinstance(done, s.Finished) else "lost"


class Heartbeat(threading.Thread):
    """Renews every held run lease each ``every`` seconds on its own connection; a renewal that
    returns ``LeaseLost`` marks that context lost (and cancelled, if a cancel fenced it). With
    ``handler_timeout``, a context held longer than that is marked lost (``timed_out``) and no
    longer renewed: its lease lapses and the run is reclaimed elsewhere."""

    def __init__(self, *, every: float, lease_seconds: float, handler_timeout: float | None = None) -> None:
        super().__init__(name="agent-heartbeat", daemon=True)
        self.every = every
        self.lease_seconds = lease_seconds
        self.handler_timeout = handler_timeout
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
                for ctx in contexts:
                    try:
                        outcome = s.heartbeat(ctx.lease, self.lease_seconds)
                    except Exception as exc:  # a lost connection: try again next round
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

"""Exceptions of the agent runtime (the services return outcomes; these stop a handler)."""

from __future__ import annotations

from buzz_delivery.exceptions import BuzzDeliveryError


class AgentError(BuzzDeliveryError):
    """Base of the agent runtime's exceptions. ``failure_code`` is what the run records."""

    failure_code = "handler_error"


class RunAborted(AgentError):
    """The run's lease was lost (reclaimed, cancelled, lapsed): the handler must stop; nothing
    more is written for it by this holder."""

    failure_code = "lease_lost"


class ToolCallFailed(AgentError):
    """A journaled tool call failed (its error is recorded on the journal entry)."""

    failure_code = "tool_call_failed"


class LeftTransactionOpen(AgentError):
    """The user's plain code (a tool, reconcile hook, compensation or plain handler run on a
    thread of the event-loop worker) left its database connection in a transaction: it was
    rolled back and the connection discarded (:class:`~buzz_delivery.usercode.UserCode`), so
    nothing it wrote there is kept. Raised in place of the code's result (or of what it raised,
    chained): a tool's call is recorded failed with it, as one that raised (docs/agents.md)."""

    failure_code = "transaction_left_open"  # (usercode.TRANSACTION_LEFT_OPEN)


class UncertainCall(AgentError):
    """A call left pending by a crashed holder could not be reconciled (no reconcile hook): it
    is marked uncertain, for compensation, and the run fails."""

    failure_code = "uncertain_call"


class BudgetExhausted(AgentError):
    """A call past the run's tool-call or cost cap was refused (nothing journaled)."""

    failure_code = "budget_exceeded"


class ReplayMismatch(AgentError):
    """On resume, the handler asked for another call than the journal recorded at this position
    (tool name, kind or input hash differ): handlers must be deterministic."""

    failure_code = "replay_mismatch"


class ApprovalExpired(AgentError):
    """The approval the run waited on expired without a decision."""

    failure_code = "approval_expired"


class OutputLimitExceeded(AgentError):
    """``ctx.emit``: the chunk would take the run's streamed output past ``MAX_STREAM_BYTES``
    (nothing was written; the handler may stop emitting and go on)."""

    failure_code = "stream_too_large"


class ApprovalBlockedByCalls(AgentError):
    """``ctx.request_approval`` could not park the run: calls ``seqs`` of this holder are
    journaled and not recorded. Raised when it is called from inside a ``ctx.call`` (its tool
    function) of the same thread (the run cannot park while that call is in flight, and the call
    cannot end while the approval waits), or when a call stays unrecorded with no call of the
    handler running (a tool ended by a ``BaseException``). Nothing was written, the lease holds;
    ask for the approval before or after the call, not from within it."""

    def __init__(self, seqs: tuple[int, ...], why: str) -> None:
        self.seqs = seqs
        super().__init__(f"request_approval: call(s) {', '.join(map(str, seqs))} of this run are in flight ({why})")


class NestedCall(AgentError):
    """``ctx.call`` made from inside another ``ctx.call``'s tool (or reconcile) function of the
    same run, on the same thread (the thread worker's ``Context``) or task (the event-loop
    worker's ``AsyncContext``): refused at once, nothing journaled. A resumed run replays the
    outer call from the journal without running its function again, so the nested call's entry
    would never be consumed (the handler's next call would meet it at its position:
    ``ReplayMismatch``); in the event-loop worker it is refused from a task the outer tool starts
    too (and from a ``SyncBridge`` thread its plain tool runs on). Make the call before or after
    the outer one (or return what it needs from the outer tool). Calls a tool runs on threads of
    its own are not nested (thread worker)."""

    failure_code = "nested_call"

    def __init__(self, tool_name: str, outer_seq: int) -> None:
        self.tool_name = tool_name
        self.outer_seq = outer_seq
        super().__init__(
            f"ctx.call({tool_name!r}) from inside the tool function of call {outer_seq} of the same run: "
            "a replayed call does not run its tool function again; make it before or after that call"
        )

"""Public services of agent runs (SPEC section 12). Every one validates its arguments
(``ValidationError`` keyed by the argument) before any SQL, uses the database clock, and
returns typed outcomes (:mod:`buzz_delivery.agents.services.types`) for expected races."""

from buzz_delivery.agents.services.approvals import request_approval
from buzz_delivery.agents.services.journal import (
    begin_compensation,
    finish_compensation,
    journal_call,
    record_call_result,
)
from buzz_delivery.agents.services.maintenance import AgentReapResult, reap_agent_runs
from buzz_delivery.agents.services.output import astream_output, emit_output, read_output, stream_output
from buzz_delivery.agents.services.policy import RunPolicy, clear_policy, get_policy, set_policy
from buzz_delivery.agents.services.runs import (
    accept_delivery,
    cancel_agent_run,
    claim_agent_runs,
    complete_run,
    fail_run,
    get_agent_run,
    get_journal,
    get_run_agent,
    heartbeat,
    intake_event,
    runs_of_agent,
)
from buzz_delivery.agents.services.types import *  # noqa: F403
from buzz_delivery.agents.services.types import __all__ as _types

__all__ = [
    *_types,
    "AgentReapResult",
    "RunPolicy",
    "accept_delivery",
    "astream_output",
    "begin_compensation",
    "cancel_agent_run",
    "emit_output",
    "claim_agent_runs",
    "clear_policy",
    "complete_run",
    "fail_run",
    "finish_compensation",
    "get_agent_run",
    "get_journal",
    "get_policy",
    "get_run_agent",
    "runs_of_agent",
    "heartbeat",
    "intake_event",
    "journal_call",
    "read_output",
    "reap_agent_runs",
    "record_call_result",
    "request_approval",
    "set_policy",
    "stream_output",
]

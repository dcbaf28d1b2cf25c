"""The demo's agent handlers, run by ``run_delivery_worker --handler project.demo.handlers:handle``.

A handler gets the claimed delivery (a ``WorkflowAgentDelivery``) and does some "work" (a
short sleep; about 1% take 2 s, long enough for the worker to renew their lease). Which
deliveries fail is decided by a hash of the delivery id, so it does not depend on which worker
gets them: about 4% raise an ordinary exception on their first attempt (the worker settles them
``retry``; they succeed on the next attempt), about 2% raise
:class:`~buzz_delivery.worker.PermanentFailure` (settled ``failed``). Every call first writes a
:class:`~project.demo.models.HandlerCall` naming the lease generation it worked under and what
it did, which the demo's report compares with the settles. ``BUZZ_DEMO_RUN`` names the run.
"""

from __future__ import annotations

import hashlib
import os
import random
import time

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.worker import PermanentFailure
from project.demo.models import HandlerCall

RETRY_PER_MILLE = 40
PERMANENT_PER_MILLE = 20
SLOW_PER_MILLE = 10
WORK_SECONDS = (0.005, 0.040)
SLOW_WORK_SECONDS = 2.0  # longer than a third of the demo's 4 s lease: the worker renews it


class AgentUnavailable(Exception):
    """A passing failure: the worker settles the delivery ``retry``."""


class MalformedMessage(PermanentFailure):
    """The delivery can never succeed: the worker settles it ``failed`` (failure_code = this name)."""


def _bucket(delivery_id: object) -> int:
    return int.from_bytes(hashlib.sha256(str(delivery_id).encode()).digest()[:4], "big") % 1000


def fate(delivery_id: object) -> str:
    """``"retry"``, ``"failed"`` or ``"finished"``: what the demo's agent does with this delivery
    on its first attempt (a retried delivery finishes on its next attempt)."""
    bucket = _bucket(delivery_id)
    if bucket < RETRY_PER_MILLE:
        return "retry"
    if bucket < RETRY_PER_MILLE + PERMANENT_PER_MILLE:
        return "failed"
    return "finished"


def work_seconds(delivery_id: object) -> float:
    """How long the agent works on this delivery: 5..40 ms, or 2 s for about 1% of them."""
    if _bucket(delivery_id) >= 1000 - SLOW_PER_MILLE:
        return SLOW_WORK_SECONDS
    return random.uniform(*WORK_SECONDS)


def _record(delivery: WorkflowAgentDelivery, outcome: str) -> None:
    HandlerCall.objects.create(
        run_id=os.environ["BUZZ_DEMO_RUN"],
        delivery_id=delivery.id,
        community_id=delivery.community_id,
        lease_generation=delivery.lease_generation,
        attempt=delivery.attempt,
        worker_pid=os.getpid(),
        outcome=outcome,
    )


def handle(delivery: WorkflowAgentDelivery) -> None:
    """Work on one delivery (:func:`work_seconds`); fail as :func:`fate` says."""
    outcome = fate(delivery.id)
    if outcome == "retry" and delivery.attempt > 1:
        outcome = "finished"
    time.sleep(work_seconds(delivery.id))
    _record(delivery, outcome)
    if outcome == "retry":
        raise AgentUnavailable(f"agent busy, try {bytes(delivery.target_pubkey).hex()[:8]} later")
    if outcome == "failed":
        raise MalformedMessage("the message cannot be parsed by this agent")


def hang(delivery: WorkflowAgentDelivery) -> None:
    """A stuck agent: records the call, then never returns (the demo kills its worker)."""
    _record(delivery, "hang")
    while True:
        time.sleep(3600)

"""``send_message`` steps of one community sent in one transaction (SPEC section 11; issue 31).

The orchestrator hands the send_message steps it claimed to its completer thread, which sends
them here, many per transaction, with a number of statements that does not grow with the
batch, in one transaction: the runs read (one statement), the identity locks of every (run,
step) in key order (:func:`~buzz_delivery.services.fanout.lock_delivery_identities`), the steps
parked ``waiting`` in one fenced statement judged by the rows it returns (the step
rows locked in id order: :func:`~buzz_delivery.workflows.services.steps.park_sends`), the
message events of the parked steps (stable ids: one an earlier attempt posted is kept), and
the deliveries of all their targets, each with its run's priority and trace context
(:func:`~buzz_delivery.services.fanout.commit_messages`). A step the park did not settle (its
lease lost, or the holder's repeat) gets nothing written: its outcome is the fenced read
(:func:`~buzz_delivery.workflows.services.steps.park_outcome`), as a single send's would be.
Lock order, as a single send's: identity locks, then step rows.

A batch is sent in transactions of at most 10,000 targets in all (one delivery commit's bound,
``MAX_BINDINGS_PER_COMMIT``), each as above: a batch of larger steps is not refused whole.

A step that cannot be prepared (its input unusable here), a batch the database refuses, or a
step the batch holds twice is not attempted (``None``): the caller sends it on its own
(:func:`~buzz_delivery.workflows.executor.execute`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from buzz_delivery import tracing
from buzz_delivery.services import Settled, fanout
from buzz_delivery.services.db import atomic_within_bound, fetch_all, retry_deadlocks
from buzz_delivery.services.producer import MAX_BINDINGS_PER_COMMIT
from buzz_delivery.services.tenancy import tenant_scoped
from buzz_delivery.tracing import work as tracing_work
from buzz_delivery.workflows.conf import get_settings
from buzz_delivery.workflows.executor import definition_event_ids, message_event_id, send_bindings
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.services import sql as wf_sql
from buzz_delivery.workflows.services import steps
from buzz_delivery.workflows.services.types import StepClaim, StepOutcome

logger = logging.getLogger("buzz_delivery.workflows")


@dataclass(frozen=True, slots=True)
class _Send:
    claim: StepClaim
    event_id: bytes
    content: str
    message: fanout.Message
    wait_seconds: float | None


def _runs(community: uuid.UUID, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, Run]:
    """The runs of the batch with the fields a send reads, in one statement."""
    rows = fetch_all(wf_sql.RUNS_FOR_SEND, {"community_id": community, "run_ids": run_ids})
    context = wf_sql.RUN_FOR_SEND_FIELDS.index("trace_context") + 2
    found: dict[uuid.UUID, Run] = {}
    for row in rows:
        values = list(row)
        if isinstance(values[context], str):  # jsonb as text from the cursor
            values[context] = json.loads(values[context])
        run = Run.from_db("default", ["community_id", "run_id", *wf_sql.RUN_FOR_SEND_FIELDS], values)
        found[run.pk] = run
    return found


def _prepare(community: uuid.UUID, claim: StepClaim, run: Run, definition: bytes) -> _Send:
    """What one step sends (its bindings built as a single send builds them), its trace
    context taken inside the step's own span."""
    key = claim.step.key
    event_id = message_event_id(run.pk, key)
    bindings = send_bindings(community, claim, run, definition)
    # The deliveries carry the context of a commit span child of the step's span, as a single
    # send's do; without tracing here, the run's stored context.
    with tracing_work.step_span(claim):
        found = tracing.tracer()
        if found is None:
            context = tracing_work.carried(run.trace_context)
        else:
            with found.start_as_current_span("buzz.commit"):
                context = tracing.with_trace(None)
    message = fanout.Message(bindings, trigger_context=context, priority=run.priority)
    return _Send(claim, event_id, claim.spec.get("content", ""), message, claim.spec.get("wait_timeout_seconds"))


@tenant_scoped
def send_messages(community: uuid.UUID, claims: Sequence[StepClaim]) -> list[StepOutcome | None]:
    """Send the ``send_message`` ``claims`` of ``community`` in one transaction (see the module
    docstring). Returns one outcome per claim, in order: ``Settled("waiting")`` for a step it
    parked, the fenced read's outcome for one it did not (``LeaseLost``, ``AlreadyTerminal``,
    the holder's repeat ``Settled("waiting")``), ``None`` for one it did not attempt (send it
    on its own). Raises what the database raises for a transaction (nothing of it is kept; the
    transactions of earlier chunks are: a step of theirs sent again is the holder's repeat and
    writes nothing more)."""
    outcomes: list[StepOutcome | None] = [None] * len(claims)
    for chunk in _chunks(claims):
        batch, parked = _send_batch(community, [claims[i] for i in chunk])
        for j, send in batch:
            lease = send.claim.lease
            outcomes[chunk[j]] = Settled("waiting") if lease.step_id in parked else steps.park_outcome(lease)
    return outcomes


def _chunks(claims: Sequence[StepClaim]) -> list[list[int]]:
    """The claims' indexes in consecutive runs of at most ``MAX_BINDINGS_PER_COMMIT`` targets
    in all (one delivery commit's bound; a step names up to 10,000): one transaction each,
    never a batch refused whole for its size."""
    chunks: list[list[int]] = []
    size = 0
    for i, claim in enumerate(claims):
        targets = claim.spec.get("targets")
        n = len(targets) if isinstance(targets, list) else 0
        if not chunks or size + n > MAX_BINDINGS_PER_COMMIT:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += n
    return chunks


def _prepared(community: uuid.UUID, claims: Sequence[StepClaim]) -> list[tuple[int, _Send]]:
    """The claims the batch attempts (with their index): of ``community``, each step once, its
    run and definition found, its bindings built."""
    runs = _runs(community, sorted({c.lease.run_id for c in claims}))
    definitions = definition_event_ids(community, {run.definition_id for run in runs.values()})
    batch: list[tuple[int, _Send]] = []
    seen: set[uuid.UUID] = set()
    for i, claim in enumerate(claims):
        run = runs.get(claim.lease.run_id)
        if claim.lease.community_id != community or claim.lease.step_id in seen or run is None:
            continue
        definition = definitions.get(run.definition_id)
        if definition is None:
            continue
        seen.add(claim.lease.step_id)
        try:
            batch.append((i, _prepare(community, claim, run, definition)))
        except Exception as exc:  # sent on its own: its failure is its own
            logger.info("send_not_batched step=%s run=%s error=%s", claim.step.key, run.pk, exc)
    return batch


@retry_deadlocks
def _send_batch(community: uuid.UUID, claims: Sequence[StepClaim]) -> tuple[list[tuple[int, _Send]], set[uuid.UUID]]:
    """The batch's transaction (run again whole when PostgreSQL picks it as a deadlock's
    victim; the runs are read in it too, a commit fewer): the sends it attempted, and the ids
    of the steps it parked, whose messages and deliveries it wrote."""
    with atomic_within_bound():
        batch = _prepared(community, claims)
        sends = [send for _, send in batch]
        if not sends:
            return batch, set()
        fanout.lock_delivery_identities(community, [(s.claim.lease.run_id, s.claim.step.key) for s in sends])
        parked = steps.park_sends(community, [(s.claim.lease, len(s.message.bindings), s.wait_seconds) for s in sends])
        mine = [s for s in sends if s.claim.lease.step_id in parked]
        if mine:
            settings = get_settings()
            fetch_all(
                wf_sql.INSERT_MESSAGE_EVENTS,
                {
                    "community_id": community,
                    "kind": settings.message_kind,
                    "pubkey": settings.author_pubkey,
                    "event_ids": [s.event_id for s in mine],
                    "contents": [s.content for s in mine],
                    "tags": [json.dumps([["step", s.claim.step.key]]) for s in mine],
                },
            )
            fanout.commit_messages(community, [s.message for s in mine])
    return batch, parked

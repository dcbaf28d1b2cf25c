"""Batched completions of ``function`` steps (SPEC section 11 "Orchestrator").

Step threads put each returned :class:`~buzz_delivery.workflows.executor.Output` here and move
on to their next step. The completer takes whatever is queued (waiting up to ``linger``
seconds for more while fewer than ``max_batch`` are there) and records the batch with one
:func:`~buzz_delivery.workflows.services.complete_steps` transaction per community: the runs
locked in id order, one fenced ``UPDATE ... FROM unnest``, Advance per row. Each step's
outcome is handed to ``done``; a lease the statement did not settle is judged as a single
completion would be (``AlreadyTerminal`` or ``LeaseLost``). In the same transaction it claims
the steps those completions released (:func:`complete_and_claim_steps`), as many as
``room(claims, community)`` allows once the ``claims`` it completes have freed their places, and hands them to
``accept``: a step that follows another runs without a wake-up or a claim of its own, and the
other orchestrators are woken only for ready steps it left.

A batch the database refuses is replayed one step at a time (:func:`complete_step`), so that
nothing about one step keeps the others of its batch from completing, and so is a step whose
run another transaction held locked (the batch never waits for a run lock); a single completion that
raises is handed to ``done`` with ``None`` (counted as an error; its lease lapses and the
maintenance reclaims the step). The thread uses its own Django connection.

It also records the failures of the ``async def`` steps the orchestrator awaits on its event
loop (:meth:`Completer.put_failure`), which holds no connection, batched the same way: one
:func:`~buzz_delivery.workflows.services.fail_steps_skip_locked` transaction per community (the
free runs locked in id order, the retry policies read in one statement, one fenced
``UPDATE ... FROM unnest`` for the retries and one for the final failures), each step retried
with its own backoff as ``fail_step`` would; a failure the batch did not attempt (its run was
busy, or the batch was refused) is recorded on its own (``fail_step``), handed to ``done`` the
same way.

And it sends the ``send_message`` steps the orchestrator claimed (no step thread takes them:
:meth:`Completer.put_sends`, issue 31), every send queued in one batch: one
:func:`~buzz_delivery.workflows.sends.send_messages` transaction per community (the identity
locks, one fenced park, the message events and the deliveries of all targets, each a
statement for the whole batch); a send the batch did not attempt (refused, not
preparable, or its batch waited past the lock bound, below) is sent on its own
(:func:`~buzz_delivery.workflows.executor.execute`), handed to ``done`` the same way.

An orchestrator of every community (``--all``) gives it a lock-wait bound: each of its
transactions waits for a lock at most that long
(:func:`~buzz_delivery.services.db.lock_waits_bounded`). One that waited longer (its
community's rows are locked: a lifecycle move of it waiting behind a long transaction of its
own code, say) changed nothing; that community's outputs, failures and sends are kept (their
leases still renewed) and recorded once its turn is back (``skipped``), and the other
communities' go on meanwhile. A send batch of several steps that waited is first sent one step
at a time, each within the bound, as the agents' batcher replays its batches
(:class:`~buzz_delivery.agents.batcher.Batcher`): a send whose delivery identity or step row
another transaction holds waits alone (its community is then left, the sends after it kept),
and is tried last from then on, so it keeps only itself waiting, not the other sends of its
community turn after turn.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, close_old_connections, connection

from buzz_delivery.lockwaits import Skipped
from buzz_delivery.services.db import lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.executor import Failure, record_failure
from buzz_delivery.workflows.sends import send_messages
from buzz_delivery.workflows.services import complete_and_claim_steps, complete_step, fail_steps_skip_locked
from buzz_delivery.workflows.services.types import StepClaim, StepFailure, StepOutcome

logger = logging.getLogger("buzz_delivery.workflows")

Done = Callable[[StepClaim, StepOutcome | None], None]
Room = Callable[[list[StepClaim], uuid.UUID], int]
Accept = Callable[[list[StepClaim]], None]


T = TypeVar("T")


def next_batch(
    source: queue.SimpleQueue[T | None], max_batch: int, linger: float, timeout: float | None = None
) -> tuple[list[T], bool]:
    """Block for one item of ``source`` (at most ``timeout`` seconds: then none), then gather
    more (up to ``max_batch``): what is there,
    and, while fewer than ``max_batch``, what comes within ``linger`` seconds, waited out in one
    sleep (the settler's ``next_batch`` wakes on every item that comes meanwhile: a GIL handoff
    per step here, where outputs come one at a time from the step threads). ``None`` in the
    queue is the close marker. Returns (items, whether the close marker was seen)."""
    try:
        first = source.get(timeout=timeout)
    except queue.Empty:
        return [], False
    if first is None:
        return [], True
    items = [first]
    if _drain(source, items, max_batch):
        return items, True
    if len(items) < max_batch and linger > 0:
        time.sleep(linger)
        return items, _drain(source, items, max_batch)
    return items, False


def _drain(source: queue.SimpleQueue[T | None], items: list[T], max_batch: int) -> bool:
    """Move what ``source`` holds now into ``items`` (up to ``max_batch`` in all); True when the
    close marker came."""
    while len(items) < max_batch:
        try:
            item = source.get_nowait()
        except queue.Empty:
            return False
        if item is None:
            return True
        items.append(item)
    return False


class _Kept:
    """_one's, _send_one's and _fail's answer for an item kept for its community's turn."""


_KEPT = _Kept()


class _Sends:
    """The output of a queued group of ``send_message`` steps (sent, not completed): one queue
    item, so a claim's sends all reach one batch."""

    __slots__ = ("claims",)

    def __init__(self, claims: list[StepClaim]) -> None:
        self.claims = claims


class Completer(threading.Thread):
    """Completes queued (claim, output) pairs in batches of at most ``max_batch`` (1..1000),
    calling ``done(claim, outcome)`` for each (``None``: the completion raised), and claims in
    the same transaction up to ``room(claims, community)`` ready steps of the batch's community
    (``claims``: those the batch completes),
    handed to ``accept`` before the batch's ``done`` calls; ``room`` returning 0 claims
    nothing; ``after()`` is called once each batch is through.
    ``lease_seconds`` and ``holder``: those of the claims. Stops after :meth:`close`, once
    everything queued before it is completed."""

    def __init__(
        self,
        *,
        max_batch: int,
        linger: float,
        done: Done,
        room: Room,
        accept: Accept,
        after: Callable[[], None],
        lease_seconds: float,
        holder: str,
        lock_wait_ms: int | None = None,
        skipped: Skipped | None = None,
    ) -> None:
        super().__init__(name="buzz-workflows-completer", daemon=True)
        # --all: the bound of each transaction's lock waits, the communities left a while after
        # one waited past it, and their items kept until then (as queued, in order).
        self.lock_wait_ms = lock_wait_ms
        self.skipped = Skipped(0.0) if skipped is None else skipped
        self._kept: list[tuple[StepClaim, Any, Failure | None]] = []
        # The send steps (by id) that waited past the bound on their own (their delivery
        # identity or row held by another transaction): tried last when their batch goes one
        # send at a time, so that one held send does not keep the others of its community
        # waiting turn after turn.
        self._held_sends: set[uuid.UUID] = set()
        self._abandoned = threading.Event()
        self.max_batch = max_batch
        self.linger = linger
        self._done = done
        self._room = room
        self._accept = accept
        self._after = after
        self.lease_seconds = lease_seconds
        self.holder = holder
        # (claim, output, None) to complete, or (claim, None, failure) to fail.
        self._queue: queue.SimpleQueue[tuple[StepClaim, Any, Failure | None] | None] = queue.SimpleQueue()
        self.statements = 0
        self.fail_batches = 0  # fail_steps_skip_locked transactions (one per community and batch)
        self.send_batches = 0  # send_messages transactions (one per community and batch)

    def put(self, claim: StepClaim, output: Any) -> None:
        """Queue one output to record (thread-safe, never blocks)."""
        self._queue.put((claim, output, None))

    def put_sends(self, claims: list[StepClaim]) -> None:
        """Queue claimed ``send_message`` steps to send, all in the same batch (thread-safe,
        never blocks)."""
        if claims:
            self._queue.put((claims[0], _Sends(claims), None))

    def put_failure(self, claim: StepClaim, failure: Failure) -> None:
        """Queue one failure to record (thread-safe, never blocks)."""
        self._queue.put((claim, None, failure))

    def close(self) -> None:
        """Complete what is queued, then stop."""
        self._queue.put(None)

    def abandon(self) -> None:
        """After :meth:`close`, at the end of the orchestrator's grace: stop waiting for the turn
        of a community whose items are kept (its rows still locked). They are not recorded; their
        leases lapse and the steps are claimed again, as any step abandoned at the grace's end
        (before, the thread outlived the orchestrator and recorded them after it had returned
        them as abandoned)."""
        self._abandoned.set()

    def _waited(self, exc: BaseException, community: uuid.UUID) -> bool:
        """Whether ``exc`` is a lock wait past the bound; its community is then left a while."""
        if self.lock_wait_ms is None or not lock_wait_timed_out(exc):
            return False
        self.skipped.skip(community)
        logger.warning(
            "complete_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its community, "
            "or a long transaction); its completions, failures and sends wait %.2fs, the other communities go on",
            community,
            self.lock_wait_ms,
            self.skipped.seconds,
        )
        return True

    def _kept_batch(self) -> list[tuple[StepClaim, Any, Failure | None]]:
        """The kept items whose community's turn is back (taken out of :attr:`_kept`)."""
        if not self._kept:
            return []
        due = [item for item in self._kept if not self.skipped.waits(item[0].lease.community_id)]
        self._kept = [item for item in self._kept if self.skipped.waits(item[0].lease.community_id)]
        return due

    def run(self) -> None:
        try:
            closing = False
            while (not closing or self._kept) and not self._abandoned.is_set():
                wait = None if not self._kept else (self.skipped.next_try() or 0.0)
                if closing:  # nothing more comes: the kept items, once their community's turn is back
                    if self._abandoned.wait(wait or 0.0):
                        break
                    batch: list[tuple[StepClaim, Any, Failure | None]] = []
                else:
                    batch, closing = next_batch(self._queue, self.max_batch, self.linger, wait)
                batch = [*self._kept_batch(), *batch]
                if not batch:
                    continue
                by_community: dict[uuid.UUID, list[tuple[StepClaim, Any]]] = {}
                failures: dict[uuid.UUID, list[tuple[StepClaim, Failure]]] = {}
                sends: dict[uuid.UUID, list[StepClaim]] = {}
                for claim, output, failure in batch:
                    if isinstance(output, _Sends):
                        for send in output.claims:
                            sends.setdefault(send.lease.community_id, []).append(send)
                    elif failure is not None:
                        failures.setdefault(claim.lease.community_id, []).append((claim, failure))
                    else:
                        by_community.setdefault(claim.lease.community_id, []).append((claim, output))
                for community, claims in sends.items():
                    if self.skipped.waits(community):
                        self._kept.append((claims[0], _Sends(claims), None))
                        continue
                    try:
                        with lock_waits_bounded(self.lock_wait_ms):
                            self._send_many(community, claims)
                    except Exception:  # never let the completer die
                        logger.exception("completer_error sends=%d", len(claims))
                for community, failed in failures.items():
                    if self.skipped.waits(community):
                        self._kept += [(claim, None, failure) for claim, failure in failed]
                        continue
                    try:
                        with lock_waits_bounded(self.lock_wait_ms):
                            self._fail_many(community, failed)
                    except Exception:  # never let the completer die
                        logger.exception("completer_error failures=%d", len(failed))
                for community, items in by_community.items():
                    if self.skipped.waits(community):
                        self._kept += [(claim, output, None) for claim, output in items]
                        continue
                    try:
                        with lock_waits_bounded(self.lock_wait_ms):
                            self._complete(community, items)
                    except Exception:  # never let the completer die: later outputs would wait forever
                        logger.exception("completer_error steps=%d", len(items))
                self._after()
            if self._kept:  # abandoned: their leases lapse and the steps are claimed again
                logger.warning("completer_abandoned steps=%d (their communities' rows stayed locked)", len(self._kept))
        finally:
            connection.close()

    def _complete(self, community: uuid.UUID, items: list[tuple[StepClaim, Any]]) -> None:
        claimed: list[StepClaim] = []
        try:
            batch = complete_and_claim_steps(
                community,
                [(claim.lease, output) for claim, output in items],
                claim_limit=self._room([claim for claim, _ in items], community),
                lease_seconds=self.lease_seconds,
                holder=self.holder,
            )
            outcomes: list[StepOutcome | None] = list(batch.outcomes)
            claimed = batch.claims
            self.statements += 1
        except Exception as exc:
            if self._waited(exc, community):  # nothing written: kept for the community's turn
                self._kept += [(claim, output, None) for claim, output in items]
                return
            logger.warning("complete_batch_refused steps=%d error=%s", len(items), str(exc).splitlines()[:1])
            self._reset_connection(exc)
            outcomes = [None] * len(items)
        # The claims first: they are this process's from the commit on, and are queued before
        # anything here can free the last place (the shutdown drain waits for them).
        if claimed:
            self._accept(claimed)
        for (claim, output), outcome in zip(items, outcomes, strict=True):
            # None: not attempted (its run was busy, or the batch was refused): one at a time.
            if outcome is None:
                alone = self._one(claim, output)
                if isinstance(alone, _Kept):
                    continue
                outcome = alone
            self._done(claim, outcome)

    def _kept_alone(self, exc: Exception, item: tuple[StepClaim, Any, Failure | None]) -> bool:
        """An item tried on its own (its run's row was held, so the batch passed it over) that
        waited past the lock bound changed nothing: it is kept for its community's turn (which
        is left a while), as a batch that waited keeps its items, not dropped as an error (its
        step would run again once its lease lapsed)."""
        if not self._waited(exc, item[0].lease.community_id):
            return False
        self._kept.append(item)
        return True

    def _one(self, claim: StepClaim, output: Any) -> StepOutcome | _Kept | None:
        if self.skipped.waits(claim.lease.community_id):  # a wait of its community's just now
            self._kept.append((claim, output, None))
            return _KEPT
        try:
            self.statements += 1
            return complete_step(claim.lease, output)
        except Exception as exc:
            if self._kept_alone(exc, (claim, output, None)):
                return _KEPT
            logger.exception("complete_error step=%s run=%s", claim.step.key, claim.lease.run_id)
            self._reset_connection(exc)
            return None

    def _send_many(self, community: uuid.UUID, claims: list[StepClaim]) -> None:
        try:
            outcomes = send_messages(community, claims)
            self.send_batches += 1
        except Exception as exc:
            if len(claims) > 1 and self.lock_wait_ms is not None and lock_wait_timed_out(exc):
                # Nothing written. One send's identity or row may be held, not the whole
                # community: one at a time, each within the bound, those that waited alone
                # before tried last (the first that waits leaves the community and keeps the rest).
                logger.info(
                    "send_batch_lock_wait community=%s steps=%d: waited past %s ms for a lock; "
                    "its sends go one at a time",
                    community,
                    len(claims),
                    self.lock_wait_ms,
                )
                claims = sorted(claims, key=lambda claim: claim.lease.step_id in self._held_sends)
            elif self._waited(exc, community):  # nothing written: kept for the community's turn
                self._held_sends.update(claim.lease.step_id for claim in claims)  # (one send: it waited alone)
                self._kept.append((claims[0], _Sends(claims), None))
                return
            else:
                logger.warning("send_batch_refused steps=%d error=%s", len(claims), str(exc).splitlines()[:1])
                self._reset_connection(exc)
            outcomes = [None] * len(claims)
        for claim, outcome in zip(claims, outcomes, strict=True):
            # None: not attempted (refused, waited past the bound, or not preparable): sent on its own.
            if outcome is None:
                alone = self._send_one(claim)
                if isinstance(alone, _Kept):
                    continue
                outcome = alone
            self._held_sends.discard(claim.lease.step_id)
            self._done(claim, outcome)

    def _send_one(self, claim: StepClaim) -> StepOutcome | _Kept | None:
        if self.skipped.waits(claim.lease.community_id):
            self._kept.append((claim, _Sends([claim]), None))
            return _KEPT
        try:
            result = executor.execute(claim)
        except Exception as exc:
            if self._kept_alone(exc, (claim, _Sends([claim]), None)):
                self._held_sends.add(claim.lease.step_id)  # tried last from now on
                return _KEPT
            logger.exception("send_error step=%s run=%s", claim.step.key, claim.lease.run_id)
            self._reset_connection(exc)
            return None
        return result if not isinstance(result, executor.Output) else None

    def _fail_many(self, community: uuid.UUID, items: list[tuple[StepClaim, Failure]]) -> None:
        try:
            outcomes = fail_steps_skip_locked(
                community,
                [StepFailure(claim.lease, f.code, f.message, f.retryable, f.retry_after) for claim, f in items],
            )
            self.fail_batches += 1
        except Exception as exc:
            if self._waited(exc, community):  # nothing written: kept for the community's turn
                self._kept += [(claim, None, failure) for claim, failure in items]
                return
            logger.warning("fail_batch_refused steps=%d error=%s", len(items), str(exc).splitlines()[:1])
            self._reset_connection(exc)
            outcomes = [None] * len(items)
        for (claim, failure), outcome in zip(items, outcomes, strict=True):
            # None: not attempted (its run was busy, or the batch was refused): one at a time.
            if outcome is None:
                alone = self._fail(claim, failure)
                if isinstance(alone, _Kept):
                    continue
                outcome = alone
            self._done(claim, outcome)

    def _fail(self, claim: StepClaim, failure: Failure) -> StepOutcome | _Kept | None:
        if self.skipped.waits(claim.lease.community_id):
            self._kept.append((claim, None, failure))
            return _KEPT
        try:
            return record_failure(claim, failure)
        except Exception as exc:
            if self._kept_alone(exc, (claim, None, failure)):
                return _KEPT
            logger.exception("fail_error step=%s run=%s", claim.step.key, claim.lease.run_id)
            self._reset_connection(exc)
            return None

    @staticmethod
    def _reset_connection(exc: Exception) -> None:
        if isinstance(exc, DatabaseError) and (connection.connection is None or not connection.is_usable()):
            close_old_connections()
            connection.close()

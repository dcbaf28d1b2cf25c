"""Built-in acceptance (issue 29): the agent worker turns the deliveries addressed to its agents
into agent runs, so a workflow whose ``send_message`` step has ``await: agent_run`` completes
with nothing but the bundled commands (``run_workflow_worker`` and ``run_agent_worker``).

Who claims what: a worker accepts the deliveries whose target is one of the agent keys it
serves (``--agent``), in the communities it serves (``--community``, or those it discovers with
pending deliveries to those keys). Claims are batched (:func:`~buzz_delivery.services.claim_deliveries`,
up to ``batch`` per agent and community in one statement); each claimed delivery is then
accepted in its own transaction by :func:`~buzz_delivery.agents.services.accept_delivery`
(settled ``finished`` and its run created together, or refused as ``RunEnded`` when its
workflow run ended): atomic per delivery, as it always was. Do not also run a
``run_delivery_worker`` for a key that a ``run_agent_worker`` serves: both would claim its
deliveries (each delivery still goes to one of them), some would become runs and some would
be handed to the delivery handler. ``run_agent_worker --no-accept`` turns acceptance off (an
inbox of your own accepts instead).

One delivery can never stop the worker: an error accepting it (past the tries again of a
transient database error on a fresh connection, :data:`ACCEPT_TRIES`) is logged and counted, its
delivery is settled ``retry`` (the core's backoff and attempt cap apply; when that settle fails
too, its lease lapses and the reaper reclaims it), and the batch goes on.

Two ways to drive it: :func:`accept_round` (one pass, returns what it did: the in-process
worker calls it from its loop threads, an event-loop runtime from its own loop) and
:func:`is_delivery_hint` (whether a core NOTIFY payload names a delivery to accept, to wake early).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, OperationalError, connections

from buzz_delivery import backoff
from buzz_delivery import services as core
from buzz_delivery.agents import services as s
from buzz_delivery.lockwaits import Skipped
from buzz_delivery.services import tenancy
from buzz_delivery.services.db import fetch_all, lock_wait_bound, lock_wait_timed_out, lock_waits_bounded, node_lost
from buzz_delivery.services.sql import ACTIVE_COMMUNITY, DB_NOW, QUEUE
from buzz_delivery.usercode import discard_connection, in_transaction

logger = logging.getLogger("buzz_delivery.agents.acceptance")

DEFAULT_BATCH = 50
ACCEPT_ERROR = "accept_error"
# accept_claim's answer when the accept waited past the caller's lock bound: nothing written,
# the delivery still held (tried again once its community's turn comes back).
WAITED = "waited"
# An accept that failed for a transient cause is tried this many times in all, on a fresh
# connection each time, after ACCEPT_BACKOFF * 2**n s with jitter (at most ACCEPT_MOST: the
# delivery's lease keeps running), as the remote acceptor resends (gateway/remote_accept.py).
ACCEPT_TRIES = 4
ACCEPT_BACKOFF = 0.2
ACCEPT_MOST = 5.0

# Discovery (a fleet read, as the runs' discovery): the active communities with deliveries to
# accept for these agents. The live queue (stage 2) holds them; its poll index (community,
# target, priority, created_at, id) serves it.
COMMUNITIES_WITH_PENDING_DELIVERIES = f"""
SELECT DISTINCT d.community_id FROM {QUEUE} AS d
WHERE d.status = 'pending' AND d.target_pubkey = ANY(%(agents)s)
  AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= {DB_NOW})
  AND {ACTIVE_COMMUNITY}
LIMIT 100
"""


def communities_with_pending_deliveries(agents: list[bytes]) -> list[uuid.UUID]:
    """The active communities (at most 100) holding claimable deliveries to one of ``agents``."""
    with tenancy.fleet():
        return [row[0] for row in fetch_all(COMMUNITIES_WITH_PENDING_DELIVERIES, {"agents": list(agents)})]


@dataclass
class AcceptRound:
    """What one :func:`accept_round` did: ``claimed`` deliveries, ``accepted`` (runs created),
    ``run_ended`` (the workflow run had ended: delivery failed, no run), ``missed`` (the lease
    was lost or the delivery settled meanwhile), ``errors`` (settled ``retry``), ``lock_waits``
    (a community's claim or accept waited past the lock bound: that community was left); ``left``:
    claimed deliveries not accepted because their community's accept waited (still held: the
    next round tries them again)."""

    counts: Counter[str] = field(default_factory=Counter)
    left: list[core.Claim] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return self.counts["accepted"]

    @property
    def claimed(self) -> int:
        return self.counts["claimed"]


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` left nothing written and may pass: an ``OperationalError`` (a lock or
    statement timeout, a terminated backend, the connection lost; a deadlock's victim is
    retried inside the service already) or an ``InterfaceError`` (the connection closed), or
    Citus losing a worker's connection at the COMMIT (:func:`~buzz_delivery.services.db.node_lost`)."""
    return isinstance(exc, (OperationalError, InterfaceError)) or node_lost(exc)


def _accept(lease: core.Lease) -> object:
    """:func:`~buzz_delivery.agents.services.accept_delivery`, tried again on a fresh connection
    (at most :data:`ACCEPT_TRIES` in all, backing off) when it failed for a :func:`transient`
    cause, as the remote acceptor resends a 503/429 and ``complete_run``/``fail_run`` are tried
    again: settling ``retry`` at once spent an attempt of the delivery for a passing error (on
    its last, ``failed``/``attempts_exhausted``, no run). Fenced: a first try that committed after
    all (a COMMIT whose answer was lost) is answered ``AlreadyTerminal`` to the next, never a
    second run."""
    for attempt in range(ACCEPT_TRIES):
        try:
            return s.accept_delivery(lease)
        except DatabaseError as exc:
            db = connections[DEFAULT_DB_ALIAS]
            if attempt == ACCEPT_TRIES - 1 or not transient(exc) or in_transaction(db) or _waited(exc):
                raise
            logger.warning(
                "accept_again delivery=%s attempt=%d: %s; on a fresh connection",
                lease.delivery_id,
                attempt + 1,
                str(exc).strip()[:500],
            )
            discard_connection(db)
            time.sleep(backoff.again_delay(ACCEPT_BACKOFF, attempt, most=ACCEPT_MOST))
    raise AssertionError("unreachable")


def _waited(exc: BaseException) -> bool:
    """Whether ``exc`` is a lock wait cut short by the bound the caller set (a worker serving
    several communities: its community's rows are locked, try it later, not again now)."""
    return lock_wait_timed_out(exc) and lock_wait_bound() is not None


def accept_claim(claim: core.Claim) -> str:
    """Accept one claimed delivery into a run; returns ``accepted``, ``run_ended``, ``missed``
    or ``errors`` (whatever went wrong with it: logged, the delivery settled ``retry``). A
    transient database error is tried again first (:func:`_accept`). Under a lock-wait bound
    (:func:`~buzz_delivery.services.db.lock_waits_bounded`), an accept that waited past it
    changed nothing: :data:`WAITED`, the delivery still held and not settled."""
    lease = claim.lease
    try:
        outcome = _accept(lease)
    except Exception as exc:  # one delivery never stops the worker
        if _waited(exc):
            return WAITED
        logger.warning("accept_error delivery=%s: %s", lease.delivery_id, str(exc)[:500])
        db = connections[DEFAULT_DB_ALIAS]
        if transient(exc) and not in_transaction(db):
            discard_connection(db)  # the settle below on a fresh connection, not the broken one
        try:
            core.finish_delivery(
                lease, "retry", failure_message=f"{ACCEPT_ERROR}: {type(exc).__name__}: {exc}"[:10_000]
            )
        except Exception as again:  # its lease lapses; the reaper reclaims it
            logger.warning("accept_retry_error delivery=%s: %s", lease.delivery_id, str(again)[:500])
        return "errors"
    if isinstance(outcome, s.Accepted):
        logger.info("accepted delivery=%s run=%s", lease.delivery_id, outcome.run_id)
        return "accepted"
    if isinstance(outcome, s.RunEnded):
        return "run_ended"
    return "missed"


def accept_round(
    communities: Iterable[uuid.UUID],
    agents: list[bytes],
    *,
    holder: str | None = None,
    batch: int = DEFAULT_BATCH,
    lease_seconds: float | None = None,
    lock_wait_ms: int | None = None,
    skipped: Skipped | None = None,
    carried: Iterable[core.Claim] = (),
) -> AcceptRound:
    """One pass: for each community and agent, claim up to ``batch`` deliveries (one statement)
    and accept each (one transaction each). ``holder`` is recorded on the claims.

    ``lock_wait_ms`` (a worker serving several communities): each claim and accept waits for a
    lock at most that long; one that waited longer (its community's rows are locked: a lifecycle
    move of it waiting behind a long transaction of its own code, say) changed nothing, its
    community is put in ``skipped`` and left (as are those ``skipped`` holds already), the
    others go on. Its claimed deliveries not accepted are in the round's ``left``: pass them as
    ``carried`` to a later round, which accepts them first (fenced by their leases: one whose
    lease lapsed meanwhile is ``missed``, never accepted twice)."""
    done = AcceptRound()
    skipped = Skipped(0.0) if skipped is None else skipped
    with lock_waits_bounded(lock_wait_ms):
        _accept_claims(list(carried), skipped, done, lock_wait_ms)
        for community in communities:
            if skipped.waits(community):
                continue
            for agent in agents:
                try:
                    claims = core.claim_deliveries(
                        community, agent, limit=batch, lease_seconds=lease_seconds, holder=holder
                    )
                except Exception as exc:  # a community moved, the database went away: next round
                    if _waited(exc):
                        _left(community, skipped, done, lock_wait_ms)
                        break
                    logger.warning("accept_claim_error community=%s: %s", community, str(exc)[:500])
                    done.counts["errors"] += 1
                    continue
                done.counts["claimed"] += len(claims)
                if not _accept_claims(claims, skipped, done, lock_wait_ms):
                    break
    return done


def _accept_claims(
    claims: list[core.Claim], skipped: Skipped, done: AcceptRound, lock_wait_ms: int | None = None
) -> bool:
    """Accept ``claims`` but those of a community ``skipped`` holds (kept in ``done.left``);
    False when an accept waited past the lock bound (its community is skipped from then on)."""
    all_through = True
    for claim in claims:
        community = claim.lease.community_id
        if skipped.waits(community):
            done.left.append(claim)
            continue
        outcome = accept_claim(claim)
        if outcome == WAITED:
            done.left.append(claim)
            _left(community, skipped, done, lock_wait_ms)
            all_through = False
            continue
        done.counts[outcome] += 1
    return all_through


def _left(community: uuid.UUID, skipped: Skipped, done: AcceptRound, lock_wait_ms: int | None) -> None:
    skipped.skip(community)
    done.counts["lock_waits"] += 1
    logger.warning(
        "accept_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its community, "
        "or a long transaction); its acceptance waits %.2fs, the other communities go on",
        community,
        lock_wait_ms,
        skipped.seconds,
    )


def is_delivery_hint(payload: str, agents: set[str], communities: set[str]) -> bool:
    """Whether a core NOTIFY ``payload`` (``{"community", "delivery", "target"}``) names a
    delivery to one of ``agents`` (hex) in one of ``communities`` (text; empty = any). Any
    payload is survived: any role may NOTIFY anything, and a hint grants nothing."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    target, community = data.get("target"), data.get("community")
    if not isinstance(target, str) or not isinstance(community, str):
        return False
    return target in agents and (not communities or community in communities)


class Acceptance:
    """The worker's acceptance: :meth:`round` runs :func:`accept_round` in one thread at a time
    (another thread calling it meanwhile returns at once with nothing done), at most every
    ``every`` seconds unless a delivery hint came (:meth:`hint`) or the last round filled a
    batch, so a worker busy with runs adds one claim statement per ``every``, not per run; the
    totals are in :attr:`counts`."""

    def __init__(
        self,
        agents: list[bytes],
        *,
        holder: str | None,
        batch: int = DEFAULT_BATCH,
        lease_seconds: float | None = None,
        every: float = 1.0,
        lock_wait_ms: int | None = None,
        skipped: Skipped | None = None,
    ) -> None:
        self.agents = list(agents)
        # A worker serving several communities: the bound of each claim's and accept's lock
        # waits, and the communities left for a while after one waited (shared with its claims).
        self.lock_wait_ms = lock_wait_ms
        self.skipped = Skipped(0.0) if skipped is None else skipped
        self.carried: list[core.Claim] = []  # claimed, not accepted: their community's accept waited
        self.holder = holder
        self.batch = batch
        self.lease_seconds = lease_seconds
        self.every = every
        self.counts: Counter[str] = Counter()
        self._busy = threading.Lock()
        self._lock = threading.Lock()
        self._due = 0.0  # monotonic time of the next round (0: now)

    def hint(self) -> None:
        """A delivery to one of the agents was announced: the next round is due at once."""
        with self._lock:
            self._due = 0.0

    def next_round(self) -> float | None:
        """Seconds until a round of this worker's threads may take the carried deliveries (None:
        none is carried): 0 when a round is due and none runs; :attr:`every` while another
        thread's round runs (that round takes them); else until the next round is due. A loop
        thread that found nothing waits that long at most, never 0 s over and over (a busy loop
        while another thread's round waits for a lock, or until a round is due)."""
        if not self.carried:
            return None
        if self._busy.locked():
            return self.every
        with self._lock:
            return max(0.0, self._due - time.monotonic())

    def due(self) -> bool:
        """Whether a round is due now (the worker's discovery of delivery communities asks)."""
        with self._lock:
            return time.monotonic() >= self._due

    def round(self, communities: Iterable[uuid.UUID], *, force: bool = False) -> int:
        """Accept what is pending in ``communities`` when a round is due (always with
        ``force``); returns the runs created (0 when not due or another thread is accepting)."""
        with self._lock:
            if not force and time.monotonic() < self._due:
                return 0
        if not self._busy.acquire(blocking=False):
            return 0
        try:
            with self._lock:
                self._due = time.monotonic() + self.every
            done = accept_round(
                communities,
                self.agents,
                holder=self.holder,
                batch=self.batch,
                lease_seconds=self.lease_seconds,
                lock_wait_ms=self.lock_wait_ms,
                skipped=self.skipped,
                carried=self.carried,
            )
            self.carried = done.left
        finally:
            self._busy.release()
        with self._lock:
            self.counts.update(done.counts)
            if done.claimed and done.claimed >= self.batch:
                self._due = 0.0  # a full batch: more may be waiting
            elif done.left or done.counts["lock_waits"]:  # a community left: tried again once its wait is over
                self._due = min(self._due, time.monotonic() + self.skipped.seconds)
        return done.accepted

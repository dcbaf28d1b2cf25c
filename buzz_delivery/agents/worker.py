"""The agent worker loop behind ``manage.py run_agent_worker`` (SPEC 12 "Runtime").

``concurrency`` threads each claim one run at a time, round-robin over the communities the
process is given (or, with none given, the active communities that have claimable runs for its
agents), run the handler (:func:`~buzz_delivery.agents.runtime.run_claim`) and go on; one
:class:`~buzz_delivery.agents.runtime.Heartbeat` thread renews every held lease on its own
connection. :meth:`AgentWorker.stop` (SIGTERM/SIGINT) stops claiming and lets in-flight runs
reach their resting point (drain) for up to ``shutdown_grace`` seconds; runs still in flight
then are abandoned: their contexts are marked lost (the handler's next ``ctx.call`` raises and
nothing more is written), their leases are no longer renewed and lapse, and the reaper
reclaims them.

Wake: a :class:`RunListener` thread LISTENs on ``buzz_agents`` (its own connection); the
database announces a claimable run there (a new run, a cancel that sends one to compensate, an
approval closed) with the community id, and idle threads claim at once instead of at their next
poll. A hint grants nothing and polling goes on, so a missed one only delays work.

Handler deadline: a handler running past ``handler_timeout`` seconds has its context marked
lost and its lease no longer renewed (it lapses: the run is reclaimed and resumed from its
journal elsewhere); Python cannot stop the thread, so that slot stays busy until the handler
returns, and nothing it does afterwards is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from buzz_delivery.agents import services as s
from buzz_delivery.agents.acceptance import Acceptance, communities_with_pending_deliveries, is_delivery_hint
from buzz_delivery.agents.conf import NOTIFY_CHANNEL
from buzz_delivery.agents.runtime import Context, Heartbeat, run_claim
from buzz_delivery.agents.services.sql import RUN
from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.fairness import round_robin
from buzz_delivery.listening import Listener
from buzz_delivery.lockwaits import Skipped
from buzz_delivery.services import tenancy
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, lock_wait_timed_out, lock_waits_bounded
from buzz_delivery.services.leases import MAX_CLAIM_BATCH
from buzz_delivery.services.sql import DB_NOW
from buzz_delivery.usercode import UserConnection, discard_connection
from buzz_delivery.worker.handlers import describe
from buzz_delivery.worker.renewer import DB_UNAVAILABLE, busy_retry_seconds, lock_wait_ms
from buzz_delivery.worker.runtime import MAX_THREADS

logger = logging.getLogger("buzz_delivery.agents")

# In round-robin order (buzz_delivery.fairness): those after %(after)s first, then from the
# first (NULL: from the first), so that past the limit every community gets its turn.
# With ``exit_when_idle``, polls the database fails count as idle (the worker stops, exit 0) once
# none has reached it for this long (or three poll intervals, the longer): one terminated backend
# or a restart's gap is retried, as the delivery worker's --idle-exit counts idle time, not polls.
UNREACHABLE_IDLE_SECONDS = 5.0


def unreachable_for_long(last_reached: float, poll_seconds: float) -> bool:
    """Whether polls have failed to reach the database long enough to count as idle."""
    return time.monotonic() - last_reached >= max(UNREACHABLE_IDLE_SECONDS, 3 * poll_seconds)


COMMUNITIES_WITH_CLAIMABLE_RUNS = f"""
SELECT r.community_id FROM {RUN} AS r JOIN buzz_delivery_community c ON c.id = r.community_id
WHERE c.deletion_state = 'active' AND r.state = 'pending' AND r.agent_pubkey = ANY(%(agents)s)
  AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= {DB_NOW})
GROUP BY r.community_id
ORDER BY r.community_id <= %(after)s::uuid, r.community_id
LIMIT 100
"""


# The largest run count a worker may be told to stop after (``max_runs``): a bigint.
MAX_RUNS = 2**63 - 1
# The longest idle wait between polls (a day), as every worker's: a finite poll_seconds past what
# a thread can wait (1e10: OverflowError) ended the thread worker at its first idle poll.
MAX_POLL_SECONDS = v.MAX_POLL_SECONDS
# The longest ``worker_id`` a claim records (the run's ``worker_id`` column).
WORKER_ID_MAX_CHARS = 200


def seconds_value(value: Any, name: str, *, zero: bool = False) -> float:
    """A finite number of seconds > 0 (>= 0 with ``zero``), as a float (``ValidationError``
    keyed ``name``)."""
    seconds = v._float_seconds(value, name)
    if not (math.isfinite(seconds) and (seconds >= 0 if zero else seconds > 0)):
        raise v.invalid(name, f"must be a finite number of seconds {'>= 0' if zero else '> 0'}, got {seconds:g}")
    return seconds


def default_worker_id() -> str:
    """``host:pid`` (as ``run_agent_worker`` without ``--worker-id``), cut to the 200 characters
    a claim records (the host name gives way)."""
    tail = f":{os.getpid()}"
    return socket.gethostname()[: max(WORKER_ID_MAX_CHARS - len(tail), 0)] + tail


def check_common(config: Any) -> None:
    """Check the fields both agent workers' configs share, as the command's options are
    checked (a ``ValidationError`` keyed by the field). ``worker_id`` empty or None: ``host:pid``
    (:func:`default_worker_id`), as the other workers' identities default (their ``name``);
    else a non-blank str of at most 200 characters: before, a config built without one was
    taken and the worker died at its first claim (``internal_errors``). ``lease_seconds``, ``poll_seconds`` and
    ``handler_timeout`` (None or) > 0, ``shutdown_grace`` >= 0, all finite, ``poll_seconds`` at
    most ``MAX_POLL_SECONDS``; ``max_runs`` None or
    >= 1; ``accept_batch`` 1..``MAX_CLAIM_BATCH`` (``--accept-batch``'s bounds). The claim checks
    ``lease_seconds`` against the configured lease bounds (``--lease-seconds`` here)."""
    if config.worker_id is None or config.worker_id == "":
        config.worker_id = default_worker_id()
    worker_id = v.optional_text(config.worker_id, "worker_id", WORKER_ID_MAX_CHARS)
    if worker_id is None or not worker_id.strip():
        raise v.invalid("worker_id", f"must name the worker (1..{WORKER_ID_MAX_CHARS} characters)")
    config.worker_id = worker_id
    seconds_value(config.lease_seconds, "lease_seconds")
    if seconds_value(config.poll_seconds, "poll_seconds") > MAX_POLL_SECONDS:
        raise v.invalid("poll_seconds", f"must be at most {MAX_POLL_SECONDS:g} seconds, got {config.poll_seconds:g}")
    seconds_value(config.shutdown_grace, "shutdown_grace", zero=True)
    if config.handler_timeout is not None:
        seconds_value(config.handler_timeout, "handler_timeout")
    if config.max_runs is not None:
        v.int_in_range(config.max_runs, "max_runs", 1, MAX_RUNS)
    v.int_in_range(config.accept_batch, "accept_batch", 1, MAX_CLAIM_BATCH)


@dataclass
class WorkerConfig:
    """``agents``: 32-byte keys served; ``communities``: UUIDs (empty = discover);
    ``concurrency``: handler threads; ``lease_seconds``; ``poll_seconds`` between empty polls;
    ``max_runs``: stop after that many claims (None = no limit); ``exit_when_idle``: stop when a
    whole poll finds nothing (a poll the database fails included: nothing could be claimed);
    ``worker_id``: recorded on each claim; ``accept``: accept the
    deliveries addressed to ``agents`` into runs (:mod:`~buzz_delivery.agents.acceptance`),
    ``accept_batch`` at most per claim. A bad number raises ``ValidationError`` keyed by its
    field (:func:`check_common`; ``concurrency`` 1..256)."""

    handler: Callable[[Context], Any]
    agents: list[bytes]
    communities: list[uuid.UUID] = field(default_factory=list)
    concurrency: int = 1
    lease_seconds: float = 60
    poll_seconds: float = 1.0
    max_runs: int | None = None
    exit_when_idle: bool = False
    worker_id: str = ""  # empty: host:pid (check_common)
    shutdown_grace: float = 30.0
    handler_timeout: float | None = None
    listen: bool = True
    accept: bool = True
    accept_batch: int = 50

    def __post_init__(self) -> None:
        # Handler threads: as the delivery and workflow workers' (``--concurrency`` 1..256).
        v.int_in_range(self.concurrency, "concurrency", 1, MAX_THREADS)
        check_common(self)


class Waker:
    """Wakes idle loop threads: :meth:`wait` returns as soon as :meth:`wake` was called after
    the ``since`` token the thread took before its last (empty) poll, so a hint that lands
    between that poll and the wait is not missed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = 0

    def token(self) -> int:
        """The current wake count (take it before polling)."""
        with self._cond:
            return self._seq

    def wake(self) -> None:
        """Wake every waiting thread."""
        with self._cond:
            self._seq += 1
            self._cond.notify_all()

    def wait(self, since: int, timeout: float) -> bool:
        """Wait until a wake after ``since`` or ``timeout`` seconds; True when woken."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq != since, timeout)


class RunListener(Listener):
    """LISTENs on ``buzz_agents`` (the shared :class:`~buzz_delivery.listening.Listener`: its own
    autocommit connection, on every node of a Citus cluster, any payload survived) and wakes the
    loop threads for hints naming one of ``communities`` (any community when that is empty).
    Reconnects after a loss (every ``retry_seconds``) and wakes the threads then too."""

    def __init__(
        self,
        *,
        waker: Waker,
        communities: list[uuid.UUID],
        conn_params: dict[str, Any],
        stop: threading.Event,
        agents: list[bytes] | None = None,
        on_delivery: Callable[[], None] | None = None,
    ) -> None:
        self.waker = waker
        self.communities = {str(c) for c in communities}
        # With acceptance on: the core's delivery hints for these agents wake the threads too.
        self.agents = {a.hex() for a in agents or []}
        self.delivery_channel = core_settings().notify_channel
        self.on_delivery = on_delivery
        self.hints = 0
        super().__init__(
            name="agent-listener",
            channels=(NOTIFY_CHANNEL, *((self.delivery_channel,) if self.agents else ())),
            conn_params=conn_params,
            stop=stop,
            on_notify=self._hint,
            on_listen=waker.wake,  # hints may have been missed while not listening
            logger=logger,
        )

    def _hint(self, channel: str, payload: str) -> None:
        if channel != NOTIFY_CHANNEL:
            if is_delivery_hint(payload, self.agents, self.communities):
                self.hints += 1
                if self.on_delivery is not None:
                    self.on_delivery()
                self.waker.wake()
        elif not self.communities or payload in self.communities:
            self.hints += 1
            self.waker.wake()


class AgentWorker:
    """Runs :class:`WorkerConfig` until stopped; :attr:`counts` is the summary."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.stopping = threading.Event()
        self.last_reached = time.monotonic()  # when a poll last reached the database
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        # Set (under ``lock``) when the shutdown grace is over and the held runs are given up: a
        # run not held yet then (its journal read still retried) is never started.
        self.abandoned = False
        # One heartbeat thread renews the runs of every community the worker serves: it bounds
        # each renewal's lock waits unless the worker serves one community (none given: any).
        several = len(set(config.communities)) != 1
        self.heartbeat = Heartbeat(
            every=max(config.lease_seconds / 3, 0.2),
            lease_seconds=config.lease_seconds,
            handler_timeout=config.handler_timeout,
            bound_lock_waits=several,
        )
        # The claims and the acceptance bound their lock waits the same way: a community whose
        # claim or accept waited past the bound (and changed nothing) is left for a while by
        # every loop thread (``skipped``), and the others are claimed meanwhile.
        self.claim_lock_wait_ms = lock_wait_ms(config.lease_seconds) if several else None
        self.skipped = Skipped(busy_retry_seconds(config.lease_seconds))
        self.waker = Waker()
        self.rounds = threading.local()  # each loop thread's ``after``: where its last round ended
        self.listener: RunListener | None = None
        self.acceptance = (
            Acceptance(
                config.agents,
                holder=config.worker_id or None,
                batch=config.accept_batch,
                every=config.poll_seconds,
                lock_wait_ms=self.claim_lock_wait_ms,
                skipped=self.skipped,
            )
            if config.accept
            else None
        )

    def stop(self, *_: Any) -> None:
        """Stop claiming; in-flight runs finish (drain) within ``shutdown_grace``."""
        self.stopping.set()
        self.waker.wake()

    def _communities(self, after: uuid.UUID | None = None) -> list[uuid.UUID]:
        """The communities of a round, in round-robin order from the one after ``after``."""
        if self.config.communities:
            return round_robin(self.config.communities, after)
        params = {"agents": self.config.agents, "after": after}
        with tenancy.fleet():  # discovery reads every community's runs: a fleet read (SPEC 13)
            found = [row[0] for row in fetch_all(COMMUNITIES_WITH_CLAIMABLE_RUNS, params)]
        if self.acceptance is not None and (self.acceptance.due() or self.config.exit_when_idle):
            found = [*found, *communities_with_pending_deliveries(self.config.agents)]
        return round_robin(found, after)

    def _take_slot(self) -> bool:
        with self.lock:
            if self.config.max_runs is not None and self.counts["claimed"] >= self.config.max_runs:
                self.stopping.set()
                return False
            self.counts["claimed"] += 1
            return True

    def _loop(self) -> None:
        lane = UserConnection()  # this thread's connection for user code (buzz_delivery.usercode)
        try:
            while not self.stopping.is_set():
                token = self.waker.token()
                try:
                    found = self._poll(lane)
                except DB_UNAVAILABLE as exc:  # a restart, a terminated backend: reconnect next poll
                    logger.warning("db_unavailable role=agent-worker error=%s", describe(exc).strip()[:200])
                    discard_connection()
                    with self.lock:
                        self.counts["db_errors"] += 1
                    # No run could be claimed: idle (exit 0) once the database stayed out of reach.
                    if self.config.exit_when_idle and unreachable_for_long(self.last_reached, self.config.poll_seconds):
                        self.stopping.set()
                        break
                    self.stopping.wait(self.config.poll_seconds)
                    continue
                self.last_reached = time.monotonic()
                if not found:
                    # A community left after a lock wait still has work: not idle; polled again
                    # once its wait is over, not a poll interval later.
                    left = self.skipped.next_try()
                    carried = None if self.acceptance is None else self.acceptance.next_round()
                    if carried is not None:  # claimed deliveries wait: polled again when they may go
                        left = carried if left is None else min(left, carried)
                    if self.config.exit_when_idle and left is None:
                        self.stopping.set()
                    elif self.waker.wait(
                        token, self.config.poll_seconds if left is None else min(left, self.config.poll_seconds)
                    ):
                        with self.lock:
                            self.counts["woken"] += 1
        except BaseException:
            # Never a silent death: the run it held is left to its lease, and the summary and the
            # exit code say the worker failed.
            logger.exception("worker_error")
            with self.lock:
                self.counts["internal_errors"] += 1
            self.stopping.set()
        finally:
            lane.close()
            connections.close_all()

    def _poll(self, lane: UserConnection) -> bool:
        """One round over the communities: the deliveries to accept (acceptance on), then a run
        claimed and run in each that has one, round robin: each round of a thread starts after
        the community its last round ended at (buzz_delivery.fairness)."""
        communities = self._communities(getattr(self.rounds, "after", None))
        # Acceptance first (one thread at a time): the runs it creates are claimed below.
        found = self.acceptance is not None and self.acceptance.round(communities) > 0
        for community in communities:
            if self.skipped.waits(community):
                continue  # its last claim or accept waited for a lock: tried again once that is over
            if self.stopping.is_set() or not self._take_slot():
                break
            held_until = time.monotonic() + self.config.lease_seconds  # before the claim: its lease ends later
            try:
                with lock_waits_bounded(self.claim_lock_wait_ms):
                    claims = s.claim_agent_runs(
                        community,
                        self.config.agents,
                        worker_id=self.config.worker_id,
                        lease_seconds=self.config.lease_seconds,
                    )
            except BaseException as exc:
                with self.lock:
                    self.counts["claimed"] -= 1
                if self.claim_lock_wait_ms is not None and lock_wait_timed_out(exc):
                    self._claim_waited(community)
                    continue
                raise
            self.rounds.after = community
            if not claims:
                with self.lock:
                    self.counts["claimed"] -= 1
                continue
            found = True
            self._run(claims[0], lane, held_until)
        if not found and self.config.exit_when_idle and self.acceptance is not None:
            found = self.acceptance.round(communities, force=True) > 0  # nothing left to accept either
        return found

    def _claim_waited(self, community: uuid.UUID) -> None:
        """A claim of ``community`` waited past the lock bound (only in a worker serving several
        communities): PostgreSQL cancelled it, so it claimed nothing. That community is left for
        :attr:`skipped`'s seconds by every loop thread; the others are claimed meanwhile."""
        self.skipped.skip(community)
        with self.lock:
            self.counts["lock_waits"] += 1
        logger.warning(
            "claim_lock_wait community=%s: waited past %s ms for a lock (a lifecycle move of its community, "
            "or a long transaction); its claims wait %.2fs, the other communities go on",
            community,
            self.claim_lock_wait_ms,
            self.skipped.seconds,
        )

    def _context(self, claim: s.AgentClaim, held_until: float = math.inf) -> Context | None:
        """``claim``'s context, its journal read. A read whose connection fails (a restart, a
        terminated backend) is retried on a fresh connection for up to a third of the lease
        (before its first renewal is due), so the run starts within the attempt it was claimed
        for instead of being left unstarted until its lease lapses; past that, None: the run is
        left to its lease, as when a runtime statement fails mid-run. A read that returns only
        once the lease has lapsed (``held_until``, monotonic: the time before the claim + the
        lease) also gives None: no handler starts on a lease the database may have handed on, as
        does any other error of the read (that run is left to its lease; the worker goes on)."""
        cfg = self.config
        until = time.monotonic() + cfg.lease_seconds / 3
        pause = min(cfg.poll_seconds, cfg.lease_seconds / 30)
        while True:
            try:
                ctx = Context(claim)
                if time.monotonic() >= held_until:
                    logger.warning("lease_lapsed run=%s: its journal was read past its lease", claim.lease.run_id)
                    return None
                return ctx
            except DB_UNAVAILABLE as exc:
                discard_connection()
                run_id, error = claim.lease.run_id, describe(exc)
                if time.monotonic() + pause >= until:
                    logger.warning("db_error run=%s: %s; the run is left to its lease", run_id, error)
                    return None
                logger.warning("journal_read_failed run=%s: %s; retried", run_id, error)
                time.sleep(pause)
            except Exception:
                # Any other error of this run's read (a row it cannot load, a database error not
                # of the connection): that run is left to its lease, as the event-loop worker
                # leaves it, and the worker goes on. Before, it ended the loop thread and with it
                # the worker (internal_errors). The connection is closed: its state is unknown.
                logger.exception(
                    "run_error run=%s: its journal could not be read; the run is left to its lease", claim.lease.run_id
                )
                discard_connection()
                return None

    def _run(self, claim: s.AgentClaim, lane: UserConnection, held_until: float = math.inf) -> None:
        logger.info("claimed run=%s generation=%s", claim.lease.run_id, claim.lease.lease_generation)
        ctx = self._context(claim, held_until)
        with self.lock:
            if ctx is None or self.abandoned:
                logger.info("lost run=%s", claim.lease.run_id)
                self.counts["lost"] += 1
                return
            self.heartbeat.hold(ctx)  # under the lock: _abandon gives it up, or it is not started
        try:
            result = run_claim(claim, self.config.handler, ctx, lane)
        finally:
            self.heartbeat.release(ctx)
        if ctx.failure_code is not None and result != "lost":  # failed (or unwound): say why
            logger.info("%s run=%s code=%r", result, claim.lease.run_id, ctx.failure_code)
        else:
            logger.info("%s run=%s", result, claim.lease.run_id)
        with self.lock:
            self.counts[result] += 1

    def run(self, conn_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run until stopped; returns the summary counts (also :meth:`summary_line`).

        ``conn_params``: ``psycopg.connect`` keywords of the LISTEN connection (default: those of
        ``BUZZ_DELIVERY["LISTEN_DATABASE"]``, else of ``default``)."""
        self.heartbeat.start()
        if self.config.listen and not self.config.exit_when_idle:
            alias = core_settings().listen_database or "default"  # a direct connection behind a pooler
            params = conn_params if conn_params is not None else connections[alias].get_connection_params()
            self.listener = RunListener(
                waker=self.waker,
                communities=list(self.config.communities),
                conn_params=params,
                stop=self.stopping,
                agents=self.config.agents if self.acceptance is not None else None,
                on_delivery=self.acceptance.hint if self.acceptance is not None else None,
            )
            self.listener.start()
        threads = [
            threading.Thread(target=self._loop, name=f"agent-{i}", daemon=True) for i in range(self.config.concurrency)
        ]
        for t in threads:
            t.start()
        stopped_at: float | None = None
        while any(t.is_alive() for t in threads):
            if self.stopping.is_set():
                stopped_at = stopped_at if stopped_at is not None else time.monotonic()
                if time.monotonic() - stopped_at > self.config.shutdown_grace:
                    self._abandon()
                    break
            for t in threads:
                t.join(timeout=0.1)
        self.heartbeat.stop.set()
        self.heartbeat.join(timeout=5)
        if self.listener is not None:
            self.listener.join(timeout=5)
        self.counts["renewed"] = self.heartbeat.renewed
        self.counts["timed_out"] = self.heartbeat.timed_out
        if self.acceptance is not None:
            self.counts["accepted"] = self.acceptance.counts["accepted"]
            self.counts["accept_errors"] = self.acceptance.counts["errors"]
        return dict(self.counts)

    def _abandon(self) -> None:
        """The grace is over: every run still held is given up (its lease lapses), and none is
        started any more."""
        with self.lock:
            self.abandoned = True
        for ctx in self.heartbeat.release_all():
            ctx.mark_lost("abandoned")
            logger.warning("abandoned run=%s (shutdown grace over)", ctx.lease.run_id)
            with self.lock:
                self.counts["abandoned"] += 1

    def summary_line(self) -> str:
        keys = (
            "claimed", "completed", "failed", "compensated", "compensation_failed", "parked", "lost", "timed_out",
            "abandoned", "woken", "accepted", "accept_errors",
        )  # fmt: skip
        body = {k: self.counts.get(k, 0) for k in keys}
        body.update(
            renewed=self.counts.get("renewed", 0),
            db_errors=self.counts.get("db_errors", 0),
            internal_errors=self.counts.get("internal_errors", 0),
        )
        return json.dumps(body, separators=(",", ":"))

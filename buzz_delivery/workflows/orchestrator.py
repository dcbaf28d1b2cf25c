"""The orchestrator behind ``manage.py run_workflow_worker`` (SPEC section 11 "Orchestrator").

Shaped like the delivery worker (:mod:`buzz_delivery.worker`): a dispatcher (the calling
thread) claims ready steps of one community, or of every community with work (walking them,
one claim statement per community), as many as there are idle step threads; step threads run
:func:`buzz_delivery.workflows.executor.execute`; a renewer thread renews every held lease each
third of its length; a listener thread LISTENs on ``buzz_workflows`` (the Advance trigger
NOTIFYs it with the community id whenever a step becomes ready) and wakes the dispatcher,
which polls every ``poll_interval`` anyway. SIGTERM/SIGINT: stop claiming, let in-flight steps
finish within ``shutdown_grace`` seconds, then exit (leases still held lapse and are reclaimed
by the maintenance). Nothing about one step stops it: an exception is counted (``errors``) and
its lease left to lapse.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import DatabaseError, close_old_connections, connection, connections

from buzz_delivery.conf import get_settings as core_settings
from buzz_delivery.holders import holder_identity
from buzz_delivery.services import AlreadyTerminal, LeaseLost, Settled
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.conf import NOTIFY_CHANNEL
from buzz_delivery.workflows.services import claim_steps, communities_with_ready_steps, renew_step
from buzz_delivery.workflows.services.types import StepClaim, StepLease, StepRenewed

logger = logging.getLogger("buzz_delivery.workflows")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_ABANDONED = 3
SUMMARY_KEYS = (
    "claimed",
    "succeeded",
    "failed",
    "retried",
    "waiting",
    "lease_lost",
    "already_terminal",
    "renewed",
    "errors",
    "abandoned",
)


@dataclass(frozen=True)
class OrchestratorConfig:
    """``community_id``: one community, or None for all. Times in seconds. ``name``: the name in
    the holder identity ``host:pid:name`` its step claims record (``claimed_by``)."""

    community_id: uuid.UUID | None
    concurrency: int = 4
    lease_seconds: float = 60
    poll_interval: float = 1.0
    idle_exit: float | None = None
    max_steps: int | None = None
    shutdown_grace: float = 30.0
    name: str = "orchestrator"


class _Listener(threading.Thread):
    def __init__(
        self,
        conn_params: dict[str, Any],
        community: uuid.UUID | None,
        wake: threading.Event,
        stop: threading.Event,
        retry: float,
    ) -> None:
        super().__init__(name="buzz-workflows-listener", daemon=True)
        self.conn_params, self.community, self.wake, self.stop, self.retry = conn_params, community, wake, stop, retry

    def run(self) -> None:
        conn = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(**self.conn_params, autocommit=True)
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.wake.set()
                for notify in conn.notifies(timeout=0.5):
                    if self.community is None or notify.payload == str(self.community):
                        self.wake.set()
            except psycopg.Error as exc:
                logger.warning("db_unavailable role=listener error=%s", str(exc).splitlines()[:1])
                if conn is not None:
                    conn.close()
                conn = None
                self.stop.wait(self.retry)
        if conn is not None:
            conn.close()


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, stop: threading.Event) -> None:
        self.config = config
        self.holder = holder_identity(config.name)
        self.stop = stop
        self.wake = threading.Event()
        self.work: queue.Queue[StepClaim | None] = queue.Queue()
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(SUMMARY_KEYS, 0)
        self.held: dict[uuid.UUID, StepLease] = {}
        self.in_flight = 0
        self.signal_name: str | None = None
        self.renew_done = threading.Event()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    # --- threads -----------------------------------------------------------------

    def _step_thread(self) -> None:
        try:
            while True:
                claim = self.work.get()
                if claim is None:
                    return
                try:
                    outcome = executor.execute(claim)
                    self._count(outcome)
                except Exception:
                    logger.exception("step_error step=%s run=%s", claim.step.key, claim.lease.run_id)
                    self.add("errors")
                    if connection.connection is not None and not connection.is_usable():
                        connection.close()
                finally:
                    with self.lock:
                        self.held.pop(claim.lease.step_id, None)
                        self.in_flight -= 1
                    self.wake.set()
        finally:
            connection.close()

    def _count(self, outcome: object) -> None:
        if isinstance(outcome, Settled):
            key = {"succeeded": "succeeded", "failed": "failed", "ready": "retried", "waiting": "waiting"}
            self.add(key.get(outcome.status, "succeeded"))
        elif isinstance(outcome, AlreadyTerminal):
            self.add("already_terminal")
        elif isinstance(outcome, LeaseLost):
            self.add("lease_lost")

    def _renew_thread(self) -> None:
        every = self.config.lease_seconds / 3
        try:
            while True:
                with self.lock:
                    if self.stop.is_set() and not self.in_flight:
                        return
                self.renew_done.wait(every)  # set only when the step threads are gone
                if self.renew_done.is_set():
                    return
                with self.lock:
                    leases = list(self.held.values())
                for lease in leases:
                    try:
                        renewed = renew_step(lease, self.config.lease_seconds)
                    except DatabaseError:
                        close_old_connections()
                        connection.close()
                        continue
                    with self.lock:
                        if isinstance(renewed, StepRenewed) and lease.step_id in self.held:
                            self.held[lease.step_id] = renewed.lease
                            self.counts["renewed"] += 1
                        elif isinstance(renewed, LeaseLost):
                            self.held.pop(lease.step_id, None)  # its complete will be told LeaseLost
        finally:
            connection.close()

    # --- dispatcher ---------------------------------------------------------------------

    def _claim(self, room: int) -> list[StepClaim]:
        c = self.config
        if c.community_id is not None:
            return claim_steps(c.community_id, limit=room, lease_seconds=c.lease_seconds, holder=self.holder)
        claims: list[StepClaim] = []
        for community in communities_with_ready_steps():
            if len(claims) >= room:
                break
            claims += claim_steps(
                community, limit=room - len(claims), lease_seconds=c.lease_seconds, holder=self.holder
            )
        return claims

    def dispatch(self) -> str:
        c = self.config
        idle_since = time.monotonic()
        started = 0
        while True:
            if self.signal_name:
                return self.signal_name
            if self.stop.is_set():
                return "stopped"
            if c.max_steps is not None and started >= c.max_steps:
                return "max_steps"
            with self.lock:
                room = c.concurrency - self.in_flight
            if c.max_steps is not None:
                room = min(room, c.max_steps - started)
            claims: list[StepClaim] = []
            if room > 0:
                self.wake.clear()
                try:
                    claims = self._claim(room)
                except DatabaseError as exc:
                    logger.warning("db_unavailable role=dispatcher error=%s", str(exc).splitlines()[:1])
                    close_old_connections()
                    connection.close()
            for claim in claims:
                with self.lock:
                    self.held[claim.lease.step_id] = claim.lease
                    self.in_flight += 1
                self.work.put(claim)
            started += len(claims)
            self.add("claimed", len(claims))
            with self.lock:
                busy = self.in_flight > 0
            if claims or busy:
                idle_since = time.monotonic()
            elif c.idle_exit is not None and time.monotonic() - idle_since >= c.idle_exit:
                return "idle_exit"
            if not claims or room - len(claims) <= 0:
                self.wake.wait(c.poll_interval)

    def run(self, conn_params: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        threads = [
            threading.Thread(target=self._step_thread, name=f"buzz-workflows-step-{i}", daemon=True)
            for i in range(c.concurrency)
        ]
        renewer = threading.Thread(target=self._renew_thread, name="buzz-workflows-renewer", daemon=True)
        listener = _Listener(conn_params, c.community_id, self.wake, self.stop, c.poll_interval)
        for t in (*threads, renewer, listener):
            t.start()
        reason = "error"
        try:
            reason = self.dispatch()
        finally:
            self.stop.set()
            for _ in threads:
                self.work.put(None)
            deadline = time.monotonic() + c.shutdown_grace
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            with self.lock:
                self.counts["abandoned"] = self.in_flight
                self.in_flight = 0
            self.renew_done.set()
            renewer.join(5)
            listener.join(5)
        exit_code = EXIT_OK if reason in ("SIGTERM", "SIGINT", "stopped", "idle_exit", "max_steps") else EXIT_ERROR
        if self.counts["abandoned"] and exit_code == EXIT_OK:
            exit_code = EXIT_ABANDONED
        return {**self.counts, "reason": reason, "exit_code": exit_code}


def run_orchestrator(
    config: OrchestratorConfig, *, stop: threading.Event | None = None, handle_signals: bool = True
) -> dict[str, Any]:
    """Run the orchestrator until stopped (signal, ``stop``, ``idle_exit``, ``max_steps``).
    Returns the summary: the counts of :data:`SUMMARY_KEYS`, ``reason`` and ``exit_code``
    (0 clean, 1 internal error, 3 in-flight steps abandoned at the end of the grace)."""
    stop = stop or threading.Event()
    orchestrator = Orchestrator(config, stop)
    previous: dict[int, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: Any) -> None:
            orchestrator.signal_name = signal.Signals(signum).name  # a plain attribute: no locks here

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    # LISTEN on a direct connection when the default one goes through a transaction pooler.
    listen_alias = core_settings().listen_database or connection.alias
    try:
        return orchestrator.run(connections[listen_alias].get_connection_params())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def summary_line(summary: dict[str, Any]) -> str:
    return json.dumps(summary, separators=(",", ":"))

"""The agent worker loop behind ``manage.py run_agent_worker`` (SPEC 12 "Runtime").

``concurrency`` threads each claim one run at a time, round-robin over the communities the
process is given (or, with none given, the active communities that have claimable runs for its
agents), run the handler (:func:`~buzz_delivery.agents.runtime.run_claim`) and go on; one
:class:`~buzz_delivery.agents.runtime.Heartbeat` thread renews every held lease on its own
connection. :meth:`AgentWorker.stop` (SIGTERM/SIGINT) stops claiming and lets in-flight runs
reach their resting point (drain).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from buzz_delivery.agents import services as s
from buzz_delivery.agents.runtime import Context, Heartbeat, run_claim
from buzz_delivery.agents.services.sql import RUN
from buzz_delivery.services import tenancy
from buzz_delivery.services.db import fetch_all
from buzz_delivery.services.sql import DB_NOW

logger = logging.getLogger("buzz_delivery.agents")

COMMUNITIES_WITH_CLAIMABLE_RUNS = f"""
SELECT DISTINCT r.community_id FROM {RUN} AS r JOIN buzz_delivery_community c ON c.id = r.community_id
WHERE c.deletion_state = 'active' AND r.state = 'pending' AND r.agent_pubkey = ANY(%(agents)s)
  AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= {DB_NOW})
LIMIT 100
"""


@dataclass
class WorkerConfig:
    """``agents``: 32-byte keys served; ``communities``: UUIDs (empty = discover);
    ``concurrency``: handler threads; ``lease_seconds``; ``poll_seconds`` between empty polls;
    ``max_runs``: stop after that many claims (None = no limit); ``exit_when_idle``: stop when a
    whole poll finds nothing; ``worker_id``: recorded on each claim."""

    handler: Callable[[Context], Any]
    agents: list[bytes]
    communities: list[uuid.UUID] = field(default_factory=list)
    concurrency: int = 1
    lease_seconds: float = 60
    poll_seconds: float = 1.0
    max_runs: int | None = None
    exit_when_idle: bool = False
    worker_id: str = ""


class AgentWorker:
    """Runs :class:`WorkerConfig` until stopped; :attr:`counts` is the summary."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.stopping = threading.Event()
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.heartbeat = Heartbeat(every=max(config.lease_seconds / 3, 0.2), lease_seconds=config.lease_seconds)

    def stop(self, *_: Any) -> None:
        """Stop claiming; in-flight runs finish (drain)."""
        self.stopping.set()

    def _communities(self) -> list[uuid.UUID]:
        if self.config.communities:
            return list(self.config.communities)
        with tenancy.fleet():  # discovery reads every community's runs: a fleet read (SPEC 13)
            return [row[0] for row in fetch_all(COMMUNITIES_WITH_CLAIMABLE_RUNS, {"agents": self.config.agents})]

    def _take_slot(self) -> bool:
        with self.lock:
            if self.config.max_runs is not None and self.counts["claimed"] >= self.config.max_runs:
                self.stopping.set()
                return False
            self.counts["claimed"] += 1
            return True

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                found = False
                for community in self._communities():
                    if self.stopping.is_set() or not self._take_slot():
                        break
                    claims = s.claim_agent_runs(
                        community,
                        self.config.agents,
                        worker_id=self.config.worker_id,
                        lease_seconds=self.config.lease_seconds,
                    )
                    if not claims:
                        with self.lock:
                            self.counts["claimed"] -= 1
                        continue
                    found = True
                    self._run(claims[0])
                if not found:
                    if self.config.exit_when_idle:
                        self.stopping.set()
                    self.stopping.wait(self.config.poll_seconds)
        except Exception:
            logger.exception("worker_error")
            with self.lock:
                self.counts["internal_errors"] += 1
            self.stopping.set()
        finally:
            connections.close_all()

    def _run(self, claim: s.AgentClaim) -> None:
        logger.info("claimed run=%s generation=%s", claim.lease.run_id, claim.lease.lease_generation)
        ctx = Context(claim)
        self.heartbeat.hold(ctx)
        try:
            result = run_claim(claim, self.config.handler, ctx)
        finally:
            self.heartbeat.release(ctx)
        logger.info("%s run=%s", result, claim.lease.run_id)
        with self.lock:
            self.counts[result] += 1

    def run(self) -> dict[str, Any]:
        """Run until stopped; returns the summary counts (also :meth:`summary_line`)."""
        self.heartbeat.start()
        threads = [
            threading.Thread(target=self._loop, name=f"agent-{i}", daemon=True) for i in range(self.config.concurrency)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)
        self.heartbeat.stop.set()
        self.heartbeat.join(timeout=5)
        self.counts["renewed"] = self.heartbeat.renewed
        return dict(self.counts)

    def summary_line(self) -> str:
        keys = ("claimed", "completed", "failed", "compensated", "compensation_failed", "parked", "lost")
        body = {k: self.counts.get(k, 0) for k in keys}
        body.update(renewed=self.counts.get("renewed", 0), internal_errors=self.counts.get("internal_errors", 0))
        return json.dumps(body, separators=(",", ":"))

"""The demo's workload: communities with agents and workflows, and a producer thread that
commits deliveries the way a workflow run's ``send_message`` step does (SPEC sections 4.1-4.2).
"""

from __future__ import annotations

import datetime as dt
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

from django.db import DatabaseError, connections, transaction
from django.utils import timezone

from buzz_delivery import services
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.models import Community, Event, Workflow, WorkflowRun
from buzz_delivery.services import Binding, Cause
from buzz_delivery.triggers import FENCE_SQLSTATE

MAX_FAN_OUT = 5
WORKFLOW_NAMES = ("triage incoming mail", "daily digest")
STEPS_PER_RUN = (1, 2)


@dataclass
class Tenant:
    """One demo community: its agents (target public keys, 32 bytes) and workflows."""

    community: Community
    agents: list[bytes]
    workflows: list[Workflow]
    definition_ids: dict[uuid.UUID, bytes] = field(default_factory=dict)

    @property
    def id(self) -> uuid.UUID:
        return self.community.id


def create_tenants(communities: int, agents_per_community: int, label: str) -> list[Tenant]:
    """Create ``communities`` communities named ``demo <label> #i``, each with
    ``agents_per_community`` agents (random 32-byte keys) and two workflows."""
    tenants = []
    for i in range(1, communities + 1):
        community = Community.objects.create(name=f"demo {label} #{i}")
        workflows = [Workflow.objects.create(community=community, name=name) for name in WORKFLOW_NAMES]
        tenants.append(
            Tenant(
                community=community,
                agents=[os.urandom(32) for _ in range(agents_per_community)],
                workflows=workflows,
                definition_ids={w.id: os.urandom(32) for w in workflows},
            )
        )
    return tenants


def _is_fence_refusal(exc: BaseException) -> bool:
    return isinstance(exc, CommunityNotWritable) or getattr(exc.__cause__, "sqlstate", None) == FENCE_SQLSTATE


def _cause(rng: random.Random) -> Cause:
    kind = rng.choice(("event", "schedule", "webhook"))
    if kind == "event":
        return Cause.event(rng.randbytes(32))
    if kind == "schedule":
        return Cause.schedule(timezone.now().replace(microsecond=0) - dt.timedelta(seconds=rng.randint(0, 3600)))
    return Cause.webhook(uuid.UUID(int=rng.getrandbits(128), version=4))


class Producer(threading.Thread):
    """Commits ``total`` deliveries at about ``rate`` per second, spread over the tenants.

    Each workflow run has one or two ``send_message`` steps; each step posts one message event
    and commits one delivery per target (1..5 agents of the community) inside
    ``transaction.atomic()``, after ``services.lock_delivery_identity`` (a retried step finds
    its deliveries and posts nothing: counted in ``deduplicated``). A community whose writes
    the database refuses (fenced) gets no more runs. Counters are read by the demo's monitor.
    """

    def __init__(self, tenants: list[Tenant], total: int, rate: float, seed: int, retry_share: float = 0.03) -> None:
        super().__init__(name="buzz-demo-producer", daemon=True)
        self.tenants = tenants
        self.total = total
        self.rate = rate
        self.rng = random.Random(seed)
        self.retry_share = retry_share
        self.committed = 0
        self.committed_by_community: dict[uuid.UUID, int] = {t.id: 0 for t in tenants}
        self.runs = 0
        self.deduplicated = 0
        self.refused: set[uuid.UUID] = set()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # reported by the demo, which fails the run
            self.error = exc
        finally:
            connections.close_all()

    def _produce(self) -> None:
        started = time.monotonic()
        while self.committed < self.total:
            open_tenants = [t for t in self.tenants if t.id not in self.refused]
            if not open_tenants:
                raise RuntimeError("every demo community refuses writes; nothing left to produce into")
            tenant = self.rng.choice(open_tenants)
            try:
                self._one_run(tenant)
            except (CommunityNotWritable, DatabaseError) as exc:
                if not _is_fence_refusal(exc):
                    raise
                self.refused.add(tenant.id)
            pause = started + self.committed / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)

    def _one_run(self, tenant: Tenant) -> None:
        workflow = self.rng.choice(tenant.workflows)
        run = WorkflowRun.objects.create(community=tenant.community, workflow=workflow)
        self.runs += 1
        cause = _cause(self.rng)
        for step in range(1, self.rng.choice(STEPS_PER_RUN) + 1):
            left = self.total - self.committed
            if left <= 0:
                return
            fan_out = self.rng.randint(1, min(MAX_FAN_OUT, len(tenant.agents), left))
            targets = self.rng.sample(tenant.agents, fan_out)
            created = self._send_message(tenant, workflow, run, f"send_message_{step}", targets, cause)
            self.committed += created
            self.committed_by_community[tenant.id] += created
            # Now and then the producer "loses the acknowledgement" and runs the step again.
            retried = created and self.rng.random() < self.retry_share
            if retried and self._send_message(tenant, workflow, run, f"send_message_{step}", targets, cause) == 0:
                self.deduplicated += 1

    def _send_message(
        self, tenant: Tenant, workflow: Workflow, run: WorkflowRun, step_id: str, targets: list[bytes], cause: Cause
    ) -> int:
        """One ``send_message`` step; returns how many deliveries it created."""
        with transaction.atomic():
            if services.lock_delivery_identity(tenant.id, run.id, step_id):
                return 0  # already sent: reuse the posted message, post nothing
            message = Event.objects.create(
                community=tenant.community,
                event_id=self.rng.randbytes(32),
                created_at=timezone.now(),
                kind=1,
                pubkey=tenant.agents[0],
                content=f"{workflow.name}: {step_id} of run {run.id}",
                tags=[["run", str(run.id)]],
            )
            bindings = [
                Binding(
                    community_id=tenant.id,
                    workflow_id=workflow.id,
                    run_id=run.id,
                    step_id=step_id,
                    target_pubkey=target,
                    definition_event_id=tenant.definition_ids[workflow.id],
                    message_event_id=bytes(message.event_id),
                    cause=cause,
                )
                for target in targets
            ]
            created = services.commit_deliveries(
                tenant.id,
                message,
                bindings,
                execution_trace={"workflow": workflow.name, "step": step_id},
                trigger_context={"cause": cause.kind},
            )
        return len(created)

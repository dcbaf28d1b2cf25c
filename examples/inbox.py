"""The inbox on its own: a producer commits deliveries, a worker claims and settles them, and a
worker that dies holding a lease loses it to the reaper. Run it against a migrated database of
the example project (the README's "Try it" line migrates the embedded one)::

    python examples/inbox.py                       # the embedded server under var/pgdata
    DATABASE_URL=postgres://... python examples/inbox.py

In your project, ``send_message`` is what the workflow engine's ``send_message`` step does for you,
``handle`` is your agent's code and ``run_delivery_worker`` / ``reap_deliveries`` are the two
commands you run (docs: README "Public API" and "Operations").
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

if __name__ == "__main__":  # a standalone script: set Django up (a project's own module needs none of this)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("BUZZ_MIN_LEASE_SECONDS", "1")  # the example project's knob: a 1 s lease below
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()

from django.db import transaction
from django.utils import timezone

from buzz_delivery import services
from buzz_delivery.models import Community, Event, Workflow, WorkflowAgentDelivery, WorkflowRun
from buzz_delivery.services import Binding, Cause
from buzz_delivery.worker import WorkerConfig, run_worker


def send_message(run: WorkflowRun, step_id: str, text: str, targets: list[bytes], cause: Cause) -> list[uuid.UUID]:
    """The producer: one delivery per target, at most once per (run, step) however often it is retried."""
    definition_event_id = bytes(32)  # the event that published the workflow's version (the engine's)
    with transaction.atomic():
        if services.lock_delivery_identity(run.community_id, run.id, step_id):
            return []  # an earlier attempt of this step committed its deliveries already
        message = Event.objects.create(
            community_id=run.community_id, event_id=os.urandom(32), created_at=timezone.now(),
            kind=1, pubkey=bytes(32), content=text, tags=[],
        )  # fmt: skip
        bindings = [
            Binding(run.community_id, run.workflow_id, run.id, step_id, target, definition_event_id,
                    bytes(message.event_id), cause)
            for target in targets
        ]  # fmt: skip
        return services.commit_deliveries(run.community_id, message, bindings)


def handle(delivery: WorkflowAgentDelivery) -> None:
    """The agent's work on one delivery: return = finished, raise = retry (PermanentFailure = failed)."""
    print(f"  handled {delivery.step_id}")


def main() -> dict[str, int]:
    community = Community.objects.create(name="inbox example")
    workflow = Workflow.objects.create(community=community, name="greetings")
    run = WorkflowRun.objects.create(community=community, workflow=workflow)
    agent = os.urandom(32)  # the agent's public key: deliveries are addressed to it
    cause = Cause.webhook(uuid.uuid4())  # what started the run

    created = [d for step in ("hello", "welcome", "tour") for d in send_message(run, step, step, [agent], cause)]
    retried = send_message(run, "hello", "hello", [agent], cause)  # a retried step commits nothing
    print(f"committed {len(created)} deliveries; the retried step committed {len(retried)}")

    # A worker that claims one delivery and dies without settling it: its lease lapses ...
    lost = services.claim_delivery(community.id, agent, lease_seconds=1, holder="crashed-worker")
    assert lost is not None
    time.sleep(1.5)
    # ... and the reaper (`manage.py reap_deliveries`, from cron) puts it back to pending.
    reaped = services.reap()
    print(f"reaper: reclaimed {reaped.reclaimed}")

    # The worker (`manage.py run_delivery_worker --handler examples.inbox:handle ...`), until idle.
    summary = run_worker(
        WorkerConfig(community.id, agent, handle, concurrency=2, poll_interval=0.2, idle_exit=1), handle_signals=False
    )
    print(f"worker: claimed {summary['claimed']}, finished {summary['finished']}")
    statuses = sorted(WorkflowAgentDelivery.objects.filter(community=community).values_list("status", flat=True))
    print(f"statuses: {statuses}")
    return {"reclaimed": reaped.reclaimed, "finished": summary["finished"]}


if __name__ == "__main__":
    main()

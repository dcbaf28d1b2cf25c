"""One OpenTelemetry trace from a producer to an agent's tool calls (issue 34): a workflow's
``send_message`` step sends a message to an agent, the agent accepts the delivery, and the agent
worker runs its handler, which makes two journaled tool calls. The spans are printed as the tree
the trace is. Needs the ``tracing`` extra and the OpenTelemetry SDK; run it against a migrated
database of the example project::

    pip install 'buzz-delivery[tracing]' opentelemetry-sdk
    DATABASE_URL=postgres://... python examples/traced_agent.py

A project configures its tracer provider once at start-up (here: the SDK's, with an in-memory
exporter so the script can print the spans; in production an OTLP exporter), in every process:
the web process, the orchestrator, the delivery and agent workers.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a standalone script: set Django up (a project's own module needs none of this)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the global provider: buzz_delivery's spans go to it


def lookup(args: dict[str, Any], key: str) -> dict[str, Any]:
    """A tool: ``key`` is the journal's idempotency key for this call."""
    return {"order": args["order"], "status": "paid"}


def handler(ctx: Any) -> dict[str, Any]:
    """The agent: two journaled tool calls, each a ``buzz.agent.call`` span."""
    found = ctx.call("lookup", lookup, {"order": "o-42"})
    ctx.call("notify", lambda args, key: {"sent": True}, {"text": f"order {found['order']} is {found['status']}"})
    return {"done": True}


def main() -> list[str]:
    from buzz_delivery import services as core
    from buzz_delivery.agents.services import accept_delivery
    from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
    from buzz_delivery.models import Community, Workflow, WorkflowAgentDelivery
    from buzz_delivery.services import Cause
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
    from buzz_delivery.workflows.services import publish_definition, start_run

    agent = os.urandom(32)  # the agent's public key
    community = Community.objects.create(name="shop")
    workflow = Workflow.objects.create(community=community, name="ask the agent")
    steps = [{"key": "ask", "kind": "send_message", "targets": [agent.hex()], "content": "check order o-42"}]
    publish_definition(community.id, workflow.id, {"steps": steps})
    with trace.get_tracer("shop").start_as_current_span("POST /orders"):  # the producer: a web request
        run = start_run(community.id, workflow.id, {}, cause=Cause.webhook(uuid.uuid4()))
    # The orchestrator runs the send_message step: its delivery stores the step's trace context.
    run_orchestrator(OrchestratorConfig(community.id, poll_interval=0.2, idle_exit=1), handle_signals=False)
    # The agent takes the message (here in-process; a remote agent does it through the gateway).
    delivery = WorkflowAgentDelivery.objects.get(community_id=community.id, run_id=run.pk)
    claim = core.claim_delivery(community.id, agent, delivery_id=delivery.id)
    accept_delivery(claim.lease)
    # The agent worker (what `manage.py run_agent_worker` runs) claims the run and calls handler.
    config = WorkerConfig(handler, [agent], communities=[community.id], exit_when_idle=True, worker_id="example")
    AgentWorker(config).run()

    spans = exporter.get_finished_spans()
    children: dict[Any, list[Any]] = {}
    for span in spans:
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    lines: list[str] = []

    def show(span: Any, depth: int) -> None:
        tool = span.attributes.get("buzz.tool")
        lines.append("  " * depth + span.name + (f" ({tool})" if tool else ""))
        for child in sorted(children.get(span.context.span_id, []), key=lambda s: s.start_time):
            show(child, depth + 1)

    (root,) = [s for s in children[None] if s.name == "POST /orders"]
    show(root, 0)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

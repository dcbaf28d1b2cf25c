"""A workflow asks an agent, the agent's run journals its tool call, and its answer flows back into
the workflow: workflow -> delivery -> agent run -> journal -> back to the step. Run it against a
migrated database of the example project::

    python examples/agent_run.py                   # the embedded server under var/pgdata
    DATABASE_URL=postgres://... python examples/agent_run.py

Three loops run here one after the other, each until idle; in production each is a process of its
own: ``manage.py run_workflow_worker`` (the engine), the inbox (claims the agent's deliveries and
accepts each, which starts its agent run; shown here as code, ``run_agent_worker`` does it itself
unless ``--no-accept``: examples/agent_inbox.py) and ``manage.py run_agent_worker --handler
examples.agent_run:answer --agent <hex>``. Docs: docs/agents.md, docs/workflows.md.
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
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()

from buzz_delivery import services as inbox
from buzz_delivery.agents import services as agents
from buzz_delivery.agents.runtime import Context
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.models import Community, Workflow
from buzz_delivery.services import Cause
from buzz_delivery.workflows import Definition, StepContext, ref, workflow_function
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.services import get_run, publish_definition, start_run

AGENT = bytes.fromhex("5a" * 32)  # the agent's public key (yours: the key it holds)


def look_up_order(args: dict[str, Any], key: str) -> dict[str, Any]:
    """A tool. ``key`` (``<run id>:<seq>``) is the call's idempotency key: pass it on to the
    outside system, so a call made again after a crash is recognised there."""
    return {"order": args["question"].split()[-1].rstrip("?"), "status": "shipped"}


def answer(ctx: Context) -> dict[str, Any]:
    """The agent's handler: each ``ctx.call`` is journaled before it is made, its result after."""
    order = ctx.call("look_up_order", look_up_order, {"question": ctx.input["content"]})
    return {"reply": f"order {order['order']} is {order['status']}"}


@workflow_function("support.close_ticket")
def close_ticket(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"ticket": input["ticket"], "closed_with": input["answer"]}


def support_flow() -> Definition:
    flow = Definition()
    # The agent's run output comes back as the step's output: {agent key hex: run output}.
    ask = flow.send_message("ask", [AGENT], "Where is order o-42?", **{"await": "agent_run"})
    reply = ask.output(AGENT.hex(), "reply")
    flow.function("close", close_ticket, input={"ticket": ref.input("ticket"), "answer": reply})
    return flow


def accept_deliveries(community_id: uuid.UUID) -> list[uuid.UUID]:
    """The inbox: claim the agent's deliveries and accept each (settles it and starts its run)."""
    runs = []
    for claim in inbox.claim_deliveries(community_id, AGENT, limit=10, holder="example-inbox"):
        outcome = agents.accept_delivery(claim.lease)
        if isinstance(outcome, agents.Accepted):
            runs.append(outcome.run_id)
    return runs


def main() -> dict[str, Any]:
    community = Community.objects.create(name="support")
    workflow = Workflow.objects.create(community=community, name="ticket")
    publish_definition(community.id, workflow.id, support_flow())
    # A run started by hand: Cause.webhook(<a fresh uuid>) names this invocation (a cron start
    # gives Cause.schedule(slot), an event Cause.event(event id)).
    run = start_run(community.id, workflow.id, {"ticket": 7}, cause=Cause.webhook(uuid.uuid4()))

    def orchestrate() -> None:
        run_orchestrator(OrchestratorConfig(community.id, poll_interval=0.2, idle_exit=1), handle_signals=False)

    orchestrate()  # "ask" commits one delivery to the agent and waits for its agent run
    (agent_run_id,) = accept_deliveries(community.id)
    print("accepted the delivery: its agent run is pending")
    config = WorkerConfig(answer, [AGENT], [community.id], exit_when_idle=True, worker_id="example-agent-worker")
    counts = AgentWorker(config).run()
    print(f"agent worker: completed {counts.get('completed', 0)}")
    orchestrate()  # "close" runs with the agent's answer

    view = get_run(community.id, run.pk)
    assert view is not None
    journal = [(e.seq, e.tool_name, e.status) for e in agents.get_journal(community.id, agent_run_id)]
    print(f"journal: {journal}")
    print(f"run {view.state}: {view.run.output}")
    return {"state": view.state, "output": view.run.output, "journal": journal}


if __name__ == "__main__":
    main()

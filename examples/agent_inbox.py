"""A workflow that asks two agents and waits for their runs (issue 29), with nothing but the
bundled commands running: ``run_workflow_worker`` sends the messages, ``run_agent_worker``
accepts each delivery into an agent run (built-in acceptance), runs ``answer`` for it and
completes it; the step that awaited the runs ends with their outputs and the next step gets
them. Run it against a migrated database of the example project::

    DATABASE_URL=postgres://... python examples/agent_inbox.py

It prints the commands it starts; in a deployment they are your long-running processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":  # a standalone script: set Django up (a project's own module needs none of this)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()


def lookup(args: dict[str, Any], key: str) -> dict[str, Any]:
    """A tool (a model or an API call in real life); ``key`` is its idempotency key."""
    return {"words": len(args["text"].split())}


def answer(ctx: Any) -> dict[str, Any]:
    """The agent's handler: one journaled tool call, then the run's output."""
    found = ctx.call("lookup", lookup, {"text": ctx.input["content"]})
    return {"agent": bytes(ctx.run.agent_pubkey).hex()[:8], "words": found["words"]}


def definition(agents: list[bytes]) -> dict[str, Any]:
    return {
        "steps": [
            {
                "key": "ask",
                "kind": "send_message",
                "targets": [a.hex() for a in agents],
                "content": "how many words is this",
                "await": "agent_run",  # the step ends when the agent runs its deliveries started end
            },
            {"key": "report", "kind": "function", "function": "echo", "depends_on": ["ask"],
             "input": {"answers": {"$ref": ["steps", "ask", "output"]}}},
        ]
    }  # fmt: skip


def main() -> dict[str, Any]:
    from buzz_delivery.models import Community, Workflow
    from buzz_delivery.services import Cause
    from buzz_delivery.workflows.services import get_run, publish_definition, start_run

    agents = [os.urandom(32), os.urandom(32)]
    community = Community.objects.create(name="inbox")
    workflow = Workflow.objects.create(community=community, name="ask the agents")
    publish_definition(community.id, workflow.id, definition(agents))
    run = start_run(community.id, workflow.id, {}, cause=Cause.webhook(uuid.uuid4()))

    commands = [
        ["run_workflow_worker", "--community", str(community.id), "--poll-interval", "0.2"],
        ["run_agent_worker", "--handler", "examples.agent_inbox:answer", "--community", str(community.id),
         *[x for a in agents for x in ("--agent", a.hex())], "--poll-seconds", "0.5"],
    ]  # fmt: skip
    procs = []
    for command in commands:
        print("manage.py", " ".join(command))
        procs.append(
            subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *command], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            view = get_run(community.id, run.pk)
            if view is not None and view.state in ("succeeded", "failed", "canceled"):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        summaries = [json.loads((proc.communicate(timeout=60)[0].strip().splitlines() or ["{}"])[-1]) for proc in procs]
    view = get_run(community.id, run.pk)
    assert view is not None
    report = next(s for s in view.steps if s.key == "report")
    print(f"run {view.state}")
    print(f"report: {json.dumps(report.output, sort_keys=True)}")
    agent_summary = summaries[1]
    print(f"agent worker: accepted {agent_summary.get('accepted')}, completed {agent_summary.get('completed')}")
    return {"state": view.state, "report": report.output}


if __name__ == "__main__":
    sys.exit(0 if main()["state"] == "succeeded" else 1)

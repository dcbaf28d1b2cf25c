"""A workflow written in code (issue 33): an order is loaded, waits for its payment event, packs
each of its lines (a map over a list known only at run time), cools off for a second (a durable
sleep) and ships. Run it against a migrated database of the example project::

    DATABASE_URL=postgres://... python examples/order_fulfilment.py

In a project of your own, the functions and the definition go in a ``workflows.py`` module of one
of your apps: it is imported when Django starts, in every process, workers included.
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

from buzz_delivery.workflows import Definition, Each, StepContext, ref, workflow_function


@workflow_function("shop.load_order")
def load_order(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"order_id": input["order_id"], "lines": [{"sku": "tea", "qty": 2}, {"sku": "cup", "qty": 1}]}


@workflow_function("shop.pack_line")
def pack_line(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    line = input["line"]
    return {"parcel": f"{line['qty']} x {line['sku']}"}


@workflow_function("shop.ship")
def ship(input: dict[str, Any], context: StepContext) -> dict[str, Any]:
    return {"shipped": [p["parcel"] for p in input["parcels"]], "paid": input["paid"]}


def order_flow() -> Definition:
    """The definition, in code: the same validated JSON a hand-written one would be."""
    flow = Definition()
    order = flow.function("load", load_order, input={"order_id": ref.input("order_id")})
    paid = flow.wait_event("paid", event="payment.received", event_key=ref.input("order_id"), wait_timeout_seconds=3600)
    pack = flow.map("pack", over=order.output("lines"), do=Each.function(pack_line, input={"line": ref.item()}))
    cool = flow.sleep("cool_off", seconds=1, after=[pack, paid])
    flow.function("ship", ship, input={"parcels": pack.output(), "paid": paid.output("amount")}, after=[cool])
    return flow


def main() -> dict[str, Any]:
    from buzz_delivery.models import Community, Workflow
    from buzz_delivery.services import Cause
    from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
    from buzz_delivery.workflows.services import get_run, publish_definition, send_event, start_run

    community = Community.objects.create(name="shop")
    workflow = Workflow.objects.create(community=community, name="order fulfilment")
    version = publish_definition(community.id, workflow.id, order_flow())
    run = start_run(community.id, workflow.id, {"order_id": "o-42"}, cause=Cause.webhook(uuid.uuid4()))
    # The payment arrives before the run waits for it: the event is kept, and taken when it does.
    send_event(community.id, "payment.received", "o-42", {"amount": 1200})
    # The orchestrator (what `manage.py run_workflow_worker` runs), in this process until idle.
    summary = run_orchestrator(
        OrchestratorConfig(community.id, poll_interval=0.2, idle_exit=3, lease_seconds=30), handle_signals=False
    )
    view = get_run(community.id, run.pk)
    assert view is not None
    print(f"definition v{version.version}, {len(version.content['steps'])} steps")
    print(f"run {view.state}: {view.run.output}")
    print(f"steps: {', '.join(f'{s.key}={s.state}' for s in view.steps)}")
    print(f"worker: claimed {summary['claimed']}, succeeded {summary['succeeded']}, waiting {summary['waiting']}")
    return {"state": view.state, "output": view.run.output}


if __name__ == "__main__":
    main()

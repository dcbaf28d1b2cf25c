"""An agent outside Django, over the signed HTTP gateway: make its key (``manage.py gateway_key``),
enroll it, and let it claim and settle the delivery a workflow sends it. Run it against a migrated
database of the example project::

    python examples/gateway_agent.py               # the embedded server under var/pgdata
    DATABASE_URL=postgres://... python examples/gateway_agent.py

The example serves the gateway from a thread of its own process (``wsgiref``) to stay one file; in
production serve it with gunicorn (docs/gateway.md) and run the agent with
``python -m buzz_delivery.gateway.client work --url ... --key-file agent.key --handler pkg.mod:func``,
which needs no Django: only ``httpx`` and ``coincurve`` (the ``gateway`` extra).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if __name__ == "__main__":  # a standalone script: set Django up (a project's own module needs none of this)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()

from django.core.management import call_command

from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayClient, read_key_file
from buzz_delivery.models import Community, Workflow
from buzz_delivery.services import Cause
from buzz_delivery.workflows import Definition
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.services import get_run, publish_definition, start_run


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_gateway() -> tuple[str, WSGIServer]:
    """The example project's WSGI app (the gateway at /gateway/v1/) on a free local port."""
    from project.wsgi import application

    server = make_server("127.0.0.1", 0, application, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/gateway/v1", server


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:  # yours: where the agent keeps its secret
        return work(Path(folder) / "agent.key")


def work(key_file: Path) -> dict[str, Any]:
    # `python manage.py gateway_key new --out agent.key`: the secret to the file (mode 0600),
    # the public key to enroll on stdout.
    out = io.StringIO()
    call_command("gateway_key", "new", "--out", str(key_file), stdout=out, verbosity=0)
    public_key = out.getvalue().strip()
    print(f"key made: {key_file.name} mode {oct(key_file.stat().st_mode & 0o777)}, public key {public_key[:12]}...")

    community = Community.objects.create(name="gateway example")
    # `python manage.py gateway_enrollment enroll --community <uuid> --agent <public key>`
    gateway.enroll(community.id, bytes.fromhex(public_key), enrolled_by="example")

    # A workflow sends the agent a message and waits until it is delivered.
    workflow = Workflow.objects.create(community=community, name="notify")
    flow = Definition()
    flow.send_message("tell", [public_key], "the parcel left", **{"await": "delivered"})
    publish_definition(community.id, workflow.id, flow)
    run = start_run(community.id, workflow.id, {}, cause=Cause.webhook(uuid.uuid4()))
    run_orchestrator(OrchestratorConfig(community.id, poll_interval=0.2, idle_exit=1), handle_signals=False)

    base_url, server = serve_gateway()
    agent = GatewayClient(base_url, read_key_file(str(key_file)))  # every request signed (NIP-98)
    try:
        print(f"the gateway knows the agent in {len(agent.me()['communities'])} community")
        # wait_seconds > 0 makes it a long poll, answered as soon as a delivery is there
        (claim,) = agent.claim(limit=1)
        print(f"claimed over HTTP: {claim.delivery['step_id']!r}")
        settled = agent.finish(claim.lease, "finished")
        print(f"settled: {settled.outcome} {settled.status}")
    finally:
        agent.close()
        server.shutdown()
        server.server_close()

    view = get_run(community.id, run.pk)
    assert view is not None
    print(f"workflow run {view.state}")
    return {"state": view.state, "outcome": settled.outcome}


if __name__ == "__main__":
    main()

"""OpenTelemetry across the work (issue 34): one trace runs from a producer's span through the
workflow run it starts, the orchestrator's ``send_message`` step, the commit of its delivery,
the agent's accept, the agent worker's run to its tool calls and compensations; the gateway
opens one server span per request, child of the W3C ``traceparent`` the bundled client sends.
Without a configured provider (or without the package) nothing is opened and nothing but a
carried-on context is stored. The SDK's in-memory exporter shows the links. The docs' example
(examples/traced_agent.py) is run by tests/test_examples.py."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from django.core.wsgi import get_wsgi_application
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from buzz_delivery import services as core
from buzz_delivery import tracing
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.runtime import run_claim
from buzz_delivery.agents.services import Accepted, accept_delivery, claim_agent_runs
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway import services as gateway
from buzz_delivery.gateway.client import GatewayClient
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory, WorkflowFactory, random32
from buzz_delivery.workflows.models import Run
from buzz_delivery.workflows.orchestrator import OrchestratorConfig, run_orchestrator
from buzz_delivery.workflows.services import publish_definition
from buzz_delivery.workflows.testing import run_until_idle, send_step
from tests import agent_handlers as h
from tests.wf_support import start


@pytest.fixture
def exporter():
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracing.use_tracer_provider(provider)
    try:
        yield exported
    finally:
        tracing.use_tracer_provider(None)


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.delenv("AGENT_KILL", raising=False)


def accept(delivery: WorkflowAgentDelivery, mode: str) -> Accepted:
    claim = core.claim_delivery(delivery.community_id, bytes(delivery.target_pubkey), delivery_id=delivery.id)
    outcome = accept_delivery(claim.lease, input={"mode": mode})
    assert isinstance(outcome, Accepted), outcome
    return outcome


def one(spans, name):
    (found,) = [s for s in spans if s.name == name]
    return found


def parent_of(span):
    return span.parent.span_id if span.parent is not None else None


@pytest.mark.django_db(transaction=True)
def test_one_trace_runs_from_the_producer_through_the_workflow_and_delivery_to_the_agents_tool_calls(exporter):
    community = CommunityFactory()
    workflow = WorkflowFactory(community=community)
    agent = random32()
    with tracing.tracer().start_as_current_span("producer") as producer:
        run = start(workflow, {"steps": [send_step("ask", [agent], content="do it")]})
    summary = run_orchestrator(
        OrchestratorConfig(community_id=community.id, max_steps=1, idle_exit=2.0, poll_interval=0.1),
        handle_signals=False,
    )
    assert summary["waiting"] == 1, summary
    (delivery,) = WorkflowAgentDelivery.objects.filter(community_id=community.id, run_id=run.pk)
    accepted = accept(delivery, "calls")
    worker = AgentWorker(
        WorkerConfig(h.by_agent, [agent], communities=[community.id], exit_when_idle=True, worker_id="w", listen=False)
    )
    assert worker.run()["completed"] == 1

    spans = exporter.get_finished_spans()
    trace_id = producer.get_span_context().trace_id
    run_span = one(spans, "buzz.workflow.run")
    step = one(spans, "buzz.workflow.step")
    commit = one(spans, "buzz.commit")
    accept_span = one(spans, "buzz.agent.accept")
    agent_run = one(spans, "buzz.agent.run")
    calls = [s for s in spans if s.name == "buzz.agent.call"]
    # producer -> workflow run -> send_message step -> commit of its delivery -> accept -> agent run -> calls
    assert parent_of(run_span) == producer.get_span_context().span_id
    assert parent_of(step) == run_span.context.span_id
    assert step.attributes["buzz.step_key"] == "ask" and step.attributes["buzz.step_kind"] == "send_message"
    assert parent_of(commit) == step.context.span_id
    assert parent_of(accept_span) == commit.context.span_id
    assert parent_of(agent_run) == accept_span.context.span_id
    assert agent_run.attributes["buzz.agent_run_id"] == str(accepted.run_id)
    assert len(calls) == 3 and {parent_of(c) for c in calls} == {agent_run.context.span_id}
    assert {c.attributes["buzz.tool"] for c in calls} == {"effect"}
    chain = [run_span, step, commit, accept_span, agent_run, *calls]
    assert {s.context.trace_id for s in chain} == {trace_id}
    # The claims are spans of their own (each its worker's root).
    assert any(s.name == "buzz.agent.claim" for s in spans)
    # What each piece of work stored: the context of the span that made it.
    assert Run.objects.get(pk=run.pk).trace_context["traceparent"].split("-")[2] == f"{run_span.context.span_id:016x}"
    stored = AgentRun.objects.get(id=accepted.run_id).trace_context
    assert stored["traceparent"].split("-")[2] == f"{accept_span.context.span_id:016x}"


@pytest.mark.django_db
def test_a_child_run_and_the_compensations_are_in_the_trace_too(exporter, community):
    workflow, child_flow = WorkflowFactory(community=community), WorkflowFactory(community=community)
    agent = random32()
    publish_definition(community.id, child_flow.id, {"steps": [send_step("ask", [agent])]})
    with tracing.tracer().start_as_current_span("producer") as producer:
        start(workflow, {"steps": [{"key": "child", "kind": "sub_workflow", "workflow": str(child_flow.id)}]})
    exporter.clear()
    run_until_idle(community.id)
    spans = exporter.get_finished_spans()
    child_step = next(s for s in spans if s.name == "buzz.workflow.step" and s.attributes["buzz.step_key"] == "child")
    child_run = next(s for s in spans if s.name == "buzz.workflow.run" and "buzz.parent_run_id" in s.attributes)
    assert parent_of(child_run) == child_step.context.span_id
    assert child_run.context.trace_id == producer.get_span_context().trace_id
    (child_send,) = [s for s in spans if s.name == "buzz.workflow.step" and s.attributes["buzz.step_key"] == "ask"]
    assert parent_of(child_send) == child_run.context.span_id

    delivery = WorkflowAgentDelivery.objects.get(community_id=community.id, target_pubkey=agent)
    accept(delivery, "fail")
    exporter.clear()
    (claim,) = claim_agent_runs(community.id, [agent], worker_id="w")
    assert run_claim(claim, h.by_agent) == "compensated"
    spans = exporter.get_finished_spans()
    agent_run = one(spans, "buzz.agent.run")
    compensations = [s for s in spans if s.name == "buzz.agent.compensation"]
    assert compensations and {parent_of(s) for s in compensations} == {agent_run.context.span_id}
    assert agent_run.context.trace_id == producer.get_span_context().trace_id


@pytest.mark.django_db
def test_without_a_configured_provider_no_span_is_opened_and_no_context_is_stored(community):
    assert tracing.tracer() is None
    workflow = WorkflowFactory(community=community)
    agent = random32()
    run = start(workflow, {"steps": [send_step("ask", [agent])]})
    assert run_until_idle(community.id) == 1
    (delivery,) = WorkflowAgentDelivery.objects.filter(community_id=community.id, run_id=run.pk)
    accepted = accept(delivery, "calls")
    (claim,) = claim_agent_runs(community.id, [agent], worker_id="w")
    assert run_claim(claim, h.by_agent) == "completed"
    assert Run.objects.get(pk=run.pk).trace_context is None
    assert WorkflowAgentDelivery.objects.get(id=delivery.id).trigger_context is None
    assert AgentRun.objects.get(id=accepted.run_id).trace_context is None


@pytest.mark.django_db
def test_a_process_that_does_not_trace_carries_the_stored_context_on(exporter, community):
    """Started where tracing records, run where it does not: the delivery and the agent run
    keep the run's context, so the agent worker's spans (traced again) are in its trace."""
    workflow = WorkflowFactory(community=community)
    agent = random32()
    with tracing.tracer().start_as_current_span("producer") as producer:
        run = start(workflow, {"steps": [send_step("ask", [agent])]})
    stored = Run.objects.get(pk=run.pk).trace_context
    tracing.use_tracer_provider(None)  # the orchestrator and the accepting process do not trace
    run_until_idle(community.id)
    (delivery,) = WorkflowAgentDelivery.objects.filter(community_id=community.id, run_id=run.pk)
    assert delivery.trigger_context == {"trace": stored}
    accepted = accept(delivery, "calls")
    assert AgentRun.objects.get(id=accepted.run_id).trace_context == stored
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    exporter.clear()
    (claim,) = claim_agent_runs(community.id, [agent], worker_id="w")
    assert run_claim(claim, h.by_agent) == "completed"
    agent_run = one(exporter.get_finished_spans(), "buzz.agent.run")
    assert agent_run.context.trace_id == producer.get_span_context().trace_id


@pytest.mark.django_db
@pytest.mark.parametrize(
    "stored",
    [{"traceparent": 5}, {"traceparent": "00-zz-zz-01"}, {"traceparent": "x" * 10_000}, ["not", "a", "dict"], "text"],
)
def test_a_malformed_stored_context_is_a_span_without_that_parent(exporter, community, stored):
    """A stored context is data (a producer may write any trigger_context["trace"]): one that is
    not W3C headers gives a root span, and the work goes on."""
    workflow = WorkflowFactory(community=community)
    agent = random32()
    run = start(workflow, {"steps": [send_step("ask", [agent])]})
    Run.objects.filter(pk=run.pk).update(trace_context=stored)
    exporter.clear()
    run_until_idle(community.id)
    step = one(exporter.get_finished_spans(), "buzz.workflow.step")
    assert step.parent is None
    (delivery,) = WorkflowAgentDelivery.objects.filter(community_id=community.id, run_id=run.pk)
    accept(delivery, "calls")
    (claim,) = claim_agent_runs(community.id, [agent], worker_id="w")
    AgentRun.objects.filter(id=claim.run.id).update(trace_context=stored)
    claim.run.trace_context = stored
    assert run_claim(claim, h.by_agent) == "completed"


def _wsgi_client(private_key: bytes) -> GatewayClient:
    """The bundled client, its HTTP served in this process by the project's WSGI app."""
    client = GatewayClient("http://localhost/gateway/v1", private_key)
    client._http = httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()))
    return client


@pytest.mark.django_db(transaction=True)
def test_the_gateway_opens_one_server_span_per_request_child_of_the_clients_traceparent(exporter):
    community = CommunityFactory()
    private_key = os.urandom(32)
    client = _wsgi_client(private_key)
    gateway.enroll(community.id, client.pubkey, enrolled_by="test")
    with tracing.tracer().start_as_current_span("remote worker") as root:
        assert client.me()
        assert client.claim() == []
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind.name == "SERVER"]
    clients = [s for s in spans if s.kind.name == "CLIENT"]
    assert [s.name for s in servers] == ["GET gateway/v1/me", "POST gateway/v1/deliveries/claim"]
    assert [s.attributes["http.response.status_code"] for s in servers] == [200, 200]
    assert [parent_of(s) for s in servers] == [c.context.span_id for c in clients]
    assert {parent_of(c) for c in clients} == {root.get_span_context().span_id}
    assert {s.context.trace_id for s in servers} == {root.get_span_context().trace_id}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("header", ["00-zz", "garbage" * 1000, "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_a_bad_traceparent_header_is_ignored(exporter, header):
    """A header that is not a valid W3C traceparent: the request is served, its span a root."""
    community = CommunityFactory()
    private_key = os.urandom(32)
    gateway.enroll(community.id, nip98.public_key_of(private_key), enrolled_by="test")
    url = "http://localhost/gateway/v1/me"
    headers = {
        "Authorization": nip98.encode_header(nip98.sign_event(private_key, url, "GET", b"")),
        "traceparent": header,
    }
    with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application())) as http:
        response = http.get(url, headers=headers)
    assert response.status_code == 200, response.text
    (server,) = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    assert server.parent is None and server.name == "GET gateway/v1/me"


def test_without_the_package_every_hook_is_the_plain_call():
    """``opentelemetry`` not importable: the decorators return the function itself and the
    context managers a shared no-op; a step, an agent run and a client request go through."""
    code = r"""
import sys
sys.modules["opentelemetry"] = None
import django
django.setup()
from buzz_delivery import tracing
from buzz_delivery.tracing import http, work
from buzz_delivery.agents import runtime
from buzz_delivery.agents.services import runs
assert not tracing.INSTALLED and tracing.tracer() is None and tracing.inject() is None
f = lambda *a, **k: "called"
assert work.accept_span(f) is f and work.agent_run_span(f) is f and work.tool_call_span(f) is f
assert http.server_span(f) is f and http.client_request("GET", "/me", {}, lambda: "sent") == "sent"
assert work.step_span(None) is tracing._NULL and work.compensation_span(None, 1) is tracing._NULL
assert work.workflow_run_span(1, 2, 3, None) is tracing._NULL and work.carried(None) is None
inner = runtime.run_claim.__wrapped__  # tenant_scoped's: the function itself inside
assert inner.__name__ == "run_claim" and not hasattr(inner, "__wrapped__")
print("ok")
"""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

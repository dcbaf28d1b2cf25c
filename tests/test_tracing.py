"""OpenTelemetry traces (issue 34): the trace context stored with a delivery at commit is the
parent of the worker's handler span, so one trace runs from the producer through the claim to
the handler; the SDK's in-memory exporter shows the links. Without a configured provider the
services open no span and store no context."""

from __future__ import annotations

import threading
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from buzz_delivery import models, services, tracing
from buzz_delivery.testing import CommunityFactory, random32
from buzz_delivery.worker import WorkerConfig, run_worker
from tests import tasks_support as t


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


@pytest.mark.django_db
def test_without_a_configured_provider_nothing_is_traced_or_stored(community, make_binding):
    assert tracing.tracer() is None and tracing.inject() is None
    binding = make_binding()
    event = models.Event.objects.get(community_id=community.id, event_id=binding.message_event_id)
    (delivery_id,) = services.commit_deliveries(community.id, event, [binding], trigger_context={"a": 1})
    assert models.WorkflowAgentDelivery.objects.get(id=delivery_id).trigger_context == {"a": 1}


@pytest.mark.django_db(transaction=True)
def test_one_trace_runs_from_the_producer_through_commit_claim_and_settle_to_the_handler(exporter):
    community = CommunityFactory()
    from buzz_delivery.testing import BindingFactory, WorkflowRunFactory

    run = WorkflowRunFactory(community=community)
    target = random32()
    binding = BindingFactory(run=run, target_pubkey=target)
    event = models.Event.objects.get(community_id=community.id, event_id=binding.message_event_id)
    producer = tracing.tracer()
    with producer.start_as_current_span("producer") as root:
        services.commit_deliveries(community.id, event, [binding], trigger_context={"kept": True})
    handled = threading.Event()

    def handler(delivery):
        handled.set()

    config = WorkerConfig(
        community_id=community.id,
        target_pubkey=target,
        handler=handler,
        max_deliveries=1,
        idle_exit=5.0,
        poll_interval=0.2,
    )
    run_worker(config, handle_signals=False)
    assert handled.is_set()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"producer", "buzz.commit", "buzz.claim", "buzz.handler", "buzz.settle"} <= set(spans)
    trace_id = root.get_span_context().trace_id
    commit, handler_span = spans["buzz.commit"], spans["buzz.handler"]
    assert commit.parent.span_id == root.get_span_context().span_id
    assert handler_span.context.trace_id == trace_id  # restored from the stored context
    assert handler_span.parent.span_id == commit.context.span_id
    stored = models.WorkflowAgentDelivery.objects.get(community_id=community.id).trigger_context
    assert stored["kept"] is True and stored["trace"]["traceparent"].split("-")[1] == f"{trace_id:032x}"


@pytest.mark.django_db(transaction=True)
def test_a_tasks_trace_runs_from_enqueue_to_the_task(exporter):
    import io

    from django.core.management import call_command

    CommunityFactory(id=uuid.UUID(t.COMMUNITY))
    with tracing.tracer().start_as_current_span("view") as root:
        result = t.add.enqueue(1, 2)
    call_command("run_task_worker", max_tasks=1, idle_exit=2.0, poll_interval=0.2, stdout=io.StringIO())
    assert t.add.get_result(result.id).return_value == 3
    handler_span = next(s for s in exporter.get_finished_spans() if s.name == "buzz.handler")
    assert handler_span.context.trace_id == root.get_span_context().trace_id

"""Both agent workers' configs check their numbers when built (as the command's options are
checked), a ``ValidationError`` keyed by the field: before, ``WorkerConfig(accept_batch=0)`` or
``concurrency=10**6`` was taken as given (the command alone checked ``--accept-batch``) and met
only later, as a failing acceptance claim or a million threads."""

from __future__ import annotations

import math
import os
import socket

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery.agents.loop_worker import AsyncWorkerConfig
from buzz_delivery.agents.worker import WorkerConfig
from tests.agents_support import AGENT


def handler(ctx):
    return None


COMMON = [
    ("accept_batch", 0),
    ("accept_batch", 1001),
    ("accept_batch", True),
    ("accept_batch", 2.0),
    ("lease_seconds", 0),
    ("lease_seconds", math.nan),
    ("poll_seconds", -1),
    ("poll_seconds", math.inf),
    ("poll_seconds", "1"),
    ("poll_seconds", 1e10),  # finite, but no thread can wait that long: the worker died at its first idle poll
    ("shutdown_grace", -0.5),
    ("handler_timeout", 0),
    ("max_runs", 0),
    ("max_runs", 2**63),
]


@pytest.mark.parametrize(("field", "value"), [*COMMON, ("concurrency", 0), ("concurrency", 257)])
def test_the_thread_workers_config_refuses_a_bad_number_naming_its_field(field, value):
    with pytest.raises(ValidationError) as refused:
        WorkerConfig(handler=handler, agents=[AGENT], **{field: value})
    assert list(refused.value.message_dict) == [field], refused.value.message_dict


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *COMMON,
        ("in_flight", 0),
        ("in_flight", 10_001),
        ("connections", 0),
        ("connections", 257),
        ("max_batch", 0),
        ("max_batch", 501),
        ("linger", -1),
        ("linger", math.nan),
    ],
)
def test_the_event_loop_workers_config_refuses_a_bad_number_naming_its_field(field, value):
    with pytest.raises(ValidationError) as refused:
        AsyncWorkerConfig(handler=handler, agents=[AGENT], **{field: value})
    assert list(refused.value.message_dict) == [field], refused.value.message_dict


def test_the_bounds_themselves_are_taken():
    WorkerConfig(handler=handler, agents=[AGENT], concurrency=256, accept_batch=1000, shutdown_grace=0, max_runs=1)
    AsyncWorkerConfig(
        handler=handler, agents=[AGENT], in_flight=10_000, connections=256, max_batch=500, linger=0, accept_batch=1
    )


@pytest.mark.parametrize("config", [WorkerConfig, AsyncWorkerConfig])
@pytest.mark.parametrize("worker_id", ["   ", "w" * 201, 7])
def test_a_worker_id_a_claim_would_refuse_is_refused_when_built(config, worker_id):
    """Before, the config took it and the worker died at its first claim (internal_errors=1)."""
    with pytest.raises(ValidationError) as refused:
        config(handler=handler, agents=[AGENT], worker_id=worker_id)
    assert list(refused.value.message_dict) == ["worker_id"], refused.value.message_dict


@pytest.mark.parametrize("config", [WorkerConfig, AsyncWorkerConfig])
def test_a_config_built_without_a_worker_id_records_host_and_pid_as_the_command_does(config):
    assert config(handler=handler, agents=[AGENT]).worker_id == f"{socket.gethostname()}:{os.getpid()}"[-200:]
    assert config(handler=handler, agents=[AGENT], worker_id="w" * 200).worker_id == "w" * 200

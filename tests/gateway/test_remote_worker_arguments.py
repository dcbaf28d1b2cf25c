"""``RemoteWorker`` and ``RemoteRunWorker`` built in code are held to the bounds the command line
gives their options (``seconds_option``, ``--concurrency`` 1..256...): before, a value from code
was taken unchecked (NaN or 0 as ``renew_every`` renewed in a busy loop, 1e10 killed the renewer
thread at its first wait, ``concurrency=0`` started no handler thread). A bad one raises a
``ValueError`` naming the parameter, before any request."""

from __future__ import annotations

import math

import pytest

from buzz_delivery.gateway.client import GatewayClient, RemoteWorker
from buzz_delivery.gateway.remote_runs import RemoteRunWorker


def handler(item):
    return None


def client() -> GatewayClient:
    return GatewayClient("http://127.0.0.1:9/gateway/v1", b"\x01" * 32)  # never reached


SHARED = [
    ("concurrency", 0),
    ("concurrency", 257),
    ("concurrency", 2.0),
    ("concurrency", True),
    ("lease_seconds", 0),
    ("lease_seconds", math.nan),
    ("lease_seconds", "30"),
    ("wait_seconds", -1),
    ("wait_seconds", math.inf),
    ("renew_every", 0),
    ("renew_every", math.nan),
    ("renew_every", 1e10),
    ("idle_exit", 0),
    ("idle_exit", -5),
    ("shutdown_grace", -1),
    ("shutdown_grace", math.nan),
]


@pytest.mark.parametrize(
    ("name", "value"),
    [*SHARED, ("max_deliveries", 0), ("max_deliveries", 1.5), ("claim_ahead", -1), ("claim_ahead", 1001)],
)
def test_remote_worker_refuses_a_value_its_option_would_refuse_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        RemoteWorker(client(), handler, **{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        *SHARED,
        ("max_runs", 0),
        ("accept_batch", 0),
        ("accept_batch", 1001),
        ("linger", -0.1),
        ("linger", math.nan),
        ("worker_id", "   "),
        ("worker_id", "w" * 201),
        ("worker_id", 7),
    ],
)
def test_remote_run_worker_refuses_a_value_its_option_would_refuse_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        RemoteRunWorker(client(), handler, **{name: value})


@pytest.mark.parametrize("worker", [RemoteWorker, RemoteRunWorker])
def test_a_handler_that_is_not_callable_is_refused(worker):
    with pytest.raises(ValueError, match=r"^handler must be callable"):
        worker(client(), "pkg.mod:handler")


def test_the_bounds_themselves_are_taken():
    edge = {"concurrency": 256, "lease_seconds": 86_400, "wait_seconds": 0, "renew_every": 0.01, "idle_exit": 1,
            "shutdown_grace": 0}  # fmt: skip
    worker = RemoteWorker(client(), handler, max_deliveries=1, claim_ahead=0, **edge)
    assert (worker.concurrency, worker.renew_every, worker.claim_ahead) == (256, 0.01, 0)
    runs = RemoteRunWorker(client(), handler, max_runs=1, accept_batch=1000, worker_id="w" * 200, linger=0, **edge)
    assert (runs.concurrency, runs.accept_batch, runs.worker_id) == (256, 1000, "w" * 200)

"""The delivery worker's and the orchestrator's ``poll_interval`` are bounded as the agent workers'
``poll_seconds`` (> 0, at most a day), refused when the config is built (``ValidationError`` keyed
``poll_interval``). Before, 1e10 was taken: the orchestrator's first idle wait on it raised
OverflowError (``threading.Event.wait``), and the delivery worker's listener waits it after a lost
connection, as a rate-limited claim does. The commands refuse it at argparse
(tests/test_worker_commands_cli.py)."""

from __future__ import annotations

import math
import threading
import uuid

import pytest
from django.core.exceptions import ValidationError

from buzz_delivery.testing import random32
from buzz_delivery.worker.runtime import WorkerConfig
from buzz_delivery.workflows.orchestrator import OrchestratorConfig


def handler(delivery):
    return None


def delivery_config(**kw):
    return WorkerConfig(community_id=uuid.uuid4(), target_pubkey=random32(), handler=handler, **kw)


def orchestrator_config(**kw):
    return OrchestratorConfig(community_id=uuid.uuid4(), **kw)


def test_a_thread_cannot_wait_that_long():
    """What the bound is for (no wait is made: the timeout is refused at once)."""
    with pytest.raises(OverflowError):
        threading.Event().wait(1e10)


@pytest.mark.parametrize("build", [delivery_config, orchestrator_config], ids=["delivery", "orchestrator"])
@pytest.mark.parametrize("value", [1e10, 86400.5, math.inf, math.nan, 0, -1, "1", True])
def test_a_poll_interval_out_of_bounds_is_refused_naming_the_field(build, value):
    with pytest.raises(ValidationError) as refused:
        build(poll_interval=value)
    assert list(refused.value.message_dict) == ["poll_interval"], refused.value.message_dict


@pytest.mark.parametrize("build", [delivery_config, orchestrator_config], ids=["delivery", "orchestrator"])
def test_the_bounds_themselves_are_taken(build):
    assert build(poll_interval=86400).poll_interval == 86400
    assert build(poll_interval=0.001).poll_interval == 0.001

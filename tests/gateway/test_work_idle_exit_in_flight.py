"""review4: ``work --idle-exit`` counted idle time from the last claim that got something, whatever
its handlers were doing: a handler running longer than --idle-exit (the last delivery of a
draining job, the others' threads free and claiming nothing) stopped the worker, and past
--shutdown-grace its lease was given up (exit 3, ``abandoned``). ``work-runs`` counts idle only
with no run in flight (``_busy == 0``), as run_delivery_worker does."""

from __future__ import annotations

import time

import pytest

from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from tests.gateway.support import enroll, new_agent
from tests.gateway.test_remote_worker import deliveries, start, summary, wait_handled

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_handler_running_past_idle_exit_is_not_idle_time(tmp_path, gateway_server):
    community = CommunityFactory()
    agent = new_agent(gateway_server)
    enroll(agent, community)
    (slow,) = deliveries(community, agent.pubkey, "slow_1")
    gate = tmp_path / "gate"
    proc = start(
        tmp_path, gateway_server, agent, "--concurrency", "2", "--idle-exit", "1", "--wait-seconds", "0.2",
        "--shutdown-grace", "1", gate=gate,
    )  # fmt: skip
    try:
        assert wait_handled(tmp_path, 1) == [str(slow.id)]  # its handler runs, held at the gate
        time.sleep(4)  # past --idle-exit and --shutdown-grace, the other thread claiming nothing
        gate.touch()
        assert proc.wait(timeout=60) == 0, (tmp_path / "worker.err").read_text()[-3000:]
    finally:
        proc.kill()
    done = summary(tmp_path)
    assert (done["finished"], done["abandoned"], done["reason"]) == (1, 0, "idle_exit"), done
    assert WorkflowAgentDelivery.objects.get(id=slow.id).status == "finished"

"""An agent worker built in code without a ``worker_id`` claims and runs its runs: before, the
config took the empty default and the threaded worker died at its first claim (the claim refuses
an empty ``worker_id``: a ValidationError, internal_errors=1), the event-loop worker likewise.
The command always set one (``--worker-id`` or ``host:pid``); the config now defaults it the same
way, as the other workers' configs default their identity (``name`` in ``host:pid:name``)."""

from __future__ import annotations

import pytest

from buzz_delivery.agents.loop_worker import AsyncAgentWorker, AsyncWorkerConfig
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.worker import AgentWorker, WorkerConfig, default_worker_id
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)


def quick(ctx):
    return {"ok": True}


async def quick_async(ctx):
    return {"ok": True}


@pytest.mark.parametrize("kind", ["threads", "event-loop"])
def test_a_worker_built_without_a_worker_id_runs_its_runs(community, kind):
    run_id = new_run(community.id)
    options = dict(agents=[AGENT], communities=[community.id], exit_when_idle=True, poll_seconds=0.1, accept=False)
    if kind == "threads":
        worker = AgentWorker(WorkerConfig(handler=quick, listen=False, **options))
    else:
        worker = AsyncAgentWorker(AsyncWorkerConfig(handler=quick_async, listen=False, connections=2, **options))
    counts = worker.run()
    assert counts.get("internal_errors", 0) == 0, counts
    assert counts.get("completed") == 1, counts
    run = AgentRun.objects.get(id=run_id)
    assert (run.state, run.worker_id) == ("completed", default_worker_id())

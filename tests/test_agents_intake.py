"""``intake_event`` as one statement (issue 29, agents migration 0021): the guarantees the
six-round-trip transaction gave, held by the plan-cached ``buzz_agents_intake`` function: the
policy's layers and bounds computed in SQL as :func:`policy.bounded` computes them, the write
fence, and the wake hint sent only for a created run and only on commit."""

from __future__ import annotations

import contextlib
import queue
import threading
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection, transaction
from django.test import override_settings

from buzz_delivery.agents.conf import NOTIFY_CHANNEL
from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, Duplicate, IdempotencyConflict, intake_event
from buzz_delivery.agents.services.policy import ask, bounded, policy_of, set_policy
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.listening import Listener
from buzz_delivery.testing import advance_to
from tests.agents_support import AGENT, counts

QUIET_SECONDS = 0.3

# (community row, agent row, settings) x (what the caller asks): every field inherits, caps and
# is capped somewhere, shadow forced by each layer, timeout with and without a cap or an ask.
POLICIES = [
    ({}, {}, {}),
    ({"max_tool_calls": 5, "max_cost": 10, "max_attempts": 2, "max_timeout_seconds": 60}, {}, {}),
    ({"max_tool_calls": 5, "max_cost": 10}, {"max_tool_calls": 50, "max_lease_seconds": 22.5}, {}),
    ({"shadow": True, "max_lease_seconds": 30.0}, {"max_cost": 7, "max_timeout_seconds": 90}, {}),
    ({}, {"shadow": False, "max_attempts": 1}, {"SHADOW": True, "MAX_TIMEOUT_SECONDS": 120, "MAX_TOOL_CALLS": 9}),
    ({"shadow": False}, {}, {"SHADOW": True, "MAX_LEASE_SECONDS": 40.0, "MAX_COST": 3}),
]
ASKS = [
    {},
    {"max_tool_calls": 3, "max_cost": 4, "max_attempts": 1, "timeout_seconds": 30, "shadow": True},
    {"max_tool_calls": 100_000, "max_cost": 2**53 - 1, "max_attempts": 100, "timeout_seconds": 86400},
]


def asked(**kwargs):
    return ask(**{"shadow": False, "max_tool_calls": None, "max_cost": None, "max_attempts": None,
                  "timeout_seconds": None, **kwargs})  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize("ask_kwargs", ASKS)
@pytest.mark.parametrize(("community_row", "agent_row", "settings"), POLICIES)
def test_the_run_gets_what_bounded_computes_from_the_policy_layers(community, community_row, agent_row, settings,
                                                                   ask_kwargs):  # fmt: skip
    if community_row:
        set_policy(community.id, **community_row)
    if agent_row:
        set_policy(community.id, AGENT, **agent_row)
    with override_settings(BUZZ_AGENTS=settings):
        expected = bounded(policy_of(community.id, AGENT), asked(**ask_kwargs))
        outcome = intake_event(community.id, "t", uuid.uuid4().hex, {}, AGENT, **ask_kwargs)
    assert isinstance(outcome, Created)
    run = AgentRun.objects.get(id=outcome.run_id)
    got = {
        "shadow": run.shadow,
        "max_tool_calls": run.max_tool_calls,
        "max_cost": run.max_cost,
        "max_attempts": run.max_attempts,
        "max_lease_seconds": run.max_lease_seconds,
    }
    assert got == {k: expected[k] for k in got}
    if expected["timeout_seconds"] is None:
        assert run.timeout_at is None
    else:
        assert (run.timeout_at - run.created_at).total_seconds() == pytest.approx(expected["timeout_seconds"], abs=1)


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["quiescing", "fenced"])
def test_a_community_that_is_not_active_refuses_the_intake_and_nothing_is_written(community, state):
    advance_to(community, state)
    before = counts()
    with pytest.raises(CommunityNotWritable, match=state):
        intake_event(community.id, "t", "ev", {"n": 1}, AGENT)
    assert counts() == before


class Hints:
    """The wake hints on the agents' channel, heard as the workers hear them: through the shared
    listener (``buzz_delivery.listening``), which LISTENs on every node of a Citus cluster too (the
    intake function sends its hint on the node holding the community)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        self.listening, self.stop = threading.Event(), threading.Event()
        self.listener = Listener(
            name="test-intake-hints",
            channels=(NOTIFY_CHANNEL,),
            conn_params=connection.get_connection_params(),
            stop=self.stop,
            on_notify=lambda channel, payload: self.queue.put(payload),
            on_listen=self.listening.set,
        )
        self.listener.start()
        assert self.listening.wait(10)

    def payloads(self, expected: int = 0) -> list[str]:
        """The hints received: ``expected`` awaited, then a quiet period so extra hints would show."""
        got = [self.queue.get(timeout=5) for _ in range(expected)]
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(self.queue.get(timeout=QUIET_SECONDS))
        return got


@pytest.fixture
def listener() -> Iterator[Hints]:
    hints = Hints()
    yield hints
    hints.stop.set()
    hints.listener.join(5)


@pytest.mark.django_db(transaction=True)
def test_a_created_run_wakes_the_workers_once_on_commit_and_a_retry_or_rollback_never(community, listener):
    with transaction.atomic():
        first = intake_event(community.id, "t", "ev-1", {"n": 1}, AGENT)
        assert isinstance(first, Created)
        assert listener.payloads() == []  # NOTIFY is transactional: nothing before commit
    assert listener.payloads(1) == [str(community.id)]

    assert intake_event(community.id, "t", "ev-1", {"n": 1}, AGENT) == Duplicate(first.run_id)
    assert intake_event(community.id, "t", "ev-1", {"n": 2}, AGENT) == IdempotencyConflict(first.run_id)
    assert listener.payloads() == []  # only the key's winner sends the hint

    with pytest.raises(RuntimeError), transaction.atomic():
        rolled_back = intake_event(community.id, "t", "ev-2", {"n": 1}, AGENT)
        raise RuntimeError("the caller's transaction rolls back")
    assert listener.payloads() == []
    assert not AgentRun.objects.filter(id=rolled_back.run_id).exists()

    alone = intake_event(community.id, "t", "ev-3", {"n": 1}, AGENT)  # autocommit: its own transaction
    assert isinstance(alone, Created)
    assert listener.payloads(1) == [str(community.id)]


@pytest.mark.django_db
def test_a_timeout_setting_past_integer_still_takes_intakes(community):
    """BUZZ_AGENTS['MAX_TIMEOUT_SECONDS'] has no upper bound; the function takes it as bigint, so a
    setting past int4 bounds the run's deadline rather than refusing every intake (found in review)."""
    with override_settings(BUZZ_AGENTS={"MAX_TIMEOUT_SECONDS": 2**31}):
        assert isinstance(intake_event(community.id, "t", uuid.uuid4().hex, {}, AGENT), Created)

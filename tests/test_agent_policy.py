"""The operator's policy for agent runs (issue 27, SPEC 16 "Trust"): budgets, attempts, deadline,
lease length and shadow mode come from settings, the community's row and the agent's row; a
caller may ask for less, never for more."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from buzz_delivery.agents.models import AgentPolicy, AgentRun
from buzz_delivery.agents.services import Accepted, Renewed, accept_delivery, claim_agent_runs, heartbeat
from buzz_delivery.agents.services.policy import clear_policy, get_policy, set_policy
from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.testing import advance_to, random32
from tests.agents_support import AGENT, delivery_lease, new_run

pytestmark = pytest.mark.django_db

GREEDY = {"max_tool_calls": 100_000, "max_cost": 2**53 - 1, "max_attempts": 100, "shadow": False}


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT buzz_delivery_now()")
        return cursor.fetchone()[0]


def test_a_caller_asking_for_more_than_the_settings_gets_the_settings(run):
    outcome = accept_delivery(delivery_lease(run), **GREEDY)
    assert isinstance(outcome, Accepted)
    got = AgentRun.objects.get(id=outcome.run_id)
    assert (got.max_tool_calls, got.max_cost, got.max_attempts, got.shadow) == (100, 1_000_000, 3, False)


def test_the_community_policy_caps_what_an_accept_asks_for_and_forces_shadow(run):
    set_policy(run.community_id, max_tool_calls=5, max_cost=10, max_attempts=2, max_timeout_seconds=60, shadow=True)
    before = db_now()
    outcome = accept_delivery(delivery_lease(run), timeout_seconds=3600, **GREEDY)
    got = AgentRun.objects.get(id=outcome.run_id)
    assert (got.max_tool_calls, got.max_cost, got.max_attempts, got.shadow) == (5, 10, 2, True)
    assert before + dt.timedelta(seconds=59) <= got.timeout_at <= db_now() + dt.timedelta(seconds=60)


def test_a_caller_may_still_ask_for_less_than_the_policy(run):
    set_policy(run.community_id, max_tool_calls=5, max_cost=10)
    outcome = accept_delivery(delivery_lease(run), max_tool_calls=2, max_cost=3, shadow=True, timeout_seconds=30)
    got = AgentRun.objects.get(id=outcome.run_id)
    assert (got.max_tool_calls, got.max_cost, got.shadow) == (2, 3, True)
    assert got.timeout_at is not None


def test_the_agents_row_overrides_the_communitys_and_unset_fields_inherit(community):
    set_policy(community.id, max_tool_calls=5, max_cost=10)
    set_policy(community.id, AGENT, max_tool_calls=50)
    assert get_policy(community.id, AGENT).max_tool_calls == 50
    assert get_policy(community.id, AGENT).max_cost == 10  # the agent's row leaves it unset
    assert get_policy(community.id, random32()).max_tool_calls == 5  # another agent: the community's
    got = AgentRun.objects.get(id=new_run(community.id, **GREEDY))
    assert (got.max_tool_calls, got.max_cost) == (50, 10)
    assert clear_policy(community.id, AGENT) == 1
    assert get_policy(community.id, AGENT).max_tool_calls == 5


def test_settings_are_the_last_layer(community):
    with override_settings(BUZZ_AGENTS={"MAX_TOOL_CALLS": 7, "SHADOW": True, "MAX_TIMEOUT_SECONDS": 120}):
        got = AgentRun.objects.get(id=new_run(community.id, **GREEDY))
    assert (got.max_tool_calls, got.shadow) == (7, True)
    assert got.timeout_at is not None


def test_a_runs_lease_never_outlasts_its_policy_on_claim_or_heartbeat(community):
    set_policy(community.id, AGENT, max_lease_seconds=20)
    run_id = new_run(community.id)
    (claimed,) = claim_agent_runs(community.id, [AGENT], worker_id="w", lease_seconds=300)
    assert claimed.lease.run_id == run_id
    assert claimed.lease.lease_until <= db_now() + dt.timedelta(seconds=20)
    renewed = heartbeat(claimed.lease, 300)
    assert isinstance(renewed, Renewed)
    assert renewed.lease.lease_until <= db_now() + dt.timedelta(seconds=20)
    # A holder asking for less gets what it asked for.
    assert heartbeat(claimed.lease, 16).lease.lease_until <= db_now() + dt.timedelta(seconds=16)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tool_calls", -1),
        ("max_tool_calls", 100_001),
        ("max_cost", 2**53),
        ("max_attempts", 0),
        ("max_timeout_seconds", 0),
        ("max_lease_seconds", 10_000),
        ("shadow", "yes"),
        ("agent_pubkey", b"short"),
        ("updated_by", "\ud800"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field_and_writes_nothing(community, field, value):
    kwargs = {field: value}
    agent = kwargs.pop("agent_pubkey", None)
    with pytest.raises(ValidationError) as caught:
        set_policy(community.id, agent, **kwargs)
    assert field in caught.value.message_dict
    assert AgentPolicy.objects.count() == 0


def test_a_retired_communitys_policy_is_fenced(community):
    set_policy(community.id, max_cost=5)
    advance_to(community, "quiescing")
    with pytest.raises(CommunityNotWritable):
        set_policy(community.id, max_cost=6)
    assert AgentPolicy.objects.get(community_id=community.id).max_cost == 5


def test_the_agent_policy_command_sets_shows_and_clears(community):
    import io
    import json

    from django.core.management import CommandError, call_command

    out = io.StringIO()
    call_command("agent_policy", "set", "--community", str(community.id), "--agent", AGENT.hex(),
                 "--max-cost", "7", "--shadow", "on", stdout=out)  # fmt: skip
    call_command("agent_policy", "show", "--community", str(community.id), "--agent", AGENT.hex(), stdout=out)
    shown = json.loads(out.getvalue().splitlines()[-1])
    assert (shown["in_force"]["max_cost"], shown["in_force"]["shadow"]) == (7, True)
    with pytest.raises(CommandError) as caught:
        call_command("agent_policy", "set", "--community", str(community.id), "--max-cost", "-1")
    assert caught.value.returncode == 2 and "max_cost" in str(caught.value)
    call_command("agent_policy", "clear", "--community", str(community.id), "--agent", AGENT.hex(), stdout=out)
    assert json.loads(out.getvalue().splitlines()[-1]) == {"cleared": 1}

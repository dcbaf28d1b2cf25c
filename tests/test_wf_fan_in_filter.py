"""The fan-in trigger fires only for deliveries that carry their run's step message event
(workflows migration 0023, issue 31): the inbox's deliveries settle without a PL/pgSQL call."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.testing import random32
from buzz_delivery.workflows.executor import message_event_id

pytestmark = pytest.mark.django_db

FAN_IN = "buzz_workflows_count_delivery"


@pytest.mark.parametrize("step_key", ["send", "notify_all", "map[3].send", "stép-✓"])
def test_the_triggers_digest_is_the_engines_message_event_id(step_key):
    """The WHEN's SQL digest and ``executor.message_event_id`` agree, key for key (UTF-8 too):
    an engine delivery that failed this test would never be counted in its step."""
    run_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sha256(convert_to('buzz-workflows/message/' || %s::uuid::text || '/' || %s, 'UTF8'))",
            [run_id, step_key],
        )
        assert bytes(cursor.fetchone()[0]) == message_event_id(run_id, step_key)


def _fan_in_calls() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions WHERE funcname = %s", [FAN_IN])
        return int(cursor.fetchone()[0])


def test_a_delivery_of_no_engine_step_settles_without_calling_the_fan_in(community, message_event, make_binding):
    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)])
    (claim,) = services.claim_deliveries(community.id, target, limit=1, lease_seconds=30)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL track_functions = 'pl'")
    before = _fan_in_calls()
    assert services.finish_deliveries([claim.lease]) == [services.Settled(status="finished")]
    assert _fan_in_calls() == before

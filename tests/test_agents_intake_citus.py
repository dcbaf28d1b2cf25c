"""Citus mode: intake_event inside a caller's transaction that also writes on another node. The
delegated buzz_agents_intake runs on the worker holding the community; a transaction that wrote
on two nodes commits in two phases, and PostgreSQL refuses to PREPARE a transaction that executed
NOTIFY there. So inside a caller's transaction the function sends no hint and the service sends
it from the caller's session (found in review: this failed at COMMIT)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection, transaction

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.agents.services import Created, intake_event
from buzz_delivery.testing import CommunityFactory
from tests.agents_support import AGENT
from tests.citus_support import CITUS_MODE

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CITUS_MODE, reason="Citus mode only"),
]


def _node_of(community_id) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT nodename, nodeport FROM citus_shards s JOIN pg_dist_shard d USING (shardid)"
            " WHERE s.table_name = 'buzz_agents_run'::regclass"
            " AND d.shardid = get_shard_id_for_distribution_column('buzz_agents_run', %s::uuid)",
            [str(community_id)],
        )
        return cursor.fetchone()


def test_two_intakes_of_communities_on_two_nodes_commit_in_one_transaction():
    first = CommunityFactory()
    other = next(c for c in (CommunityFactory() for _ in range(40)) if _node_of(c.id) != _node_of(first.id))
    with transaction.atomic():
        a = intake_event(first.id, "t", uuid.uuid4().hex, {}, AGENT)
        b = intake_event(other.id, "t", uuid.uuid4().hex, {}, AGENT)
    assert isinstance(a, Created) and isinstance(b, Created)
    assert AgentRun.objects.filter(id__in=[a.run_id, b.run_id]).count() == 2

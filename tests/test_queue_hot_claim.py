"""A claim is a HOT update of the queue row (issue 31, stage 2; ``bench/results/queue-design-plan.md``):
no index of ``buzz_delivery_delivery_queue`` names a column a claim, a renewal or a retry back to
pending writes, so PostgreSQL rewrites the row on its own page without one index entry. Read from
``pg_stat_xact_user_tables`` (this transaction's counts), with the table's fillfactor lowered in
the test's transaction so that the room left in each page cannot decide the outcome (a page with
no room for the new version makes any update non-HOT, whatever the indexes)."""

from __future__ import annotations

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.services import sql
from buzz_delivery.testing import random32
from tests.citus_support import CITUS_MODE

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CITUS_MODE, reason="the counts are the coordinator's, the rows the workers'"),
]


def updates() -> tuple[int, int]:
    """(updated, of which HOT) rows of the queue in this transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relid = %s::regclass",
            [sql.QUEUE],
        )
        row = cursor.fetchone()
    return (row[0], row[1]) if row else (0, 0)


@pytest.fixture
def roomy_queue() -> None:
    """The queue's new pages keep 90% free (rolled back with the test's transaction)."""
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {sql.QUEUE} SET (fillfactor = 10)")


def test_a_claim_batch_of_50_then_renewals_and_retries_are_hot_updates_of_the_queue(
    roomy_queue, community, message_event, make_binding
):
    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target) for _ in range(50)])
    before = updates()
    claims = services.claim_deliveries(community.id, target, limit=50)
    assert len(claims) == 50
    claimed = updates()
    assert (claimed[0] - before[0], claimed[1] - before[1]) == (50, 50)

    renewed = services.renew_deliveries([c.lease for c in claims])
    assert {type(o) for o in renewed} == {services.Renewed}
    retried = [services.finish_delivery(c.lease, "retry") for c in claims[:10]]
    assert {getattr(o, "status", None) for o in retried} == {"pending"}
    after = updates()
    assert (after[0] - claimed[0], after[1] - claimed[1]) == (60, 60)

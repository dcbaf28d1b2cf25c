"""The lease statements test their community's lifecycle once a statement, not once a row (core
0041, issue 31): each names its community (``d.community_id = %(community_id)s``), so the test is
an InitPlan over that one row. Correlated on each row's ``community_id`` it probed the community
table once for every row a claim picked or a settle ended, and every backend of every worker
probes that one row.

Counted with ``pg_stat_xact_user_tables`` (this transaction's scans of the community table) around
each service call on 20 deliveries. The write fence reads the community once a transaction (then
``buzz_delivery.fence_passed`` holds); a plain write before the calls takes that read out of them."""

from __future__ import annotations

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.testing import random32
from tests.citus_support import CITUS_MODE

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CITUS_MODE, reason="reads one PostgreSQL node's table statistics (pg_stat_xact_user_tables)"),
]

ROWS = 20
COMMUNITY = "buzz_delivery_community"


def _community_reads() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_scan + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables WHERE relid = %s::regclass",
            [COMMUNITY],
        )
        return cursor.fetchone()[0]


def _reads_of(call):
    before = _community_reads()
    result = call()
    return _community_reads() - before, result


@pytest.fixture
def backlog(community, message_event, make_binding):
    """``ROWS`` pending deliveries of one target, the write fence already passed in this transaction,
    and the tables analyzed (so the plans are those of a table with rows)."""
    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target) for _ in range(ROWS)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE buzz_delivery_delivery_queue")
        cursor.execute("ANALYZE buzz_delivery_delivery_record")
        cursor.execute(f"ANALYZE {COMMUNITY}")
    return community, target


def test_a_batch_claim_renewal_and_settle_read_the_community_once_each(backlog):
    community, target = backlog
    reads, claims = _reads_of(lambda: services.claim_deliveries(community.id, target, limit=ROWS))
    assert len(claims) == ROWS
    assert reads == 1
    leases = [c.lease for c in claims]
    reads, renewed = _reads_of(lambda: services.renew_deliveries(leases))
    assert {type(r) for r in renewed} == {services.Renewed}
    assert reads == 1
    leases = [r.lease for r in renewed]
    reads, settled = _reads_of(lambda: services.finish_deliveries(leases[: ROWS // 2]))
    assert {type(s) for s in settled} == {services.Settled}
    assert reads == 1
    mixed = [
        services.Settle(lease=lease, outcome="failed" if i % 2 else "retry", failure_code="x" if i % 2 else None)
        for i, lease in enumerate(leases[ROWS // 2 :])
    ]
    reads, settled = _reads_of(lambda: services.settle_deliveries(mixed))
    assert {s.status for s in settled} == {"failed", "pending"}
    assert reads == 2  # its retries' and its terminals' statements: one read each

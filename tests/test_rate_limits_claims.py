"""A rate limit on claims (issue 32): ``run_delivery_worker --rate-key`` takes one unit of the key
per delivery before it claims, so the workers sharing the key claim at most ``limit`` deliveries
of a community per ``period``; over it they wait for the next window, and every delivery is
still settled. Real worker processes; an audit trigger on the rate-limit row records the units
used after every take."""

from __future__ import annotations

import bisect
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from buzz_delivery.models import RateLimit, WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, random32
from tests.test_rate_limits_processes import AUDIT, DROP_AUDIT

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT, PERIOD = 10, 1.0
N = 60


@pytest.fixture
def audit():
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)
        cursor.execute(AUDIT)
    yield
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)


def test_two_workers_sharing_a_claim_rate_key_claim_at_most_its_limit_a_window_and_settle_everything(
    make_binding, start_worker, audit
):
    target = random32()
    ids = [DeliveryFactory(binding=make_binding(target_pubkey=target)).id for _ in range(N)]
    limits = json.dumps({"claims": {"limit": LIMIT, "period": PERIOD}})
    workers = [
        start_worker(
            target, "--rate-key", "claims", "--concurrency", "4", "--idle-exit", "3", "--poll-interval", "0.2",
            handler="tests.worker_handlers:finish", BUZZ_RATE_LIMITS=limits,
        )
        for _ in range(2)
    ]  # fmt: skip
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.log()[-3000:]
    assert set(WorkflowAgentDelivery.objects.filter(id__in=ids).values_list("status", flat=True)) == {"finished"}
    summaries = [w.summary() for w in workers]
    assert sum(s["claimed"] for s in summaries) == N
    assert sum(s["rate_waits"] for s in summaries) >= 1  # they were held back
    with connection.cursor() as cursor:
        cursor.execute("SELECT window_start, max(used) FROM rate_audit GROUP BY window_start")
        windows = dict(cursor.fetchall())
        cursor.execute(  # each claim, by its history entry (the claim statement's clock)
            "SELECT extract(epoch FROM (e->>'at')::timestamptz) AS at FROM buzz_delivery_delivery AS d,"
            " jsonb_array_elements(d.history) AS e WHERE d.id = ANY(%s) AND e->>'event' = 'claim' ORDER BY at",
            [ids],
        )
        claimed = [float(at) for (at,) in cursor.fetchall()]
    assert max(windows.values()) <= LIMIT  # no window granted more units than its limit
    assert len(windows) >= N // LIMIT  # the claims spread over that many windows at least
    # 60 claims at 10 a window take 6 windows: from the end of the first to the start of the last.
    assert claimed[-1] - claimed[0] >= (N / LIMIT - 2) * PERIOD
    # Any one-period stretch of claims: at most twice the limit (the fixed window's edge).
    busiest = max(bisect.bisect_left(claimed, at + PERIOD) - i for i, at in enumerate(claimed))
    assert busiest <= 2 * LIMIT + 2, busiest


def test_idle_polls_spend_no_units_and_a_community_that_is_not_active_stops_nothing(community, start_worker):
    from buzz_delivery.services import advance_community
    from buzz_delivery.testing import CommunityFactory

    quiet = CommunityFactory()
    advance_community(quiet.id, "quiescing")  # its write fence refuses the take
    limits = json.dumps({"claims": {"limit": LIMIT, "period": PERIOD}})
    worker = start_worker(
        random32(), "--pair", f"{quiet.id}:{random32().hex()}", "--rate-key", "claims", "--idle-exit", "2",
        "--poll-interval", "0.1", handler="tests.worker_handlers:finish", BUZZ_RATE_LIMITS=limits,
    )  # fmt: skip
    assert worker.wait(timeout=60) == 0, worker.log()[-3000:]
    assert worker.summary()["claimed"] == 0
    # About twenty idle polls of the active community: each took a batch's units and gave them back.
    (row,) = RateLimit.objects.filter(community_id=community.id, key="claims")
    assert row.used == 0
    assert not RateLimit.objects.filter(community_id=quiet.id).exists()
    assert "rate_take_refused" in worker.log()


def test_an_undeclared_claim_rate_key_is_refused_by_name_and_nothing_is_written(community):
    before = RateLimit.objects.count()
    with pytest.raises(CommandError, match="--rate-key: 'nope' is not a rate limit key declared"):
        call_command(
            "run_delivery_worker", "--community", str(community.id), "--target", random32().hex(),
            "--handler", "tests.worker_handlers:finish", "--rate-key", "nope",
        )  # fmt: skip
    assert RateLimit.objects.count() == before

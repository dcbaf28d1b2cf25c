"""A holder's renewal round and its settle batch of the same leases, at once (the gateway's remote
worker renews a settled lease "until its batch is answered", so its renew and settle requests
overlap by design): each is one multi-row statement on the queue that locks its rows in the
order of its own list (a nested loop over the unnest), the renewal in the order the leases were
claimed, the settle in the order the handlers finished. Met in opposite orders, each holds a row
the other waits for: "deadlock detected" for one of them (a 503 for the remote worker's request).

A reproduction, deterministic: an open transaction holding the first lease's row (a renewal of
it that has not committed yet) lines the two up so that the settle takes that row first and the
round the other one."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import services
from buzz_delivery.services import LeaseLost, Renewed, Settled, sql
from buzz_delivery.services.types import Settle
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.conftest import BARRIER_TIMEOUT, collecting, lock_waits_reach


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("form", ["finish_deliveries", "settle_deliveries"])
def test_a_renewal_round_and_a_settle_of_the_same_leases_in_other_orders_never_deadlock(form):
    """``finish_deliveries`` (the plan-cached FINISH_MANY) and ``settle_deliveries`` with rows of
    their own outcomes (SETTLE_MANY: the gateway's batch finish, the in-process settler)."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    # A community with a backlog (another target's), analysed: each statement reaches its rows by
    # probing the primary key once per lease of its list, as in production (on a handful of rows
    # the planner scans the table instead, in the rows' physical order, the same for both).
    other = random32()
    for _ in range(4):
        backlog = [BindingFactory.build(run=run, message_event=event, target_pubkey=other) for _ in range(500)]
        services.commit_deliveries(community.id, event, backlog)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {sql.QUEUE}")
    target = random32()
    bindings = [BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(2)]
    services.commit_deliveries(community.id, event, bindings)
    first, second = (c.lease for c in services.claim_deliveries(community.id, target, limit=2, lease_seconds=60))
    connection.close()
    errors: list[BaseException] = []
    found: dict[str, object] = {}
    holding, release = threading.Event(), threading.Event()

    guarded = collecting(errors)

    @guarded
    def slow_renewal() -> None:  # a renewal of the first lease, not committed yet: holds its row
        with transaction.atomic():
            assert isinstance(services.renew_delivery(first, 60), Renewed)
            holding.set()
            assert release.wait(BARRIER_TIMEOUT)

    @guarded
    def settle() -> None:  # the settle batch, in the order the handlers finished
        if form == "finish_deliveries":
            found["settle"] = services.finish_deliveries([first, second])
        else:
            found["settle"] = services.settle_deliveries([Settle(first, "finished"), Settle(second, "failed")])

    @guarded
    def round_() -> None:  # the renewal round, in the order the leases were claimed
        found["round"] = services.renew_deliveries([second, first], 60)

    with ThreadPoolExecutor(max_workers=3) as pool:
        held = pool.submit(slow_renewal)
        assert holding.wait(BARRIER_TIMEOUT)
        settled = pool.submit(settle)
        lock_waits_reach(1, 5.0)  # the settle waits for the first row
        renewed = pool.submit(round_)
        lock_waits_reach(2, 5.0)  # the round holds the second row and waits for the first
        release.set()  # the settle takes the first row, then waits for the second: the round's
        held.result(BARRIER_TIMEOUT)
        settled.result(BARRIER_TIMEOUT)
        renewed.result(BARRIER_TIMEOUT)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    want = ["finished", "finished"] if form == "finish_deliveries" else ["finished", "failed"]
    assert found["settle"] == [Settled(status=status) for status in want]
    assert all(isinstance(o, Renewed | LeaseLost) for o in found["round"])

"""A hostile review of tenant isolation through the gateway (one community against another),
through a real gunicorn, a real HTTP client and real PostgreSQL: what one community's keys and
work can do to another community's long-polls and request bounds."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from django.db import connection

from buzz_delivery.testing import CommunityFactory, Expr, set_delivery_state
from tests.gateway.support import (
    LONG_WAIT,
    WAKE_TEST_ENV,
    assert_woken_by_a_commit,
    deliver,
    enroll,
    long_poll_in_background,
    long_polls_waiting,
    new_agent,
    start_server,
    stop_server,
    wait_for,
    wait_for_long_polls,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_deliveries_of_one_community_to_a_key_enrolled_elsewhere_do_not_wake_its_long_polls(tmp_path):
    """The gateway's wake hub woke a long-poll on any hint naming its key, whatever the hint's
    community: community A's workflows may send to any key, so A woke (and could keep waking,
    one claim round per hint) the long-polls of a key enrolled only in community B. A hint now
    wakes the claims of its (community, target) only, as the in-process worker's listener does.
    Seen here by a delivery of B that became claimable without a hint (``not_before``): on a
    server that polls every 30 s, only a wake-up can hand it over before the wait ends."""
    server = start_server(tmp_path / "gunicorn.log", {"BUZZ_GATEWAY_POLL_SECONDS": "30"})
    try:
        a, b = CommunityFactory(), CommunityFactory()
        agent = new_agent(server)
        enroll(agent, b)
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            now = cursor.fetchone()[0]
        (silent,) = deliver(b, agent.pubkey, not_before=now + dt.timedelta(hours=1))
        waiter, got = long_poll_in_background(agent, 10)
        wait_for(lambda: long_polls_waiting() == 1, "the long-poll to wait (its first claim found nothing)")
        # claimable now, without a hint: nothing wakes the poll
        set_delivery_state((b.id, silent.id), next_attempt_at=Expr("now()"))
        time.sleep(1.0)  # (a wake-up would claim it at once)
        assert got == [] and waiter.is_alive()
        deliver(a, agent.pubkey)  # community A's work, to a key not enrolled in A
        time.sleep(2.5)
        assert got == [] and waiter.is_alive(), "community A's delivery woke a long-poll of community B"
        waiter.join(15)
        assert [c.lease.delivery_id for c in got] == [str(silent.id)]  # at the end of its wait
    finally:
        stop_server(server)


def test_a_hint_of_the_keys_own_community_still_wakes_its_long_poll(tmp_path):
    """The control of the test above: B's own delivery wakes the key's long-poll at once."""
    server = start_server(tmp_path / "gunicorn.log", WAKE_TEST_ENV)
    try:
        a, b = CommunityFactory(), CommunityFactory()
        agent = new_agent(server)
        enroll(agent, a)
        enroll(agent, b)
        waiter, got = long_poll_in_background(agent, LONG_WAIT)
        wait_for_long_polls(server, 1)
        assert got == [] and waiter.is_alive()
        assert_woken_by_a_commit(b, agent, waiter, got)  # B's own delivery: its community's hint
    finally:
        stop_server(server)


def _heavy_calls(n: int = 100, size: int = 4000) -> dict:
    """A calls batch whose items the gateway takes a while to prepare (each ``args`` checked and
    hashed), naming run ids no one holds."""
    args = {"x": [1] * size}
    return {"runs": [{"run_id": str(uuid.uuid4()), "lease_generation": 1, "tool_name": "t", "args": args}
                     for _ in range(n)]}  # fmt: skip


def test_a_key_naming_a_community_it_is_not_enrolled_in_takes_none_of_that_communitys_request_slots(tmp_path):
    """Each request held a slot of the community its path named (MAX_REQUESTS_PER_COMMUNITY)
    before the view checked the key was enrolled there: community A's key, sending requests
    that name community B (each a 403 in the end), held B's slots while the gateway prepared
    them, and B's own agents were refused 429. A request now holds a slot only of a community
    its key was admitted to (the others are refused 403 all the same)."""
    server = start_server(
        tmp_path / "gunicorn.log",
        {"BUZZ_GATEWAY_MAX_REQUESTS_PER_COMMUNITY": "1", "BUZZ_GATEWAY_MAX_BODY_BYTES": str(4 * 1024 * 1024)},
    )
    try:
        a, b = CommunityFactory(), CommunityFactory()
        intruder, owner = new_agent(server), new_agent(server)
        enroll(intruder, a)
        enroll(owner, b)
        body = _heavy_calls()
        stop = threading.Event()
        intruder_statuses: list[int] = []

        def flood() -> None:
            while not stop.is_set():
                response = intruder.request("POST", f"/communities/{b.id}/runs/calls", body)
                intruder_statuses.append(response.status_code)

        threads = [threading.Thread(target=flood) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            owners = []
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                owners.append(owner.request("GET", f"/communities/{b.id}/runs/{uuid.uuid4()}").status_code)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert 403 in intruder_statuses and set(intruder_statuses) <= {403, 429}, intruder_statuses[:5]
        assert owners and set(owners) == {404}, f"{owners.count(429)} of {len(owners)} of B's own requests were 429"
    finally:
        stop_server(server)

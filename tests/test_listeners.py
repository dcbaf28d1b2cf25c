"""Every LISTEN thread survives any NOTIFY payload and restarts itself after any error (issue 27):
any role may ``pg_notify`` any text on our channels. The payloads here are sent by a real
tenant login (a plain member of the tenant role)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connection

from buzz_delivery.conf import get_settings
from buzz_delivery.listening import Listener
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import random32
from buzz_delivery.workflows.conf import NOTIFY_CHANNEL as WORKFLOWS_CHANNEL
from buzz_delivery.workflows.orchestrator import _listener
from tests.test_tenant_isolation import TENANT_LOGIN, login, logins  # noqa: F401 (fixture)
from tests.test_worker import commit, wait_until
from tests.worker_support import one_worker_listening, wait_for_poll_since_listening

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("logins")]

# What anyone may send: not JSON, nested deeper than Python's parser goes (RecursionError, which
# killed the delivery worker's and the gateway's listener), JSON of every wrong shape.
HOSTILE_PAYLOADS = [
    "[" * 3990 + "]" * 3990,
    '{"a":' * 1300 + "1" + "}" * 1300,
    "not json",
    "",
    "[1, 2]",
    "null",
    '{"community": ["x"], "delivery": {}, "target": 5}',
    '{"community": "c", "delivery": "not-a-uuid", "target": "t"}',
    '{"target": {"nested": [[[]]]}}',
    "\u00e9\u4e2d\U0001f600",
]


def notify_as_tenant(channel: str, payloads: list[str]) -> None:
    with login(TENANT_LOGIN) as conn:
        for payload in payloads:
            conn.execute("SELECT pg_notify(%s, %s)", [channel, payload])


def _params() -> dict:
    return connection.get_connection_params()


def test_the_shared_listener_ignores_and_counts_what_its_handler_refuses_and_restarts_after_any_error():
    received: list[str] = []
    listened = threading.Event()
    first = {"listen": True}

    def on_notify(channel: str, payload: str) -> None:
        if payload != "ok":
            raise RecursionError("as a nested payload would")
        received.append(payload)

    def on_listen() -> None:
        if first.pop("listen", False):
            raise RuntimeError("an error that is not the database's")
        listened.set()

    stop = threading.Event()
    listener = Listener(
        name="test-listener", channels=["buzz_test_channel"], conn_params=_params(), stop=stop,
        on_notify=on_notify, on_listen=on_listen, retry_seconds=0.1,
    )  # fmt: skip
    listener.start()
    try:
        assert listened.wait(10), "the listener did not restart after the error in on_listen"
        notify_as_tenant("buzz_test_channel", [*HOSTILE_PAYLOADS, "ok"])
        wait_until(lambda: received == ["ok"], what="the payload after the hostile ones")
        assert listener.ignored == len(HOSTILE_PAYLOADS)
        assert listener.restarts == 1 and listener.is_alive()
        # A lost connection: reconnects and listens again.
        listened.clear()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%buzz_test_channel%%'"
            )
        assert listened.wait(10)
        notify_as_tenant("buzz_test_channel", ["ok"])
        wait_until(lambda: received == ["ok", "ok"], what="a payload after the reconnection")
    finally:
        stop.set()
        listener.join(5)
    assert not listener.is_alive()


def test_the_delivery_worker_is_woken_by_a_hint_after_any_number_of_hostile_ones(make_binding, start_worker):
    target = random32()
    worker = start_worker(target, "--poll-interval", "600", "--max-deliveries", "1", "--lease-seconds", "2")
    wait_until(one_worker_listening, what="the worker to LISTEN")
    # Its poll after the LISTEN found nothing: it sleeps until a hint, or for 600 s.
    wait_for_poll_since_listening()
    # Sent before the delivery's commit: PostgreSQL delivers them first, in this order.
    notify_as_tenant(get_settings().notify_channel, HOSTILE_PAYLOADS)
    (delivery_id,) = commit(make_binding, target)
    assert worker.wait(timeout=60) == 0, worker.log()  # without the hint the next poll is 600 s away
    assert WorkflowAgentDelivery.objects.get(id=delivery_id).status == "finished"


def test_the_orchestrators_listener_wakes_for_its_community_only_whatever_else_arrives():
    community = uuid.uuid4()
    wake, stop = threading.Event(), threading.Event()
    listener = _listener(_params(), community, wake, stop, 0.1)
    listener.start()
    try:
        wait_until(wake.is_set, what="the first LISTEN")  # every (re)connection wakes the dispatcher
        wake.clear()
        notify_as_tenant(WORKFLOWS_CHANNEL, [*HOSTILE_PAYLOADS, str(uuid.uuid4())])
        time.sleep(1.0)
        assert not wake.is_set() and listener.is_alive()
        notify_as_tenant(WORKFLOWS_CHANNEL, [str(community)])
        wait_until(wake.is_set, what="the hint of its community")
    finally:
        stop.set()
        listener.join(5)


def test_a_listener_that_cannot_connect_keeps_trying_until_stopped():
    stop = threading.Event()
    bad = {**_params(), "dbname": "buzz_no_such_database"}
    listener = Listener(
        name="test-listener", channels=["x"], conn_params=bad, stop=stop, on_notify=lambda c, p: None,
        retry_seconds=0.05,
    )  # fmt: skip
    listener.start()
    try:
        wait_until(lambda: listener.restarts >= 3, what="three failed connections")
        assert listener.is_alive()
    finally:
        stop.set()
        listener.join(5)
    assert not listener.is_alive()


def test_a_paused_listener_holds_no_listening_backend_and_listens_again_when_resumed():
    """Issue 31: a follower of a live leader pauses its listener. Paused, the listener closes its
    connection (PostgreSQL signals every listening backend on every notifying commit); resumed,
    it LISTENs at once and runs ``on_listen`` (its owner polls for what came meanwhile), and
    hints arrive again."""
    received: list[str] = []
    listened = threading.Event()
    stop = threading.Event()

    def listeners() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN \"buzz_test_pause\"'"
                " AND datname = current_database()"
            )
            return cursor.fetchone()[0]

    listener = Listener(
        name="test-listener", channels=["buzz_test_pause"], conn_params=_params(), stop=stop,
        on_notify=lambda c, p: received.append(p), on_listen=listened.set, retry_seconds=0.1,
    )  # fmt: skip
    listener.start()
    try:
        assert listened.wait(10)
        wait_until(lambda: listeners() == 1, what="the LISTEN")
        listener.pause(True)
        assert listener.paused
        wait_until(lambda: listeners() == 0, what="the paused listener to close its connection")
        notify_as_tenant("buzz_test_pause", ["while paused"])
        time.sleep(0.3)
        assert received == [] and listener.pauses == 1
        listened.clear()
        listener.pause(False)
        # Bounds a connect and a LISTEN (one per node on Citus): a paused loop looks at its flag
        # every NOTIFY_WAIT_SECONDS anyway, so a tighter bound never told "at once" apart.
        assert listened.wait(30), "resuming did not LISTEN again at once"
        assert listeners() == 1
        notify_as_tenant("buzz_test_pause", ["ok"])
        wait_until(lambda: received == ["ok"], what="a hint after resuming")
        assert listener.restarts == 0
    finally:
        stop.set()
        listener.join(5)
    assert not listener.is_alive()

"""Wake hints (SPEC sections 4.2 and 7): one NOTIFY per created delivery, published at commit,
carrying only identifiers; and the ``deliveries_committed`` signal, sent after commit.

These tests need real commits (``transaction=True``) and a second, LISTENing connection.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection, transaction
from django.test import override_settings
from psycopg import sql

from buzz_delivery import services, signals
from buzz_delivery.conf import get_settings
from buzz_delivery.testing import random32
from buzz_delivery.worker.listener import hint_keys, parse_hint

pytestmark = pytest.mark.django_db(transaction=True)

QUIET_SECONDS = 0.3


class Listener:
    """A LISTENing autocommit psycopg connection of its own."""

    def __init__(self, channel: str) -> None:
        connection.ensure_connection()
        self.conn = psycopg.connect(**connection.get_connection_params(), autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def receive(self, expected: int, timeout: float = 5) -> list[dict]:
        """Wait for ``expected`` hints; then a short quiet period so extra hints would show."""
        got = [json.loads(n.payload) for n in self.conn.notifies(timeout=timeout, stop_after=expected)]
        got += [json.loads(n.payload) for n in self.conn.notifies(timeout=QUIET_SECONDS)]
        return got

    def nothing(self) -> bool:
        return not list(self.conn.notifies(timeout=QUIET_SECONDS))


@pytest.fixture
def listener() -> Iterator[Listener]:
    listening = Listener(get_settings().notify_channel)
    yield listening
    listening.conn.close()


@pytest.fixture
def received_signals() -> Iterator[list[dict]]:
    calls: list[dict] = []

    def receiver(sender, **kwargs):
        calls.append({**kwargs, "in_atomic_block": connection.in_atomic_block})

    signals.deliveries_committed.connect(receiver, dispatch_uid="test_hints")
    yield calls
    signals.deliveries_committed.disconnect(dispatch_uid="test_hints")


def test_one_hint_per_created_delivery_arrives_after_commit_and_not_before(
    community, message_event, make_binding, listener
):
    bindings = [make_binding() for _ in range(3)]
    with transaction.atomic():
        created = services.commit_deliveries(community.id, message_event, bindings)
        assert listener.nothing()  # NOTIFY is transactional: nothing until commit

    hints = listener.receive(3)

    assert hints == [
        {"community": str(community.id), "delivery": str(delivery_id), "target": b.target_pubkey.hex()}
        for delivery_id, b in zip(created, bindings, strict=True)
    ]
    assert all(set(hint) == {"community", "delivery", "target"} for hint in hints)


def test_a_rolled_back_commit_publishes_no_hint(community, message_event, make_binding, listener):
    with pytest.raises(RuntimeError), transaction.atomic():
        services.commit_deliveries(community.id, message_event, [make_binding()])
        raise RuntimeError("the producer's transaction fails after the insert")
    assert listener.nothing()


def test_a_producer_retry_that_creates_nothing_publishes_no_hint(community, message_event, make_binding, listener):
    bindings = [make_binding(), make_binding()]
    services.commit_deliveries(community.id, message_event, bindings)
    assert len(listener.receive(2)) == 2

    assert services.commit_deliveries(community.id, message_event, bindings) == []
    assert listener.nothing()


def test_a_partly_new_retry_publishes_hints_only_for_the_new_deliveries(
    community, message_event, make_binding, listener
):
    old = make_binding()
    services.commit_deliveries(community.id, message_event, [old])
    listener.receive(1)
    new = make_binding()

    created = services.commit_deliveries(community.id, message_event, [old, new])

    assert [h["delivery"] for h in listener.receive(1)] == [str(created[0])]


@override_settings(BUZZ_DELIVERY={"NOTIFY_CHANNEL": "buzz_hints_elsewhere"})
def test_hints_go_to_the_configured_channel(community, message_event, make_binding):
    default = Listener("buzz_delivery")
    elsewhere = Listener("buzz_hints_elsewhere")
    try:
        (created,) = services.commit_deliveries(community.id, message_event, [make_binding()])
        assert [h["delivery"] for h in elsewhere.receive(1)] == [str(created)]
        assert default.nothing()
    finally:
        default.conn.close()
        elsewhere.conn.close()


def test_the_committed_signal_is_sent_once_after_commit_with_the_created_ids(
    community, message_event, make_binding, received_signals
):
    bindings = [make_binding(), make_binding()]
    with transaction.atomic():
        created = services.commit_deliveries(community.id, message_event, bindings)
        assert received_signals == []

    assert received_signals == [
        {
            "signal": signals.deliveries_committed,
            "community_id": community.id,
            "delivery_ids": created,
            "target_pubkeys": [b.target_pubkey for b in bindings],
            "in_atomic_block": False,
        }
    ]


def test_no_signal_for_a_rollback_or_a_retry_that_created_nothing(
    community, message_event, make_binding, received_signals
):
    binding = make_binding()
    with pytest.raises(RuntimeError), transaction.atomic():
        services.commit_deliveries(community.id, message_event, [binding])
        raise RuntimeError("rolled back")
    assert received_signals == []

    services.commit_deliveries(community.id, message_event, [binding])
    services.commit_deliveries(community.id, message_event, [binding])
    assert len(received_signals) == 1


# --- the worker's reading of a hint: identifiers only, for its own community and target -------

COMMUNITY = uuid.UUID("01234567-89ab-7def-8123-456789abcdef")
TARGET = random32().hex()
DELIVERY = uuid.UUID("01234567-89ab-7def-8123-000000000001")
OTHER_PAIR = (uuid.UUID("01234567-89ab-7def-8123-456789abcde0"), random32())
WANTED = hint_keys([(COMMUNITY, bytes.fromhex(TARGET)), OTHER_PAIR])


@pytest.mark.django_db(transaction=False)
def test_the_worker_takes_the_delivery_id_and_pair_of_a_hint_for_one_of_its_pairs():
    payload = json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY), "target": TARGET})
    assert parse_hint(payload, WANTED) == (DELIVERY, (COMMUNITY, bytes.fromhex(TARGET)))
    other = json.dumps({"community": str(OTHER_PAIR[0]), "delivery": str(DELIVERY), "target": OTHER_PAIR[1].hex()})
    assert parse_hint(other, WANTED) == (DELIVERY, OTHER_PAIR)


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(
    "payload",
    [
        json.dumps({"community": str(uuid.uuid4()), "delivery": str(DELIVERY), "target": TARGET}),
        json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY), "target": "00" * 32}),
        # a community of one pair with the target of another: not a pair of this worker
        json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY), "target": OTHER_PAIR[1].hex()}),
        json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY), "target": ["x"]}),
        json.dumps({"community": str(COMMUNITY), "delivery": "not-a-uuid", "target": TARGET}),
        json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY), "target": TARGET, "lease": 1}),
        json.dumps({"community": str(COMMUNITY), "delivery": str(DELIVERY)}),
        json.dumps([str(COMMUNITY), str(DELIVERY), TARGET]),
        "not json",
    ],
    ids=[
        "other-community",
        "other-target",
        "crossed-pair",
        "target-not-text",
        "bad-id",
        "extra-key",
        "missing-key",
        "not-an-object",
        "not-json",
    ],
)
def test_the_worker_ignores_hints_for_others_and_malformed_hints(payload):
    assert parse_hint(payload, WANTED) is None

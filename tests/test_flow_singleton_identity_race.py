"""A replace commit racing a plain commit of the same delivery identity (community, run, step,
target; ``services/singleton.py``): the plain commit takes no key lock, so the replace's
supersede may run before the plain commit's record is visible, and its own insert then meets
that record. What the replace superseded must go back with what it did not create."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from buzz_delivery import models, services
from buzz_delivery.services import singleton
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.conftest import lock_waits_reach

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_replace_that_loses_its_identity_to_a_plain_commit_supersedes_nothing():
    """The replace supersedes the holder H (the plain commit's record not yet visible), names
    its own new delivery in H's failure message, then its insert waits on the plain commit's
    identity and, once that commits, creates nothing: AlreadyCommitted. H must stay the key's
    pending holder (a producer's retry supersedes nothing), not end ``superseded by delivery
    N`` with no delivery N: that loses H's work with nothing in its place."""
    community = CommunityFactory()
    event = EventFactory(community=community)
    target = random32()
    holder_binding = BindingFactory.build(
        run=WorkflowRunFactory(community=community), message_event=event, target_pubkey=target
    )
    (holder,) = services.commit_deliveries(community.id, event, [holder_binding], singleton_key="k").created
    # One identity, committed twice: plainly, and as a replace of the key.
    binding = BindingFactory.build(
        run=WorkflowRunFactory(community=community), message_event=event, target_pubkey=target
    )
    connection.close()
    written, release = threading.Event(), threading.Event()
    found: dict[str, object] = {}

    def plain() -> None:
        try:
            with transaction.atomic():
                found["plain"] = services.commit_deliveries(community.id, event, [binding])
                written.set()
                assert release.wait(30)
        finally:
            connection.close()

    def replace() -> None:
        try:
            found["replace"] = services.commit_deliveries(
                community.id, event, [binding], singleton_key="k", on_conflict="replace"
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        p = pool.submit(plain)
        assert written.wait(30)
        r = pool.submit(replace)
        # The replace superseded H, and its insert now waits on the plain commit's identity.
        lock_waits_reach(1, 5.0)
        release.set()
        p.result(30)
        r.result(30)

    (plain_id,) = found["plain"]
    result = found["replace"]
    assert result.outcomes == (singleton.AlreadyCommitted(plain_id, target),)
    assert result.created == []
    ids = set(models.DeliveryRecord.objects.filter(community_id=community.id).values_list("id", flat=True))
    assert ids == {holder, plain_id}
    held = models.DeliveryRecord.objects.get(community_id=community.id, id=holder)
    assert (held.status, held.failure_code, held.failure_message) == ("pending", None, None), held.failure_message
    queued = models.DeliveryQueue.objects.filter(community_id=community.id, singleton_key="k")
    assert list(queued.values_list("id", flat=True)) == [holder]

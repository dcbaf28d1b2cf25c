"""The remote acceptor (``work-runs``) sends an accept the gateway answered 503 ``unavailable``
(its transaction could not commit: nothing kept) again, signed anew, instead of settling the
delivery ``retry`` at once: that spent one of the delivery's attempts for a passing database
error, and on its last attempt ended it ``failed``/``attempts_exhausted`` (no run, the workflow
step that awaits it failed) where the accept, sent again a moment later, would have succeeded.

Real gateway, real database: the accept waits on a table lock this test holds, past the server's
``lock_timeout``, so the gateway answers a true 503; the lock is let go once that answer came
back."""

from __future__ import annotations

import os

import pytest

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.gateway import remote_accept
from buzz_delivery.testing import CommunityFactory, set_delivery_state
from tests.gateway.support import ReleasingClient, TableLock, deliver, enroll

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_accept_answered_503_is_sent_again_not_settled_retry_on_the_last_attempt(impatient_gateway):
    community = CommunityFactory()
    lock = TableLock()  # let go once the first accept was answered
    agent = ReleasingClient(impatient_gateway.base, os.urandom(32), release=lock.release, watched="accept")
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    set_delivery_state(delivery.id, max_attempts=1)  # its one attempt
    try:
        (claim,) = agent.claim(1)
        # the accept's first read of the deliveries must wait (on a cluster too: the
        # coordinator's table, where the server's lock_timeout applies)
        lock.hold("buzz_delivery_delivery_record")
        result = remote_accept.accept_remote_claim(agent, claim)
    finally:
        lock.close()
        agent.close()

    assert agent.answers[0] == (503, "unavailable")  # a true 503 from the gateway
    delivery.refresh_from_db()
    assert (result, delivery.status, delivery.failure_code) == ("accepted", "finished", None)
    assert AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.id).count() == 1

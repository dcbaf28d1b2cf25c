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

import psycopg
import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun
from buzz_delivery.gateway import remote_accept
from buzz_delivery.gateway.client import GatewayClient, GatewayHTTPError
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import CommunityFactory
from project.database_url import database_url
from tests.gateway.support import deliver, enroll, start_server, stop_server

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def impatient_gateway(tmp_path):
    """A gateway whose statements wait on a row lock at most 300 ms (then 503 ``unavailable``)."""
    server = start_server(tmp_path / "gunicorn.log", {"PGOPTIONS": "-c lock_timeout=300"}, threads=4)
    yield server
    stop_server(server)


class Spy(GatewayClient):
    """Lets the test's row lock go once the first accept was answered; records the answers."""

    def __init__(self, *args, release, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release, self.answers = release, []

    def accept(self, lease, **options):
        try:
            outcome = super().accept(lease, **options)
        except GatewayHTTPError as exc:
            self.answers.append((exc.status, exc.code))
            raise
        finally:
            if len(self.answers) <= 1:
                self.release()
        self.answers.append(outcome.outcome)
        return outcome


def test_an_accept_answered_503_is_sent_again_not_settled_retry_on_the_last_attempt(impatient_gateway):
    community = CommunityFactory()
    blocker = psycopg.connect(database_url(connection.settings_dict, application_name="test-blocker"))
    agent = Spy(impatient_gateway.base, os.urandom(32), release=blocker.rollback)
    enroll(agent, community)
    (delivery,) = deliver(community, agent.pubkey)
    WorkflowAgentDelivery.objects.filter(id=delivery.id).update(max_attempts=1)  # its one attempt
    try:
        (claim,) = agent.claim(1)
        with blocker.cursor() as cur:  # the accept's first read of the deliveries must wait (on a
            # cluster too: the coordinator's table, where the server's lock_timeout applies)
            cur.execute("LOCK TABLE buzz_delivery_delivery IN ACCESS EXCLUSIVE MODE")
        result = remote_accept.accept_remote_claim(agent, claim)
    finally:
        blocker.close()
        agent.close()

    assert agent.answers[0] == (503, "unavailable")  # a true 503 from the gateway
    delivery.refresh_from_db()
    assert (result, delivery.status, delivery.failure_code) == ("accepted", "finished", None)
    assert AgentRun.objects.filter(community_id=community.id, delivery_id=delivery.id).count() == 1

"""A terminal move made of two statements (issue 31, stage 2, ``services/ending.py``): the queue
row's DELETE, then the record's UPDATE, in one transaction. A process killed (SIGKILL) between
the two must leave both as they were: the delivery still live, its queue row there and free, its
record pending; and the move then runs whole. Real processes on the test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery import models, services
from buzz_delivery.services import sql
from buzz_delivery.services.tenancy import fleet
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from project.database_url import database_url
from tests.citus_support import CITUS_MODE
from tests.conftest import backdate_lease

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CITUS_MODE, reason="one PostgreSQL server: the killed backend's transaction"),
]

ROOT = Path(__file__).resolve().parent.parent

# The child: the move with its second statement replaced by a stall, so it is killed between the
# queue row's DELETE (done, uncommitted) and the record's UPDATE.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from buzz_delivery import services
    from buzz_delivery.services import operator, reaper, runs

    def stall(*args, **kwargs):
        print("deleted", flush=True)
        time.sleep(120)

    for module in (operator, reaper, runs):
        module.end_on_record = stall
    case, community, delivery, run = sys.argv[1:5]
    if case == "force_fail":
        services.force_fail_delivery(community, delivery)
    elif case == "reap":
        services.reap()
    else:
        runs.expire_run_deliveries(community, run)
    """
)


def _state(community_id, delivery_id) -> tuple:
    with fleet(), connection.cursor() as cursor:
        cursor.execute(
            f"SELECT r.status, q.status FROM {sql.RECORD} AS r"
            f" LEFT JOIN {sql.QUEUE} AS q ON q.community_id = r.community_id AND q.id = r.id"
            " WHERE r.community_id = %s AND r.id = %s",
            [community_id, delivery_id],
        )
        return cursor.fetchone()


def _queue_row_free(community_id, delivery_id) -> bool:
    with fleet(), connection.cursor() as cursor:
        try:
            cursor.execute("BEGIN")
            cursor.execute(
                f"SELECT 1 FROM {sql.QUEUE} WHERE community_id = %s AND id = %s FOR UPDATE NOWAIT",
                [community_id, delivery_id],
            )
            return cursor.fetchone() is not None
        except Exception:
            return False
        finally:
            cursor.execute("ROLLBACK")


@pytest.mark.parametrize("case", ["force_fail", "reap", "run_expire"])
def test_a_process_killed_between_the_queue_delete_and_the_record_update_changes_nothing(case):
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    (delivery,) = services.commit_deliveries(
        community.id, event, [BindingFactory.build(run=run, message_event=event, target_pubkey=target)]
    )
    if case != "run_expire":
        models.DeliveryQueue.objects.filter(id=delivery).update(max_attempts=1)
        services.claim_delivery(community.id, target, holder="w")
    if case == "reap":
        backdate_lease(delivery)
    live = _state(community.id, delivery)
    assert live == ("pending", "pending" if case == "run_expire" else "claimed")

    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, case, str(community.id), str(delivery), str(run.id)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line == "deleted\n", (line, child.stderr.read() if child.poll() is not None else "")
        assert not _queue_row_free(community.id, delivery)  # the child's DELETE holds it
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)

    deadline = time.monotonic() + 30
    while not _queue_row_free(community.id, delivery):  # the server ends the dead client's backend
        assert time.monotonic() < deadline, "the killed process's transaction still holds the queue row"
        time.sleep(0.05)
    assert _state(community.id, delivery) == live

    # The move then runs whole.
    if case == "force_fail":
        assert services.force_fail_delivery(community.id, delivery).done
        assert _state(community.id, delivery) == ("failed", None)
    elif case == "reap":
        assert services.reap().exhausted == 1
        assert _state(community.id, delivery) == ("failed", None)
    else:
        assert services.expire_run_deliveries(community.id, run.id) == 1
        assert _state(community.id, delivery) == ("expired", None)

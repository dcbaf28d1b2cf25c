"""What SQL run on the tenant login can and cannot do to another community (issue 27).

Every test connects as a real login that is a plain member of the tenant role (neither
superuser, nor BYPASSRLS, nor the tables' owner: asserted by ``login``), the shared tenant login
docs/tenant-isolation.md recommends."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import psycopg
import pytest
from django.db import OperationalError, connection

from buzz_delivery import services
from buzz_delivery.agents.services import intake_event
from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowRunFactory, advance_to, random32
from buzz_delivery.triggers import FENCE_LOCK_NAMESPACE
from tests.conftest import backdate_lease
from tests.test_tenant_isolation import TENANT_LOGIN, login, logins  # noqa: F401 (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("logins")]

# A victim that waits longer than this for a lock has been frozen (the test fails, it never hangs).
VICTIM_LOCK_TIMEOUT = "5s"


def _victim_bound(value: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, false)", [value])


@pytest.fixture
def victim():
    """Community B with a pending delivery; the test's own connection gives up a lock wait
    after :data:`VICTIM_LOCK_TIMEOUT`."""
    b = CommunityFactory()
    run = WorkflowRunFactory(community=b)
    delivery = DeliveryFactory(binding__run=run)
    _victim_bound(VICTIM_LOCK_TIMEOUT)
    yield b, delivery
    _victim_bound("0")


def _hold_fence_lock(conn: psycopg.Connection, community_id, shared: bool = False) -> None:
    function = "pg_advisory_lock_shared" if shared else "pg_advisory_lock"
    conn.execute(f"SELECT {function}(%s, hashtext(%s::text))", [FENCE_LOCK_NAMESPACE, str(community_id)])


def test_a_tenant_holding_another_communitys_fence_lock_does_not_stop_its_writes(victim):
    b, delivery = victim
    target = bytes(delivery.target_pubkey)
    with login(TENANT_LOGIN) as attacker:
        _hold_fence_lock(attacker, b.id)
        try:
            claim = services.claim_delivery(b.id, target, lease_seconds=30)
            assert claim is not None
            assert isinstance(services.finish_delivery(claim.lease, "finished"), services.Settled)
        except OperationalError as exc:  # lock_timeout (5 s): the attacker froze B's writes
            pytest.fail(f"B's writes waited for the tenant's advisory lock: {exc}")
    delivery.refresh_from_db()
    assert delivery.status == "finished"


def test_a_tenant_holding_another_communitys_fence_lock_does_not_stop_its_maintenance(victim):
    b, delivery = victim
    claim = services.claim_delivery(b.id, bytes(delivery.target_pubkey), lease_seconds=30)
    backdate_lease(claim.lease.delivery_id)
    intake_event(b.id, "t", "e1", {}, random32())  # the agents' reaper walks B too
    with login(TENANT_LOGIN) as attacker:
        _hold_fence_lock(attacker, b.id)
        assert services.reap_expired_deliveries() == 1  # was skipped as "busy" for as long as it was held
    delivery.refresh_from_db()
    assert (delivery.status, delivery.lease_generation) == ("pending", 2)


def test_a_move_still_waits_for_writers_and_refuses_them_after_it_while_a_tenant_holds_the_lock(victim):
    """The move meets the writers on the community row when the fence lock is taken: a writer
    inside its transaction holds the move back, and a write after the move is refused."""
    b, _delivery = victim
    _victim_bound("0")
    moved = threading.Event()
    with login(TENANT_LOGIN) as attacker, psycopg.connect(**_params(), autocommit=False) as writer:
        _hold_fence_lock(attacker, b.id, shared=True)  # the move must wait for it: release it below
        writer.execute(
            "UPDATE buzz_delivery_delivery_record SET attempt = attempt WHERE community_id = %s", [b.id]
        )  # a write inside an open transaction

        def move():
            advance_to(b, "quiescing")
            connection.close()
            moved.set()

        thread = threading.Thread(target=move)
        thread.start()
        assert not moved.wait(1.0), "the move did not wait for the writer"
        attacker.execute("SELECT pg_advisory_unlock_all()")
        assert not moved.wait(1.0), "the move did not wait for the writer"
        writer.commit()
        assert moved.wait(15)
        thread.join()
        with pytest.raises(psycopg.Error, match="write fence"):
            writer.execute("UPDATE buzz_delivery_delivery_record SET attempt = attempt WHERE community_id = %s", [b.id])
        writer.rollback()


def _params() -> dict:
    s = connection.settings_dict
    return {"host": s["HOST"] or None, "port": s["PORT"] or None, "dbname": s["NAME"], "user": s["USER"]}


def test_a_tenant_session_cannot_read_another_communitys_statements_in_flight():
    """Every session of the shared tenant login could read the others' statements, the tenant
    context and every literal included, in pg_stat_activity."""
    secret = f"delivery-of-community-a-{uuid.uuid4()}"
    with login(TENANT_LOGIN) as a, login(TENANT_LOGIN) as b:
        running = threading.Thread(
            target=lambda: a.execute(
                f"SELECT set_config('buzz.community_id', '{uuid.uuid4()}', true), pg_sleep(3), '{secret}'"
            )
        )
        running.start()
        try:
            time.sleep(0.5)
            seen: list = []
            for probe in (
                "SELECT query FROM pg_stat_activity",
                "SELECT pg_stat_get_backend_activity(i) FROM pg_stat_get_backend_idset() i",
                "SELECT query FROM pg_stat_get_activity(NULL)",
            ):
                with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                    seen += [row[0] for row in b.execute(probe).fetchall()]
            assert not [text for text in seen if text and secret in text], "another session's statement was readable"
        finally:
            running.join(10)
    with connection.cursor() as cursor:  # the operators' monitoring (a superuser here) still sees it all
        cursor.execute("SELECT count(*) FROM pg_stat_activity")
        assert cursor.fetchone()[0] >= 1


def test_a_tenant_login_has_no_right_on_the_host_projects_sequences_and_cannot_read_the_event_sequence():
    with login(TENANT_LOGIN) as conn:
        for statement in (
            "SELECT nextval('auth_user_id_seq')",
            "SELECT last_value FROM auth_user_id_seq",
            "SELECT nextval('django_admin_log_id_seq')",
            "SELECT last_value FROM buzz_delivery_event_id_seq",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
                conn.execute(statement)
        # What the producer needs: a new event id.
        assert conn.execute("SELECT nextval('buzz_delivery_event_id_seq')").fetchone()[0] > 0

"""Core migration 0036 does not stop the delivery record's writes while it reads the record.

Its key to the run is added ``NOT VALID`` in the swap's short transaction, then validated in a
transaction of its own: ``VALIDATE CONSTRAINT`` holds SHARE UPDATE EXCLUSIVE on the record, which
a claim's or settle's UPDATE (ROW EXCLUSIVE) does not wait for. Validated inside the swap (as the
key was first added), the scan of every delivery held SHARE ROW EXCLUSIVE on the record to the
commit and every claim, settle and commit waited for it (0.7 s for 2,000,000 deliveries,
``bench/results/index-diet.md``). Here the validation is held up by a lock on the run table it
reads, with its lock on the record taken, and a claim goes through meanwhile.
"""

from __future__ import annotations

import importlib
import threading
import time

import psycopg
import pytest
from django.db import connection

from buzz_delivery import services
from tests.citus_support import CITUS_MODE

MIGRATION = importlib.import_module("buzz_delivery.migrations.0036_delivery_one_key_to_its_run")
RECORD = "buzz_delivery_delivery_record"

pytestmark = pytest.mark.skipif(
    CITUS_MODE, reason="watches one PostgreSQL node's lock waits (pg_stat_activity); the DDL's texts run on the cluster"
)


def _connect() -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(
        host=s["HOST"] or None, port=s["PORT"] or None, user=s["USER"], password=s["PASSWORD"] or None,
        dbname=s["NAME"], autocommit=True,
    )  # fmt: skip


def _waits_for_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row and row[0] == "Lock")


def test_the_migration_validates_its_key_apart_from_the_swap():
    assert MIGRATION.Migration.atomic is False
    assert "NOT VALID" in MIGRATION.ADD_ONE_KEY
    assert MIGRATION.Migration.operations[-1].sql == MIGRATION.VALIDATE_ONE_KEY


@pytest.mark.django_db(transaction=True)
def test_a_claim_goes_through_while_the_key_is_validated(community, message_event, make_binding):
    binding = make_binding()
    (delivery_id,) = services.commit_deliveries(community.id, message_event, [binding])
    with connection.cursor() as cursor:  # what the swap commits: the key, not validated yet
        cursor.execute(f"ALTER TABLE {RECORD} DROP CONSTRAINT {MIGRATION.ONE_KEY}")
        cursor.execute(MIGRATION.ADD_ONE_KEY)
    blocker, validator = _connect(), _connect()
    failure: list[BaseException] = []

    def validate() -> None:
        try:
            validator.execute(MIGRATION.VALIDATE_ONE_KEY)
        except BaseException as exc:  # reported by the test, after the join
            failure.append(exc)

    thread = threading.Thread(target=validate)
    try:
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE buzz_delivery_workflow_run IN EXCLUSIVE MODE")
        thread.start()
        deadline = time.monotonic() + 30
        while not _waits_for_a_lock(validator.info.backend_pid):
            assert time.monotonic() < deadline, "the validation never waited for the run table"
            time.sleep(0.05)

        with connection.cursor() as cursor:  # a claim waits at most this long for a lock
            cursor.execute("SET lock_timeout = '10s'")
        claim = services.claim_delivery(community.id, binding.target_pubkey, lease_seconds=60)
        assert claim is not None and claim.lease.delivery_id == delivery_id
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
        blocker.execute("ROLLBACK")
        thread.join(60)
        for conn in (blocker, validator):
            conn.close()
    assert not failure, failure
    with connection.cursor() as cursor:
        cursor.execute("SELECT convalidated FROM pg_constraint WHERE conname = %s", [MIGRATION.ONE_KEY])
        assert cursor.fetchone() == (True,)

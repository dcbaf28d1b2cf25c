"""Concurrency limits by key under real worker processes (issue 32): eight ``run_delivery_worker``
processes and a reaper drain one target under ``{"target": 2}`` while an audit trigger counts the
claimed deliveries of that key at every change (and a sampler reads it from outside): never more
than 2; and they take the deliveries higher priority first, claim statement after claim statement.
A SIGKILLed holder keeps its slot until its lease lapses and the reaper takes it back."""

from __future__ import annotations

import itertools
import json
import random
import signal
import threading
import time

import pytest
from django.db import connection, connections

from buzz_delivery import services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import DeliveryFactory, random32

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = {"target": 2}
WORKERS = 8

# On the live queue (issue 31, stage 2): a claim updates its row, a settle deletes it.
AUDIT = """
CREATE TABLE flow_audit (at timestamptz DEFAULT clock_timestamp(), claimed integer NOT NULL);
CREATE FUNCTION flow_audit_claimed() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    row_ buzz_delivery_delivery_queue := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
BEGIN
    -- A fresh snapshot per statement (READ COMMITTED): every committed claim and this one's.
    INSERT INTO flow_audit (claimed)
    SELECT count(*) FROM buzz_delivery_delivery_queue
    WHERE community_id = row_.community_id AND target_pubkey = row_.target_pubkey AND status = 'claimed';
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER flow_audit_claimed AFTER UPDATE OR DELETE ON buzz_delivery_delivery_queue
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION flow_audit_claimed();
CREATE TRIGGER flow_audit_claimed_now AFTER UPDATE OR DELETE ON buzz_delivery_delivery_queue
    FOR EACH ROW EXECUTE FUNCTION flow_audit_claimed();
-- The order of the claims: each claim's row, its transaction and priority, numbered as it is
-- written (the claims of one community take turns on its advisory lock, so in claim order).
CREATE TABLE flow_claims (n bigserial, tx bigint NOT NULL, priority integer NOT NULL);
CREATE FUNCTION flow_claims_order() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO flow_claims (tx, priority) VALUES (txid_current(), NEW.priority);
    RETURN NULL;
END $$;
CREATE TRIGGER flow_claims_order AFTER UPDATE ON buzz_delivery_delivery_queue
    FOR EACH ROW WHEN (NEW.status = 'claimed' AND OLD.status <> 'claimed') EXECUTE FUNCTION flow_claims_order();
"""
DROP_AUDIT = """
DROP TRIGGER IF EXISTS flow_audit_claimed ON buzz_delivery_delivery_queue;
DROP TRIGGER IF EXISTS flow_audit_claimed_now ON buzz_delivery_delivery_queue;
DROP FUNCTION IF EXISTS flow_audit_claimed();
DROP TABLE IF EXISTS flow_audit;
DROP TRIGGER IF EXISTS flow_claims_order ON buzz_delivery_delivery_queue;
DROP FUNCTION IF EXISTS flow_claims_order();
DROP TABLE IF EXISTS flow_claims;
"""


@pytest.fixture
def audit():
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)
        cursor.execute(AUDIT)
    yield
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)


def wait_until(condition, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def commit(make_binding, target: bytes, n: int, priorities=None, **script) -> list:
    return [
        DeliveryFactory(
            binding=make_binding(target_pubkey=target),
            trigger_context=script,
            priority=priorities[i] if priorities else 0,
        ).id
        for i in range(n)
    ]


def count(ids, status: str) -> int:
    return WorkflowAgentDelivery.objects.filter(id__in=ids, status=status).count()


def test_eight_workers_and_the_reaper_never_hold_more_than_the_limit_of_one_key(make_binding, start_worker, audit):
    target = random32()
    rng = random.Random(32)
    priorities = [rng.randint(-10, 10) for _ in range(24)]
    assert len(set(priorities)) > 8
    ids = commit(make_binding, target, 24, priorities, sleep=0.05)
    community_id = WorkflowAgentDelivery.objects.get(id=ids[0]).community_id
    limits = json.dumps(LIMIT)
    stop = threading.Event()
    sampled: list[int] = []
    errors: list[BaseException] = []

    def sampler_and_reaper() -> None:
        try:
            with connections["default"].cursor() as cursor:
                while not stop.is_set():
                    cursor.execute(
                        "SELECT count(*) FROM buzz_delivery_delivery WHERE community_id = %s"
                        " AND target_pubkey = %s AND status = 'claimed'",
                        [community_id, target],
                    )
                    sampled.append(cursor.fetchone()[0])
                    services.reap()
                    time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    workers = [
        start_worker(
            target,
            *("--concurrency", "3", "--batch-size", "3", "--lease-seconds", "5", "--idle-exit", "2"),
            handler="tests.worker_handlers:scripted",
            BUZZ_CONCURRENCY_LIMITS=limits,
        )
        for _ in range(WORKERS)
    ]
    watcher = threading.Thread(target=sampler_and_reaper)
    watcher.start()
    try:
        for worker in workers:
            assert worker.wait(timeout=120) == 0, worker.log()
    finally:
        stop.set()
        watcher.join()
    assert not errors
    assert count(ids, "finished") == len(ids)
    with connection.cursor() as cursor:
        cursor.execute("SELECT max(claimed), count(*) FROM flow_audit")
        most, changes = cursor.fetchone()
    assert changes >= 2 * len(ids)  # every claim and every settle was counted
    assert most == LIMIT["target"]  # reached, never exceeded
    assert max(sampled) <= LIMIT["target"]
    claimers = {WorkflowAgentDelivery.objects.get(id=i).claimed_by for i in ids}
    assert len(claimers) > 1  # the limit was shared between processes
    # Higher priority first across the eight processes: each claim statement took only
    # deliveries of no higher priority than every later statement's.
    with connection.cursor() as cursor:
        cursor.execute("SELECT tx, min(priority), max(priority) FROM flow_claims GROUP BY tx ORDER BY min(n)")
        statements = cursor.fetchall()
    assert len(statements) >= len(ids) // 2  # the limit of 2: at most 2 a statement
    for (_, lowest, _), (_, _, later_highest) in itertools.pairwise(statements):
        assert lowest >= later_highest, statements


def test_a_sigkilled_holder_keeps_its_slot_until_the_reaper_takes_its_lapsed_lease_back(make_binding, start_worker):
    target = random32()
    ids = commit(make_binding, target, 2, sleep=60)
    env = {"BUZZ_CONCURRENCY_LIMITS": json.dumps({"target": 1})}
    holder = start_worker(target, "--concurrency", "2", "--lease-seconds", "1", **env)
    wait_until(lambda: count(ids, "claimed") == 1, what="the first claim")
    holder.proc.send_signal(signal.SIGKILL)
    holder.wait()

    second = start_worker(
        target, "--max-deliveries", "2", "--lease-seconds", "2", handler="tests.worker_handlers:finish", **env
    )
    wait_until(
        lambda: (
            WorkflowAgentDelivery.objects.filter(id__in=ids, status="claimed", lease_until__lt=time_now()).count() == 1
        ),
        what="the killed holder's lease to lapse",
    )
    time.sleep(1)  # the second worker polls meanwhile: the lapsed lease still holds the only slot
    assert (count(ids, "claimed"), count(ids, "pending"), count(ids, "finished")) == (1, 1, 0)

    assert services.reap().reclaimed == 1
    assert second.wait(timeout=30) == 0, second.log()
    assert count(ids, "finished") == 2


def time_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]

"""The live queue under a concurrency adversary (issue 31, stage 2): real threads, each on its own
connection, claim, renew, settle (single and batch, stale leases too), reap, force-fail,
requeue, expire a cancelled run's deliveries and prune, all at once on the same deliveries.
Checked all along (one statement's snapshot) and at the end: a record is ``pending`` iff it has
exactly one queue row, a terminal record has none; and from each record's history, a delivery
never ends twice without a requeue between, and its generations never go back."""

from __future__ import annotations

import datetime as dt
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from buzz_delivery import services
from buzz_delivery.services import runs, sql
from buzz_delivery.services.tenancy import fleet
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.citus_support import CITUS_MODE

pytestmark = pytest.mark.skipif(CITUS_MODE, reason="PostgreSQL mode: raw chaos writes on the queue")

TERMINAL = {"finished", "failed", "expired"}

BROKEN = f"""
SELECT r.id, r.status, (SELECT count(*) FROM {sql.QUEUE} AS q WHERE q.community_id = r.community_id AND q.id = r.id)
FROM {sql.RECORD} AS r
WHERE r.community_id = %s
  AND (r.status = 'pending') <> ((SELECT count(*) FROM {sql.QUEUE} AS q
                                  WHERE q.community_id = r.community_id AND q.id = r.id) = 1)
"""
ORPHANS = f"""
SELECT q.id FROM {sql.QUEUE} AS q
LEFT JOIN {sql.RECORD} AS r ON r.community_id = q.community_id AND r.id = q.id
WHERE q.community_id = %s AND (r.id IS NULL OR r.status <> 'pending')
"""


def _broken(community_id) -> list[tuple]:
    with fleet(), connection.cursor() as cursor:
        cursor.execute(BROKEN, [community_id])
        found = list(cursor.fetchall())
        cursor.execute(ORPHANS, [community_id])
        found += [("orphan", *row) for row in cursor.fetchall()]
    return found


def _time_passes(community_id, lapse: float) -> None:
    """Time passing: a share ``lapse`` of the claimed leases lapse, retry gates open. Two
    multi-row writes that lock their rows in delivery id order, the order of the product's batch
    writers: in another order they would deadlock with them, a cycle the product never makes
    (its statements take the queue's rows in one order)."""
    picked = f"id IN (SELECT id FROM {sql.QUEUE} WHERE community_id = %s AND {{}} ORDER BY id FOR UPDATE)"
    with fleet(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {sql.QUEUE} SET lease_until = now() - interval '1 hour', claimed_at = claimed_at - interval "
            "'1 hour' WHERE community_id = %s AND status = 'claimed' AND "
            + picked.format("status = 'claimed' AND random() < %s"),
            [community_id, community_id, lapse],
        )
        cursor.execute(
            f"UPDATE {sql.QUEUE} SET next_attempt_at = NULL"
            " WHERE community_id = %s AND next_attempt_at IS NOT NULL AND "
            + picked.format("next_attempt_at IS NOT NULL"),
            [community_id, community_id],
        )


@pytest.mark.django_db(transaction=True)
def test_every_move_at_once_keeps_one_queue_row_per_pending_record_and_ends_each_delivery_once():
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    bindings = [BindingFactory.build(run=run, message_event=event, target_pubkey=target) for _ in range(200)]
    ids = services.commit_deliveries(community.id, event, bindings)
    connection.close()
    stop = time.monotonic() + 8.0
    errors: list[BaseException] = []
    seen_broken: list[tuple] = []
    stale: list = []  # leases kept past their delivery's move, settled later
    lock = threading.Lock()

    def loop(body) -> None:
        rng = random.Random()
        try:
            while time.monotonic() < stop and not errors:
                body(rng)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def worker(rng: random.Random) -> None:
        claims = services.claim_deliveries(community.id, target, limit=rng.randint(1, 4), holder="w")
        leases = [c.lease for c in claims]
        with lock:
            stale.extend(leases)
            old = [stale.pop(rng.randrange(len(stale))) for _ in range(min(2, len(stale)))]
        leases += old
        if not leases:
            return
        roll = rng.random()
        if roll < 0.25:
            for lease in leases:
                services.finish_delivery(lease, rng.choice(["finished", "failed", "retry"]))
        elif roll < 0.5:
            unique = list({lease.delivery_id: lease for lease in leases}.values())
            services.settle_deliveries(
                [services.Settle(lease, rng.choice(["finished", "retry", "failed"])) for lease in unique]
            )
        elif roll < 0.65:
            unique = list({lease.delivery_id: lease for lease in leases}.values())
            services.finish_deliveries(unique, "finished")
        elif roll < 0.8:
            services.renew_deliveries(list({lease.delivery_id: lease for lease in leases}.values()))
        # else: the leases are left to lapse

    def chaos(rng: random.Random) -> None:
        _time_passes(community.id, 0.3)
        time.sleep(0.02)

    def operator(rng: random.Random) -> None:
        delivery = rng.choice(ids)
        roll = rng.random()
        if roll < 0.4:
            services.requeue_delivery(community.id, delivery, actor="operator:a")
        elif roll < 0.7:
            services.force_fail_delivery(community.id, delivery, failure_message="x", actor="operator:b")
        elif roll < 0.8:
            runs.expire_run_deliveries(community.id, run.id, batch_size=3)
        else:
            services.reap(batch_size=5)

    def pruner(rng: random.Random) -> None:
        with fleet(), connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {sql.RECORD} SET finished_at = now() - interval '10 days', "
                "created_at = now() - interval '10 days' "
                "WHERE community_id = %s AND status IN ('finished', 'failed', 'expired') AND random() < 0.02",
                [community.id],
            )
        services.prune_deliveries({s: dt.timedelta(days=1) for s in TERMINAL}, batch_size=3)
        time.sleep(0.5)

    def checker(rng: random.Random) -> None:
        found = _broken(community.id)
        if found:
            seen_broken.extend(found)
        time.sleep(0.01)

    bodies = [worker, worker, worker, worker, operator, operator, chaos, pruner, checker]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        list(pool.map(loop, bodies))

    assert not errors, errors[:3]
    assert not seen_broken, seen_broken[:5]
    assert not _broken(community.id)
    with fleet(), connection.cursor() as cursor:
        cursor.execute(f"SELECT id, history FROM {sql.RECORD} WHERE community_id = %s", [community.id])
        histories = [(i, json.loads(h) if isinstance(h, str) else h) for i, h in cursor.fetchall()]
    # The run did meet every move (else it proves nothing).
    events = {e.get("event") for _, h in histories for e in h}
    assert {"claim", "settle", "retry", "reap", "requeue"} <= events, events
    for delivery, history in histories:
        generations = [e["generation"] for e in history if "generation" in e]
        assert generations == sorted(generations), (delivery, history)
        ended = False
        for entry in history:
            if entry.get("event") == "requeue":  # (a cancelled run's expiry writes no entry)
                ended = False
            elif entry.get("status") in TERMINAL:
                assert not ended, ("ended twice", delivery, history)
                ended = True


@pytest.mark.django_db(transaction=True)
def test_singleton_producers_of_one_key_beside_claimers_and_the_reaper_keep_the_queue_whole():
    from buzz_delivery.services import singleton

    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    targets = [random32(), random32()]
    connection.close()
    stop = time.monotonic() + 6.0
    errors: list[BaseException] = []
    seen_broken: list[tuple] = []
    outcomes: list = []

    def loop(body) -> None:
        rng = random.Random()
        try:
            while time.monotonic() < stop and not errors:
                body(rng)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def producer(rng: random.Random) -> None:
        mine = rng.sample(targets, rng.randint(1, 2))
        bindings = [BindingFactory.build(run=run, message_event=event, target_pubkey=t) for t in mine]
        result = services.commit_deliveries(
            community.id, event, bindings, singleton_key="k", on_conflict=rng.choice(["keep", "replace"])
        )
        outcomes.extend(result.outcomes)

    def claimer(rng: random.Random) -> None:
        for claim in services.claim_deliveries(community.id, rng.choice(targets), limit=2, holder="c"):
            roll = rng.random()
            if roll < 0.4:
                services.finish_delivery(claim.lease, "finished")
            elif roll < 0.7:
                services.finish_delivery(claim.lease, "retry")
            # else: left to lapse

    def maintenance(rng: random.Random) -> None:
        _time_passes(community.id, 0.5)
        services.reap(batch_size=5)
        if rng.random() < 0.3:
            with fleet(), connection.cursor() as cursor:
                cursor.execute(f"SELECT id FROM {sql.RECORD} WHERE community_id = %s ORDER BY random() LIMIT 1",
                               [community.id])  # fmt: skip
                row = cursor.fetchone()
            if row:
                services.requeue_delivery(community.id, row[0])
        time.sleep(0.02)

    def checker(rng: random.Random) -> None:
        found = _broken(community.id)
        if found:
            seen_broken.extend(found)
        time.sleep(0.01)

    bodies = [producer] * 6 + [claimer, claimer, maintenance, checker]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        list(pool.map(loop, bodies))

    assert not errors, errors[:3]
    assert not seen_broken, seen_broken[:5]
    assert not _broken(community.id)
    with fleet(), connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, status, failure_code, (SELECT array_agg(e ->> 'event') FROM jsonb_array_elements(history) e)"
            f" FROM {sql.RECORD} WHERE community_id = %s",
            [community.id],
        )
        records = {row[0]: row[1:] for row in cursor.fetchall()}
        cursor.execute(
            f"SELECT target_pubkey, count(*) FROM {sql.QUEUE} WHERE community_id = %s AND singleton_key IS NOT NULL"
            " GROUP BY 1",
            [community.id],
        )
        assert all(n == 1 for _, n in cursor.fetchall())
    kinds = {type(o).__name__ for o in outcomes}
    assert {"Committed", "Replaced", "Kept"} <= kinds, kinds
    for outcome in outcomes:
        assert outcome.delivery_id in records, outcome  # never a record deleted again after it was reported
        if isinstance(outcome, singleton.Replaced):  # (a requeue may have brought it back since)
            assert "supersede" in records[outcome.superseded_id][2], outcome

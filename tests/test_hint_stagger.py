"""Hint fan-out (issue 31): every worker process listening on a pair hears every hint, so K idle
processes made K hinted claims per delivery, K-1 of them empty. A worker whose last hinted claim
of a pair came back empty (a sibling took the row) holds that pair's next hints for
``hint_stagger`` seconds and then claims one row of the pair (its oldest claimable): a win ends
the hold and the other hints are claimed; empty, nothing they name is claimable and they are
dropped. No claimable delivery waits for a poll. Waits poll for a condition; nothing is timed
except that a held hint was not claimed before its stagger (a lower bound, on the database clock).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.utils import timezone

from buzz_delivery import models, services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import random32
from buzz_delivery.worker import WorkerConfig
from buzz_delivery.worker.listener import HintInbox
from buzz_delivery.worker.runtime import DEFAULT_HINT_STAGGER, Worker
from tests.test_worker import commit, statuses, wait_until

PAIR = (uuid.UUID("01234567-89ab-7def-8123-456789abcdef"), bytes(range(32)))
OTHER = (uuid.UUID("01234567-89ab-7def-8123-456789abcde0"), bytes(range(1, 33)))


def ids(n: int) -> list[uuid.UUID]:
    return [uuid.uuid4() for _ in range(n)]


def test_the_inbox_holds_the_hints_of_held_pairs_until_their_stagger_and_hands_out_the_others_at_once():
    inbox = HintInbox(threading.Event())
    held_a, held_b, free = ids(3)
    inbox.put(held_a, PAIR)
    inbox.put(free, OTHER)
    between = time.monotonic()
    time.sleep(0.001)  # held_b comes strictly later
    inbox.put(held_b, PAIR)
    now = time.monotonic()  # after every put: each hint is at most this old

    taken, poll, due = inbox.drain_due({PAIR}, 10.0, now)
    assert taken == [(free, OTHER)] and not poll  # the pair not held: at once
    assert due is not None and now < due <= between + 10.0  # its oldest one's turn

    taken, _, due = inbox.drain_due({PAIR}, 10.0, now + 5.0)
    assert taken == [] and due is not None  # still younger than the stagger
    inbox.request_poll()
    # The oldest is due (held_b, younger, is not yet): the pair's whole window goes, oldest first.
    taken, poll, due = inbox.drain_due({PAIR}, 10.0, between + 10.0)
    assert taken == [(held_a, PAIR), (held_b, PAIR)] and poll and due is None
    assert inbox.drain() == ([], False)


def test_a_hint_put_again_keeps_its_first_arrival():
    inbox = HintInbox(threading.Event())
    (delivery,) = ids(1)
    inbox.put(delivery, PAIR)
    first = time.monotonic()
    inbox.put(delivery, PAIR)  # the same id hinted again (a producer's retry): not held longer
    taken, _, _ = inbox.drain_due({PAIR}, 10.0, first + 10.0)
    assert taken == [(delivery, PAIR)]


def worker_for(community, target: bytes, **options) -> Worker:
    config = WorkerConfig(
        community_id=community.id, target_pubkey=target, handler=lambda delivery: None, concurrency=4, **options
    )
    return Worker(config, threading.Event())


@pytest.mark.django_db(transaction=True)
def test_an_empty_hinted_claim_holds_the_pair_and_a_claim_of_its_held_hints_that_wins_ends_the_hold(
    community, make_binding
):
    target = random32()
    pair = (community.id, target)
    worker = worker_for(community, target, hint_stagger=0.5, lease_seconds=30)
    (taken,) = commit(make_binding, target)
    assert services.claim_delivery(community.id, target, delivery_id=taken, lease_seconds=30)  # a sibling's
    assert worker._claim([(taken, pair)], False, 4) == (0, False)
    assert worker.hints_lost == {pair}  # its next hints of that pair wait the stagger

    # Held hints now due: one row of the pair is claimed (the oldest claimable); it won (no
    # sibling took it), so the pair leaves the hold and the rest are kept for the ordinary claim.
    later = commit(make_binding, target, 3)
    before = worker.tally.summary()["claim_statements"]
    kept, room = worker._sift_held([(d, pair) for d in later], 4)
    assert kept == [(d, pair) for d in later[1:]] and room == 3
    assert worker.tally.summary()["claim_statements"] == before + 1
    assert worker.hints_lost == set()  # a win: the next hint is claimed at once
    assert statuses(later) == {later[0]: "claimed", later[1]: "pending", later[2]: "pending"}
    # Two hints at once: one statement for both
    assert worker._claim(kept, False, room)[0] == 2 and worker.tally.summary()["claim_statements"] == before + 2


@pytest.mark.django_db(transaction=True)
def test_when_a_sibling_took_every_held_hints_delivery_they_are_dropped_and_other_pairs_kept(community, make_binding):
    target, other_target = random32(), random32()
    pair, other = (community.id, target), (community.id, other_target)
    config = WorkerConfig(
        community_id=community.id,
        target_pubkey=target,
        extra_pairs=((community.id, other_target),),
        handler=lambda delivery: None,
        concurrency=4,
        hint_stagger=0.5,
        lease_seconds=30,
    )
    worker = Worker(config, threading.Event())
    worker.hints_lost.add(pair)
    held = commit(make_binding, target, 3)
    (free,) = commit(make_binding, other_target)
    for d in held:  # a sibling took them all within the stagger
        assert services.claim_delivery(community.id, target, delivery_id=d, lease_seconds=30)
    hinted = [(held[0], pair), (free, other), (held[1], pair), (held[2], pair)]
    before = worker.tally.summary()["claim_statements"]
    kept, room = worker._sift_held(hinted, 4)
    assert kept == [(free, other)] and room == 4  # the other pair's hint: untouched, claimed as ever
    assert worker.tally.summary()["claim_statements"] == before + 1  # one row of the held pair only
    assert worker.tally.summary()["hints_dropped"] == 3  # none of them claimable: none claimed
    assert worker.hints_lost == {pair}


@pytest.mark.django_db(transaction=True)
def test_a_hinted_claim_that_lost_to_the_workers_own_poll_holds_nothing(community, make_binding):
    """A one-process worker is never held by its own polls: its poll claimed the row before the
    hint's claim ran (a round while the hint was queued), no sibling did."""
    target = random32()
    pair = (community.id, target)
    worker = worker_for(community, target, hint_stagger=0.5)
    (delivery,) = commit(make_binding, target)
    assert worker._claim([], True, 4)[0] == 1  # a round of every pair
    assert worker._claim([(delivery, pair)], False, 4) == (0, False)
    assert worker.hints_lost == set()


@pytest.mark.django_db(transaction=True)
def test_with_no_stagger_an_empty_hinted_claim_holds_nothing(community, make_binding):
    target = random32()
    worker = worker_for(community, target, hint_stagger=0)
    (taken,) = commit(make_binding, target)
    assert services.claim_delivery(community.id, target, delivery_id=taken, lease_seconds=30)
    assert worker._claim([(taken, (community.id, target))], False, 4) == (0, False)
    assert worker.hints_lost == set()


@pytest.mark.django_db(transaction=True)
def test_a_running_worker_claims_a_held_hint_after_its_stagger_without_waiting_for_a_poll(
    community, make_binding, caplog
):
    target = random32()
    pair = (community.id, target)
    stagger = 0.5
    worker = worker_for(community, target, hint_stagger=stagger, poll_interval=60, lease_seconds=30)
    params = connection.get_connection_params()
    caplog.set_level(logging.INFO, logger="buzz_delivery.worker")

    def run() -> None:
        try:
            worker.run(params)
        finally:
            connections.close_all()  # this thread's (the dispatcher's) connection

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: "listening" in caplog.text, what="the worker listening")
        # A probe, claimed by its hint or by the poll the listener asks for once it listens:
        # after it, the next poll is 60 s away and only a hint gets a delivery claimed.
        (probe,) = commit(make_binding, target)
        wait_until(lambda: statuses([probe]) == {probe: "finished"}, what="the probe")
        worker.hints_lost.add(pair)  # as after a hinted claim a sibling won
        before = worker.tally.summary()["claim_statements"]

        # No sibling takes it: held the stagger, then claimed (the pair's one-row claim).
        (held,) = commit(make_binding, target)
        wait_until(lambda: statuses([held]) == {held: "finished"}, what="the held hint's delivery")
        assert worker.tally.summary()["claim_statements"] == before + 1  # its hint's claim, no poll
        assert worker.hints_lost == set()  # it won: the pair's next hints are claimed at once
        row = WorkflowAgentDelivery.objects.get(id=held)
        claimed_at = next(h["at"] for h in row.history if h["event"] == "claim")
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::timestamptz - %s::timestamptz", [claimed_at, row.created_at])
            waited = cursor.fetchone()[0].total_seconds()
        assert waited >= stagger  # held back the stagger (its hint came after the commit)
    finally:
        worker.stop.set()
        thread.join(60)
    assert not thread.is_alive()


@pytest.mark.parametrize("value", [-0.01, 10.5, math.nan, math.inf, "0.1", True])
def test_a_bad_hint_stagger_is_refused_naming_it(value):
    with pytest.raises(ValidationError) as refused:
        WorkerConfig(community_id=PAIR[0], target_pubkey=PAIR[1], handler=lambda d: None, hint_stagger=value)
    assert "hint_stagger" in str(refused.value)


def test_the_hint_stagger_is_off_by_default_and_a_config_takes_an_int():
    config = WorkerConfig(community_id=PAIR[0], target_pubkey=PAIR[1], handler=lambda d: None)
    assert config.hint_stagger == DEFAULT_HINT_STAGGER == 0.0  # every process claims every hint, as before
    config = WorkerConfig(community_id=PAIR[0], target_pubkey=PAIR[1], handler=lambda d: None, hint_stagger=1)
    assert config.hint_stagger == 1.0 and isinstance(config.hint_stagger, float)


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["-1", "11", "nan", "soon"])
def test_a_bad_hint_stagger_option_is_refused_naming_it_before_anything_runs(value, community):
    with pytest.raises(CommandError) as refused:
        call_command(
            "run_delivery_worker",
            *("--community", str(community.id), "--target", random32().hex(), "--hint-stagger", value),
            *("--handler", "tests.worker_handlers:scripted"),
        )
    assert "--hint-stagger" in str(refused.value)
    assert not models.WorkerRegistration.objects.exists()


def run_in_thread(worker: Worker) -> threading.Thread:
    params = connection.get_connection_params()

    def run() -> None:
        try:
            worker.run(params)
        finally:
            connections.close_all()  # this thread's (the dispatcher's) connection

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_a_lone_worker_claims_a_due_delivery_whose_held_hint_came_after_a_scheduled_deliverys(
    community, message_event, make_binding, caplog
):
    """A delivery committed with ``not_before`` sends its hint at commit, and its hinted claim
    comes back empty: a lone worker (no sibling at all) then holds the pair. A window whose oldest
    hint is such a delivery's must not drop the due delivery hinted after it: nobody else heard
    it, and the next poll is 60 s away (up to a day in production)."""
    target = random32()
    pair = (community.id, target)
    stagger = 0.3
    worker = worker_for(community, target, hint_stagger=stagger, poll_interval=60, lease_seconds=30)
    caplog.set_level(logging.INFO, logger="buzz_delivery.worker")
    thread = run_in_thread(worker)
    tomorrow = timezone.now() + dt.timedelta(days=1)

    def scheduled() -> uuid.UUID:
        binding = make_binding(target_pubkey=target)
        (created,) = services.commit_deliveries(community.id, message_event, [binding], not_before=tomorrow)
        return created

    try:
        wait_until(lambda: "listening" in caplog.text, what="the worker listening")
        (probe,) = commit(make_binding, target)  # after it, the next poll is 60 s away
        wait_until(lambda: statuses([probe]) == {probe: "finished"}, what="the probe")
        time.sleep(stagger)  # the probe's poll (if a poll took it) no longer excuses an empty claim
        scheduled()
        wait_until(lambda: worker.hints_lost == {pair}, what="the pair held after the scheduled one's claim")

        with transaction.atomic():  # both hints at one commit, the scheduled one's first
            later = scheduled()
            (due,) = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)])
        wait_until(lambda: statuses([due]) == {due: "finished"}, what="the due delivery, held behind a scheduled one")
        assert statuses([later]) == {later: "pending"}
    finally:
        worker.stop.set()
        thread.join(60)
    assert not thread.is_alive()


@pytest.mark.django_db(transaction=True)
def test_a_held_pair_left_unclaimed_for_want_of_room_keeps_its_hints(community, make_binding):
    """Two held pairs, room for one claim: the first pair's claim takes the room; the second
    pair's held hints were never claimed nor checked, so they are not dropped."""
    target, other_target = random32(), random32()
    pair, other = (community.id, target), (community.id, other_target)
    config = WorkerConfig(
        community_id=community.id,
        target_pubkey=target,
        extra_pairs=((community.id, other_target),),
        handler=lambda delivery: None,
        concurrency=4,
        hint_stagger=0.5,
        lease_seconds=30,
    )
    worker = Worker(config, threading.Event())
    worker.hints_lost.update({pair, other})
    (first,) = commit(make_binding, target)
    (second,) = commit(make_binding, other_target)
    kept, room = worker._sift_held([(first, pair), (second, other)], 1)
    assert room == 0 and statuses([first]) == {first: "claimed"}
    assert kept == [(second, other)]  # claimed as hints beyond the room are: by the next poll
    assert worker.tally.summary()["hints_dropped"] == 0


@pytest.mark.django_db(transaction=True)
def test_held_hints_a_sibling_left_behind_the_oldest_are_claimed_not_dropped(community, make_binding):
    """The sibling took the oldest held hint's delivery and then died (or stalled) before the
    younger ones: they are still pending, nobody else claims them, so they are not dropped."""
    target = random32()
    pair = (community.id, target)
    worker = worker_for(community, target, hint_stagger=0.5, lease_seconds=30)
    worker.hints_lost.add(pair)
    held = commit(make_binding, target, 3)
    assert services.claim_delivery(community.id, target, delivery_id=held[0], lease_seconds=30)  # the sibling's
    kept, room = worker._sift_held([(d, pair) for d in held], 4)
    if kept:  # as the dispatcher: what is left of the hints is claimed (nothing left: no claim)
        worker._claim(kept, False, room)
    assert statuses(held) == {d: "claimed" for d in held}
    assert worker.tally.summary()["hints_dropped"] == 0


@pytest.mark.django_db(transaction=True)
def test_an_idle_exit_waits_for_a_held_hint_to_be_claimed(community, make_binding, caplog):
    """A worker holding a hint knows of a delivery: it is not idle. With ``idle_exit`` shorter
    than the stagger (here 2 s against 6 s), a held hint's delivery was left pending when the
    worker exited idle (for the next run's, or another process's, poll)."""
    target = random32()
    pair = (community.id, target)
    worker = worker_for(community, target, hint_stagger=6.0, idle_exit=2.0, poll_interval=60, lease_seconds=30)
    caplog.set_level(logging.INFO, logger="buzz_delivery.worker")
    summaries = []
    params = connection.get_connection_params()

    def run() -> None:
        try:
            summaries.append(worker.run(params))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: "listening" in caplog.text, what="the worker listening")
        (probe,) = commit(make_binding, target)  # its claim and settle: busy until just now
        wait_until(lambda: statuses([probe]) == {probe: "finished"}, what="the probe")
        worker.hints_lost.add(pair)  # as after a hinted claim a sibling won
        (held,) = commit(make_binding, target)
        thread.join(30)
    finally:
        worker.stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert statuses([held]) == {held: "finished"}
    assert summaries[0].reason == "idle_exit"

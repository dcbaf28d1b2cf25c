"""One worker process serving several (community, target) pairs (issue 16), as real processes.

``run_delivery_worker --target A --target B --pair OTHER_COMMUNITY:C`` claims from every pair
with the same handler threads and connections: each delivery of each pair is settled exactly
once by its holder, a hint for any pair wakes it, and deliveries of pairs it does not serve stay
untouched. Waits poll the database for a condition; nothing here is timed.
"""

from __future__ import annotations

import uuid

import pytest
from django.core.management import CommandError, call_command

from buzz_delivery import models, services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.test_worker import commit, statuses, wait_until
from tests.test_worker_batching import RUNTIME_CONNECTIONS, other_backends

pytestmark = pytest.mark.django_db(transaction=True)


def other_community_binding():
    """A second community and ``make_binding`` for it (its own run and message event, which
    ``make.event`` holds)."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)

    def make(**overrides):
        return BindingFactory(run=run, message_event=event, **overrides)

    make.event = event  # type: ignore[attr-defined]
    return community, make


def test_one_worker_settles_every_delivery_of_each_of_its_pairs_once_and_leaves_other_pairs_alone(
    community, make_binding, start_worker
):
    targets = [random32(), random32(), random32()]
    other, make_other = other_community_binding()
    other_target = random32()
    mine = [d for t in targets for d in commit(make_binding, t, 30)] + commit(make_other, other_target, 30)
    not_served = commit(make_binding, random32(), 5) + commit(make_other, targets[0], 5)
    baseline = other_backends()

    worker = start_worker(
        targets[0],
        *("--target", targets[1].hex(), "--target", targets[2].hex()),
        *("--pair", f"{other.id}:{other_target.hex()}"),
        *("--concurrency", "8", "--lease-seconds", "10", "--idle-exit", "1"),
        handler="tests.worker_handlers:finish",  # touches no database: no connection of its own
    )
    wait_until(lambda: sum(1 for s in statuses(mine).values() if s != "pending") >= 10, what="the first claims")
    held = other_backends() - baseline  # the worker's connections while it works, whatever the pairs
    assert worker.wait(60) == 0, worker.log()

    rows = list(WorkflowAgentDelivery.objects.filter(id__in=mine))
    assert {(r.status, r.lease_generation, r.attempt) for r in rows} == {("finished", 1, 1)}
    assert all(r.history[-1]["actor"] == r.history[0]["actor"] for r in rows)  # settled by its holder
    assert set(statuses(not_served).values()) == {"pending"}
    summary = worker.summary()
    assert (summary["claimed"], summary["finished"], summary["lease_lost"]) == (120, 120, 0)
    # batched per pair: a batch mixing pairs would be refused and replayed one by one
    assert "batch refused" not in worker.log()
    assert summary["settle_statements"] < 120 / 2
    # dispatcher, settler, renewer, listener, and the command's registry heartbeat connection
    assert 0 < held <= RUNTIME_CONNECTIONS + 1


def test_a_hint_for_any_of_its_pairs_wakes_the_worker_before_its_next_poll(
    community, message_event, make_binding, start_worker
):
    first, second = random32(), random32()
    other, make_other = other_community_binding()
    # One delivery of the pair polled last, there before the worker starts: the start-up poll (of
    # every pair, which can end after "listening" is logged: on the cluster it did) claims it, and
    # its log line says that round is over. Two handler threads: that poll does not come back full,
    # so the next is due 60 s later, and only a hint gets the deliveries below claimed in the wait.
    (early,) = services.commit_deliveries(other.id, make_other.event, [make_other(target_pubkey=second)])
    worker = start_worker(
        first,
        *("--pair", f"{other.id}:{second.hex()}", "--poll-interval", "60", "--max-deliveries", "4"),
        *("--concurrency", "2"),
    )
    wait_until(lambda: "listening" in worker.log(), what="the worker listening")
    wait_until(lambda: "via=poll" in worker.log(), what="the worker's start-up poll")
    # The listener asks for a poll once it listens (hints before that were missed). When that
    # ask lands after the start-up poll, the poll it makes can claim this first delivery: once it
    # is claimed the ask has been taken (it was made before "listening" was seen), so the two
    # below can only be claimed by their hints.
    (late,) = services.commit_deliveries(other.id, make_other.event, [make_other(target_pubkey=second)])
    wait_until(lambda: statuses([late]) == {late: "finished"}, what="the first delivery of the second pair")
    (own,) = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=first)])
    wait_until(lambda: statuses([own]) == {own: "finished"}, what="the hinted delivery of the first pair")
    (later,) = services.commit_deliveries(other.id, make_other.event, [make_other(target_pubkey=second)])

    assert worker.wait(30) == 0, worker.log()
    assert statuses([early, later]) == {early: "finished", later: "finished"}
    claims = [line.rsplit("via=", 1)[1].strip() for line in worker.log().splitlines() if "claimed n=" in line]
    assert claims[-2:] == ["hint", "hint"], worker.log()  # the first pair's, then the second's
    assert claims.count("poll") in (1, 2) and len(claims) == 4, worker.log()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("not-a-pair", "COMMUNITY_UUID:TARGET_HEX"),
        (f"{uuid.uuid4()}:abc", "64 hex characters"),
        (f"not-a-uuid:{'ab' * 32}", "not a valid UUID"),
    ],
)
def test_a_bad_pair_is_refused_naming_the_option_before_anything_runs(value, says, community, capsys):
    target = random32()
    with pytest.raises(CommandError) as refused:
        call_command(
            "run_delivery_worker",
            *("--community", str(community.id), "--target", target.hex(), "--pair", value),
            *("--handler", "tests.worker_handlers:scripted"),
        )
    assert "--pair" in str(refused.value) and says in str(refused.value)
    assert not models.WorkerRegistration.objects.exists()  # it never started


def test_a_pair_with_a_long_backlog_does_not_starve_a_hinted_pair(community, message_event, make_binding, start_worker):
    busy, quiet = random32(), random32()
    backlog = commit(make_binding, busy, 300, sleep=0.02)  # about 3 s of work on 2 threads
    # Polls every 60 s: while the busy pair's polls come back full, only the hint can bring
    # the quiet pair in.
    worker = start_worker(
        busy,
        *("--target", quiet.hex(), "--concurrency", "2", "--poll-interval", "60", "--idle-exit", "1"),
    )
    wait_until(lambda: sum(1 for s in statuses(backlog).values() if s == "finished") >= 20, what="the drain")
    (late,) = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=quiet)])
    wait_until(lambda: statuses([late]) == {late: "finished"}, what="the quiet pair's delivery")
    still_pending = sum(1 for s in statuses(backlog).values() if s == "pending")

    assert worker.wait(60) == 0, worker.log()
    assert still_pending > 0  # it was served while the busy pair still had a backlog
    assert set(statuses(backlog).values()) == {"finished"}


def test_extra_pairs_given_as_text_or_bytearray_are_normalized_or_refused_naming_the_field():
    from django.core.exceptions import ValidationError

    from buzz_delivery.worker import WorkerConfig

    community, target = uuid.uuid4(), random32()
    config = WorkerConfig(
        community_id=community,
        target_pubkey=target,
        handler=print,
        extra_pairs=((str(community).upper(), bytearray(target)), (community.hex, target)),
    )
    assert config.pairs == ((community, target),)  # the same pair three ways: counted once
    with pytest.raises(ValidationError, match=r"extra_pairs\[0\].target_pubkey"):
        WorkerConfig(community_id=community, target_pubkey=target, handler=print, extra_pairs=((community, b"x"),))

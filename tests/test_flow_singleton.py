"""Debounce / singleton deliveries (issue 32, ``services/singleton.py``, docs/flow-control.md):
one unclaimed pending delivery per (community, target, singleton key), kept by a partial UNIQUE
index; "keep" writes nothing and reports the holder, "replace" supersedes it; a claimed delivery
does not hold the key; bad keys are refused naming ``singleton_key`` with nothing written."""

from __future__ import annotations

import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction

from buzz_delivery import models, services
from buzz_delivery.services import singleton, sql
from buzz_delivery.services.tenancy import fleet
from buzz_delivery.testing import BindingFactory, CommunityFactory, EventFactory, WorkflowRunFactory, random32
from tests.citus_support import CITUS_MODE
from tests.conftest import BARRIER_TIMEOUT, backdate_lease, collecting, lock_waits_reach

pytestmark = pytest.mark.django_db

DELIVERY = models.DeliveryRecord._meta.db_table


def rows(community, **filters) -> list[models.WorkflowAgentDelivery]:
    return list(
        models.WorkflowAgentDelivery.objects.filter(community_id=community.id, **filters).order_by("created_at")
    )


def test_keep_writes_nothing_for_a_target_whose_key_is_held_and_reports_the_holder(
    community, message_event, make_binding
):
    target, other = random32(), random32()
    first = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="digest"
    )
    assert [type(o) for o in first.outcomes] == [singleton.Committed]
    (holder,) = first.created

    second = services.commit_deliveries(
        community.id,
        message_event,
        [make_binding(target_pubkey=target), make_binding(target_pubkey=other)],
        singleton_key="digest",
        on_conflict="keep",
    )

    kept, committed = second.outcomes
    assert kept == singleton.Kept(holder, target)
    assert isinstance(committed, singleton.Committed) and committed.target_pubkey == other
    assert second.created == [committed.delivery_id]
    assert [r.id for r in rows(community, target_pubkey=target)] == [holder]
    (row,) = rows(community, target_pubkey=other)
    assert row.singleton_key == "digest" and row.status == "pending"


def test_the_key_is_scoped_per_community_and_target_and_other_keys_do_not_meet(community, message_event, make_binding):
    target = random32()
    services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="a")
    other_key = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="b"
    )
    plain = services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)])
    elsewhere = CommunityFactory()
    event = EventFactory(community=elsewhere)
    binding = BindingFactory(run=WorkflowRunFactory(community=elsewhere), message_event=event, target_pubkey=target)
    other_community = services.commit_deliveries(elsewhere.id, event, [binding], singleton_key="a")

    assert isinstance(other_key.outcomes[0], singleton.Committed)
    assert len(plain) == 1
    assert isinstance(other_community.outcomes[0], singleton.Committed)
    assert len(rows(community, target_pubkey=target, status="pending")) == 3


def test_replace_supersedes_the_holder_and_keeps_its_row_and_history_as_committed(
    community, message_event, make_binding
):
    target = random32()
    (old,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="digest", priority=3
    ).created
    newer = make_binding(target_pubkey=target)

    result = services.commit_deliveries(
        community.id, message_event, [newer], singleton_key="digest", on_conflict="replace", priority=5
    )

    (outcome,) = result.outcomes
    assert isinstance(outcome, singleton.Replaced) and outcome.superseded_id == old
    assert result.rounds == 1  # superseded and inserted in one statement
    superseded = models.WorkflowAgentDelivery.objects.get(id=old)
    assert superseded.status == "expired" and superseded.failure_code == "superseded"
    assert str(outcome.delivery_id) in superseded.failure_message
    assert superseded.finished_at is not None and superseded.lease_generation == 1
    assert superseded.priority == 3 and superseded.singleton_key == "digest"  # as committed
    entry = superseded.history[-1]
    assert entry["event"] == "supersede" and entry["status"] == "expired"
    assert entry["superseded_by"] == str(outcome.delivery_id) and entry["actor"] == "producer"
    (pending,) = rows(community, target_pubkey=target, status="pending")
    assert pending.id == outcome.delivery_id and pending.priority == 5
    assert services.Binding.of(pending) == newer


def test_replace_with_no_holder_commits_and_a_producer_retry_supersedes_nothing(community, message_event, make_binding):
    binding = make_binding()
    first = services.commit_deliveries(community.id, message_event, [binding], singleton_key="k", on_conflict="replace")
    (created,) = first.created
    assert first.outcomes == (singleton.Committed(created, binding.target_pubkey),)

    retry = services.commit_deliveries(community.id, message_event, [binding], singleton_key="k", on_conflict="replace")

    assert retry.outcomes == (singleton.AlreadyCommitted(created, binding.target_pubkey),)
    assert retry.created == []
    assert [(r.id, r.status) for r in rows(community)] == [(created, "pending")]


def test_a_claimed_delivery_does_not_hold_the_key_nor_does_one_back_to_pending(community, message_event, make_binding):
    target = random32()
    (first,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    claim = services.claim_delivery(community.id, target)
    assert claim.lease.delivery_id == first

    # In flight: a new commit of the key makes a new pending delivery beside it (debounce).
    (second,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    # The claimed one comes back to pending by a retry: no refusal, and it does not hold the key.
    assert services.finish_delivery(claim.lease, "retry") == services.Settled("pending")
    assert {r.id for r in rows(community, status="pending")} == {first, second}
    kept = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    )
    assert kept.outcomes == (singleton.Kept(second, target),)
    replaced = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k", on_conflict="replace"
    )
    assert replaced.outcomes[0].superseded_id == second
    assert models.WorkflowAgentDelivery.objects.get(id=first).status == "pending"  # the retried one is left alone


def test_the_reaper_brings_a_lapsed_singleton_delivery_back_beside_a_new_holder(community, message_event, make_binding):
    target = random32()
    (first,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    services.claim_delivery(community.id, target)
    (second,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    backdate_lease(first)

    assert services.reap_expired_deliveries() == 1

    assert {r.id for r in rows(community, status="pending")} == {first, second}


def test_an_operator_requeue_back_to_pending_is_not_refused_by_a_new_holder_of_the_key(
    community, message_event, make_binding
):
    target = random32()
    (first,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    claim = services.claim_delivery(community.id, target)
    assert services.finish_delivery(claim.lease, "failed") == services.Settled("failed")
    (second,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created

    assert services.requeue_delivery(community.id, first).done

    assert {r.id for r in rows(community, status="pending")} == {first, second}
    # The requeued one (generation 2) does not hold the key: "keep" still reports the new holder.
    kept = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    )
    assert kept.outcomes == (singleton.Kept(second, target),)


def test_the_database_refuses_a_second_unclaimed_pending_delivery_of_one_key(community, message_event, make_binding):
    target = random32()
    (first,) = services.commit_deliveries(
        community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
    ).created
    # The key's index is the live queue's (issue 31, stage 2): a second record of the key is
    # written, its queue row carrying the key is refused.
    second = uuid.uuid4()
    with (
        pytest.raises(DatabaseError, match="delivery_queue_singleton_key"),  # IntegrityError; relayed on Citus
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            f"INSERT INTO {DELIVERY} (id, community_id, workflow_id, run_id, step_id, target_pubkey,"
            " definition_event_id, message_event_id, cause_kind, cause_event_id, cause_scheduled_for,"
            " cause_webhook_invocation_id, singleton_key, status,"
            " lease_generation, attempt, priority, renewals, history, created_at)"
            " SELECT %s, community_id, workflow_id, run_id, 'another-step', target_pubkey,"
            " definition_event_id, message_event_id, cause_kind, cause_event_id, cause_scheduled_for,"
            " cause_webhook_invocation_id, singleton_key, 'pending',"
            f" 0, 0, 0, 0, '[]', now() FROM {DELIVERY} WHERE community_id = %s AND id = %s",
            [second, community.id, first],
        )
        cursor.execute(sql.INSERT_QUEUE_ROWS_OF_CREATED.replace("ON CONFLICT DO NOTHING\n", ""),
                       {"community_id": community.id, "created_ids": [second]})  # fmt: skip
    with (
        pytest.raises(DatabaseError, match="binding and snapshots never change"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            f"UPDATE {DELIVERY} SET singleton_key = 'other' WHERE community_id = %s AND id = %s",
            [community.id, first],
        )


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (42, "must be a str"),
        (b"digest", "must be a str"),
        ("", "1..64 characters"),
        ("x" * 65, "1..64 characters"),
        ("has space", "1..64 characters"),
        ("new\nline", "1..64 characters"),
        ("é", "1..64 characters"),
        ("a'; DROP TABLE x; --", "1..64 characters"),
    ],
)
def test_a_bad_key_is_refused_naming_singleton_key_and_nothing_is_written(
    community, message_event, make_binding, table_snapshot, key, message
):
    binding = make_binding()
    before = table_snapshot()
    with pytest.raises(ValidationError) as refused:
        services.commit_deliveries(community.id, message_event, [binding], singleton_key=key)
    assert list(refused.value.message_dict) == ["singleton_key"]
    assert message in refused.value.message_dict["singleton_key"][0]
    assert table_snapshot() == before


def test_a_bad_on_conflict_and_two_bindings_of_one_target_are_refused_with_nothing_written(
    community, message_event, make_binding, table_snapshot
):
    target = random32()
    before = table_snapshot()
    with pytest.raises(ValidationError) as refused:
        services.commit_deliveries(
            community.id, message_event, [make_binding()], singleton_key="k", on_conflict="overwrite"
        )
    assert list(refused.value.message_dict) == ["on_conflict"]
    with pytest.raises(ValidationError) as refused:
        services.commit_deliveries(community.id, message_event, [make_binding()], on_conflict="replace")
    assert "needs a singleton_key" in refused.value.message_dict["on_conflict"][0]
    with pytest.raises(ValidationError) as refused:
        services.commit_deliveries(
            community.id,
            message_event,
            [make_binding(target_pubkey=target), make_binding(target_pubkey=target)],
            singleton_key="k",
        )
    assert list(refused.value.message_dict) == ["bindings[1].target_pubkey"]
    assert table_snapshot() == before


def test_the_signal_is_sent_for_created_deliveries_only(
    community, message_event, make_binding, django_capture_on_commit_callbacks
):
    from buzz_delivery import signals

    target = random32()
    received: list[list] = []

    def listener(sender, delivery_ids, **kwargs):
        received.append(list(delivery_ids))

    signals.deliveries_committed.connect(listener)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            first = services.commit_deliveries(
                community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
            )
            kept = services.commit_deliveries(
                community.id, message_event, [make_binding(target_pubkey=target)], singleton_key="k"
            )
    finally:
        signals.deliveries_committed.disconnect(listener)
    assert isinstance(kept.outcomes[0], singleton.Kept)
    assert received == [first.created]


# --- concurrency: real threads, each on its own connection --------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["keep", "replace"])
def test_sixteen_threads_committing_one_key_at_once_leave_exactly_one_pending_delivery(mode):
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    threads = 16
    start = threading.Barrier(threads, timeout=BARRIER_TIMEOUT)
    results: list[singleton.SingletonCommit | None] = [None] * threads
    errors: list[BaseException] = []

    def producer(slot: int) -> None:
        try:
            binding = BindingFactory.build(run=run, message_event=event, target_pubkey=target)
            start.wait()
            results[slot] = services.commit_deliveries(
                community.id, event, [binding], singleton_key="burst", on_conflict=mode
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(producer, range(threads)))

    assert not errors, errors[:3]
    pending = rows(community, status="pending")
    assert len(pending) == 1
    (holder,) = pending
    outcomes = [r.outcomes[0] for r in results if r is not None]
    assert len(outcomes) == threads
    if mode == "keep":
        # One commit created it; every other one kept that very delivery.
        assert sum(isinstance(o, singleton.Committed) for o in outcomes) == 1
        assert all(o.delivery_id == holder.id for o in outcomes)
        assert len(rows(community)) == 1
    else:
        # Every commit created its own; each but the first superseded exactly one, each once.
        assert sum(isinstance(o, singleton.Committed) for o in outcomes) == 1
        replaced = [o for o in outcomes if isinstance(o, singleton.Replaced)]
        assert len(replaced) == threads - 1
        assert len({o.superseded_id for o in replaced}) == threads - 1
        expired = rows(community, status="expired")
        assert len(expired) == threads - 1 and {r.failure_code for r in expired} == {"superseded"}
        assert {o.superseded_id for o in replaced} == {r.id for r in expired}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["keep", "replace"])
def test_a_commit_that_meets_an_uncommitted_commit_of_the_key_waits_and_then_keeps_or_replaces_it(mode):
    """The race the snapshot cannot see: the second commit waits on the first one's key (its lock,
    ``singleton.LOCK_KEYS``, taken before any read), and once the first commits decides with a
    snapshot that sees it, in one round."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    target = random32()
    first_written, release = threading.Event(), threading.Event()
    found: dict[str, object] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                binding = BindingFactory.build(run=run, message_event=event, target_pubkey=target)
                found["first"] = services.commit_deliveries(community.id, event, [binding], singleton_key="k")
                first_written.set()
                assert release.wait(30)
        finally:
            connection.close()

    def second() -> None:
        try:
            binding = BindingFactory.build(run=run, message_event=event, target_pubkey=target)
            found["second"] = services.commit_deliveries(
                community.id, event, [binding], singleton_key="k", on_conflict=mode
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        one = pool.submit(first)
        assert first_written.wait(30)
        two = pool.submit(second)
        with pytest.raises(TimeoutError):
            two.result(timeout=1.0)  # waits on the first commit's key
        release.set()
        one.result(30)
        two.result(30)

    (holder,) = found["first"].created
    result = found["second"]
    assert result.rounds == 1
    (outcome,) = result.outcomes
    if mode == "keep":
        assert outcome == singleton.Kept(holder, target)
        assert [r.id for r in rows(community)] == [holder]
    else:
        assert isinstance(outcome, singleton.Replaced) and outcome.superseded_id == holder
        assert [(r.id, r.status) for r in rows(community)] == [(holder, "expired"), (outcome.delivery_id, "pending")]


@pytest.mark.skipif(not CITUS_MODE, reason="Citus mode only: the plan of the commit statements on the cluster")
@pytest.mark.parametrize(
    "statement",
    singleton.REPLACE_STATEMENTS,
    ids=["supersede", "expire_superseded", "held_or_already", "insert_records", "insert_queue_rows", "delete_unqueued"],
)
def test_on_citus_every_step_of_the_commit_runs_on_the_community_node_alone(community, statement):
    """Each statement of a round is one task on the community's node; the records' INSERT takes
    its rows from the client as the plain commit does (pull to the coordinator, then routed by
    community), the queue rows' INSERT ... SELECT is pushed down between colocated tables."""
    params = {
        name: None for name in ("message_event_id", "max_attempts", "expires_at", "execution_trace", "trigger_context")
    }
    params.update(
        community_id=community.id, singleton_key="k", channel="c", priority=0, not_before=None,
        ids=[uuid.uuid4()], workflow_ids=[uuid.uuid4()], run_ids=[uuid.uuid4()], step_ids=["s"],
        target_pubkeys=[random32()], definition_event_ids=[random32()], cause_kinds=["event"],
        cause_event_ids=[random32()], cause_scheduled_fors=[None], cause_webhook_invocation_ids=[None],
        created_ids=[uuid.uuid4()], superseded_ids=[uuid.uuid4()], superseded_bys=[uuid.uuid4()],
        lease_generations=[0], attempts=[0], claimed_bys=["w"], renewals=[0], histories=["[]"],
    )  # fmt: skip
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (COSTS OFF) " + statement, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    counts = re.findall(r"Task Count: (\d+)", plan)
    assert counts and set(counts) == {"1"}, plan
    if statement is not singleton.INSERT_RECORDS:  # (the plain commit's shape: rows from the client)
        assert "buzz_delivery_delivery_" in plan  # the shard's table, read on its node


def _docs_block(heading: str) -> str:
    """The first python block under ``heading`` in docs/flow-control.md."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "flow-control.md").read_text()
    section = text.split(heading + "\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_docs_example_runs():
    exec(compile(_docs_block("## Debounce / singleton"), "docs/flow-control.md", "exec"), {})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("modes", [("replace",), ("keep", "replace")])
def test_producers_of_one_key_over_several_targets_never_deadlock(modes):
    """A round writes a target's key twice (the supersede deletes the holder, the insert adds the
    new one) and a commit's targets span several statements and rounds: without a lock per
    (community, target, key) taken first in one order, two commits over the same targets each
    held a key the other waited for, and PostgreSQL aborted one ("deadlock detected", an error,
    not an outcome). Six producers, each committing 25 times to a random subset of three targets."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    targets = [random32() for _ in range(3)]
    errors: list[BaseException] = []
    start = threading.Barrier(6, timeout=BARRIER_TIMEOUT)

    def producer(seed: int) -> None:
        import random

        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(25):
                mine = rng.sample(targets, rng.randint(1, 3))
                bindings = [BindingFactory.build(run=run, message_event=event, target_pubkey=t) for t in mine]
                services.commit_deliveries(
                    community.id, event, bindings, singleton_key="k", on_conflict=rng.choice(modes)
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(producer, range(6)))

    assert not errors, [str(e).splitlines()[0] for e in errors]
    queued = models.DeliveryQueue.objects.filter(community_id=community.id, singleton_key="k")
    assert sorted(bytes(t) for t in queued.values_list("target_pubkey", flat=True)) == sorted(targets)


@pytest.mark.django_db(transaction=True)
def test_a_replace_locks_its_holders_in_the_order_a_worker_locks_its_leases():
    """The supersede met its holders as its snapshot saw them, in target order. A holder claimed
    since (the claim committed after the statement began) was locked anyway (READ COMMITTED
    re-checks the newest version under its lock, and keeps the lock when the row no longer
    qualifies), and the next holder waited for: so a replace could hold one worker lease's row
    while waiting for another's, and a worker renewing or settling both in delivery id order (the
    batch statements' order) closed the cycle when the targets' order was the other one:
    "deadlock detected" for one of them, an error, not an outcome (CI's adversary run). The
    supersede now locks its holders in delivery id order too."""
    community = CommunityFactory()
    run = WorkflowRunFactory(community=community)
    event = EventFactory(community=community)
    # H1 before H2 in target order, after it in id order (ids grow with time: H2 committed first).
    t1, t2 = sorted([random32(), random32()])
    (h2,) = services.commit_deliveries(
        community.id, event, [BindingFactory.build(run=run, message_event=event, target_pubkey=t2)], singleton_key="k"
    ).created
    (h1,) = services.commit_deliveries(
        community.id, event, [BindingFactory.build(run=run, message_event=event, target_pubkey=t1)], singleton_key="k"
    ).created
    assert h2.int < h1.int
    connection.close()
    errors: list[BaseException] = []
    a_claimed, a_commit, c_holds_h2, c_go = (threading.Event() for _ in range(4))
    found: dict[str, object] = {}

    guarded = collecting(errors)

    @guarded
    def worker_a() -> None:  # claims H1 in its own transaction, open until told to commit
        with transaction.atomic():
            found["a"] = services.claim_deliveries(community.id, t1, limit=1, holder="a")
            a_claimed.set()
            assert a_commit.wait(30)

    @guarded
    def producer() -> None:
        more = [BindingFactory.build(run=run, message_event=event, target_pubkey=t) for t in (t1, t2)]
        found["p"] = services.commit_deliveries(community.id, event, more, singleton_key="k", on_conflict="replace")

    @guarded
    def worker_c() -> None:  # its two leases' rows in delivery id order: H2's, then H1's
        with transaction.atomic(), fleet(), connection.cursor() as cursor:
            renew = f"UPDATE {sql.QUEUE} SET renewals = renewals + 1 WHERE community_id = %s AND id = %s"
            cursor.execute(renew, [community.id, h2])
            c_holds_h2.set()
            assert c_go.wait(30)
            cursor.execute(renew, [community.id, h1])

    with ThreadPoolExecutor(max_workers=3) as pool:
        a = pool.submit(worker_a)
        assert a_claimed.wait(30)
        p = pool.submit(producer)
        lock_waits_reach(1, 1.0)  # (before: the supersede waits for A's claim of H1)
        found["b"] = services.claim_deliveries(community.id, t2, limit=1, holder="b")  # H2 claimed, if it is free
        connection.close()
        c = pool.submit(worker_c)
        c_holds_h2.wait(1.0)  # (after: C waits for the replace, which superseded H2)
        a_commit.set()
        a.result(30)
        lock_waits_reach(1, 1.0)  # (before: the supersede, now holding H1's row, waits for C's H2)
        c_go.set()
        c.result(30)
        p.result(30)

    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert [type(o) for o in found["p"].outcomes] in (
        [singleton.Committed, singleton.Committed],  # B claimed H2 first
        [singleton.Committed, singleton.Replaced],  # the replace superseded H2 first
    )
    queued = models.DeliveryQueue.objects.filter(
        community_id=community.id, singleton_key="k", target_pubkey__in=[t1, t2]
    )
    assert sorted(bytes(t) for t in queued.values_list("target_pubkey", flat=True)) == [t1, t2]


@pytest.mark.django_db(transaction=True)
def test_a_replace_and_a_run_cancel_never_leave_deliveries_of_canceled_runs_pending():
    """A run's end expires its pending deliveries in the caller's transaction, run after run of
    its tree (``expire_deliveries_of_ended_runs``), and each ``expire_run_deliveries`` skips a
    row locked right now and reads again for about two seconds before it gives up. A supersede
    that skipped locked holders too (tried once) skipped the holder the cancel already expired
    (the cancel's transaction still open) and deleted the holders of the cancel's next runs,
    then spun in its rounds while holding them; the cancel spun on each of those in turn. The
    replace's rounds ended first: SingletonContended, its rollback put the holders back, and the
    cancel, which gave up on them, committed with deliveries of canceled runs left pending. The
    supersede waits for a locked holder: the cancel expires the others, or the replace
    supersedes them after."""
    community = CommunityFactory()
    event = EventFactory(community=community)
    old_runs = [WorkflowRunFactory(community=community) for _ in range(4)]
    targets = sorted(random32() for _ in old_runs)
    holders = [
        BindingFactory.build(run=run, message_event=event, target_pubkey=t)
        for run, t in zip(old_runs, targets, strict=True)
    ]
    services.commit_deliveries(community.id, event, holders, singleton_key="k")
    new_run = WorkflowRunFactory(community=community)
    connection.close()
    errors: list[BaseException] = []
    first_expired, go_on = threading.Event(), threading.Event()
    found: dict[str, object] = {}

    def cancel() -> None:  # the tree's runs expired one after the other in one transaction
        try:
            with transaction.atomic():
                services.expire_run_deliveries(community.id, old_runs[0].id)
                first_expired.set()
                assert go_on.wait(30)
                for run in old_runs[1:]:
                    services.expire_run_deliveries(community.id, run.id)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def replace() -> None:
        try:
            more = [BindingFactory.build(run=new_run, message_event=event, target_pubkey=t) for t in targets]
            found["p"] = services.commit_deliveries(community.id, event, more, singleton_key="k", on_conflict="replace")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        c = pool.submit(cancel)
        assert first_expired.wait(30), [str(e).splitlines()[0] for e in errors]
        p = pool.submit(replace)
        time.sleep(0.5)  # the replace's supersede waits for a holder the cancel holds
        go_on.set()
        c.result(60)
        p.result(60)

    left = models.DeliveryRecord.objects.filter(
        community_id=community.id, run_id__in=[r.id for r in old_runs], status="pending"
    )
    assert not left.exists(), (
        f"{left.count()} deliveries of canceled runs left pending",
        [str(e).splitlines()[0] for e in errors],
    )
    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert [type(o) for o in found["p"].outcomes] in (
        [singleton.Committed] * 4,
        [singleton.Committed] + [singleton.Replaced] * 3,
    )

"""The in-process worker's settler settles every outcome in batches (issue 29): failed and retried
results (each with its own text and Retry-After) go in one fenced statement with the finished
ones, each row ending exactly as the one-by-one settle of its twin leaves it."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from buzz_delivery import backoff, services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import sql
from buzz_delivery.testing import frozen_db_clock, random32
from buzz_delivery.worker.handlers import SettleArgs
from buzz_delivery.worker.settler import SettleJob, Settler
from tests.test_settle_batch import CASES, claimed, prepare, row


def settler(counts: dict[str, int]) -> Settler:
    def count(key: str, n: int) -> None:
        counts[key] = counts.get(key, 0) + n

    return Settler(max_batch=100, linger=0, lease_seconds=5, count=count, done=lambda n: None)


@pytest.mark.django_db
def test_a_mixed_batch_settles_in_one_statement_each_row_as_its_one_by_one_twin(
    community, message_event, make_binding, monkeypatch, django_assert_num_queries
):
    """Every case of test_settle_batch twice: one delivery settled by finish_delivery, its twin
    through the settler's batch with all the others (the clock frozen and the jitter fixed, so
    backoff deadlines and history times are exact): the same outcome counted, the same row."""
    monkeypatch.setattr(backoff, "jitter", lambda: 0.75)
    counts: dict[str, int] = {}
    with frozen_db_clock():
        singles, batch = {}, {}
        for name, (max_attempts, before, _) in CASES.items():
            singles[name] = claimed(community, message_event, make_binding, max_attempts=max_attempts)
            batch[name] = claimed(community, message_event, make_binding, max_attempts=max_attempts)
            prepare(singles[name], before)
            prepare(batch[name], before)
        expected = {name: services.finish_delivery(singles[name], **args) for name, (_, _, args) in CASES.items()}
        jobs = [SettleJob(batch[name], SettleArgs(**args)) for name, (_, _, args) in CASES.items()]
        misses = sum(before is not None for _, before, _ in CASES.values())

        with django_assert_num_queries(1 + 2 * misses) as captured:  # the batch; a settle and its read per miss
            settler(counts)._settle_batch(jobs)

        assert services.cached.SETTLE_MANY.function in captured.captured_queries[0]["sql"]  # the mixed statement
        for name in CASES:
            assert row(batch[name].delivery_id) == row(singles[name].delivery_id), name
    outcomes = list(expected.values())
    assert 1 <= counts["settle_statements"] <= 1 + 2 * misses  # its count is rough: a repeated retry is Settled
    assert counts["lease_lost"] == sum(o == services.LeaseLost() for o in outcomes)
    assert counts["retried"] == sum(o == services.Settled("pending") for o in outcomes)
    assert counts["failed"] == sum(getattr(o, "status", None) == "failed" for o in outcomes)
    assert counts["finished"] == sum(getattr(o, "status", None) == "finished" for o in outcomes)


@pytest.mark.django_db
def test_an_all_finished_batch_keeps_the_plan_cached_statement(
    community, message_event, make_binding, django_assert_num_queries
):
    leases = [claimed(community, message_event, make_binding) for _ in range(3)]
    counts: dict[str, int] = {}
    with django_assert_num_queries(1) as captured:
        settler(counts)._settle_batch([SettleJob(x, SettleArgs("finished")) for x in leases])
    assert services.cached.FINISH_MANY.function in captured.captured_queries[0]["sql"]
    assert (counts["finished"], counts["settle_statements"]) == (3, 1)


@pytest.mark.django_db
def test_a_refused_batch_is_replayed_one_by_one_and_one_bad_row_fails_alone(
    community, message_event, make_binding, django_assert_num_queries
):
    """A row the batch refuses (a retry_after no settle takes) costs the batch nothing but a
    replay: the other rows settle one statement each, the bad one is left to lapse."""
    good, bad, retried = (claimed(community, message_event, make_binding) for _ in range(3))
    counts: dict[str, int] = {}
    jobs = [
        SettleJob(good, SettleArgs("failed", "poison", "bad")),
        SettleJob(bad, SettleArgs("retry", None, "x", -1.0)),
        SettleJob(retried, SettleArgs("retry", None, "later", 60.0)),
    ]
    with django_assert_num_queries(2):  # no batch statement ran: refused before any SQL
        settler(counts)._settle_batch(jobs)
    assert [row(x.delivery_id)["status"] for x in (good, bad, retried)] == ["failed", "claimed", "pending"]
    assert (counts["failed"], counts["retried"], counts["settle_errors"]) == (1, 1, 1)


@pytest.mark.django_db
def test_a_send_steps_deliveries_settled_by_the_settler_count_as_one_by_one(community):
    """The workflow fan-in counts each row of the settler's mixed batch in its statement, as it
    counts the one-by-one settles of a twin run."""
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.services import get_run
    from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
    from tests.wf_support import start

    workflow = WorkflowFactory(community=community)

    def run_with_claims():
        run = start(workflow, {"steps": [send_step("send", [random32() for _ in range(3)]),
                                         function_step("after", depends_on=["send"])]})  # fmt: skip
        run_until_idle(community.id)
        rows = WorkflowAgentDelivery.objects.filter(run_id=run.pk).order_by("target_pubkey")
        return run, [
            services.claim_delivery(community.id, bytes(d.target_pubkey), delivery_id=d.id, lease_seconds=30).lease
            for d in rows
        ]

    def step(run):
        s = get_run(community.id, run.pk).step("send")
        return s.state, s.delivered_terminal, s.delivered_failed, s.output

    single, single_leases = run_with_claims()
    batch, batch_leases = run_with_claims()
    plan = [SettleArgs("failed", "poison"), SettleArgs("failed", "gone", "x"), SettleArgs("retry", None, "later")]
    for lease, args in zip(single_leases, plan, strict=True):
        services.finish_delivery(
            lease, args.outcome, failure_code=args.failure_code, failure_message=args.failure_message
        )
    settler({})._settle_batch([SettleJob(lease, args) for lease, args in zip(batch_leases, plan, strict=True)])
    assert step(batch) == step(single)
    assert step(batch)[:3] == ("waiting", 2, 2)


def settling_transactions(ids) -> int:
    """How many transactions last wrote these rows (rows one statement wrote share its xmin): a
    live row's queue row (a retry back to pending writes it alone), else its record."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(DISTINCT COALESCE(q.xmin::text, r.xmin::text)) FROM {sql.RECORD} AS r"
            f" LEFT JOIN {sql.QUEUE} AS q ON q.community_id = r.community_id AND q.id = r.id"
            " WHERE r.community_id = %s AND r.id = ANY(%s)",
            [WorkflowAgentDelivery.objects.get(id=ids[0]).community_id, list(ids)],
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_handler_always_raises_settles_its_failures_and_retries_in_batches(make_binding, start_worker):
    """24 deliveries whose handler raises (a third retried, a third retried after 300 s, a third
    failed for good): they settle in a few statements, each row as a one-by-one settle leaves it."""
    from tests.test_worker import commit, db_now

    target = random32()
    retried = commit(make_binding, target, 8, **{"raise": "ordinary"})
    later = commit(make_binding, target, 8, **{"raise": "retry_after", "seconds": 300})
    failed = commit(make_binding, target, 8, **{"raise": "permanent"})
    started = db_now()
    worker = start_worker(target, "--concurrency", "8", "--max-deliveries", "24", "--lease-seconds", "10")
    assert worker.wait(60) == 0, worker.log()
    ended = db_now()

    rows = {r.id: r for r in WorkflowAgentDelivery.objects.filter(id__in=retried + later + failed)}
    for d in retried + later:
        r = rows[d]
        assert (r.status, r.attempt, r.failure_code, r.failure_message) == ("pending", 1, None, None)
        assert r.lease_until is None
        assert (r.history[-1]["event"], r.history[-1]["status"]) == ("retry", "pending")
        assert r.next_attempt_at > started
    for d in retried:  # the jittered backoff of a first attempt (base 1 s by default)
        assert rows[d].next_attempt_at <= ended + dt_seconds(60)
    for d in later:  # the handler's Retry-After honoured
        assert rows[d].next_attempt_at >= started + dt_seconds(300)
    for d in failed:
        r = rows[d]
        assert (r.status, r.attempt, r.failure_code, r.failure_message) == (
            "failed",
            1,
            "BadPayload",
            "payload cannot be parsed",
        )
        assert (r.history[-1]["event"], r.history[-1]["status"]) == ("settle", "failed")
    summary = worker.summary()
    assert (summary["claimed"], summary["failed"], summary["retried"]) == (24, 8, 16)
    assert "batch refused" not in worker.log()
    # Batched: one by one, each of the 24 rows is last written by a transaction of its own.
    assert settling_transactions(retried + later + failed) <= 12
    assert summary["settle_statements"] <= 12


def dt_seconds(n: float) -> dt.timedelta:
    return dt.timedelta(seconds=n)

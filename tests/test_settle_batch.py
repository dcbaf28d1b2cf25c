"""services.settle_deliveries: a batch whose rows each settle with their own outcome, text and
Retry-After (issue 29), row for row what finish_delivery does."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from buzz_delivery import backoff, services
from buzz_delivery.models import WorkflowAgentDelivery
from buzz_delivery.services import sql
from buzz_delivery.services.types import Settle
from buzz_delivery.testing import Expr, frozen_db_clock, random32, set_delivery_state
from tests.conftest import backdate_lease, without_context

pytestmark = pytest.mark.django_db

# What a settle writes, compared column for column between the twins (history included: its
# entries carry the database clock, frozen here, so they match exactly).
COLUMNS = (
    "status",
    "failure_code",
    "failure_message",
    "next_attempt_at",
    "finished_at",
    "lease_until",
    "claimed_at",
    "attempt",
    "lease_generation",
    "renewals",
    "claimed_by",
    "history",
)


def claimed(community, message_event, make_binding, *, max_attempts=None):
    """One delivery of its own target, committed (with ``max_attempts``) and claimed."""
    target = random32()
    with override_settings(BUZZ_DELIVERY={"MAX_ATTEMPTS": max_attempts}):
        services.commit_deliveries(community.id, message_event, [make_binding(target_pubkey=target)])
    (claim,) = services.claim_deliveries(community.id, target, limit=1, lease_seconds=30)
    return claim.lease


def row(delivery_id) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(COLUMNS)} FROM {sql.DELIVERY_VIEW} WHERE id = %s", [delivery_id])
        return dict(zip(COLUMNS, cursor.fetchone(), strict=True))


# name -> (max_attempts, what happened to the lease before the settle, the settle's arguments)
CASES = {
    "finished": (None, None, {"outcome": "finished"}),
    "failed": (None, None, {"outcome": "failed", "failure_code": "upstream_gone", "failure_message": "gone"}),
    "failed, code only": (None, None, {"outcome": "failed", "failure_code": "bad_input"}),
    "retry": (None, None, {"outcome": "retry", "failure_message": "timeout"}),
    "retry after": (None, None, {"outcome": "retry", "retry_after": 500.0}),
    "retry, attempts left": (3, None, {"outcome": "retry", "failure_message": "flaky"}),
    "retry, max attempts reached": (1, None, {"outcome": "retry", "failure_message": "last"}),
    "stale": (None, "lapsed", {"outcome": "finished"}),
    "stale retry": (None, "lapsed", {"outcome": "retry"}),
    "already terminal": (None, "failed before", {"outcome": "finished"}),
    "retried before": (None, "retried before", {"outcome": "retry", "failure_message": "again"}),
}


def prepare(lease, before: str | None) -> None:
    if before == "lapsed":
        backdate_lease(lease.delivery_id)
    elif before == "failed before":
        assert services.finish_delivery(lease, "failed") == services.Settled("failed")
    elif before == "retried before":
        assert services.finish_delivery(lease, "retry") == services.Settled("pending")


def test_each_row_of_a_mixed_batch_ends_as_finish_delivery_leaves_its_twin(
    community, message_event, make_binding, monkeypatch, django_assert_num_queries
):
    """Every case twice: one delivery settled by finish_delivery, its twin in one batch with all
    the others; the same outcome and the same row, column for column (the clock frozen and the
    jitter fixed, so the backoff's deadline and the history's times are exact)."""
    monkeypatch.setattr(backoff, "jitter", lambda: 0.75)
    with frozen_db_clock():
        singles, batch = {}, {}
        for name, (max_attempts, before, _) in CASES.items():
            singles[name] = claimed(community, message_event, make_binding, max_attempts=max_attempts)
            batch[name] = claimed(community, message_event, make_binding, max_attempts=max_attempts)
            prepare(singles[name], before)
            prepare(batch[name], before)

        expected = {name: services.finish_delivery(singles[name], **args) for name, (_, _, args) in CASES.items()}
        misses = sum(before is not None for _, before, _ in CASES.values())
        with django_assert_num_queries(1 + 2 * misses):  # the batch; finish_delivery and its read per miss
            outcomes = services.settle_deliveries([Settle(batch[name], **args) for name, (_, _, args) in CASES.items()])

        assert dict(zip(CASES, outcomes, strict=True)) == expected
        for name in CASES:
            assert row(batch[name].delivery_id) == row(singles[name].delivery_id), name
    assert expected["retry, max attempts reached"] == services.Settled("failed")
    assert row(batch["retry, max attempts reached"].delivery_id)["failure_code"] == "attempts_exhausted"
    assert expected["stale"] == services.LeaseLost()
    assert expected["already terminal"] == services.AlreadyTerminal("failed")
    assert expected["retried before"] == services.Settled("pending")
    assert row(batch["stale"].delivery_id)["status"] == "claimed"


def test_a_mixed_batch_settles_in_one_statement_a_stale_row_refused_while_the_others_settle(
    community, message_event, make_binding, django_assert_num_queries
):
    done, failed, retried, stale = (claimed(community, message_event, make_binding) for _ in range(4))
    backdate_lease(stale.delivery_id)
    settles = [
        Settle(done, "finished"),
        Settle(stale, "failed", failure_code="x"),
        Settle(failed, "failed", failure_code="poison", failure_message="bad"),
        Settle(retried, "retry", failure_message="later", retry_after=60),
    ]

    with django_assert_num_queries(3) as captured:
        outcomes = services.settle_deliveries(settles)

    statements = [without_context(q["sql"]) for q in captured.captured_queries]
    assert services.cached.SETTLE_MANY.function + "(" in statements[0]  # the mixed statement, once
    assert outcomes == [
        services.Settled("finished"),
        services.LeaseLost(),
        services.Settled("failed"),
        services.Settled("pending"),
    ]
    assert [row(x.delivery_id)["status"] for x in (done, stale, failed, retried)] == [
        "finished",
        "claimed",
        "failed",
        "pending",
    ]
    assert row(failed.delivery_id)["failure_code"] == "poison"
    assert row(retried.delivery_id)["failure_message"] is None  # a retry with attempts left keeps no text


def test_one_outcome_and_one_text_for_every_row_goes_through_the_plan_cached_batch(
    community, message_event, make_binding, django_assert_num_queries
):
    leases = [claimed(community, message_event, make_binding) for _ in range(3)]
    with django_assert_num_queries(1) as captured:
        outcomes = services.settle_deliveries([Settle(x, "failed", failure_code="c") for x in leases])
    assert services.cached.FINISH_MANY.function in captured.captured_queries[0]["sql"]
    assert outcomes == [services.Settled("failed")] * 3


def test_bad_rows_are_refused_naming_the_row_and_field_before_any_sql(
    community, message_event, make_binding, table_snapshot, django_assert_num_queries
):
    a, b = (claimed(community, message_event, make_binding) for _ in range(2))
    other_community = dataclasses.replace(b, community_id=uuid.uuid4())
    before = table_snapshot()
    cases = {
        "settles": [],
        "settles[1]": [Settle(a, "finished"), "not a settle"],
        "settles[1].lease": [Settle(a, "finished"), Settle("not a lease", "finished")],  # type: ignore[arg-type]
        "settles[1].lease.delivery_id": [Settle(a, "finished"), Settle(a, "failed")],
        "settles[1].lease.community_id": [Settle(a, "finished"), Settle(other_community, "finished")],
        "settles[1].outcome": [Settle(a, "finished"), Settle(b, "done")],
        "settles[1].failure_code": [Settle(a, "retry"), Settle(b, "retry", failure_code="x")],
        "settles[0].failure_message": [Settle(a, "finished", failure_message="x"), Settle(b, "retry")],
        "settles[1].retry_after": [Settle(a, "retry"), Settle(b, "failed", retry_after=5)],
        "settles[0].retry_after": [Settle(a, "retry", retry_after=-1), Settle(b, "retry")],
        "settles[1].failure_message": [Settle(a, "retry"), Settle(b, "failed", failure_message="\x00")],
    }
    for key, settles in cases.items():
        with pytest.raises(ValidationError) as caught, django_assert_num_queries(0):
            services.settle_deliveries(settles)
        assert key in caught.value.message_dict, (key, caught.value.message_dict)
    assert table_snapshot() == before


def test_a_mixed_batch_advances_a_send_step_as_the_same_settles_one_by_one(community):
    """The workflow's fan-in (a row trigger on each terminal move) counts each row of a mixed
    batch once, as it counts the one-by-one settles of a twin run: a retry with attempts left
    is not terminal, its later settle is."""
    from buzz_delivery.testing import WorkflowFactory
    from buzz_delivery.workflows.services import get_run
    from buzz_delivery.workflows.testing import function_step, run_until_idle, send_step
    from tests.wf_support import run_state, start

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
    plan = [("finished", {}), ("failed", {"failure_code": "poison"}), ("retry", {"failure_message": "later"})]
    for lease, (outcome, texts) in zip(single_leases, plan, strict=True):
        services.finish_delivery(lease, outcome, **texts)
    services.settle_deliveries(
        [Settle(lease, outcome, **texts) for lease, (outcome, texts) in zip(batch_leases, plan, strict=True)]
    )
    assert step(batch) == step(single)
    assert step(batch)[:3] == ("waiting", 2, 1)
    for run, leases in ((single, single_leases), (batch, batch_leases)):
        retried = leases[2]
        # its backoff over at once
        set_delivery_state((community.id, retried.delivery_id), next_attempt_at=Expr("now()"))
        again = services.claim_delivery(community.id, retried.target_pubkey, lease_seconds=30).lease
        if run is single:
            services.finish_delivery(again, "finished")
        else:
            services.settle_deliveries([Settle(again, "finished")])
    assert step(batch) == step(single)
    assert step(batch)[:3] == ("failed", 3, 1)  # a send step with a failed delivery fails
    run_until_idle(community.id)
    assert run_state(batch) == run_state(single)

"""The join's last two dependencies completing at once, in two transactions on two connections
(migration 0024: the counting UPDATE readies the join): exactly one of them readies it, with
one NOTIFY, never none and never twice; a cancel racing a completion leaves nothing ready."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection, transaction

from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.services import cancel_run, claim_steps, complete_step, fail_step
from buzz_delivery.workflows.testing import diamond, function_step
from tests.citus_support import CITUS_MODE
from tests.conftest import BARRIER_TIMEOUT
from tests.wf_support import start

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        CITUS_MODE,
        reason="Citus mode: the race needs the second transaction seen waiting on the first's row lock, which "
        "on the cluster is taken on the worker and not shown by the coordinator's pg_stat_activity; the "
        "Advance's statements run on the cluster in test_wf_advance_release",
    ),
]


@pytest.fixture
def workflow(community):
    return WorkflowFactory(community=community)


def claim_ready(community_id) -> dict:
    return {c.step.key: c for c in claim_steps(community_id, limit=100, lease_seconds=30)}


def lock_waiters(pids: list[int]) -> int:
    """Of ``pids``, the backends waiting on a lock in a statement. The backend-status snapshot
    is cleared first: inside a transaction PostgreSQL reads ``pg_stat_activity`` once and keeps
    it, so a caller polling in its open transaction would never see a wait that began after its
    first look (CI saw "the second never waited on the first")."""
    waiting = "wait_event_type = 'Lock'"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            f"SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND state = 'active' AND {waiting}", [pids]
        )
        return int(cursor.fetchone()[0])


def race(first, second) -> list[BaseException]:
    """``first`` runs in a transaction held open until ``second`` (another connection) waits on
    one of its locks; then both commit. Returns what either raised."""
    errors: list[BaseException] = []
    pids: list[int] = []
    started = threading.Event()

    def run_first() -> None:
        try:
            with transaction.atomic():
                first()
                started.set()
                deadline = time.monotonic() + BARRIER_TIMEOUT
                while not (len(pids) == 1 and lock_waiters(pids) == 1):
                    assert time.monotonic() < deadline, "the second never waited on the first"
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
            started.set()
        finally:
            connection.close()

    def run_second() -> None:
        try:
            assert started.wait(BARRIER_TIMEOUT)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pids.append(cursor.fetchone()[0])
            with transaction.atomic():
                second()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run_first), threading.Thread(target=run_second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BARRIER_TIMEOUT)
    return errors


def listen() -> psycopg.Connection:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    conn = psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "host", "port", "password")})
    conn.autocommit = True
    conn.execute("LISTEN buzz_workflows")
    return conn


def notifies(conn: psycopg.Connection, community_id) -> int:
    return sum(1 for n in conn.notifies(timeout=0.5) if n.payload == str(community_id))


@pytest.mark.parametrize("second_fails", [False, True])
def test_two_last_dependencies_completing_at_once_decide_the_join_once(workflow, second_fails):
    run = start(workflow, diamond())
    complete_step(claim_ready(workflow.community_id)["step1"].lease, None)
    branches = claim_ready(workflow.community_id)
    if second_fails:
        run.refresh_from_db()
    listener = listen()
    try:
        if second_fails:
            # step3 skips its dependents: the join is decided by release (skipped), once.
            Step.objects.filter(pk=branches["step3"].lease.step_id).update(on_error="skip_dependents")

            def second() -> None:
                fail_step(branches["step3"].lease, "boom", retryable=False)
        else:

            def second() -> None:
                complete_step(branches["step3"].lease, None)

        errors = race(lambda: complete_step(branches["step2"].lease, None), second)
        assert errors == []
        join = Step.objects.get(run_id=run.pk, key="step4")
        assert join.deps_done == join.deps_total == 2
        if second_fails:
            assert (join.state, join.skip_reason) == ("skipped", "dependency_not_succeeded")
            assert Run.objects.get(pk=run.pk).state == "succeeded"
            assert notifies(listener, workflow.community_id) == 0
        else:
            assert join.state == "ready" and join.ready_at is not None
            assert notifies(listener, workflow.community_id) == 1
            assert list(claim_ready(workflow.community_id)) == ["step4"]
    finally:
        listener.close()


@pytest.mark.parametrize("cancel_first", [True, False])
def test_a_cancel_racing_the_last_completion_leaves_nothing_ready(workflow, cancel_first):
    run = start(workflow, {"steps": [function_step("a"), function_step("b", depends_on=["a"])]})
    a = claim_ready(workflow.community_id)["a"]
    results: list = []

    def cancel() -> None:
        results.append(cancel_run(workflow.community_id, run.pk))

    def complete() -> None:
        results.append(complete_step(a.lease, None))

    errors = race(cancel, complete) if cancel_first else race(complete, cancel)
    assert errors == []
    assert Run.objects.get(pk=run.pk).state == "canceled"
    found = {s.key: s.state for s in Step.objects.filter(run_id=run.pk)}
    assert found["b"] == "canceled"
    assert found["a"] == ("canceled" if cancel_first else "succeeded")
    assert claim_ready(workflow.community_id) == {}


@pytest.mark.parametrize("cancel_first", [True, False])
@pytest.mark.parametrize("outcome", ["complete", "fail"])
def test_a_cancel_racing_the_runs_last_step_counts_every_step_once(workflow, cancel_first, outcome):
    """The run's last open step is counted in the UPDATE that ends the run (migration 0027:
    ``buzz_workflows_end_run``'s ``counted``): racing a cancel, in either order, every step is
    counted exactly once (``steps_left`` 0), and the run ends as the first to commit decided."""
    run = start(workflow, {"steps": [function_step("a"), function_step("b", on_error="fail_run")]})
    claims = claim_ready(workflow.community_id)
    complete_step(claims["a"].lease, None)  # b is the run's last open step
    b = claims["b"]
    results: list = []

    def cancel() -> None:
        results.append(cancel_run(workflow.community_id, run.pk))

    def end() -> None:
        if outcome == "complete":
            results.append(complete_step(b.lease, None))
        else:
            results.append(fail_step(b.lease, "boom", retryable=False))

    errors = race(cancel, end) if cancel_first else race(end, cancel)
    assert errors == []
    row = Run.objects.get(pk=run.pk)
    expected = "canceled" if cancel_first else ("succeeded" if outcome == "complete" else "failed")
    assert (row.state, row.steps_left) == (expected, 0)
    assert all(s.state in ("succeeded", "failed", "canceled") for s in Step.objects.filter(run_id=run.pk))

"""Fairness between communities (issue 32), as real processes: a worker serving several
communities (a delivery worker with pairs of two communities, ``run_workflow_worker --all``,
``run_agent_worker --async`` with two ``--community``) never lets one community's backlog delay
another's single item by more than one claim batch.

Community A gets a backlog (100,000 pending deliveries; 20,000 ready workflow steps, two maps
of 10,000 items, a map's most; 100,000 pending agent runs), inserted in one statement each by
copying a row made the proper way (``generate_series``; the steps by running the maps); the
worker starts draining it; then community B commits one item. The test reads, on the database
clock, how many of A's items were first claimed after B's item could be seen (read after its
commit returned: its ``created_at`` is its transaction's start, and A's claims before the commit,
two-phase on a cluster, could not take it) and before it was claimed: never more than one claim round
(``--batch-size`` steps, ``--in-flight`` runs; for deliveries the round under way, whose room is
the free handler threads and at most one batch claimed ahead of them), while A's claims go on
after B's. The poll interval is 30 s, so B's item cannot have been found by the periodic
poll: the claim rounds go round the communities. The workers' output goes to files (a pipe
nobody reads stalls a worker once it is full).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from django.db import connection
from django.test import override_settings

from buzz_delivery.testing import CommunityFactory, DeliveryFactory, WorkflowFactory, insert_delivery_rows, random32
from buzz_delivery.workflows import executor
from buzz_delivery.workflows.models import Step
from buzz_delivery.workflows.services import claim_steps
from buzz_delivery.workflows.testing import function_step
from tests.test_worker import commit, wait_until
from tests.test_worker_pairs import other_community_binding
from tests.wf_support import start
from tests.worker_support import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)

DELIVERY = "buzz_delivery_delivery_record"
BACKLOG = 100_000
BATCH = 50
CONCURRENCY = 8
# The time of a delivery's first claim, from its history: ``claimed_at`` is cleared when the
# delivery is settled, and the handler here settles at once.
FIRST_CLAIM = (
    "(SELECT (e->>'at')::timestamptz FROM jsonb_array_elements(history) AS e WHERE e->>'event' = 'claim' LIMIT 1)"
)


def _bulk_copy(seed: uuid.UUID, community_id: uuid.UUID, n: int) -> None:
    """``n`` copies of delivery ``seed`` (pending, oldest first), in one statement."""
    insert_delivery_rows(
        ["id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id",
         "message_event_id", "cause_kind", "cause_webhook_invocation_id", "created_at"],
        f"""SELECT gen_random_uuid(), community_id, workflow_id, run_id, 'bulk-' || g, target_pubkey,
                   definition_event_id, message_event_id, cause_kind, gen_random_uuid(),
                   now() - make_interval(secs => (%s - g) / 1000.0)
            FROM {DELIVERY}, generate_series(1, %s) AS g WHERE community_id = %s AND id = %s""",
        [n, n, community_id, seed],
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {DELIVERY}")


def _one(sql: str, params: list) -> object:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def test_a_backlog_of_100000_does_not_delay_another_communitys_delivery_by_more_than_one_batch(
    community, make_binding, start_worker
):
    busy_target = random32()
    (seed,) = commit(make_binding, busy_target)
    _bulk_copy(seed, community.id, BACKLOG - 1)
    other, make_other = other_community_binding()
    other_target = random32()

    worker = start_worker(
        busy_target,
        *("--pair", f"{other.id}:{other_target.hex()}"),
        *("--concurrency", str(CONCURRENCY), "--batch-size", str(BATCH)),
        *("--poll-interval", "30", "--lease-seconds", "30"),
        handler="tests.worker_handlers:finish",
    )
    claimed_a = f"SELECT count(*) FROM {DELIVERY} WHERE community_id = %s AND status <> 'pending'"
    wait_until(lambda: _one(claimed_a, [community.id]) >= 2000, timeout=40, what="A's backlog draining")

    (single,) = [DeliveryFactory(binding=make_other(target_pubkey=other_target)).id]
    # From when B could be seen (read after its commit returned): ``created_at`` is its
    # transaction's start, and the claims before its commit could not have taken it.
    created = _one("SELECT clock_timestamp()", [])
    # When each delivery was first claimed, from its history (a settle clears ``claimed_at``).
    claimed_b = f"SELECT {FIRST_CLAIM} FROM {DELIVERY} WHERE community_id = %s AND id = %s AND status <> 'pending'"
    wait_until(lambda: _one(f"SELECT count(*) FROM ({claimed_b}) AS b", [other.id, single]) == 1, what="B's claim")
    b_claimed_at = _one(claimed_b, [other.id, single])
    assert b_claimed_at is not None
    claimed_after = f"SELECT count(*) FROM {DELIVERY} WHERE community_id = %s AND {FIRST_CLAIM} > %s"
    # A was still being drained: the bound below is not met by a worker that stopped claiming.
    wait_until(lambda: _one(claimed_after, [community.id, b_claimed_at]) >= BATCH, what="A's claims after B's")
    worker.proc.terminate()
    assert worker.wait(60) == 0, worker.log()

    in_between = _one(
        f"SELECT count(*) FROM {DELIVERY} WHERE community_id = %s AND {FIRST_CLAIM} > %s AND {FIRST_CLAIM} < %s",
        [community.id, created, b_claimed_at],
    )
    remaining = _one(f"SELECT count(*) FROM {DELIVERY} WHERE community_id = %s AND status = 'pending'", [community.id])
    assert remaining > BACKLOG / 2  # B was claimed while A's backlog was still there
    # The round under way when B became visible: at most its room, the free handler threads and
    # at most one batch claimed ahead of them (the worker's claim-ahead); then B's hint goes first.
    assert in_between <= BATCH + CONCURRENCY, f"{in_between} of A's deliveries were claimed while B's waited"


STEP = Step._meta.db_table
MAP_RUNS, MAP_ITEMS = 2, 10_000  # 20,000 ready steps
STEP_BATCH = 32


class Process:
    """A ``manage.py`` command as a real process, its output to files (a pipe nobody reads
    would fill up and stall the process's logging)."""

    def __init__(self, tmp_path, *args: str) -> None:
        env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "PYTHONPATH": str(ROOT)}
        self.out, self.err = tmp_path / f"{args[0]}.out", tmp_path / f"{args[0]}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "manage.py", *args], cwd=ROOT, env=env, stdout=out, stderr=err
            )

    def stop(self) -> int:
        """SIGTERM, and its exit code (it drains what it holds first)."""
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.err.read_text()[-3000:]


def test_run_workflow_worker_all_serves_another_community_within_one_batch_of_a_backlog_of_20000(community, tmp_path):
    mapping = {
        "steps": [
            {
                "key": "each",
                "kind": "map",
                "over": {"$ref": "input.items"},
                "do": {"kind": "function", "function": "echo", "input": {"x": {"$ref": "item"}}},
            }
        ]
    }
    workflow = WorkflowFactory(community=community)
    with override_settings(BUZZ_WORKFLOWS={"MAX_MAP_ITEMS": MAP_ITEMS}):
        for _ in range(MAP_RUNS):
            start(workflow, mapping, {"items": list(range(MAP_ITEMS))})
        for claim in claim_steps(community.id, limit=MAP_RUNS):
            executor.execute(claim)  # the map step: its items become ready steps
    ready = f"SELECT count(*) FROM {STEP} WHERE community_id = %s AND state = 'ready'"
    assert _one(ready, [community.id]) == MAP_RUNS * MAP_ITEMS
    other = CommunityFactory()
    other_workflow = WorkflowFactory(community=other)

    options = ("--all", "--concurrency", "4", "--batch-size", str(STEP_BATCH), "--poll-interval", "30")
    worker = Process(tmp_path, "run_workflow_worker", *options, "--lease-seconds", "30")
    try:
        done_a = f"SELECT count(*) FROM {STEP} WHERE community_id = %s AND started_at IS NOT NULL"
        wait_until(lambda: _one(done_a, [community.id]) >= 1000, timeout=40, what="A's backlog draining")

        run = start(other_workflow, {"steps": [function_step("one", "echo")]})
        visible = _one("SELECT clock_timestamp()", [])  # as for the runs below: after the commit returned
        claimed_b = f"SELECT started_at FROM {STEP} WHERE community_id = %s AND run_id = %s AND started_at IS NOT NULL"
        wait_until(lambda: _one(f"SELECT count(*) FROM ({claimed_b}) AS b", [other.id, run.pk]) == 1, what="B's claim")
        b_claimed_at = _one(claimed_b, [other.id, run.pk])
        claimed_after = f"SELECT count(*) FROM {STEP} WHERE community_id = %s AND started_at > %s"
        wait_until(lambda: _one(claimed_after, [community.id, b_claimed_at]) >= STEP_BATCH, what="A's claims after B's")
    finally:
        code = worker.stop()
    assert code == 0, worker.log()

    in_between = _one(
        f"SELECT count(*) FROM {STEP} WHERE community_id = %s AND started_at > %s AND started_at < %s",
        [community.id, visible, b_claimed_at],
    )
    assert _one(ready, [community.id]) > MAP_RUNS * MAP_ITEMS / 2  # B was claimed amid A's backlog
    assert in_between <= STEP_BATCH, f"{in_between} of A's steps were claimed while B's waited"


RUN_TABLE = "buzz_agents_run"
RUN_BACKLOG = 100_000
IN_FLIGHT = 50


def _copy_runs(seed: uuid.UUID, community_id: uuid.UUID, n: int) -> None:
    """``n`` copies of the pending agent run ``seed`` (oldest first), in one statement."""
    from buzz_delivery.agents.models import AgentRun

    columns = [f.column for f in AgentRun._meta.concrete_fields if f.column not in ("id", "created_at")]
    listed = ", ".join(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO {RUN_TABLE} (id, created_at, {listed})
                SELECT gen_random_uuid(), now() - make_interval(secs => (%s - g) / 1000.0), {listed}
                FROM {RUN_TABLE}, generate_series(1, %s) AS g WHERE community_id = %s AND id = %s""",
            [n, n, community_id, seed],
        )
        cursor.execute(f"ANALYZE {RUN_TABLE}")


def _claims_between(community_id: uuid.UUID, after: object, before: object) -> int:
    """Runs of ``community_id`` with a claim recorded in their history between the two times."""
    return _one(
        f"""SELECT count(*) FROM {RUN_TABLE} AS r WHERE r.community_id = %s AND EXISTS (
                SELECT 1 FROM jsonb_array_elements(r.history) AS e
                WHERE e->>'event' = 'claim' AND (e->>'at')::timestamptz > %s AND (e->>'at')::timestamptz < %s)""",
        [community_id, after, before],
    )


def test_the_event_loop_agent_worker_serves_another_community_within_one_batch_of_a_backlog_of_100000(
    community, tmp_path
):
    from tests.agents_support import AGENT, new_run

    _copy_runs(new_run(community.id), community.id, RUN_BACKLOG - 1)
    other = CommunityFactory()
    worker = Process(
        tmp_path,
        "run_agent_worker", "--async", "--no-accept",
        "--handler", "tests.agent_async_handlers:quick", "--agent", AGENT.hex(),
        "--community", str(community.id), "--community", str(other.id),
        "--in-flight", str(IN_FLIGHT), "--connections", "2", "--poll-seconds", "30", "--lease-seconds", "30",
    )  # fmt: skip
    try:
        drained = f"SELECT count(*) FROM {RUN_TABLE} WHERE community_id = %s AND state <> 'pending'"
        wait_until(lambda: _one(drained, [community.id]) >= 1000, timeout=40, what="A's backlog draining")

        single = new_run(other.id)
        # A's claims are counted from when B could be seen (read after its commit returned), as
        # for the deliveries: ``created_at`` is its transaction's start, and on a cluster the
        # claims of A between that start and the commit (two-phase, under load) could not take it.
        visible = _one("SELECT clock_timestamp()", [])
        created = _one(f"SELECT created_at FROM {RUN_TABLE} WHERE community_id = %s AND id = %s", [other.id, single])
        far = "infinity"
        wait_until(lambda: _claims_between(other.id, created, far) == 1, what="B's claim")
        b_claimed_at = _one(
            f"""SELECT max((e->>'at')::timestamptz) FROM {RUN_TABLE} AS r, jsonb_array_elements(r.history) AS e
                WHERE r.community_id = %s AND r.id = %s AND e->>'event' = 'claim'""",
            [other.id, single],
        )
        # A was still being drained: the bound below is not met by a worker that stopped claiming.
        wait_until(lambda: _claims_between(community.id, b_claimed_at, far) >= IN_FLIGHT, what="A's claims after B's")
    finally:
        code = worker.stop()
    assert code == 0, worker.log()

    in_between = _claims_between(community.id, visible, b_claimed_at)
    assert _one(f"SELECT count(*) FROM {RUN_TABLE} WHERE community_id = %s AND state = 'pending'", [community.id]) > (
        RUN_BACKLOG / 2
    )
    assert in_between <= IN_FLIGHT, f"{in_between} of A's runs were claimed while B's waited"

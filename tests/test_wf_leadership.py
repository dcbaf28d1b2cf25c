"""One leader per community among its orchestrators (issue 31): the ``run_workflow_worker``
process holding the community's advisory lock claims on every wake and chains claims into its
completions; the others claim only ready steps left waiting (``FOLLOW_AFTER``), chain nothing,
and one of them leads once the leader is gone (SIGKILL included): its steps come back after
their lease. Steps that keep the leader's threads busy (here: sleeping) still spread over the
followers. Real processes, real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import psycopg
import pytest
from django.db import connection

from buzz_delivery.services import Cause, advance_community
from buzz_delivery.testing import WorkflowFactory
from buzz_delivery.workflows.models import Run, Step
from buzz_delivery.workflows.orchestrator import LEADER_LOCK_NAMESPACE
from buzz_delivery.workflows.services import publish_definition, start_run
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from buzz_delivery.workflows.services.steps import steps_left_waiting
from buzz_delivery.workflows.testing import diamond, function_step
from project.database_url import database_url
from tests.test_wf_concurrency import ROOT, env
from tests.worker_support import wait_for_poll_since_listening

pytestmark = pytest.mark.django_db(transaction=True)

POLL = 0.5
SLACK = 3.0  # scheduling on a loaded 2-core machine
FOLLOW_SLACK = 3.0  # a follower tries the lock once a poll interval: this much more on a loaded machine
START = 60.0  # bound of what waits for the processes' start (Django's import: seconds each on a loaded machine)


def orchestrator(community, log, *, concurrency: int = 2, lease: float = 30, poll: float = POLL) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "tests.wf_poison_worker", "--community", str(community.id),
        "--concurrency", str(concurrency), "--poll-interval", str(poll), "--lease-seconds", str(lease), "-v", "0",
    ]  # fmt: skip
    environ = {**env(), "BUZZ_TEST_LIVENESS_LOG": str(log)}
    return subprocess.Popen(args, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def leader_pid(community) -> int | None:
    """The process whose lock connection holds the community's leadership (its
    ``application_name`` names the process)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objsubid = 2"
            " AND l.objid = (hashtext(%s::text)::bigint & 4294967295)",
            [LEADER_LOCK_NAMESPACE, str(community.id)],
        )
        rows = cursor.fetchall()
    assert len(rows) <= 1, rows
    return int(rows[0][0].rsplit(":", 1)[1]) if rows else None


def wait_leader(community, among: set[int], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (pid := leader_pid(community)) not in among:
        assert time.monotonic() < deadline, f"no leader among {among} within {timeout} s (lock held by {pid})"
        time.sleep(0.05)
    assert pid is not None
    return pid


# The opening columns of the orchestrator's claim of ready steps (after the tenant's set_config when
# tenant isolation is on), within the 1 kB of text pg_stat_activity keeps.
STEP_CLAIM_OPENING = "SELECT d.o_community_id, d.o_id, d.o_run_id, "


def listening() -> int:
    """Backends of this database that LISTEN on ``buzz_workflows`` (an orchestrator's listener
    connection: its LISTEN is the last statement it sent; a paused listener has closed it)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query = 'LISTEN \"buzz_workflows\"' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def tried_the_lock(pid: int) -> bool:
    """Whether process ``pid``'s lock connection has asked for the leadership."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
            [f"buzz-workflows-lead:{pid}", "%pg_try_advisory_lock%"],
        )
        return cursor.fetchone()[0] > 0


def start_runs(workflow, n: int, input: dict | None = None) -> list:
    return [
        start_run(workflow.community_id, workflow.id, input or {}, cause=Cause.event(os.urandom(32))).pk
        for _ in range(n)
    ]


def wait_done(community, ids: list, timeout: float = 90, reap: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while Run.objects.filter(community_id=community.id, run_id__in=ids, state="succeeded").count() < len(ids):
        assert time.monotonic() < deadline, f"runs not done within {timeout} s"
        if reap:
            reap_workflow_steps()  # lapsed leases back to ready (the cron's job)
        time.sleep(0.1)


def ran_by(log) -> Counter:
    return Counter(json.loads(line)["pid"] for line in log.read_text().splitlines())


def test_one_orchestrator_of_a_community_leads_and_chains_the_other_chains_nothing(community, tmp_path):
    """Fails on main: both orchestrators claimed on every wake and chained claims into their
    own completions (two short pipelines); now only the leader chains."""
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond("liveness.record"))
    log = tmp_path / "started.jsonl"
    procs = [orchestrator(community, log) for _ in range(2)]
    try:
        leader = wait_leader(community, {p.pid for p in procs}, timeout=START)
        ids = []
        for _ in range(3):
            batch = start_runs(workflow, 20)
            wait_done(community, batch)
            ids += batch
        assert leader_pid(community) == leader
    finally:
        summaries = {p.pid: summary(p) for p in procs}

    (follower,) = set(summaries) - {leader}
    assert summaries[leader]["chained"] > 0
    assert summaries[follower]["chained"] == 0, summaries[follower]
    assert summaries[leader]["led"] == 1  # (the follower may lead once the leader stops first)
    assert summaries[follower]["claimed"] < summaries[leader]["claimed"], summaries
    assert sum(s["succeeded"] for s in summaries.values()) == 4 * len(ids)
    assert sum(s["errors"] for s in summaries.values()) == 0


def test_a_follower_leads_once_the_leader_is_killed_and_the_leaders_steps_come_back(community, tmp_path):
    workflow = WorkflowFactory(community=community)
    slow = function_step("s", "liveness.record", input={"sleep": {"$ref": "input.sleep"}})
    publish_definition(
        community.id, workflow.id, {"steps": [slow, function_step("t", "liveness.record", depends_on=["s"])]}
    )
    log = tmp_path / "started.jsonl"
    procs = {p.pid: p for p in (orchestrator(community, log, lease=2) for _ in range(2))}
    try:
        leader = wait_leader(community, set(procs), timeout=START)
        (other,) = set(procs) - {leader}
        first = start_runs(workflow, 4, {"sleep": 3})  # still running on the leader when it dies
        held = Step.objects.filter(community_id=community.id, run_id__in=first, state="running")
        deadline = time.monotonic() + START
        while not held.filter(claimed_by__contains=f":{leader}:").exists():
            assert time.monotonic() < deadline, "the leader never took a step"
            time.sleep(0.05)
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(10)
        killed_at = time.monotonic()
        assert wait_leader(community, {other}, timeout=POLL + FOLLOW_SLACK) == other
        took_over = time.monotonic() - killed_at
        later = start_runs(workflow, 10, {"sleep": 0})
        wait_done(community, first + later, reap=True)
        assert held.count() == 0
    finally:
        survivor = summary(procs[other])

    assert took_over <= POLL + FOLLOW_SLACK
    assert survivor["chained"] > 0  # it leads: its completions claim the successors
    assert survivor["errors"] == 0
    # The killed leader's steps ran again elsewhere, after their lease (reaped, then claimed).
    claims = [
        [e["actor"] for e in step.history if e["event"] == "claim"]
        for step in Step.objects.filter(community_id=community.id, run_id__in=first, key="s")
    ]
    taken_back = [actors for actors in claims if any(f":{leader}:" in a for a in actors)]
    assert taken_back, claims
    assert all(f":{other}:" in actors[-1] for actors in taken_back), claims


def test_a_follower_of_a_live_leader_does_not_listen_and_listens_again_once_it_leads(community, tmp_path):
    """Fails on main: every orchestrator LISTENed, and PostgreSQL runs a transaction in every
    listening backend of the database for every notifying commit. Now only the leader does;
    the follower polls, and once the leader is killed it leads and LISTENs again: each run
    started then is claimed on its NOTIFY, well before the next poll (poll interval 20 s: a run
    done within half of it, a bound generous for a loaded CI, was not claimed by a poll)."""
    poll = 20.0
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [function_step("s", "liveness.record")]})
    log = tmp_path / "started.jsonl"
    procs = {p.pid: p for p in (orchestrator(community, log, poll=poll) for _ in range(2))}
    try:
        leader = wait_leader(community, set(procs), timeout=START)
        (other,) = set(procs) - {leader}
        deadline = time.monotonic() + START
        while not tried_the_lock(other):  # (a process still starting has no listener yet either)
            assert time.monotonic() < deadline, "the follower never tried the lock"
            time.sleep(0.05)
        time.sleep(1.0)  # a listener that connected before it closes within 0.5 s
        deadline = time.monotonic() + SLACK
        while listening() != 1:  # the follower stopped listening at its first try of the lock
            assert time.monotonic() < deadline, f"{listening()} listening backends, not 1"
            time.sleep(0.05)
        ids = start_runs(workflow, 5)  # the leader hears them
        wait_done(community, ids, timeout=poll)
        assert listening() == 1
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(10)
        assert wait_leader(community, {other}, timeout=poll + FOLLOW_SLACK) == other
        deadline = time.monotonic() + SLACK
        while listening() != 1:  # its listener LISTENs again
            assert time.monotonic() < deadline, "the new leader does not listen"
            time.sleep(0.05)
        # The claim after it LISTENed is behind: what follows comes by NOTIFY (or a poll 20 s on).
        wait_for_poll_since_listening(STEP_CLAIM_OPENING)
        for _ in range(3):
            started = time.monotonic()
            later = start_runs(workflow, 1)
            wait_done(community, later, timeout=poll)
            assert time.monotonic() - started < poll / 2, "a poll, not the NOTIFY, woke the new leader"
            ids += later
    finally:
        if procs[leader].poll() is None:  # the test failed before the kill
            procs[leader].kill()
            procs[leader].wait(10)
        survivor = summary(procs[other])
    assert survivor["unlistened"] == 1, survivor  # it followed once, then led
    assert survivor["led"] == 1 and survivor["errors"] == 0


def test_steps_that_keep_the_leader_busy_spread_over_the_followers(community, tmp_path):
    """I/O-bound steps (sleeping) fill the leader's two threads: the ready steps it leaves
    waiting go to the follower, which runs a fair part of them."""
    workflow = WorkflowFactory(community=community)
    publish_definition(
        community.id, workflow.id, {"steps": [function_step("s", "liveness.record", input={"sleep": 0.4})]}
    )
    log = tmp_path / "started.jsonl"
    procs = [orchestrator(community, log) for _ in range(2)]
    try:
        leader = wait_leader(community, {p.pid for p in procs}, timeout=START)
        ids = start_runs(workflow, 24)
        wait_done(community, ids)
    finally:
        summaries = {p.pid: summary(p) for p in procs}
    (follower,) = set(summaries) - {leader}
    ran = ran_by(log)
    assert sum(ran.values()) == 24
    assert ran[follower] >= 6, f"the follower ran {ran[follower]} of 24 steps: {dict(ran)}"
    assert summaries[follower]["chained"] == 0


def test_with_no_leader_the_followers_still_run_every_step(community, tmp_path):
    """Leadership is a hint: with the lock held elsewhere (no orchestrator can lead), every
    orchestrator follows, and claims what is left waiting."""
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, diamond("liveness.record"))
    log = tmp_path / "started.jsonl"
    holder = psycopg.connect(database_url(connection.settings_dict), autocommit=True)
    try:
        holder.execute("SELECT pg_advisory_lock(%s, hashtext(%s::text))", [LEADER_LOCK_NAMESPACE, str(community.id)])
        procs = [orchestrator(community, log) for _ in range(2)]
        try:
            ids = start_runs(workflow, 10)
            wait_done(community, ids)
        finally:
            summaries = [summary(p) for p in procs]
    finally:
        holder.close()
    assert [s["led"] for s in summaries] == [0, 0]
    assert [s["chained"] for s in summaries] == [0, 0]
    assert sum(s["succeeded"] for s in summaries) == 40
    assert all(s["follow_reads"] > 0 for s in summaries)


def test_steps_left_waiting_counts_the_steps_claimable_that_long(community):
    workflow = WorkflowFactory(community=community)
    publish_definition(community.id, workflow.id, {"steps": [function_step("s", "liveness.record")]})
    first, *_ = runs = start_runs(workflow, 3)
    assert steps_left_waiting(community.id, 0, limit=10) == 3
    assert steps_left_waiting(community.id, 0, limit=2) == 2
    assert steps_left_waiting(community.id, 60, limit=10) == 0
    assert steps_left_waiting(uuid.uuid4(), 0, limit=10) == 0  # another community's steps are not read
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_workflows_step SET ready_at = now() - interval '2 minutes',"
            " next_attempt_at = now() + interval '1 minute' WHERE run_id = ANY(%s)",
            [runs],
        )
    assert steps_left_waiting(community.id, 0, limit=10) == 0  # in their backoff: not claimable yet
    with connection.cursor() as cursor:
        cursor.execute("UPDATE buzz_workflows_step SET next_attempt_at = NULL WHERE run_id = %s", [first])
    assert steps_left_waiting(community.id, 60, limit=10) == 1
    advance_community(community.id, "quiescing")  # not active: nothing is claimable
    assert steps_left_waiting(community.id, 60, limit=10) == 0


def test_the_lock_connection_is_bounded_and_a_follower_that_cannot_reach_the_database_says_so(caplog):
    """The dispatcher asks the leadership question on its own thread: the lock connection must
    not hang it (connect timeout, statement timeout) nor let a vanished leader hold the lock for
    hours (the server ends an idle session); a follower that cannot connect logs it once a
    minute and follows, and a reachable one leads."""
    from django.db import connections

    from buzz_delivery.workflows.orchestrator import Leadership

    community = uuid.uuid4()
    params = connections["default"].get_connection_params()
    lead = Leadership(params, community, every=0.5)
    try:
        assert lead.check() is True
        assert lead.conn is not None
        assert lead.following is False
        other = Leadership(params, community, every=0.0)
        try:
            assert other.check() is False
            assert other.following is True  # the lock is held by a live session: it need not listen
        finally:
            other.close()
        assert other.following is False
        assert lead.conn_params["connect_timeout"] == 5
        assert lead.conn.execute("SHOW statement_timeout").fetchone()[0] == "5s"
        if lead.conn.info.server_version >= 140000:
            assert lead.conn.execute("SHOW idle_session_timeout").fetchone()[0] == "1min"
    finally:
        lead.close()

    unreachable = Leadership({**params, "host": "127.0.0.1", "port": 1}, community, every=0.0)
    with caplog.at_level("WARNING", logger="buzz_delivery.workflows"):
        assert unreachable.check() is False
        assert unreachable.following is False  # nobody is known to lead: it listens
        assert unreachable.check() is False
    warned = [r for r in caplog.records if "leadership_unreachable" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert unreachable.conn is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"community_id": "not-a-uuid", "seconds": 0, "limit": 1}, "community_id"),
        ({"community_id": uuid.uuid4(), "seconds": -1, "limit": 1}, "seconds"),
        ({"community_id": uuid.uuid4(), "seconds": 0, "limit": 0}, "limit"),
        ({"community_id": uuid.uuid4(), "seconds": 0, "limit": 10_000}, "limit"),
    ],
)
def test_steps_left_waiting_refuses_bad_input_naming_the_field(kwargs, field):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as refused:
        steps_left_waiting(**kwargs)
    assert field in refused.value.message_dict

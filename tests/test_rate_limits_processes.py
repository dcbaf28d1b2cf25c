"""A rate limit held by eight worker processes over a 30-second run (issue 32): eight
``run_agent_worker`` processes run agent runs whose every call takes one unit of the key
``probe`` (8 a second). An audit trigger on the rate-limit row records the units used after every
take: no window ever granted more than its limit. The calls' own times show the rate held within
the fixed window's documented tolerance (any one-second stretch at most twice the limit) and the
whole run within its windows' total, and every run completed: a call over the limit waited."""

from __future__ import annotations

import bisect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from buzz_delivery.agents.models import AgentRun, JournalEntry
from project.database_url import database_url
from tests.agents_support import AGENT, new_run

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 8
LIMIT, PERIOD = 8, 1.0  # units a second
CALLS_PER_RUN = 5  # tests.agent_handlers.five_rated_calls
RUNS = 48  # 240 calls: 30 windows at the limit

AUDIT = """
CREATE TABLE rate_audit (window_start timestamptz NOT NULL, used bigint NOT NULL, took timestamptz NOT NULL,
    granted boolean NOT NULL);
CREATE FUNCTION rate_audit_used() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    -- now(): the take statement's own clock, the one its window is judged by.
    INSERT INTO rate_audit VALUES (NEW.window_start, NEW.used, now(), NEW.granted);
    RETURN NULL;
END $$;
CREATE TRIGGER rate_audit_used AFTER INSERT OR UPDATE ON buzz_delivery_rate_limit
    FOR EACH ROW EXECUTE FUNCTION rate_audit_used();
"""
DROP_AUDIT = """
DROP TRIGGER IF EXISTS rate_audit_used ON buzz_delivery_rate_limit;
DROP FUNCTION IF EXISTS rate_audit_used();
DROP TABLE IF EXISTS rate_audit;
"""


@pytest.fixture
def audit():
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)
        cursor.execute(AUDIT)
    yield
    with connection.cursor() as cursor:
        cursor.execute(DROP_AUDIT)


def test_eight_worker_processes_hold_a_rate_limit_over_thirty_seconds_and_every_run_completes(community, audit):
    run_ids = [new_run(community.id) for _ in range(RUNS)]
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "BUZZ_MIN_LEASE_SECONDS": "1",
        "BUZZ_RATE_LIMITS": json.dumps({"probe": {"limit": LIMIT, "period": PERIOD}}),
    }
    command = [
        sys.executable, "manage.py", "run_agent_worker", "--handler", "tests.agent_handlers:five_rated_calls",
        "--agent", AGENT.hex(), "--community", str(community.id), "--concurrency", "2", "--exit-when-idle",
        "--poll-seconds", "0.2", "--lease-seconds", "15",
    ]  # fmt: skip
    workers = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(WORKERS)
    ]
    outputs = [worker.communicate(timeout=180) for worker in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    summaries = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    assert sum(s["completed"] for s in summaries) == RUNS, summaries
    assert sum(1 for s in summaries if s["claimed"]) >= 2  # the limit was shared between processes
    assert set(AgentRun.objects.filter(id__in=run_ids).values_list("state", flat=True)) == {"completed"}

    # The database: after every take, no window had granted more than its limit.
    with connection.cursor() as cursor:
        cursor.execute("SELECT window_start, max(used), count(*) FROM rate_audit GROUP BY window_start")
        windows = {start: (most, takes) for start, most, takes in cursor.fetchall()}
    assert max(most for most, _ in windows.values()) == LIMIT  # reached, never exceeded
    assert sum(takes for _, takes in windows.values()) >= RUNS * CALLS_PER_RUN

    # The calls: when each ran (the tool's clock, the same host's as the database's): about
    # 30 s for 240 calls at 8 a second, so they waited for their units.
    made = sorted(entry.output["at"] for entry in JournalEntry.objects.filter(run_id__in=run_ids, status="succeeded"))
    assert len(made) == RUNS * CALLS_PER_RUN
    span = made[-1] - made[0]
    assert span >= (len(made) / LIMIT - 1) * PERIOD * 0.9, span
    # The grants by the take statements' own clock: any one-period stretch holds at most twice
    # the limit (the fixed window's edge: the documented tolerance), give or take a take that
    # counted in the window after its clock read's (a concurrent take had moved the window on).
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM took) FROM rate_audit WHERE granted ORDER BY took")
        granted = [float(at) for (at,) in cursor.fetchall()]
    busiest = max(bisect.bisect_left(granted, at + PERIOD) - i for i, at in enumerate(granted))
    assert LIMIT <= busiest <= 2 * LIMIT + 2, busiest

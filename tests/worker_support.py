"""The ``start_worker`` fixture: ``manage.py run_delivery_worker`` as a real subprocess on the
test database (``transaction=True`` tests, so it sees committed rows); registered in conftest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from project.database_url import database_url

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class WorkerRun:
    proc: subprocess.Popen
    stdout: Path
    stderr: Path
    handler_log: Path

    def wait(self, timeout: float = 20) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker did not exit within {timeout}s; stderr:\n{self.stderr.read_text()}")

    def summary(self) -> dict[str, int]:
        lines = self.stdout.read_text().splitlines()
        assert len(lines) == 1, f"expected one summary line, got {lines!r}"
        return json.loads(lines[0])

    def log(self) -> str:
        return self.stderr.read_text()

    def handler_events(self) -> list[dict]:
        if not self.handler_log.exists():
            return []
        return [json.loads(line) for line in self.handler_log.read_text().splitlines()]


@pytest.fixture
def start_worker(tmp_path, community):
    """Start ``run_delivery_worker`` for ``community`` and a target; kills leftovers at teardown."""
    runs: list[WorkerRun] = []

    def start(
        target: bytes, *options: str, handler: str = "tests.worker_handlers:scripted", **extra_env: str
    ) -> WorkerRun:
        n = len(runs)
        env = {
            **os.environ,
            "DATABASE_URL": database_url(connection.settings_dict),
            "BUZZ_MIN_LEASE_SECONDS": "1",
            "BUZZ_TEST_HANDLER_LOG": str(tmp_path / f"handler-{n}.jsonl"),
            "LOG_LEVEL": "INFO",
            **extra_env,
        }
        run = WorkerRun(
            proc=None,  # type: ignore[arg-type]
            stdout=tmp_path / f"worker-{n}.out",
            stderr=tmp_path / f"worker-{n}.err",
            handler_log=tmp_path / f"handler-{n}.jsonl",
        )
        with open(run.stdout, "w") as out, open(run.stderr, "w") as err:
            run.proc = subprocess.Popen(
                [
                    sys.executable, "manage.py", "run_delivery_worker",
                    "--community", str(community.id), "--target", target.hex(), "--handler", handler,
                    "--poll-interval", "0.2", *options,
                ],
                cwd=ROOT, env=env, stdout=out, stderr=err,
            )  # fmt: skip
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def one_worker_listening() -> bool:
    """True when exactly one session of the test database is LISTENing (the worker's listener),
    leaving out the gateway test servers' (the session's gunicorn keeps one open)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%%'"
            " AND coalesce(application_name, '') <> 'buzz-gateway-test'"
        )
        return cursor.fetchone()[0] == 1


# The opening columns of the claims, within the 1 kB of text pg_stat_activity keeps (after the
# tenant's set_config when tenant isolation is on): a delivery claim, an agent run claim.
DELIVERY_CLAIM_OPENING = "SELECT d.community_id, d.id, d.workflow_id, "
RUN_CLAIM_OPENING = "WITH candidate AS MATERIALIZED (\n    SELECT r.id FROM "


def polled_since_listening(claim_opening: str = DELIVERY_CLAIM_OPENING) -> bool:
    """True once a worker of the test database has claimed (found nothing, or something) since
    its listener LISTENed: a backend idle after a claim statement (``claim_opening``) that began
    after the LISTENing backend's LISTEN ended. The poll a listener asks for when it starts has
    then run, and the worker waits for a hint or its next poll (the gateway test servers'
    backends are left out)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT FROM pg_stat_activity AS c, pg_stat_activity AS l"
            " WHERE c.datname = current_database() AND l.datname = current_database()"
            " AND coalesce(c.application_name, '') <> 'buzz-gateway-test'"
            " AND coalesce(l.application_name, '') <> 'buzz-gateway-test'"
            " AND l.state = 'idle' AND l.query LIKE 'LISTEN %%'"
            " AND c.state = 'idle' AND strpos(c.query, %s) > 0 AND c.query_start > l.state_change)",
            [claim_opening],
        )
        return cursor.fetchone()[0]


def wait_for_poll_since_listening(claim_opening: str = DELIVERY_CLAIM_OPENING, timeout: float = 60) -> None:
    """Wait (``timeout`` s, generous for a loaded CI) until :func:`polled_since_listening`."""
    deadline = time.monotonic() + timeout
    while not polled_since_listening(claim_opening):
        assert time.monotonic() < deadline, f"waited {timeout} s for the worker's first claim after its LISTEN"
        time.sleep(0.05)

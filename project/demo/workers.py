"""Worker processes of the demo: real ``manage.py run_delivery_worker`` subprocesses.

Each gets the demo's database as ``DATABASE_URL`` (built from the running connection's
settings, so under pytest they use the test database), a low ``BUZZ_MIN_LEASE_SECONDS`` for
short leases, and ``BUZZ_DEMO_RUN`` for the handler. stdout (the JSON summary line) and
stderr (the transition log) go to files in the run's log folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from django.conf import settings

from project.database_url import database_url


def application_name(worker_name: str) -> str:
    """``buzz-demo-<worker name>``, set through ``PGAPPNAME`` on every connection of the worker."""
    return f"buzz-demo-{worker_name}"


@dataclass
class WorkerProcess:
    """One running worker: its role, arguments, process and log files."""

    name: str
    community_id: uuid.UUID
    target_hex: str
    handler: str
    process: subprocess.Popen[str]
    stdout_path: Path
    stderr_path: Path
    files: list[TextIO] = field(default_factory=list)

    @property
    def application_name(self) -> str:
        """The worker's PostgreSQL ``application_name``: how the demo's audit names it."""
        return application_name(self.name)

    @property
    def pid(self) -> int:
        return self.process.pid

    def summary(self) -> dict[str, int] | None:
        """The counts of the worker's JSON summary line (its ``reason`` text left out), or None
        if it printed none (killed, crashed)."""
        for line in reversed(self.stdout_path.read_text().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return {k: v for k, v in json.loads(line).items() if isinstance(v, int)}
                except (ValueError, AttributeError):
                    return None
        return None

    def close_files(self) -> None:
        for f in self.files:
            f.close()


def worker_env(settings_dict: dict[str, Any], run_id: uuid.UUID, min_lease_seconds: float) -> dict[str, str]:
    """The environment of every worker subprocess."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url(settings_dict),
        DJANGO_SETTINGS_MODULE=settings.SETTINGS_MODULE,
        BUZZ_MIN_LEASE_SECONDS=str(min_lease_seconds),
        BUZZ_DEMO_RUN=str(run_id),
        PYTHONUNBUFFERED="1",
        LOG_LEVEL="INFO",
    )
    return env


def start_worker(
    *,
    name: str,
    community_id: uuid.UUID,
    target_hex: str,
    handler: str,
    env: dict[str, str],
    log_dir: Path,
    concurrency: int,
    lease_seconds: float,
    poll_interval: float,
    idle_exit: float,
) -> WorkerProcess:
    """Start ``python -m django run_delivery_worker`` for one community and target."""
    command = [
        sys.executable,
        "-m",
        "django",
        "run_delivery_worker",
        "--community",
        str(community_id),
        "--target",
        target_hex,
        "--handler",
        handler,
        "--concurrency",
        str(concurrency),
        "--batch-size",
        str(concurrency),
        "--lease-seconds",
        f"{lease_seconds:g}",
        "--poll-interval",
        f"{poll_interval:g}",
        "--idle-exit",
        f"{idle_exit:g}",
    ]
    stdout_path, stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.log"
    out, err = stdout_path.open("w"), stderr_path.open("w")
    process = subprocess.Popen(
        command,
        cwd=str(getattr(settings, "BASE_DIR", Path.cwd())),
        env={**env, "PGAPPNAME": application_name(name)},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        text=True,
    )
    return WorkerProcess(name, community_id, target_hex, handler, process, stdout_path, stderr_path, [out, err])


def stop_all(workers: list[WorkerProcess], timeout: float) -> None:
    """SIGTERM every worker still running, wait up to ``timeout`` seconds, SIGKILL the rest."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        worker.close_files()

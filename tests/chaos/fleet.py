"""The driver side of a chaos run: :class:`Fleet` spawns the member processes
(:mod:`tests.chaos.member`), SIGKILLs and respawns them, pauses them past their lease and
terminates their database backends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from project.database_url import database_url as project_database_url
from tests.chaos.audit import read_log

REPO = Path(__file__).resolve().parents[2]


def database_url(settings_dict: dict[str, Any], application_name: str) -> str:
    """A DATABASE_URL for a subprocess, from a Django connection's ``settings_dict`` (socket
    folders of the embedded server included)."""
    return project_database_url(settings_dict, application_name=application_name)


@dataclass
class Member:
    role: str
    slot: int
    spawn: int
    app: str
    log: Path
    process: subprocess.Popen[bytes]


@dataclass
class Fleet:
    """N workers and one reaper as real processes; the chaos a driver inflicts on them."""

    workdir: Path
    settings_dict: dict[str, Any]
    addresses: list[tuple[str, str]]
    seed: int
    workers: int = 4
    lease: float = 1.0
    prefix: str = "chaos"
    members: dict[tuple[str, int], Member] = field(default_factory=dict)
    retired: list[Member] = field(default_factory=list)
    killed_logs: set[Path] = field(default_factory=set)
    pauses: list[dict[str, Any]] = field(default_factory=list)
    actions: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.stop_file = self.workdir / "STOP"
        self.address_file = self.workdir / "addresses.json"
        self.address_file.write_text(json.dumps(self.addresses))
        self._spawns = 0

    def _spawn(self, role: str, slot: int) -> Member:
        self._spawns += 1
        app = f"{self.prefix}_{role}{slot}_{self._spawns}"
        log = self.workdir / f"{role}{slot}-{self._spawns}.jsonl"
        env = subprocess_env(self.settings_dict, app, self.lease)
        command = [
            sys.executable,
            "-m",
            "tests.chaos.member",
            role,
            "--log",
            str(log),
            "--stop",
            str(self.stop_file),
            "--lease",
            str(self.lease),
            "--seed",
            str(self.seed * 1000 + self._spawns),
        ]
        if role == "worker":
            command += ["--addresses", str(self.address_file)]
        process = subprocess.Popen(command, cwd=REPO, env=env, stderr=open(log.with_suffix(".err"), "wb"))  # noqa: SIM115
        member = Member(role, slot, self._spawns, app, log, process)
        self.members[(role, slot)] = member
        return member

    def start(self, timeout: float = 60.0) -> None:
        """Spawn the workers and the reaper; return once each has logged its start."""
        for slot in range(self.workers):
            self._spawn("worker", slot)
        self._spawn("reaper", 0)
        deadline = time.monotonic() + timeout
        for member in self.members.values():
            while not read_log(member.log) and time.monotonic() < deadline:
                if member.process.poll() is not None:
                    raise RuntimeError(f"{member.app} exited at start: {member.log.with_suffix('.err').read_text()}")
                time.sleep(0.05)

    def sigkill_and_respawn(self, role: str, slot: int) -> None:
        member = self.members[(role, slot)]
        member.process.send_signal(signal.SIGKILL)
        member.process.wait()
        self.killed_logs.add(member.log)
        self.retired.append(member)
        self.actions[f"SIGKILL {role}"] += 1
        self._spawn(role, slot)

    def terminate_backend(self, cursor: Any, role: str, slot: int) -> int:
        """pg_terminate_backend on the member's connection (by application_name)."""
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
            [self.members[(role, slot)].app],
        )
        count = cursor.fetchone()[0]
        self.actions[f"terminate backend {role}"] += count
        return count

    def holding(self, slot: int) -> bool:
        """True when the worker's last log line is a claim or renew (it is working under a lease)."""
        try:
            with open(self.members[("worker", slot)].log, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 2048))
                last = log.read().splitlines()[-1]
            return json.loads(last)["kind"] in ("claim", "renew")
        except (OSError, IndexError, ValueError):
            return False

    def pause_past_lease(self, slot: int, seconds: float) -> bool:
        """SIGSTOP a worker while it holds a lease, sleep past the lease, SIGCONT: it wakes up stale."""
        for _ in range(50):
            if self.holding(slot):
                break
            time.sleep(0.01)
        else:
            return False
        member = self.members[("worker", slot)]
        member.process.send_signal(signal.SIGSTOP)
        stopped = time.time()
        time.sleep(seconds)
        resumed = time.time()
        member.process.send_signal(signal.SIGCONT)
        self.pauses.append({"log": member.log, "stopped": stopped, "resumed": resumed})
        self.actions["pause past lease"] += 1
        return True

    def stop(self, timeout: float = 20.0) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        for member in self.members.values():
            try:
                member.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()
                self.killed_logs.add(member.log)
        self.retired.extend(self.members.values())

    def kill_all(self) -> None:
        """Last resort in a finally block: no process outlives the test."""
        for member in self.members.values():
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGCONT)
                member.process.kill()
                member.process.wait()

    def worker_logs(self) -> list[Path]:
        return sorted(
            {m.log for m in self.retired if m.role == "worker"}
            | {m.log for m in self.members.values() if m.role == "worker"}
        )

    def stderr_of_clean_exits(self) -> str:
        """stderr of members that exited on their own (a traceback there is a bug in the run)."""
        out = []
        for member in self.retired:
            if member.log not in self.killed_logs and member.process.returncode != 0:
                out.append(
                    f"{member.app} exit {member.process.returncode}: "
                    f"{member.log.with_suffix('.err').read_text()[-2000:]}"
                )
        return "\n".join(out)


def subprocess_env(settings_dict: dict[str, Any], application_name: str, lease: float = 1.0) -> dict[str, str]:
    """Environment for a fleet member or a manage.py call on the database of ``settings_dict``."""
    return {
        **os.environ,
        "DATABASE_URL": database_url(settings_dict, application_name),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "BUZZ_MIN_LEASE_SECONDS": str(min(lease, 0.5)),
        "LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(REPO),
    }


@contextlib.contextmanager
def private_workdir(prefix: str = "buzz-chaos-") -> Iterator[Path]:
    """A temporary folder of the run's own. Not pytest's ``tmp_path``: pytest deletes all but its
    three newest base folders, so a concurrent pytest run on the machine could remove the logs of
    a long run under its feet."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

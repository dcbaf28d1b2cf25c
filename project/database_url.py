"""Turn a Django ``DATABASES`` entry back into a ``DATABASE_URL`` for a subprocess.

The demo's workers and tests that start ``manage.py`` processes need the URL of the database
the current connection uses (under pytest: the test database). The embedded server's ``HOST``
is a Unix-socket folder, which cannot go in the host part of a URL as is; it goes in a ``host``
query parameter, which ``project.settings`` (django-environ) passes on to libpq.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode


def database_url(settings_dict: dict[str, Any], *, application_name: str | None = None) -> str:
    """A ``postgres://`` URL for the database of ``settings_dict`` (``connection.settings_dict``).

    TCP hosts go in the host part, a socket folder (a ``HOST`` starting with ``/``) in the
    ``host`` query parameter, with ``port`` beside it. ``application_name`` (optional) names
    the subprocess's sessions in ``pg_stat_activity``.
    """
    user = quote(str(settings_dict.get("USER") or ""), safe="")
    password = quote(str(settings_dict.get("PASSWORD") or ""), safe="")
    credentials = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(settings_dict.get("HOST") or "")
    port = str(settings_dict.get("PORT") or "")
    name = quote(str(settings_dict["NAME"]), safe="")
    query: dict[str, str] = {}
    if host.startswith("/"):
        query["host"] = host
        if port:
            query["port"] = port
        netloc = credentials
    else:
        netloc = credentials + host + (f":{port}" if port else "")
    if application_name:
        query["application_name"] = application_name
    url = f"postgres://{netloc}/{name}"
    return f"{url}?{urlencode(query)}" if query else url

"""Database plumbing shared by the services: cursors and the mapping of
PostgreSQL errors raised by our triggers and keys to domain errors.

The hot statements of the agent side (claim, renew, settle, the fenced status read: see
:data:`SERVER_BOUND`) run on a server-side binding cursor: their parameters travel apart from
the SQL text instead of being quoted into it by the client. Whether psycopg also *prepares*
them (parse and plan once per connection, after ``prepare_threshold`` runs) is the database's
own psycopg option: only a ``DATABASES[alias]["OPTIONS"]["prepare_threshold"]`` set to an int
turns it on (``DATABASE_URL=...?prepare_threshold=5``). Leave it unset behind PgBouncer older
than 1.21, or without ``max_prepared_statements``, in transaction pooling mode: a prepared
statement lives on one server connection and the pooler may hand the next transaction another.
Unprepared server-side binding (the default) is safe behind any pooler: each statement is one
Parse/Bind/Execute/Sync exchange inside its own transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection

from buzz_delivery.exceptions import CommunityNotWritable, DeliveryWriteRefused, LifecycleError
from buzz_delivery.services import sql as statements
from buzz_delivery.triggers import FENCE_SQLSTATE, HISTORY_SQLSTATE, LIFECYCLE_SQLSTATE

# The agent side's hot statements (run once or twice per delivery): server-side binding.
SERVER_BOUND = frozenset(
    {
        *(statements.claim_oldest_pending(by_id=i, by_binding=b) for i in (False, True) for b in (False, True)),
        statements.RENEW_IF_CURRENT_GENERATION,
        statements.FINISH_IF_CURRENT_GENERATION,
        statements.FINISH_MANY_IF_CURRENT_GENERATION,
        statements.RETRY_IF_CURRENT_GENERATION,
        statements.STATUS_AT_GENERATION,
    }
)

# Foreign keys and unique keys of the insert path, mapped to the binding field they judge.
CONSTRAINT_FIELDS = {
    "delivery_workflow_same_community": ("workflow_id", "no such workflow in this community"),
    "delivery_run_same_community": ("run_id", "no such workflow run in this community"),
    "delivery_message_event_same_community": ("message_event", "no such message event in this community"),
    "buzz_delivery_delive_community_id_a6f14938_fk_buzz_deli": ("community_id", "no such community"),
}


def _sqlstate(exc: BaseException) -> str | None:
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None)


def _constraint(exc: BaseException) -> str | None:
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None)


@contextmanager
def translated_errors(field_prefix: str = "") -> Iterator[None]:
    """Re-raise write-fence, lifecycle and known key violations as domain errors."""
    try:
        yield
    except IntegrityError as exc:
        name = _constraint(exc)
        if name in CONSTRAINT_FIELDS:
            field, message = CONSTRAINT_FIELDS[name]
            key = f"{field_prefix}{field}"
            raise ValidationError({key: [f"{key}: {message}"]}, code="invalid") from exc
        raise
    except DatabaseError as exc:
        state = _sqlstate(exc)
        if state == FENCE_SQLSTATE:
            raise CommunityNotWritable(str(exc.__cause__).splitlines()[0]) from exc
        if state == LIFECYCLE_SQLSTATE:
            raise LifecycleError(str(exc.__cause__).splitlines()[0]) from exc
        if state == HISTORY_SQLSTATE:
            raise DeliveryWriteRefused(str(exc.__cause__).splitlines()[0]) from exc
        raise


def prepares_statements() -> bool:
    """True when the default database's ``OPTIONS`` set ``prepare_threshold`` to an int: the
    :data:`SERVER_BOUND` statements are then prepared by psycopg after that many runs on a
    connection (see the module docstring for poolers)."""
    threshold = connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold")
    return isinstance(threshold, int) and not isinstance(threshold, bool)


class _UnpreparedCursor(psycopg.Cursor[Any]):
    """A server-side binding cursor that never prepares (safe behind any pooler)."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        return super().execute(query, params, prepare=False if prepare is None else prepare, binary=binary)


def _server_bound_cursor() -> Any:
    """A Django cursor wrapper (query logging, ``execute_wrapper`` hooks and error translation
    as usual) around a psycopg server-side binding cursor of the default connection."""
    connection.ensure_connection()
    factory = psycopg.Cursor if prepares_statements() else _UnpreparedCursor
    with connection.wrap_database_errors:
        raw = factory(connection.connection)
    # Django's own step of cursor(): the debug or plain wrapper (not in django-stubs).
    return connection._prepare_cursor(raw)  # type: ignore[attr-defined]


def fetch_all(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run one statement on the default connection and return its rows.

    A :data:`SERVER_BOUND` statement is bound on the server (and prepared when
    :func:`prepares_statements`); any other is bound by the client, as Django does."""
    if sql in SERVER_BOUND:
        with _server_bound_cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall() if cursor.description else []
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []

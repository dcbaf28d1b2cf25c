"""The tenant context of every services call, for row-level security (SPEC section 13).

Every public service that works on one community runs in a *tenant scope*
(:func:`tenant_scoped`): each of its statements runs with the transaction-local setting
``buzz.community_id`` naming that community, and, when ``BUZZ_DELIVERY["SWITCH_ROLES"]`` is on,
as the tenant role (``SET LOCAL ROLE`` through ``set_config('role', ..., true)``). Fleet work
(reaper, pruner, purge, lifecycle moves, operator actions, the engine's and the agents'
maintenance, the workers' discovery of communities with work) runs in a *fleet scope*
(:func:`fleet_scoped`): as the maintenance role when switching roles, else as the login role.

How the context reaches the server, without a round trip of its own:

- outside a transaction (autocommit, how agents and workers call the lease operations) each
  statement of the scope is sent behind a small ``SELECT set_config(...)`` in one simple query
  (see :class:`_Prefix`): both run in one implicit transaction, so the setting holds for exactly
  that statement and is gone after it (one network round trip, as before);
- inside a caller's transaction the scope sets the context with each statement (the first one
  also reads what was there) and puts the previous values back when it closes (one more round
  trip), so
  a tenant call inside a test's or an operator's transaction leaves that transaction's role
  and context as they were.

Nothing is session-level: behind PgBouncer in transaction mode no tenant state outlives a
transaction. When enforcement is off in the database (``manage.py tenant_isolation status``)
the scopes do nothing at all; whether it is on is read once per database connection.
"""

from __future__ import annotations

import functools
import inspect
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from psycopg import sql as pgsql

from buzz_delivery import isolation
from buzz_delivery.conf import DEFAULTS, raw_settings

F = TypeVar("F", bound=Callable[..., Any])

# One statement each; the setting is transaction-local (``is_local = true``).
SET_CONTEXT = "SELECT set_config('buzz.community_id', %(community)s, true)"
SET_ROLE_AND_CONTEXT = "SELECT set_config('role', %(role)s, true), set_config('buzz.community_id', %(community)s, true)"
# Inside a transaction: set, and return what was there, to put back when the scope closes.
SWAP = (
    "SELECT o.r, o.c FROM (SELECT current_setting('role') AS r,"
    " coalesce(current_setting('buzz.community_id', true), '') AS c OFFSET 0) o,"
    " LATERAL (SELECT set_config('role', coalesce(%(role)s, o.r), true),"
    " set_config('buzz.community_id', %(community)s, true)) s"
)
FLEET = ""  # the community context of a fleet scope: none


_TRANSACTION_CONTROL = re.compile(r"\s*(SAVEPOINT|RELEASE|ROLLBACK|COMMIT|BEGIN|START\s+TRANSACTION)\b", re.I)


def _several_statements(sql: str) -> bool:
    """True for a text that holds more than one statement (a ``;`` before its end)."""
    return ";" in sql.rstrip().rstrip(";")


@dataclass(frozen=True, slots=True)
class Target:
    """What a scope's statements run as: ``role`` (None = leave the role alone) and
    ``community`` (a community id as text, or '' for none)."""

    role: str | None
    community: str


@dataclass(slots=True)
class _ConnectionState:
    """Per Django connection (so per thread): the open scopes, and whether enforcement is on
    for the psycopg connection ``raw`` (read on its first scoped statement)."""

    stack: list[Target] = field(default_factory=list)
    raw: Any = None
    enforced: bool = False
    # By target: the prefixes of :func:`run_statement_in` (the async handlers' threads only).
    prefixes: dict[Target, _Prefix] = field(default_factory=dict)


# The most targets whose prefix one connection keeps (one per community its async handlers served).
_MAX_PREFIXES = 1024


def _state(db: Any = None) -> _ConnectionState:
    """The scope state of Django connection ``db`` (default: this thread's default connection)."""
    db = connections[DEFAULT_DB_ALIAS] if db is None else db
    state: _ConnectionState | None = getattr(db, "_buzz_tenancy", None)
    if state is None:
        state = _ConnectionState()
        db._buzz_tenancy = state
    return state


def _enforced_on(state: _ConnectionState, raw: Any) -> bool:
    """Whether RLS is on, read once per psycopg connection (one query, on its first use)."""
    if state.raw is not raw:
        with connection.wrap_database_errors:
            enforced = isolation.enforced(raw.cursor())
        state.raw, state.enforced = raw, enforced
    return state.enforced


def forget() -> None:
    """Read the enforcement switch again on the next scoped statement (after ``tenant_isolation``)."""
    _state().raw = None


def enforcing() -> bool:
    """True when row-level security is on for the default connection's database (connects)."""
    connection.ensure_connection()
    return _enforced_on(_state(), connection.connection)


def _switching() -> bool:
    # raw_settings()["SWITCH_ROLES"] without merging every default into a new dict: asked on
    # every scope (each service call, each handler call), read live as settings may change.
    user = getattr(settings, "BUZZ_DELIVERY", None) or {}
    return bool(user.get("SWITCH_ROLES", DEFAULTS["SWITCH_ROLES"]))


class _Prefix:
    """An ``execute_wrapper`` that sends the scope's ``set_config`` with each statement, in the
    same round trip. Inside a transaction the first one also reads what to put back (``SWAP``);
    the later ones set the context again (cheap, and right after a savepoint rolled back).

    With Django's client-side binding cursor (the default) the ``set_config`` goes in front of
    the statement's text, as literals, and both travel as one simple query, which PostgreSQL
    runs as one implicit transaction; the cursor is then moved on to the statement's own result.
    Any other cursor gets a psycopg pipeline (the same effect, at a higher client cost); an
    ``executemany``, a server-side cursor or a text of several statements on such a cursor gets
    the ``set_config`` as a statement of its own, in the same transaction."""

    def __init__(self, state: _ConnectionState, target: Target, in_transaction: bool) -> None:
        self.state = state
        self.target = target
        self.in_transaction = in_transaction
        self.previous: tuple[str, str] | None = None  # read by the first statement in a transaction
        self.params = {"role": target.role, "community": target.community}
        self.set_sql = SET_CONTEXT if target.role is None else SET_ROLE_AND_CONTEXT
        self._literals: dict[str, str] = {}

    def _statement(self) -> str:
        return SWAP if self.in_transaction and self.previous is None else self.set_sql

    def _text(self, raw: Any, statement: str) -> str:
        if statement not in self._literals:
            template = statement.replace("%(role)s", "{role}").replace("%(community)s", "{community}")
            composed = pgsql.SQL(template).format(  # type: ignore[arg-type]
                role=pgsql.Literal(self.target.role), community=pgsql.Literal(self.target.community)
            )
            self._literals[statement] = composed.as_string(raw)
        return self._literals[statement]

    def _swapped(self, statement: str, row: Any) -> None:
        if statement is SWAP and self.previous is None:
            self.previous = row

    def __call__(self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if not self.state.stack or self.state.stack[-1] is not self.target:
            return execute(sql, params, many, context)  # an inner scope's statement
        db = context["connection"]
        raw = db.connection
        if not _enforced_on(self.state, raw):
            return execute(sql, params, many, context)
        if not isinstance(sql, str):  # a psycopg.sql.Composed
            sql = sql.as_string(raw)
        if _TRANSACTION_CONTROL.match(sql):
            # Django's SAVEPOINT / RELEASE / ROLLBACK TO: never delay them (after an error a
            # set_config in front would fail and the rollback never run); the next statement
            # sets the context again.
            return execute(sql, params, many, context)
        statement = self._statement()
        cursor = getattr(context["cursor"], "cursor", None)
        if many or isinstance(cursor, psycopg.ServerCursor):
            return self._on_its_own(statement, execute, sql, params, many, context)
        if isinstance(cursor, psycopg.ClientCursor):
            prefix = self._text(raw, statement)
            text = f"{prefix.replace('%', '%%') if params is not None else prefix}; {sql}"
            result = execute(text, params, many, context)
            self._swapped(statement, cursor.fetchone() if statement is SWAP else None)
            cursor.nextset()
            return result
        if _several_statements(sql):
            return self._on_its_own(statement, execute, sql, params, many, context)
        with db.wrap_database_errors:
            with raw.pipeline():
                swap = raw.execute(statement, self.params, prepare=False)
                result = execute(sql, params, many, context)
            self._swapped(statement, swap.fetchone() if statement is SWAP else None)
        return result

    def _on_its_own(
        self, statement: str, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
    ) -> Any:
        """The ``set_config`` as a statement of its own (on the raw connection, so no wrapper
        sees it), in the caller's transaction or in one of psycopg's around the two."""
        db = context["connection"]
        raw = db.connection
        with db.wrap_database_errors:
            if db.in_atomic_block or not db.get_autocommit():
                self._swapped(statement, raw.execute(statement, self.params, prepare=False).fetchone())
                return execute(sql, params, many, context)
            with raw.transaction():
                raw.execute(statement, self.params, prepare=False)
                return execute(sql, params, many, context)

    def restore(self) -> None:
        """Put back the role and context the transaction had before the scope set its own."""
        if self.previous is None or connection.needs_rollback:
            return
        role, community = self.previous
        try:
            with connection.wrap_database_errors:
                connection.connection.execute(
                    SET_ROLE_AND_CONTEXT, {"role": role, "community": community}, prepare=False
                )
        except DatabaseError:
            pass  # the transaction failed in the block: it rolls back anyway


def _in_transaction(db: Any = None) -> bool:
    """True inside a transaction of the caller's: an atomic block, or Django's manual
    transaction mode (``set_autocommit(False)``, ``AUTOCOMMIT = False``). Opens no connection."""
    db = connections[DEFAULT_DB_ALIAS] if db is None else db
    if db.in_atomic_block:
        return True
    if db.connection is None:
        return not db.settings_dict.get("AUTOCOMMIT", True)
    return not db.autocommit


def prefixing(db: Any = None) -> bool:
    """True inside a scope that sends a context with each statement (the services' cue to use a
    client-side binding cursor, whose statements carry the context in the same simple query).
    ``db``: the default Django connection, if the caller has it."""
    db = connections[DEFAULT_DB_ALIAS] if db is None else db
    state: _ConnectionState | None = getattr(db, "_buzz_tenancy", None)
    if not (state and state.stack):
        return False
    return state.raw is not db.connection or state.enforced  # unknown yet: as if on


class scope:
    """Run the block's statements as ``target`` (see the module docstring for how). Sends
    nothing, and opens no connection, until the block runs a statement.

    A class rather than a generator context manager, and the connection looked up once: the
    worker enters a scope for every delivery (its handler's) and every service call, where the
    generator form and Django's per-thread connection proxy cost more than the work itself."""

    __slots__ = ("_db", "_open", "_prefix", "_state", "_target")

    def __init__(self, target: Target) -> None:
        self._target = target
        self._prefix: _Prefix | None = None
        self._open = False

    def __enter__(self) -> None:
        self.enter_on(connections[DEFAULT_DB_ALIAS])

    def enter_on(self, db: Any) -> None:
        """``__enter__`` for a caller that already holds this thread's default connection
        wrapper ``db`` (looking it up again costs more than the rest of the entry)."""
        if self._open:  # its exit would undo the outer entry's context while that block still runs
            raise RuntimeError("a tenancy scope is open already: enter a new one (tenant(), handler(), scope())")
        self._open = True
        state = _state(db)
        if state.stack and state.stack[-1] == self._target:
            return  # already in this scope: nothing to add
        self._db, self._state = db, state
        self._prefix = _Prefix(state, self._target, _in_transaction(db))
        state.stack.append(self._target)
        db.execute_wrappers.append(self._prefix)  # what connection.execute_wrapper() does

    def __exit__(self, *exc: object) -> None:
        self._open = False
        prefix = self._prefix
        if prefix is None:
            return
        self._prefix = None
        try:
            self._db.execute_wrappers.pop()
        finally:
            self._state.stack.pop()
            if prefix.in_transaction:
                prefix.restore()


def tenant_target(community_id: uuid.UUID | str) -> Target:
    """The target of a tenant scope for ``community_id``."""
    role = raw_settings()["TENANT_ROLE"] if _switching() else None
    return Target(role=role, community=str(community_id))


def fleet_target() -> Target:
    """The target of a fleet scope: the maintenance role when switching roles."""
    return Target(role=raw_settings()["MAINTENANCE_ROLE"] if _switching() else None, community=FLEET)


def tenant(community_id: uuid.UUID | str) -> scope:
    """A tenant scope for ``community_id`` (a UUID or its text), for ``with``. SPEC section 13."""
    return scope(tenant_target(community_id))


def handler(community_id: uuid.UUID | str) -> scope:
    """The scope of a user's handler (a delivery handler, a function step, an agent handler) for
    ``community_id``, for ``with``: that community as context, as the login role (``SET LOCAL
    ROLE NONE`` when switching roles), so the handler keeps the login's grants on the project's
    own tables while what it reads of ours is its community's rows. SPEC section 13."""
    # (handler_target's, inline: a plain handler's delivery enters one, on the workers' hot path)
    return scope(Target(role="none" if _switching() else None, community=str(community_id)))


def handler_target(community_id: uuid.UUID | str) -> Target:
    """The target of :func:`handler`'s scope for ``community_id`` (an async handler's)."""
    return Target(role="none" if _switching() else None, community=str(community_id))


class NoTenantScope(DatabaseError):
    """A statement that must run in a tenant scope was sent with none (an ``async def``
    handler's thread outside any handler: :func:`run_statement_in`)."""


def run_statement_in(
    target: Target | None, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """Send one statement as ``target``, for an ``execute_wrapper`` that picks the target per
    statement (the async handlers' threads, :mod:`buzz_delivery.usercode`): the ``set_config``
    travels with the statement as a scope's does, and leaves nothing behind it (outside a
    transaction it lasts the statement; inside one, until its end). A scope open on the
    connection (a services call's) rules its own statements: they pass through. With no target,
    the statement is refused (:class:`NoTenantScope`) where enforcement is on, and sent as it is
    where it is off."""
    db = context["connection"]
    state = _state(db)
    if state.stack:
        return execute(sql, params, many, context)
    if target is None:
        if not _enforced_on(state, db.connection):
            return execute(sql, params, many, context)
        raise NoTenantScope(
            "a statement of an async handler's thread ran outside any delivery's tenant scope"
            " (row-level security is on): send it from the handler's own task"
        )
    prefix = state.prefixes.get(target)
    if prefix is None:
        if len(state.prefixes) >= _MAX_PREFIXES:
            state.prefixes.clear()
        prefix = state.prefixes[target] = _Prefix(state, target, in_transaction=False)
    state.stack.append(prefix.target)  # (the very object: the prefix checks it by identity)
    try:
        return prefix(execute, sql, params, many, context)
    finally:
        state.stack.pop()


@contextmanager
def fleet() -> Iterator[None]:
    """A fleet scope (maintenance). Without role switching it does nothing: the login role's
    own policies apply. SPEC section 13."""
    if not _switching():
        yield
        return
    with scope(fleet_target()):
        yield


_COMMUNITY_ARGUMENTS = ("community_id", "community", "lease", "leases", "settles", "claim")


def _community_of(value: Any) -> uuid.UUID | None:
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    for attribute in ("community_id", "lease"):
        inner = getattr(value, attribute, None)
        if inner is not None and not isinstance(value, uuid.UUID | str):
            return _community_of(inner)
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            return None
    pk = getattr(value, "pk", None)  # a Community instance
    return pk if isinstance(pk, uuid.UUID) else None


def tenant_scoped(func: F) -> F:
    """Decorate a service of one community: its statements run in :func:`tenant` for the
    community named by its first argument among ``community_id``, ``community``, ``lease``,
    ``leases`` or ``settles`` (the first one's lease's) or ``claim``. A value that names no
    community (bad input the service itself rejects) runs the call without a scope: it then
    sees no rows (fail closed)."""
    signature = inspect.signature(func)
    names = list(signature.parameters)
    found = [(names.index(n), n) for n in _COMMUNITY_ARGUMENTS if n in names]
    if not found:
        raise TypeError(f"{func.__qualname__} has no argument naming a community")
    index, name = min(found)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = args[index] if len(args) > index else kwargs.get(name)
        community = _community_of(value)
        if community is None:
            return func(*args, **kwargs)
        with tenant(community):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def fleet_scoped(func: F) -> F:
    """Decorate a fleet-wide service: it runs in :func:`fleet`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with fleet():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

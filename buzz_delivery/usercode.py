"""Running a user's code (a delivery handler, a ``function`` step) on a runtime thread, so that
nothing it leaves on the thread's database connection reaches the runtime's own statements
or the next user call on that thread.

The workers run user code on a thread whose Django connection the runtime may use right after
(the engine's step threads record a failure, park a ``send_message`` step...), and the next
delivery or step on that thread runs on it too. :class:`UserCode` wraps one call, in the
handler's tenancy scope (:func:`~buzz_delivery.services.tenancy.handler`), and on the way out
puts the connection back as the runtime expects it:

- a transaction left open (an ``atomic()`` block not exited, autocommit turned off through
  Django or psycopg, a raw ``BEGIN``, a failed transaction) cannot be trusted to commit what
  the user meant: the ``atomic()`` blocks it left are exited as by an exception (rolled
  back), and a connection still in a transaction after that is closed (the server rolls it
  back) and Django's transaction state reset, so the next statement on the thread opens a
  fresh connection; :attr:`UserCode.left_open` says what was left, and the caller fails that one
  delivery or step with :data:`TRANSACTION_LEFT_OPEN`;
- session state (``SET statement_timeout``, ``SET search_path``, ``SET ROLE``, temporary
  tables, session advisory locks, ``LISTEN``, prepared statements, cursors): after a call that
  ran such a statement through Django (:data:`SESSION_STATEMENT`, or any statement on a
  server-side cursor: the ORM's ``.iterator()``), ``DISCARD ALL`` (what poolers
  run between clients) and Django's time zone again. The call's own work stands (it
  committed); only the session is cleaned. (A statement sent on the raw psycopg connection,
  past Django's cursor, is not seen: its transaction is still judged, its session is not.)

A call that changed no session state costs nothing here (no round trip): the workers' no-op
handlers and steps are measured that way in ``bench/``, and ordinary ORM work adds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
from asgiref.sync import AsyncToSync
from django.db import DEFAULT_DB_ALIAS, connections

from buzz_delivery.services import tenancy

logger = logging.getLogger("buzz_delivery.usercode")

# The failure code of a delivery or step whose code left a transaction open.
TRANSACTION_LEFT_OPEN = "transaction_left_open"
# A statement that may leave state on the session past its transaction (the ORM sends none).
SESSION_STATEMENT = re.compile(
    r"^\s*(SET|RESET|LISTEN|PREPARE|DECLARE|LOAD|CREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?)\b|set_config\s*\(|advisory_lock",
    re.IGNORECASE,
)

_IDLE = psycopg.pq.TransactionStatus.IDLE
_UNKNOWN = psycopg.pq.TransactionStatus.UNKNOWN


def discard_connection(db: Any = None) -> None:
    """Close the thread's connection whatever state it is in, and reset Django's transaction
    bookkeeping (an ``atomic()`` left open, autocommit off), so that the next statement on the
    thread connects afresh. The server rolls back whatever the closed connection had open."""
    db = connections[DEFAULT_DB_ALIAS] if db is None else db
    raw = db.connection
    db.connection = None
    if raw is not None:
        with contextlib.suppress(Exception):  # a broken connection may fail to close: gone either way
            raw.close()
    db.in_atomic_block = False
    db.savepoint_ids = []
    db.atomic_blocks = []
    db.needs_rollback = False
    db.closed_in_transaction = False
    db.savepoint_state = 0
    db.run_on_commit = []
    db.autocommit = bool(db.settings_dict.get("AUTOCOMMIT", True))


def left_open(db: Any) -> str | None:
    """What transaction the connection ``db`` has open, as a sentence, or None (no round trip:
    Django's flags and libpq's transaction status)."""
    return _left_open(db, db.connection)


def _left_open(db: Any, raw: Any) -> str | None:
    """:func:`left_open` of ``db``, whose psycopg connection ``raw`` the caller already read."""
    if db.in_atomic_block:
        return "an atomic() block was left open"
    if not db.autocommit:
        return "autocommit was left off"
    if raw is None or raw.closed:
        return None
    # libpq's status as the int it is (``raw.info.transaction_status`` builds a ConnectionInfo
    # and an enum member per read; the values are the same, TransactionStatus is an IntEnum).
    status = raw.pgconn.transaction_status
    if status == _UNKNOWN:
        return None  # a broken connection: the call's own error says so; it is dropped below
    if not raw.autocommit:
        return "autocommit was left off on the psycopg connection"
    if status != _IDLE:
        return "a transaction was left open"
    return None


class TransactionLeftOpen(Exception):
    """What the atomic blocks a user's code left open are exited with (so they roll back)."""


class _Guard:
    """What a guard of user code judges on its way out (:meth:`_clean`): ``_depth``, the atomic
    blocks open on entry; ``_in_transaction``, whether the entry was inside a caller's
    transaction; ``session_touched``, whether the code sent a :data:`SESSION_STATEMENT`."""

    __slots__ = ("_depth", "_in_transaction", "session_touched")
    # What cleans the session after a call that touched it (a plain handler's thread: one call at a time).
    _SESSION_RESET = "DISCARD ALL"
    _depth: int
    _in_transaction: bool
    session_touched: bool

    def _clean(self, db: Any) -> str | None:
        problem = None
        if len(db.atomic_blocks) > self._depth:
            problem = "an atomic() block was left open"
            try:
                while len(db.atomic_blocks) > self._depth:  # exited as by an exception: rolled back
                    db.atomic_blocks[-1].__exit__(TransactionLeftOpen, TransactionLeftOpen(problem), None)
            except Exception:
                if self._in_transaction:
                    raise
                discard_connection(db)
                return problem
        if self._in_transaction:
            return problem
        raw = db.connection
        if raw is None and problem is None and not db.in_atomic_block:
            return None  # never opened (or closed by Django): nothing open; autocommit is set on connect
        problem = problem or _left_open(db, raw)
        if problem is not None:
            logger.warning("user_code_left_open: %s; its connection is discarded", problem)
            discard_connection(db)
            return problem
        if raw is not None and (raw.closed or raw.pgconn.transaction_status == _UNKNOWN):
            discard_connection(db)  # terminated under the call: the next statement reconnects
        elif raw is not None and self.session_touched:
            try:
                raw.execute(self._SESSION_RESET, prepare=False)
                db.ensure_timezone()
            except Exception:
                discard_connection(db)
        return None


class UserCode(_Guard):
    """``with UserCode(community_id) as call: handler(...)``; then ``call.left_open`` is None,
    or what the call left open (its connection was discarded: see the module docstring).
    Exceptions from the call pass through unchanged, after the clean-up."""

    __slots__ = ("_db", "_mark", "_scope", "left_open")

    def __init__(self, community_id: uuid.UUID | str, db: Any = None) -> None:
        """``db``: this thread's default Django connection wrapper, if the caller already looked
        it up (``connections[DEFAULT_DB_ALIAS]``; looked up on entry otherwise)."""
        self._scope = tenancy.handler(community_id)
        self._db = db
        self.session_touched = False
        self.left_open: str | None = None

    def _watch(self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        # A server-side cursor (the ORM's ``.iterator()``) is session state too: declared WITH
        # HOLD outside a transaction, it outlives the call while anything keeps it, its rows
        # read in this call's scope, visible by name (``pg_cursors``) to the next call here.
        if not self.session_touched and (
            isinstance(getattr(context.get("cursor"), "cursor", None), psycopg.ServerCursor)
            or SESSION_STATEMENT.search(sql if isinstance(sql, str) else str(sql))
        ):
            self.session_touched = True
        return execute(sql, params, many, context)

    def __enter__(self) -> UserCode:
        db = self._db
        if db is None:
            db = self._db = connections[DEFAULT_DB_ALIAS]
        self._mark = len(db.execute_wrappers)
        self._depth = len(db.atomic_blocks)
        # Called inside a caller's transaction (a test's, run_until_idle's): only what the call
        # adds to it can be judged and undone. Not while the connection is unopened (a handler
        # thread's first call): Django's wrapper says autocommit off until it connects.
        self._in_transaction = in_transaction(db)
        db.execute_wrappers.append(self._watch)
        self._scope.enter_on(db)
        return self

    def __exit__(self, *exc: object) -> None:
        db = self._db
        try:
            self._scope.__exit__(*exc)
        except Exception:  # restoring a context inside a transaction the call broke
            pass
        finally:
            del db.execute_wrappers[self._mark :]  # ours, and any the call left behind
            self.left_open = self._clean(db)

    def checkpoint(self) -> str | None:
        """Judge and clean the connection now, as on exit, and stay entered: what the code run
        since the entry (or the last checkpoint) left open (its connection discarded), or None.
        For a caller that runs its own statements between two pieces of user code inside one
        call (the task runner records a task's outcome between the task and its
        ``task_finished`` receivers): they run on a clean connection, in the call's scope."""
        self.left_open = self._clean(self._db)
        if not self._in_transaction:
            self.session_touched = False  # cleaned (DISCARD ALL, or a fresh connection next)
        return self.left_open


def in_transaction(db: Any) -> bool:
    """True when Django connection ``db`` is inside a caller's transaction (an ``atomic()``
    block, or autocommit off). Opens no connection."""
    if db.in_atomic_block:
        return True
    if db.connection is None:
        return not db.settings_dict.get("AUTOCOMMIT", True)
    return not db.autocommit


class UserConnection:
    """A second Django connection of one thread, for user code, so that user code never shares a
    session or a transaction with the runtime's own statements (an agent handler calls back
    into the runtime, ``ctx.call``, from the middle of its own code)::

        lane = UserConnection()
        with lane:                  # the thread's default connection is the user's in here
            with lane.runtime():    # and the runtime's again in here (its journal, its leases)
                ...
        lane.close()                # when the thread is done with it

    A handler that leaves a transaction open, turns autocommit off, sets ``statement_timeout`` or
    has its connection terminated does it to its own connection: the runtime's statements
    commit (or fail) on theirs. Called inside a caller's transaction (a test's), user code runs
    on the caller's connection, as before: a second connection would not see that transaction's
    rows. Only the thread that entered the lane swaps connections; :meth:`runtime` from another
    thread (a handler's own threads) is a no-op: that thread's statements use its own connection.
    """

    __slots__ = ("_owner", "_runtime_db", "_swapped", "_user_db")

    def __init__(self) -> None:
        self._user_db: Any = None
        self._runtime_db: Any = None
        self._swapped = False
        self._owner: int | None = None

    def __enter__(self) -> UserConnection:
        if self._swapped:
            raise RuntimeError("this UserConnection is entered already")
        runtime = connections[DEFAULT_DB_ALIAS]
        if runtime is self._user_db or in_transaction(runtime):
            return self  # shared: see the class docstring
        if self._user_db is None:
            self._user_db = connections.create_connection(DEFAULT_DB_ALIAS)
        self._runtime_db, self._owner, self._swapped = runtime, threading.get_ident(), True
        connections[DEFAULT_DB_ALIAS] = self._user_db
        return self

    def __exit__(self, *exc: object) -> None:
        if self._swapped:
            self._swapped = False
            connections[DEFAULT_DB_ALIAS] = self._runtime_db

    @contextlib.contextmanager
    def runtime(self) -> Iterator[None]:
        """The runtime's connection as the thread's default for the block (inside the lane)."""
        if not self._swapped or threading.get_ident() != self._owner:
            yield
            return
        user = connections[DEFAULT_DB_ALIAS]
        connections[DEFAULT_DB_ALIAS] = self._runtime_db
        try:
            yield
        finally:
            connections[DEFAULT_DB_ALIAS] = user

    def close(self) -> None:
        """Close the user's connection (whatever its state); the lane opens a new one if entered again."""
        user, self._user_db = self._user_db, None
        if user is not None:
            discard_connection(user)


# --- async def handlers ---------------------------------------------------------------------------
#
# An ``async def`` handler runs on the worker's event loop thread, and its database statements
# (the async ORM, ``sync_to_async``, ``asyncio.to_thread``) run on executor threads that every
# async handler of the worker shares, whatever its community. The scope cannot be a block around
# the handler on one connection, as for a plain handler: it follows the handler's task instead.
# :class:`AsyncUserCode` names the handler's community in a context variable of the handler's
# task (its child tasks and the calls ``sync_to_async`` sends to a thread copy it), and the
# worker's executor threads (:class:`ScopedExecutor`) carry an ``execute_wrapper`` that sends each
# statement with that community's context (``tenancy.run_statement_in``): no state stays on the
# shared connection between two statements, so handlers of different communities interleaved on
# one thread each read and write their own community's rows only. After each call a thread
# ran, the connection is judged and cleaned as :class:`UserCode` does after a plain handler (a
# transaction left open is rolled back, the connection discarded, and the delivery whose call it
# was fails; session state is discarded), so nothing one call leaves reaches the next, another
# community's. The plain handler threads never see any of this (no per-statement cost there).

# Seconds ScopedExecutor.close waits for calls still running on its threads.
CLOSE_WAIT_SECONDS = 5.0
# Seconds ScopedExecutor.close gives a call whose statement it cancelled (and the cancel request) to end.
CANCEL_WAIT_SECONDS = 1.0

_ASYNC_CALL: contextvars.ContextVar[AsyncUserCode | None] = contextvars.ContextVar(
    "buzz_delivery_async_user_code", default=None
)
_THREAD = threading.local()  # ``guard``: the call a ScopedExecutor thread is running (a _ThreadCall)


class AsyncUserCode:
    """``with AsyncUserCode(community_id) as call: await handler(...)``, entered in the handler's
    own task: the statements the handler sends through a :class:`ScopedExecutor`'s threads run
    in the handler's tenancy scope (:func:`~buzz_delivery.services.tenancy.handler`'s target).
    Then ``call.left_open`` is None, or what one of its calls left open on a thread's connection
    (rolled back there, its connection discarded). Exceptions pass through."""

    __slots__ = ("_token", "left_open", "target")

    def __init__(self, community_id: uuid.UUID | str, target: tenancy.Target | None = None) -> None:
        """``target``: ``tenancy.handler_target(community_id)``, if the caller already has it
        (the worker makes one per community and claim batch: it reads the settings)."""
        self.target = tenancy.handler_target(community_id) if target is None else target
        self.left_open: str | None = None

    def __enter__(self) -> AsyncUserCode:
        self._token = _ASYNC_CALL.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ASYNC_CALL.reset(self._token)


# DISCARD ALL but its CLOSE ALL: the cursors open on a shared thread's connection are other
# handlers' too (an ``aiterator()`` reads its server-side cursor a chunk per call, with other
# communities' calls in between); a cursor holds the rows of the scope it was opened in.
_RESET_KEEPING_CURSORS = (
    "SET SESSION AUTHORIZATION DEFAULT; RESET ALL; DEALLOCATE ALL; UNLISTEN *;"
    " SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES"
)


class _ThreadCall(_Guard):
    """One call a :class:`ScopedExecutor` thread runs: the handler's :class:`AsyncUserCode` that
    sent it (None: sent from outside any handler), judged on its way out as a plain handler is
    (its session reset keeps the connection's open cursors: :data:`_RESET_KEEPING_CURSORS`)."""

    __slots__ = ("call",)
    _SESSION_RESET = _RESET_KEEPING_CURSORS

    def __init__(self, call: AsyncUserCode | None, db: Any) -> None:
        self.call = call
        self._depth = len(db.atomic_blocks)
        self._in_transaction = in_transaction(db)
        self.session_touched = False


def _scoped_statement(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
    """The ``execute_wrapper`` of a :class:`ScopedExecutor` thread's connection: the statement
    runs in the scope of the handler whose context it runs in (else of the handler that sent the
    call: ``loop.run_in_executor`` copies no context); with neither it is refused where
    row-level security is on (``tenancy.NoTenantScope``)."""
    call = _ASYNC_CALL.get()
    guard: _ThreadCall | None = getattr(_THREAD, "guard", None)
    if guard is not None:
        if call is None:
            call = guard.call
        if not guard.session_touched and SESSION_STATEMENT.search(sql if isinstance(sql, str) else str(sql)):
            guard.session_touched = True
    return tenancy.run_statement_in(None if call is None else call.target, execute, sql, params, many, context)


class ScopedExecutor(ThreadPoolExecutor):
    """The threads of the worker's event loop for async handlers' sync code: its default
    executor (``sync_to_async(thread_sensitive=False)``, ``asyncio.to_thread``,
    ``run_in_executor(None, ...)``) and, with ``max_workers=1``, its thread-sensitive one
    (``sync_to_async``'s default, the async ORM): see :func:`serve_loop`. Each call runs with
    the statement scope of the handler that sent it (the module's notes above), and the call's
    thread's connection is judged and cleaned after it. :meth:`close` ends the threads and
    closes their connections."""

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._dbs: list[tuple[threading.Thread, Any]] = []  # its threads, and the connection wrappers they used
        self._dbs_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:  # type: ignore[override]
        # Called in the sending task's context (``run_in_executor`` calls it there): its handler's.
        return super().submit(self._run, _ASYNC_CALL.get(), fn, args, kwargs)

    def _run(self, call: AsyncUserCode | None, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        db = connections[DEFAULT_DB_ALIAS]
        if _scoped_statement not in db.execute_wrappers:  # this thread's first call (or a new wrapper)
            db.execute_wrappers.insert(0, _scoped_statement)  # outermost: a services scope inside rules
            with self._dbs_lock:
                self._dbs.append((threading.current_thread(), db))
        guard = _ThreadCall(call, db)
        outer = getattr(_THREAD, "guard", None)
        _THREAD.guard = guard
        try:
            return fn(*args, **kwargs)
        finally:
            _THREAD.guard = outer
            problem = guard._clean(db)
            if problem is not None and call is not None and call.left_open is None:
                call.left_open = problem

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As ThreadPoolExecutor's, but ``wait`` waits for the running calls up to
        :data:`CLOSE_WAIT_SECONDS` only: ``asyncio.run`` shuts the loop's default executor down
        with ``wait=True`` when the loop ends, and a call a handler abandoned there (a
        ``wait_for`` around ``asyncio.to_thread``) would otherwise hold the worker's stop until it ends."""
        super().shutdown(wait=False, cancel_futures=cancel_futures)
        if wait:
            deadline = time.monotonic() + CLOSE_WAIT_SECONDS
            for thread in list(self._threads):
                thread.join(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """End the threads (calls not started are cancelled; running ones are waited for up to
        ``timeout`` seconds in all, then the statement each one's connection runs is cancelled
        on the server and the call waited for one second more) and close the connections of
        the threads that ended (a call still running, in Python code, keeps its thread and
        connection: the process's exit waits for the thread and closes them)."""
        self.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        with self._dbs_lock:
            dbs, self._dbs = self._dbs, []
        running = []
        for thread, db in dbs:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raw = db.connection
                if raw is not None:
                    with contextlib.suppress(Exception):  # (closed under us, or the server gone)
                        raw.cancel_safe(timeout=CANCEL_WAIT_SECONDS)
                running.append((thread, db))
            else:
                discard_connection(db)  # (its thread has ended: no one else uses it)
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        for thread, db in running:
            thread.join(max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                discard_connection(db)


@contextlib.contextmanager
def serve_loop(
    loop: asyncio.AbstractEventLoop, thread_name_prefix: str, pool_class: type[ScopedExecutor] = ScopedExecutor
) -> Iterator[tuple[ScopedExecutor, ...]]:
    """For the block, the running ``loop``'s executors are :class:`ScopedExecutor` threads:
    its default executor (a ``pool_class``), and asgiref's thread-sensitive executor for this
    loop (one thread, as asgiref's own: ``sync_to_async`` and the async ORM run there one call
    at a time). Call it from the loop's thread; close the executors (``close()``) once the loop
    has stopped."""
    shared = ScopedExecutor(1, f"{thread_name_prefix}-sync")
    pool = pool_class(None, f"{thread_name_prefix}-pool")
    loop.set_default_executor(pool)
    executors: Any = AsyncToSync.loop_thread_executors  # (typed for asgiref's own CurrentThreadExecutor)
    executors[loop] = shared
    try:
        yield shared, pool
    finally:
        if executors.get(loop) is shared:
            del executors[loop]

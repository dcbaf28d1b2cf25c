"""The agent runtime on an event loop (SPEC 12 "Runtime"): ``async def`` handlers, tools,
reconcile hooks and compensations, with the journal's guarantees of the threaded runtime
(:mod:`buzz_delivery.agents.runtime`).

:class:`AsyncContext` mirrors :class:`~buzz_delivery.agents.runtime.Context`:
``await ctx.call(tool_name, fn, args, *, compensate=None, reconcile=None, destructive=False,
cost=0)`` journals the call before making it and records its result; ``await
ctx.request_approval(prompt, deadline_seconds)`` parks the run; ``await ctx.emit(chunk)`` appends to
the run's output stream (one fenced statement on the worker's pool, as the threaded runtime's);
``ctx.cancelled`` is True once a cancel fenced the run (the worker also cancels the handler's
task, so an ``await`` in flight raises ``CancelledError`` and no further call is made). ``fn``,
``reconcile`` and compensations may be ``async def`` (awaited on the loop) or plain functions
(run on a thread, in the user's tenant scope, so they may use the ORM on their own connection).
Calls of one run made by several tasks are in flight at once (Pydantic AI's parallel tools, an
``asyncio.gather``), as the threaded runtime's threads are: only their journal writes are one at
a time (the run's journal lock, held from taking the call's index in its scope to its entry's
``seq``; the server gives the ``seq``, contiguous, and judges the budgets, one statement each;
a call's wait for its rate limit comes between, the lock let go: the index stays the call's);
their bodies and results are not (``emit`` keeps its own lock: one chunk at a time, in the
order asked). Each call is replayed by its scope and its
index in it (an asyncio task inherits the scope it was created in: docs/agents.md "Resume"), so
tasks that call at once replay correctly when each calls in a scope of its own. An approval
waits for the run's calls in flight, then parks under the journal lock; the handler's end waits
for them too (a call is recorded before the run completes or fails); a cancel (or a lost lease)
cancels the handler's task and the task of each call in flight.

No statement of the runtime runs on a connection of the user's code: the journal, results,
renewals, completions, failures and the steps of an unwinding (begin and finish each
compensation) go through the worker's :class:`~buzz_delivery.agents.batcher.Batcher` (batched
per community over a fixed pool of connections), and the rare transitions (approvals, emits)
through the same pool one at a time.

    async def handler(ctx):
        page = await ctx.call("fetch", fetch_page, {"url": ctx.input["url"]})
        summary = await ctx.call("llm", summarize, {"text": page["text"]}, cost=3)
        return {"summary": summary}

A plain ``def handler(ctx)`` works too: it runs on a thread and gets a :class:`SyncBridge`,
whose ``call`` / ``request_approval`` block that thread on the loop's coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from django.db import DatabaseError

from buzz_delivery import journal_scope
from buzz_delivery.agents import compensations
from buzz_delivery.agents import services as s
from buzz_delivery.agents.batcher import Batcher, DbPool, UsedConnections
from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.exceptions import (
    AgentError,
    ApprovalBlockedByCalls,
    ApprovalExpired,
    BudgetExhausted,
    LeftTransactionOpen,
    NestedCall,
    OutputLimitExceeded,
    ReplayMismatch,
    RunAborted,
    ToolCallFailed,
    UncertainCall,
)
from buzz_delivery.agents.models import JournalEntry
from buzz_delivery.agents.runtime import (
    APPROVAL_RETRY_SECONDS,
    APPROVAL_SETTLE_SECONDS,
    NOT_MADE,
    RATE_WAIT_SLICE_SECONDS,
    Context,
    RatePlan,
    ended_by,
    failure_code_of,
    failure_message_of,
    parked_turn,
    ratelimits_plan,
)
from buzz_delivery.agents.services import batch
from buzz_delivery.agents.services.common import sha256_json
from buzz_delivery.agents.services.output import chunk_value
from buzz_delivery.exceptions import in_chain
from buzz_delivery.services import ratelimits
from buzz_delivery.usercode import AsyncUserCode, UserCode
from buzz_delivery.worker.handlers import describe
from buzz_delivery.worker.renewer import DB_UNAVAILABLE

logger = logging.getLogger("buzz_delivery.agents")
T = TypeVar("T")

# A run's end or approval park waits for its calls in flight holding the journal lock (a task
# calling again and again is held back, not let in at each gap, which kept the end waiting for
# ever) for this long at first, then lets the calls waiting for the lock in and waits again for
# twice as long (an in-flight tool may wait for a call of another task: never a deadlock).
QUIET_HOLD_SECONDS = 0.5


class _Parked(BaseException):
    """Internal: the run parked on an approval; the handler stops here. A ``BaseException`` (as
    the thread runtime's); caught by the handler all the same, the runtime judges by its own
    record (``AsyncContext.parked``): the turn ends ``parked``."""


class Runtime:
    """What every context of one worker shares: the pool, the batcher, the loop, and the
    executor that runs the user's plain (sync) functions."""

    def __init__(self, pool: DbPool, batcher: Batcher, user_executor: Executor) -> None:
        self.pool = pool
        self.batcher = batcher
        self.user_executor = user_executor
        self.loop = asyncio.get_running_loop()
        self.user_connections = UsedConnections()  # opened by the user's plain code, closed at exit
        self.tool_threads = CallThreads(user_executor, self.user_connections)  # threads a call's async tool starts

    async def user_code(self, community_id: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the user's ``fn(*args)``: awaited when it is a coroutine function, else on a
        thread as :func:`plain_user_code` (the run's community scope, its connection cleaned)."""
        if inspect.iscoroutinefunction(fn):
            return await async_user_code(community_id, fn, *args)

        def in_scope() -> Any:
            return plain_user_code(self.user_connections, community_id, fn, *args)

        # In a copy of this context: a ctx.call the function makes through the SyncBridge sees
        # the call it runs in (_IN_CALL), and is refused, not left waiting for it.
        thread = self.user_executor.submit(contextvars.copy_context().run, in_scope)
        try:
            result = await asyncio.wrap_future(thread)
        except asyncio.CancelledError:
            # A cancel cannot stop a thread: one that started runs on. The call it runs in is
            # told (_OUTLIVING), so that call stays in flight until the thread ends.
            if not thread.cancel() and not thread.done():
                outliving = _OUTLIVING.get()
                if outliving is not None:
                    outliving.append(thread)
            raise
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            return await result
        return result


def plain_user_code(used: UsedConnections, community_id: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on this thread (one the worker's plain user code shares, whatever the
    community), as the delivery worker runs a plain handler: inside
    :class:`~buzz_delivery.usercode.UserCode` (the run's community as tenancy scope, the login's
    role), so nothing it leaves on the thread's connection reaches the next call there, maybe
    another community's: session state (``SET``, a ``TEMP`` table, prepared statements) is
    discarded; a transaction left open is rolled back, the connection discarded, and
    :class:`LeftTransactionOpen` raised in place of its result (chained to what it raised)."""
    used.note()
    call = UserCode(community_id)
    token = _RUN_COMMUNITY.set(community_id)
    try:
        with call:
            result = fn(*args)
    except BaseException as exc:
        if call.left_open is None or _runtime_stop(exc) is not None:
            raise  # (a park, a lost run through a plain handler's bridge: as async_user_code's)
        raise LeftTransactionOpen(_left_open_text(call.left_open)) from exc
    finally:
        _RUN_COMMUNITY.reset(token)
    if call.left_open is not None:
        raise LeftTransactionOpen(_left_open_text(call.left_open))
    return result


async def async_user_code(community_id: Any, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)`` inside :class:`~buzz_delivery.usercode.AsyncUserCode`, as the delivery
    worker awaits an ``async def`` handler: the statements it sends to the loop's threads (the
    async ORM, ``sync_to_async``, ``asyncio.to_thread``: :func:`~buzz_delivery.usercode.serve_loop`,
    set up by the event-loop worker) run in the run's community scope, however many communities'
    runs share those threads, and what one of them leaves open there is rolled back and raised as
    :class:`LeftTransactionOpen` (unless the code stopped on the runtime's own account: a park,
    a lost run, a cancel)."""
    call = AsyncUserCode(community_id)
    token = _RUN_COMMUNITY.set(community_id)
    try:
        with call:
            result = await fn(*args)
    except BaseException as exc:
        if call.left_open is None or _runtime_stop(exc) is not None:
            raise
        raise LeftTransactionOpen(_left_open_text(call.left_open)) from exc
    finally:
        _RUN_COMMUNITY.reset(token)
    if call.left_open is not None:
        raise LeftTransactionOpen(_left_open_text(call.left_open))
    return result


# The community of the run whose user code (handler, tool, hook, compensation) this code runs
# in: set by plain_user_code and async_user_code, for CallThreads outside any call.
_RUN_COMMUNITY: contextvars.ContextVar[Any] = contextvars.ContextVar("buzz_agents_run_community", default=None)


def _left_open_text(left_open: str) -> str:
    return (
        f"transaction_left_open: the code left its database connection with {left_open}; nothing it wrote there is kept"
    )


# The call whose tool (or reconcile) function this code runs in: (its context, its seq). Set
# around the user's function; a task or SyncBridge thread it starts inherits it.
_IN_CALL: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("buzz_agents_in_call", default=None)

# Set by a call around its functions: the threads of its plain functions that a cancel of its
# task left running (Runtime.user_code); the call lands once they end (AsyncContext._land_after).
_OUTLIVING: contextvars.ContextVar[list[Future[Any]] | None] = contextvars.ContextVar(
    "buzz_agents_outliving", default=None
)


class CallThreads(Executor):
    """The executor for the threads an async tool function starts (Pydantic AI's plain tools:
    the integration hands it to ``Agent.using_thread_executor`` inside the call): each thread
    is told to the call it runs for, as :meth:`Runtime.user_code`'s are, so a cancel of the
    call's task (a sibling tool raising) lands the call only once its thread ends, not while
    the tool may still make its effect. Its threads are the runtime's user executor's; what
    one runs for a call runs as :func:`plain_user_code` in the call's run's community (outside
    any call, in the community of the run whose code submits it: a handler's own threads share
    these with every community's calls too; submitted from no run's code, as it is)."""

    def __init__(self, inner: Executor, used: UsedConnections) -> None:
        self._inner = inner
        self._used = used

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        inside = _IN_CALL.get()
        community = _RUN_COMMUNITY.get() if inside is None else inside[0].lease.community_id
        if community is None:
            future = self._inner.submit(fn, *args, **kwargs)
        else:
            future = self._inner.submit(plain_user_code, self._used, community, functools.partial(fn, **kwargs), *args)
        outliving = _OUTLIVING.get()
        if outliving is not None:
            outliving.append(future)
        return future


class _Cancelled(Exception):
    """Internal: a call's tool ended (``output``, or raised ``error``) after its caller's task
    was cancelled by the handler's own code; recorded, then the cancellation goes on."""

    def __init__(self, output: Any, error: BaseException | None) -> None:
        super().__init__("the call's caller was cancelled")
        self.output, self.error = output, error


class AsyncContext:
    """What an async handler gets for one claimed run: ``run``, ``input``, ``shadow``, ``lease``
    (renewed by the worker), :meth:`call`, :meth:`request_approval`, :attr:`cancelled`.

    ``journal``: the run's entries, or None when they are not known yet (the worker's claim round
    did not read them): :func:`read_journal` reads them before the handler runs."""

    journal_scopes = True  # calls are replayed by scope (ctx.scope): integrations may run them at once

    def __init__(self, claim: s.AgentClaim, journal: list[JournalEntry] | None, runtime: Runtime) -> None:
        self.run = claim.run
        self.lease = claim.lease
        self.input = claim.run.input
        self.shadow = claim.run.shadow
        self.runtime = runtime
        self.lost = threading.Event()
        self._cancelled = threading.Event()
        self.reason = ""
        self.failure_code: str | None = None  # set by run_claim when it fails the run (for the worker's line)
        self.parked: Any = None  # the approval this turn parked on, once written (Context.parked)
        self._positions = journal_scope.Positions()  # each scope's last call (docs/agents.md "Resume")
        self._journal: dict[tuple[str, int], JournalEntry] | None = None
        if journal is not None:
            self.set_journal(journal)
        # One journal write (index taken, entry written, seq known) or approval park at a time; the
        # calls' bodies and results run at once. What it orders: a scope's indexes in the order its
        # calls are made (a rated call keeps its index through its wait, the lock let go, its seq
        # given after), and no call journaled while an approval parks the run.
        self._journaling = asyncio.Lock()
        # The calls in flight (journaled or replaying, not yet ended): each one's seq and task.
        self._flights: dict[object, tuple[int, asyncio.Task[Any] | None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.replayed = 0
        self.rate_waits = 0  # how many times a call waited for its rate limit
        self.task: asyncio.Task[Any] | None = None
        self._emitted_before = claim.run.output_chunks
        self._emit_pos = 0
        self._emit_lock = asyncio.Lock()
        # Until when (monotonic) the run is surely still held: set by the worker from the claim
        # and each renewal (the local time before the statement + the lease's seconds).
        self.held_until = math.inf

    @property
    def cancelled(self) -> bool:
        """True once the worker learnt the run was cancelled (the handler should stop)."""
        return self._cancelled.is_set()

    @property
    def journal_known(self) -> bool:
        return self._journal is not None

    def set_journal(self, journal: list[JournalEntry]) -> None:
        self._journal = {e.replay_key: e for e in journal}

    scope = staticmethod(Context.scope)

    def tools_journaled(self) -> list[tuple[str, str]]:
        """As :meth:`Context.tools_journaled <buzz_delivery.agents.runtime.Context.tools_journaled>`."""
        journal = self._journal or {}
        return [(k[0], e.tool_name) for k, e in sorted(journal.items()) if e.kind == "tool"]

    def journaled_cost(self, scope: str) -> int | None:
        """As :meth:`Context.journaled_cost <buzz_delivery.agents.runtime.Context.journaled_cost>`."""
        journal = self._journal or {}
        first = min(((k[1], e.cost) for k, e in journal.items() if k[0] == scope and e.kind == "tool"), default=None)
        return None if first is None else first[1]

    @property
    def tool_threads(self) -> Executor:
        """The executor for the threads a call's async tool function starts (:class:`CallThreads`)."""
        return self.runtime.tool_threads

    def _entry(self, key: tuple[str, int]) -> JournalEntry | None:
        if self._journal is None:  # never replay against a journal not read: no call is made
            self.mark_lost("journal_unknown")
            raise RunAborted("the run's journal was not read")
        return self._journal.get(key)

    def mark_lost(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.lost.set()
        if reason == "cancelled":
            self._cancelled.set()

    def _check(self) -> None:
        if self.parked is not None:  # the park was swallowed: nothing more under a released lease
            raise _Parked(self.parked)
        if self.lost.is_set():
            raise RunAborted("the run's lease was lost")

    async def _runtime(self, statement: Awaitable[T]) -> T:
        """``await statement``, a runtime statement on the worker's pool: one whose connection
        fails (a restart, a terminated backend) marks the run lost and raises
        :class:`RunAborted`, so the handler's failure is not recorded for it: its lease lapses
        and it resumes from its journal, as in the thread worker (``Context._runtime``)."""
        try:
            return await statement
        except DatabaseError as exc:
            logger.warning("db_error run=%s: %s; the run is left to its lease", self.lease.run_id, describe(exc))
            self.mark_lost("db_error")
            raise RunAborted(f"the runtime's database connection failed: {describe(exc)}") from exc

    async def call(
        self,
        tool_name: str,
        fn: Callable[..., Any],
        args: Any,
        *,
        compensate: Callable[..., Any] | None = None,
        reconcile: Callable[..., Any] | None = None,
        destructive: bool = False,
        cost: int = 0,
        rate_key: str | None = None,
        weight: int | Callable[[Any], int] = 1,
    ) -> Any:
        """Journal, make and record one tool call (or replay it); returns its output (None for
        a shadow-blocked call). ``fn(args, key)`` and ``reconcile(args, key)`` may be async.
        Raises :class:`ToolCallFailed`, :class:`BudgetExhausted`, :class:`UncertainCall`,
        :class:`ReplayMismatch` or :class:`RunAborted`. ``rate_key`` and ``weight``: as
        :meth:`Context.call <buzz_delivery.agents.runtime.Context.call>`; a wait for the rate
        limit is an ``asyncio.sleep`` (the loop serves other runs meanwhile) taken once the call
        has its index, with the journal lock let go (the run's other calls, its approval and its
        end go on meanwhile); its entry is written at that index once its units are granted."""
        rate = ratelimits_plan(rate_key, weight)
        self._refuse_nested(tool_name)
        scope = journal_scope.current_key()  # a deep path by its stable key
        async with self._journaling:
            self._check()
            # The index is the call's from here, whatever the wait below: a resumed handler makes
            # the scope's calls in the same order and replays each from its own entry (an index
            # taken once the units were granted went to whichever call of the scope came next).
            index = self._positions.take(scope)
            entry = self._entry((scope, index))
            waits = entry is None and rate is not None
            if waits:  # its compensation and its input checked before its take (a refusal spends its index)
                batch.prepare_call(
                    self.lease,
                    tool_name,
                    args,
                    cost=cost,
                    compensation=compensations.descriptor(compensate),
                    destructive=destructive,
                    scope=scope,
                    index=index,
                )
            else:
                outcome, cancelled = await self._journal_call(
                    entry, scope, index, tool_name, args, compensate, cost, destructive
                )
                # In flight from here (under the journal lock: an approval parking sees it).
                flight = self._take_off(entry.seq if entry is not None else getattr(outcome, "seq", 0))
        give_back: tuple[RatePlan, ratelimits.Granted] | None = None
        if waits:
            # A new call with a rate limit: its units taken with the lock let go, so the run's
            # other calls, its approval and its end do not wait for the provider's window; its
            # entry is written at its index once they are granted.
            assert rate is not None
            granted = await self._take_rate(rate)
            sent = False
            try:
                async with self._journaling:
                    self._check()
                    sent = True
                    outcome, cancelled = await self._journal_call(
                        None, scope, index, tool_name, args, compensate, cost, destructive
                    )
                    flight = self._take_off(getattr(outcome, "seq", 0))
            except (RunAborted, _Parked, asyncio.CancelledError) as exc:
                # Nothing journaled (lost, parked or cancelled before its write, or its write withdrawn
                # as its task was cancelled), unless the run was lost as its write was out: then
                # whether it was written is not known (a resumed run may make it): units spent.
                if not sent or (isinstance(exc, asyncio.CancelledError) and not self.lost.is_set()):
                    await self._give_back(rate, granted, raising=False)  # exc goes on, whatever it meets
                raise
            if not isinstance(outcome, s.Journaled) or cancelled:
                # Refused or shadow-blocked (its tool is never made), or closed 'not made' below:
                # its units given back where the call lands whatever this task's cancels (in
                # flight from its write, it keeps the run's end waiting until it lands).
                give_back = (rate, granted)
        if cancelled:  # written as its task was cancelled: its tool is not made
            await self._not_made(flight, outcome, give_back)
        outliving: list[Future[Any]] = []
        token = _OUTLIVING.set(outliving)
        try:
            if give_back is not None:
                await self._give_back(*give_back)
            with journal_scope.entered(journal_scope.inside_call(scope, index)):  # the tool's own scopes
                return await self._called(entry, outcome, tool_name, fn, args, reconcile, rate)
        finally:
            _OUTLIVING.reset(token)
            self._land_after(flight, outliving)

    async def _journal_call(
        self,
        entry: JournalEntry | None,
        scope: str,
        index: int,
        tool_name: str,
        args: Any,
        compensate: Callable[..., Any] | None,
        cost: int,
        destructive: bool,
    ) -> tuple[Any, bool]:
        """The call at ``(scope, index)`` journaled (none for a replayed ``entry``), the journal
        lock held: its outcome, and whether its task was cancelled while its entry was written
        (:meth:`_written`)."""
        if entry is not None:
            return None, False
        descriptor = compensations.descriptor(compensate)  # ValueError when not registered
        prepared = batch.prepare_call(
            self.lease,
            tool_name,
            args,
            cost=cost,
            compensation=descriptor,
            destructive=destructive,
            scope=scope,
            index=index,
        )
        outcome, cancelled = await self._written("journal", prepared, withdraw=True)
        self._check()
        return outcome, cancelled

    async def _written(self, op: str, item: Any, *, withdraw: bool) -> tuple[Any, bool]:
        """``op``'s outcome for ``item`` (a runtime statement through the batcher), and whether
        this task was cancelled meanwhile: :meth:`_outlasting`'s batcher form. Cancelled (by the
        handler's own code: a sibling's failure in a TaskGroup, a ``wait_for``) while ``item`` is
        still queued, it is withdrawn when ``withdraw`` (nothing written: ``CancelledError``).
        Once its batch is sent it cannot be, and a record is never withdrawn (its call would stay
        pending, no longer in flight: the run's end would wait for it, then fail
        ``calls_in_flight``): its outcome is awaited (a statement's time, further cancels
        included) and returned with True, for the caller to close what was written and then let
        the cancel go on. The run lost (cancelled, its lease lost): ``CancelledError`` at once,
        what was written left to the lease."""
        batcher = self.runtime.batcher
        future = batcher.queue(op, self.lease.community_id, self.lease.run_id, item)
        cancelled = False

        async def handed_back(outcome: Any) -> bool:
            nonlocal cancelled
            cancelled = True  # the caller closes what was written, then lets the cancel go on
            return True

        outcome = await self._outlasting(
            future, handed_back, withdraw=(lambda: batcher.withdraw(future)) if withdraw else None
        )
        return outcome, cancelled

    async def _pool_statement(
        self, landed: Callable[[T], Awaitable[bool]], fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)``, a runtime statement on the worker's pool, awaited by
        :meth:`_outlasting` (``landed`` judges its outcome when this task is cancelled meanwhile)."""
        statement = asyncio.ensure_future(self.runtime.pool.run(fn, *args, **kwargs))
        return await self._outlasting(statement, landed)

    async def _outlasting(
        self,
        statement: asyncio.Future[T],
        landed: Callable[[T], Awaitable[bool]],
        *,
        withdraw: Callable[[], bool] | None = None,
    ) -> T:
        """The outcome of ``statement``, a runtime statement already sent or queued (it commits
        whatever its awaiter does), awaited shielded from this task's cancels: the one form of
        the park's (:meth:`_park`), the emit's (:meth:`emit`), the rate take's
        (:meth:`_take_rate`) and the batcher's writes (:meth:`_written`).

        Its awaiter cancelled by the handler's own code (a sibling failing in a TaskGroup, a
        ``wait_for``'s timeout) as it runs: ``withdraw()`` is asked first, when given (a batcher
        write still queued: True, nothing written, the cancel goes on at once); else its outcome
        is awaited through further cancels (:meth:`_through_cancels`), handed to ``landed``
        (count the chunk written, give back the units granted, record the park...), and the
        cancel goes on (the ``CancelledError`` re-raised) unless ``landed`` says the outcome
        supersedes it (True: returned instead). The run lost (cancelled, its lease lost):
        ``CancelledError`` at once, ``statement`` cancelled, what it wrote left to the lease. A
        statement whose connection fails marks the run lost and raises :class:`RunAborted`
        (:meth:`_runtime`), cancelled meanwhile or not; one that raises anything else as it is
        awaited through a cancel (it refused what it was sent: nothing written) is logged and
        the cancel goes on (the ``CancelledError``, its cause that error), never replaced by it.

        Where its users differ, it is in ``landed`` only (behaviour kept as each had it):

        - the park's: a park written supersedes the cancel (returned: the run waits for its
          approval, its lease released, the handler stops on :class:`_Parked`); not parked, the
          cancel goes on, the run marked lost unless the outcome was ``CallsInFlight`` or
          ``BudgetExceeded`` (no retry of a ``CallsInFlight`` then: the cancel goes on);
        - the emit's: a chunk written advances the run's emit position (the emit lock held
          through it all: no next chunk beside it), ``TooLarge`` changes nothing, any other
          outcome marks the run lost; then the cancel goes on;
        - the rate take's: units granted are given back (:meth:`_give_back`, sent whatever this
          task's cancels; a ``Wait`` took nothing); then the cancel goes on;
        - the batcher's (:meth:`_written`): the only one with ``withdraw``; its outcome always
          supersedes the cancel here, returned to its caller with a flag, who closes what was
          written (a call closed ``not made``, a record kept) and raises a new
          ``CancelledError`` itself after that."""
        try:
            return await self._runtime(asyncio.shield(statement))
        except asyncio.CancelledError as cancel:
            if self.lost.is_set() or (withdraw is not None and withdraw()):
                statement.cancel()
                raise
            try:
                outcome = await self._through_cancels(statement)
            except RunAborted:
                raise  # its connection failed: the run lost, as were it not cancelled
            except Exception as exc:
                # The statement refused what it was sent (a key's limit lowered under the units
                # since the call asked, a bad argument): nothing written, and the cancel goes on,
                # never replaced by that error (asyncio.timeout, a TaskGroup judge it by its type).
                logger.warning("cancelled_statement_refused run=%s: %r", self.lease.run_id, exc)
                raise cancel from exc
            if await landed(outcome):
                return outcome
            raise

    async def _through_cancels(self, future: asyncio.Future[T]) -> T:
        """``future``'s outcome (a statement sent: it commits whatever its awaiter does), this
        task's cancels by the handler's own code waited through; the run lost, ``CancelledError``
        at once (what was written left to the lease), as when ``future`` is cancelled (a write
        asked back whose batch came back unwritten: :meth:`Batcher.withdraw`)."""
        while True:
            try:
                return await self._runtime(asyncio.shield(future))
            except asyncio.CancelledError:
                # future cancelled: a withdrawn write whose batch came back unwritten (nothing written)
                if self.lost.is_set() or future.cancelled():
                    future.cancel()
                    raise

    async def _not_made(
        self, flight: object, outcome: Any, give_back: tuple[RatePlan, ratelimits.Granted] | None = None
    ) -> None:
        """A call journaled as its task was cancelled (its write already sent): closed
        ``failed`` without its tool being made (in flight meanwhile, so the run's end waits for
        the close), then the cancel goes on. Not journaled (shadow-blocked: closed already, a
        budget's refusal: nothing written): the cancel goes on; refused for its lease, the run
        is marked lost first, as a call not cancelled is. ``give_back``: the rate units the
        call took, given back once it is closed."""
        try:
            if isinstance(outcome, s.Journaled):
                error = "not made: the call's task was cancelled as it was journaled"
                await self._record(outcome.seq, ok=False, error=error, started=time.monotonic())
            elif not isinstance(outcome, s.Blocked | s.BudgetExceeded):
                self.mark_lost(getattr(outcome, "reason", "") or "lost")
            if give_back is not None:  # closed or refused, never to be made: the units it took go back
                await self._give_back(*give_back, raising=False)  # the cancel goes on, whatever it meets
        finally:
            self._land(flight)
        raise asyncio.CancelledError

    def _take_off(self, seq: int) -> object:
        flight = object()
        self._flights[flight] = (seq, asyncio.current_task())
        self._idle.clear()
        return flight

    def _land_after(self, flight: object, threads: list[Future[Any]]) -> None:
        """Land ``flight`` now, or, when its task was cancelled while a plain function of it ran
        on a thread (a sibling's failure in a TaskGroup, Pydantic AI's parallel tools, a
        ``wait_for``), once that thread ends: until then its effect may still come, so the run
        neither fails (closing it uncertain, compensating it: the undo before the effect) nor
        completes nor parks."""
        running = [thread for thread in threads if not thread.done()]
        if not running:
            self._land(flight)
            return
        loop = self.runtime.loop

        def ended(_: Future[Any]) -> None:
            if all(thread.done() for thread in running):
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the worker's exit)
                    loop.call_soon_threadsafe(self._land, flight)

        for thread in running:
            thread.add_done_callback(ended)

    def _land(self, flight: object) -> None:
        self._flights.pop(flight, None)
        if not self._flights:
            self._idle.set()

    @property
    def calls_in_flight(self) -> tuple[int, ...]:
        """The seqs of this run's calls in flight (journaled or replaying, not yet ended)."""
        return tuple(sorted(seq for seq, _ in self._flights.values()))

    def cancel_tasks(self) -> None:
        """Cancel the handler's task and the task of each call in flight (a cancel, a lost lease,
        the handler's deadline): a call the handler started in a task of its own stops too."""
        tasks = [self.task, *(task for _, task in self._flights.values())]
        for task in dict.fromkeys(tasks):
            if task is not None and not task.done():
                task.cancel()

    async def wait_calls(self) -> None:
        """Until none of this run's calls is in flight (other tasks' calls run on, the lease
        renewed meanwhile); :class:`RunAborted` once the run is lost."""
        while self._flights:
            self._check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), APPROVAL_RETRY_SECONDS)
        self._check()

    @contextlib.asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """The journal lock, held with none of this run's calls in flight (as
        :meth:`request_approval` parks): a run's completion or failure is written under
        it, so no call of a task the handler left behind is journaled as it is (a call closed
        uncertain by the failure and undone while its tool then runs). They are waited for
        under the lock, a while at a time (``QUIET_HOLD_SECONDS``): waited for outside it, a
        task calling again and again took each gap and the run never ended; held until they
        end, a tool waiting for a call of another task would wait for ever. :class:`RunAborted`
        once the run is lost."""
        hold = QUIET_HOLD_SECONDS
        while True:
            async with self._journaling:
                if await self._calls_end_within(hold):
                    yield
                    return
            hold *= 2  # the calls waiting for the lock take it first (asyncio.Lock is fair)

    async def _calls_end_within(self, seconds: float) -> bool:
        """Whether none of this run's calls is in flight within ``seconds`` (the journal lock
        held); :class:`RunAborted` once the run is lost."""
        deadline = time.monotonic() + seconds
        while True:
            self._check()
            if not self._flights:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(left, APPROVAL_RETRY_SECONDS))

    async def _called(
        self,
        entry: JournalEntry | None,
        outcome: Any,
        tool_name: str,
        fn: Callable[..., Any],
        args: Any,
        reconcile: Callable[..., Any] | None,
        rate: RatePlan | None,
    ) -> Any:
        """The call once it holds its journal position: replayed, or made and recorded."""
        if entry is not None:
            return await self._replay(entry, tool_name, fn, args, reconcile)
        if isinstance(outcome, s.Blocked):
            return None
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted ({outcome.used}/{outcome.cap})")
        if not isinstance(outcome, s.Journaled):
            self.mark_lost(getattr(outcome, "reason", "") or "lost")
            raise RunAborted(f"cannot journal: {outcome}")
        output = await self._make(outcome.seq, outcome.idempotency_key, fn, args)
        if rate is not None and rate.after is not None:
            units = rate.units_after(output)
            await self._runtime(self.runtime.pool.run(ratelimits.charge, self.lease.community_id, rate.spec.key, units))
        return output

    def _refuse_nested(self, tool_name: str) -> None:
        """A call from inside one of this run's calls' tool functions (on its task, a task or a
        SyncBridge thread it starts): :class:`NestedCall` at once, nothing journaled. A resumed
        run replays the outer call from the journal without running its function, so the nested
        call's entry would never be consumed."""
        outer = _IN_CALL.get()
        if outer is not None and outer[0] is self:
            raise NestedCall(tool_name, outer[1])

    async def _user_fn(self, seq: int, fn: Callable[..., Any], *args: Any) -> Any:
        """The user's tool (or reconcile) function of call ``seq``, marked as running in it."""
        token = _IN_CALL.set((self, seq))
        try:
            return await self.runtime.user_code(self.lease.community_id, fn, *args)
        finally:
            _IN_CALL.reset(token)

    async def _take_rate(self, rate: RatePlan) -> ratelimits.Granted:
        """Take ``rate``'s units before the call, awaiting each :class:`Wait` (never a failure of
        the run); a lease lost or a cancel meanwhile stops the wait. Its task cancelled by the
        handler's own code as a take statement runs (it commits whatever its awaiter does), its
        outcome is awaited and the units it granted given back, then the cancel goes on
        (:meth:`_outlasting`; the run lost, what it took is left spent, as a write out when the
        run is lost)."""

        async def landed(taken: ratelimits.TakeOutcome) -> bool:
            if isinstance(taken, ratelimits.Granted):
                await self._give_back(rate, taken, raising=False)
            return False  # the cancel goes on

        while True:
            outcome = await self._pool_statement(
                landed, ratelimits.take, self.lease.community_id, rate.spec.key, rate.before
            )
            if isinstance(outcome, ratelimits.Granted):
                return outcome
            self.rate_waits += 1
            deadline = time.monotonic() + outcome.seconds
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(left, RATE_WAIT_SLICE_SECONDS))
                self._check()

    async def _give_back(self, rate: RatePlan, granted: ratelimits.Granted, *, raising: bool = True) -> None:
        """As :meth:`Context._give_back <buzz_delivery.agents.runtime.Context._give_back>`: the
        units of a call whose tool is never made (its journal write refused, withdrawn or closed
        'not made'; shadow-blocked) given back to their window, on the worker's pool. The
        statement is sent whatever this task's cancels meanwhile (they go on after it); a
        failure in the database only logs. One the settings refuse (``ValidationError``: the key
        removed, or its limit lowered under the units, since the take) raises to the caller;
        with ``raising`` False (a give-back on the way out of a cancel or a lost run, that
        exception pending) it only logs too: the cancel goes on, never replaced by it (or
        ``asyncio.timeout`` around the call raised this error, not ``TimeoutError``)."""
        if rate.before <= 0:
            return
        statement = asyncio.ensure_future(
            self.runtime.pool.run(
                ratelimits.give_back, self.lease.community_id, rate.spec.key, rate.before, granted.window_start
            )
        )
        try:
            await asyncio.shield(statement)
        except asyncio.CancelledError:
            statement.add_done_callback(lambda done: done.cancelled() or done.exception())  # no warning
            raise
        except DatabaseError as exc:
            logger.info("rate_give_back_refused run=%s key=%s: %s", self.lease.run_id, rate.spec.key, describe(exc))
        except Exception as exc:
            if raising:
                raise
            logger.warning("rate_give_back_refused run=%s key=%s: %r", self.lease.run_id, rate.spec.key, exc)

    async def _make(self, seq: int, key: str, fn: Callable[..., Any], args: Any) -> Any:
        started = time.monotonic()
        try:
            output = await self._ended(asyncio.ensure_future(self._user_fn(seq, fn, args, key)))
        except asyncio.CancelledError:
            raise
        except _Cancelled as cancelled:  # the tool ended after its caller was cancelled: recorded
            if cancelled.error is None:
                await self._record(seq, ok=True, output=cancelled.output, started=started)
            elif not (self.lost.is_set() and in_chain(cancelled.error, RunAborted) is not None):
                await self._record(seq, ok=False, error=failure_message_of(cancelled.error), started=started)
            raise asyncio.CancelledError from cancelled.error
        except Exception as exc:
            if self.lost.is_set() and in_chain(exc, RunAborted) is not None:
                # The runtime stopped the tool (its own ctx.emit or ctx.call met a failed
                # connection or a lost lease): its call stays pending, as in the thread worker.
                raise RunAborted(f"the run was lost during call {seq}") from exc
            await self._record(seq, ok=False, error=failure_message_of(exc), started=started)
            raise ToolCallFailed(f"{seq}: {exc}") from exc
        await self._record(seq, ok=True, output=output, started=started)
        return output

    async def _ended(self, tool: asyncio.Future[Any]) -> Any:
        """The tool's output. Its caller cancelled by the handler's own code (a framework that
        cancels a call's task when another raises: the OpenAI Agents SDK's, Pydantic AI's), not
        by the worker (the run lost or cancelled: the tool is cancelled too), the tool runs to
        its end and raises :class:`_Cancelled` with its outcome,
        to be recorded: a plain function's thread runs on whatever its awaiter does, and the
        run failed meanwhile would compensate the call before its effect was made."""
        try:
            return await asyncio.shield(tool)
        except asyncio.CancelledError:
            if self.lost.is_set():
                tool.cancel()
                raise
        while True:
            try:
                output = await asyncio.shield(tool)
            except asyncio.CancelledError:
                if self.lost.is_set():
                    tool.cancel()
                    raise
                continue
            except Exception as exc:
                raise _Cancelled(None, exc) from exc
            raise _Cancelled(output, None)

    async def _record(self, seq: int, *, started: float, **kwargs: Any) -> None:
        latency = int((time.monotonic() - started) * 1000)
        prepared = batch.prepare_result(self.lease, seq, latency_ms=latency, **kwargs)
        outcome, cancelled = await self._written("record", prepared, withdraw=False)
        if not isinstance(outcome, (s.Recorded, s.AlreadyRecorded)):
            self.mark_lost(getattr(outcome, "reason", "") or "lost")
            raise RunAborted(f"cannot record call {seq}: {outcome}")
        if cancelled:  # recorded all the same (the call lands after it), then the cancel goes on
            raise asyncio.CancelledError

    async def _replay(self, entry: JournalEntry, tool_name: str, fn: Any, args: Any, reconcile: Any) -> Any:
        if entry.kind != "tool" or entry.tool_name != tool_name or bytes(entry.input_hash) != sha256_json(args):
            raise ReplayMismatch(f"call {entry.seq} was {entry.kind} {entry.tool_name!r}, now {tool_name!r}")
        if entry.status == "succeeded":
            self.replayed += 1
            return entry.output
        if entry.status == "failed":
            if entry.blocked_reason:
                return None
            raise ToolCallFailed(f"{entry.seq}: {entry.error}")
        # pending: its holder crashed between journaling and recording.
        if reconcile is None:
            await self._record(
                entry.seq, ok=False, uncertain=True, error="uncertain: no reconcile hook", started=time.monotonic()
            )
            raise UncertainCall(f"call {entry.seq} ({tool_name}) may or may not have happened")
        started = time.monotonic()
        found = await self._user_fn(entry.seq, reconcile, args, entry.idempotency_key)
        if found is NOT_MADE:
            return await self._make(entry.seq, entry.idempotency_key, fn, args)
        await self._record(entry.seq, ok=True, output=found, started=started)
        return found

    async def emit(self, chunk: str) -> int | None:
        """As :meth:`Context.emit <buzz_delivery.agents.runtime.Context.emit>`: appends ``chunk`` to
        the run's output stream under its lease (one fenced statement on the worker's pool);
        returns its ``seq``, None for an empty chunk."""
        if isinstance(chunk, str) and not chunk:
            return None
        chunk_value(chunk, get_settings().max_chunk_bytes)
        async with self._emit_lock:
            self._check()
            if self._emit_pos < self._emitted_before:
                self._emit_pos += 1
                return self._emit_pos

            # Its task cancelled by the handler's own code (a sibling failing in a TaskGroup, a
            # wait_for's timeout) as the statement runs, the chunk may still be written: its
            # outcome is awaited (a statement's time, further cancels included: _outlasting), the
            # position advanced for a chunk written, the lock held meanwhile (no next chunk's
            # statement beside it: one at a time, in the order asked), then the cancel goes on.
            async def landed(written: Any) -> bool:
                if isinstance(written, s.Emitted):
                    self._emit_pos = written.seq
                elif not isinstance(written, s.TooLarge):
                    self.mark_lost(getattr(written, "reason", "") or "lost")
                return False  # the cancel goes on

            outcome = await self._pool_statement(landed, s.emit_output, self.lease, chunk)
            if isinstance(outcome, s.Emitted):
                self._emit_pos = outcome.seq
                return outcome.seq
        if isinstance(outcome, s.TooLarge):
            raise OutputLimitExceeded(f"{outcome.field}: {outcome.used} + {outcome.size} bytes is over {outcome.cap}")
        self.mark_lost(getattr(outcome, "reason", "") or "lost")
        raise RunAborted(f"cannot emit: {outcome}")

    async def request_approval(self, prompt: str = "", deadline_seconds: int = 86400) -> dict[str, Any]:
        """As :meth:`Context.request_approval <buzz_delivery.agents.runtime.Context.request_approval>`:
        parks the run the first time; returns the decision when the run is resumed."""
        outer = _IN_CALL.get()
        if outer is not None and outer[0] is self:  # that call cannot end while the approval waits
            raise ApprovalBlockedByCalls((outer[1],), "asked from inside a ctx.call of this run")
        scope = journal_scope.current_key()  # a deep path by its stable key
        # The calls in flight are waited for under the journal lock, a while at a time (as
        # quiet(): waited for outside it, a task calling again and again took each gap and the
        # approval waited for ever); the park is under it, none in flight, as the thread
        # runtime's: no call journaled while the run parks.
        hold = QUIET_HOLD_SECONDS
        while True:
            async with self._journaling:
                self._check()
                entry = self._entry((scope, self._positions.peek(scope)))
                if entry is not None or await self._calls_end_within(hold):
                    index = self._positions.take(scope)
                    if entry is None:
                        outcome = await self._park(prompt, deadline_seconds, scope, index)
                    break
            hold *= 2
        if entry is not None:
            if entry.kind != "approval":
                raise ReplayMismatch(f"entry {entry.seq} is a {entry.tool_name!r} call, not an approval")
            if entry.status == "succeeded":
                self.replayed += 1
                return dict(entry.output or {})
            if entry.status == "failed":
                raise ApprovalExpired("the approval expired without a decision")
            raise RunAborted("the approval is still pending")
        if isinstance(outcome, s.ApprovalRequested):
            self.parked = outcome.approval_id
            raise _Parked(outcome.approval_id)
        if isinstance(outcome, s.BudgetExceeded):
            raise BudgetExhausted(f"{outcome.budget} budget exhausted")
        self.mark_lost(getattr(outcome, "reason", "") or "lost")
        raise RunAborted(f"cannot request an approval: {outcome}")

    async def _park(self, prompt: str, deadline_seconds: int, scope: str, index: int) -> Any:
        """``request_approval`` (none of this run's calls in flight, the journal lock held); the
        server may still see the last one's result being recorded as the park reads: ask again
        shortly, for at most ``APPROVAL_SETTLE_SECONDS``."""
        settle = time.monotonic() + APPROVAL_SETTLE_SECONDS

        # Its task cancelled by the handler's own code (a sibling failing in a TaskGroup) as the
        # statement runs, the park still commits: its outcome is awaited (_outlasting), and a
        # park written is the park (_Parked, the cancel superseded: the run waits for its
        # approval, its lease released), not a cancel the worker would take for a failure it
        # cannot write. Not parked, the cancel goes on.
        async def landed(parked: Any) -> bool:
            if isinstance(parked, s.ApprovalRequested):
                return True  # the park supersedes the cancel
            if not isinstance(parked, s.CallsInFlight | s.BudgetExceeded):
                self.mark_lost(getattr(parked, "reason", "") or "lost")
            return False

        while True:
            outcome = await self._pool_statement(
                landed,
                s.request_approval,
                self.lease,
                prompt=prompt,
                deadline_seconds=deadline_seconds,
                scope=scope,
                index=index,
            )
            if not isinstance(outcome, s.CallsInFlight):
                return outcome
            if time.monotonic() > settle:
                raise ApprovalBlockedByCalls(outcome.seqs, "journaled and never recorded, no call running")
            await asyncio.sleep(APPROVAL_RETRY_SECONDS)
            self._check()


class SyncBridge:
    """What a plain ``def handler(ctx)`` gets in the event-loop worker: the
    :class:`AsyncContext`'s calls, blocking the handler's thread (never the loop)."""

    scope = staticmethod(Context.scope)

    def __init__(self, actx: AsyncContext) -> None:
        self._actx = actx
        self.run, self.input, self.shadow = actx.run, actx.input, actx.shadow

    def tools_journaled(self) -> list[tuple[str, str]]:
        return self._actx.tools_journaled()

    def journaled_cost(self, scope: str) -> int | None:
        return self._actx.journaled_cost(scope)

    @property
    def lease(self) -> s.AgentLease:
        return self._actx.lease

    @property
    def lost(self) -> threading.Event:
        return self._actx.lost

    @property
    def cancelled(self) -> bool:
        return self._actx.cancelled

    @property
    def replayed(self) -> int:
        return self._actx.replayed

    def _wait(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._actx.runtime.loop)
        try:
            return future.result()
        except FutureCancelled:
            # A cancel, a lost lease or the handler's deadline cancelled the call's task: the
            # handler hears RunAborted, as the thread worker's does (not an Exception it may take
            # for a tool's failure and go on with).
            if self._actx.lost.is_set():
                raise RunAborted(f"the run was lost ({self._actx.reason})") from None
            raise

    def call(self, tool_name: str, fn: Callable[..., Any], args: Any, **kwargs: Any) -> Any:
        """As :meth:`AsyncContext.call` (``fn`` runs on another thread of the user's executor)."""
        return self._wait(self._actx.call(tool_name, fn, args, **kwargs))

    def emit(self, chunk: str) -> int | None:
        """As :meth:`AsyncContext.emit`."""
        return self._wait(self._actx.emit(chunk))

    def request_approval(self, prompt: str = "", deadline_seconds: int = 86400) -> dict[str, Any]:
        """As :meth:`AsyncContext.request_approval`."""
        return self._wait(self._actx.request_approval(prompt, deadline_seconds))


async def _fail(runtime: Runtime, lease: s.AgentLease, code: str, message: str | None = None) -> batch.FailOutcome:
    """``fail_run`` through the batcher (``fail_runs``: each run locked, then fenced by its own
    lease): the single form's outcome. Bad text raises ``ValidationError`` here, as it would."""
    prepared = batch.prepare_failure(lease, code, message)
    return await runtime.batcher.submit("fail", lease.community_id, lease.run_id, prepared)


async def unwind(runtime: Runtime, lease: s.AgentLease, seqs: tuple[int, ...]) -> str:
    """As :func:`buzz_delivery.agents.runtime.unwind`, with async or plain compensations:
    ``compensated``, ``compensation_failed`` or ``lost``. Each step (begin, finish, the run's
    end) goes through the batcher, batched with the other runs' unwinding at that step."""
    submit = runtime.batcher.submit
    community, run_id = lease.community_id, lease.run_id
    result = "compensated"
    for seq in seqs:
        began = await submit("begin_compensation", community, run_id, batch.prepare_compensation_begin(lease, seq))
        if isinstance(began, batch.NotNext):
            continue
        if not isinstance(began, dict):
            return "lost"
        # A stored name is looked up in this process's registry, never imported (issue 27).
        function = compensations.resolve(began["compensation"])
        try:
            if function is None:
                raise LookupError(compensations.unregistered_error(began["compensation"]))
            await runtime.user_code(lease.community_id, function, began["args"], began["output"], began["key"])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit included: this compensation's failure, never the worker's
            # Made storable and cut as the thread worker makes it: text the database cannot take
            # would raise here and end this run's task, to be reclaimed and compensated again.
            error = failure_message_of(exc)
            logger.warning("compensation_failed run=%s seq=%s: %s", lease.run_id, seq, error[:200])
            failing = batch.prepare_compensation_finish(lease, seq, ok=False, error=error)
            if not isinstance(
                await submit("finish_compensation", community, run_id, failing), s.Recorded | s.AlreadyRecorded
            ):
                return "lost"
            result = "compensation_failed"
            break
        done = batch.prepare_compensation_finish(lease, seq, ok=True)
        if not isinstance(await submit("finish_compensation", community, run_id, done), s.Recorded | s.AlreadyRecorded):
            return "lost"
    final = await _fail(runtime, lease, "compensated")
    if isinstance(final, s.Unwinding):
        return await unwind(runtime, lease, final.seqs)
    return result if isinstance(final, (s.Finished, s.AlreadyTerminal)) else "lost"


async def _invoke(handler: Callable[..., Any], ctx: AsyncContext) -> Any:
    if inspect.iscoroutinefunction(handler):
        return await async_user_code(ctx.lease.community_id, handler, ctx)
    bridge = SyncBridge(ctx)

    def in_scope() -> Any:
        return plain_user_code(ctx.runtime.user_connections, ctx.lease.community_id, handler, bridge)

    result = await ctx.runtime.loop.run_in_executor(ctx.runtime.user_executor, in_scope)
    return await result if inspect.isawaitable(result) else result


async def read_journal(runtime: Runtime, ctx: AsyncContext, *, retry_for: float, pause: float) -> bool:
    """Read the journal of ``ctx``'s run before its handler runs (the worker's claim round could
    not); whether it was read. A read whose connection fails (a restart, a terminated backend) is
    retried on a fresh connection every ``pause`` seconds for up to ``retry_for`` seconds while the
    run is held (its lease renewed meanwhile), so the run starts within the attempt it was claimed
    for. Past that, on another database error, or once the run is lost, it is marked lost and
    left to its lease, as a runtime statement failing mid-run is. "Held" is ``ctx.held_until``
    (the claim's or last renewal's time + the lease): a read that comes through after it (the
    renewals failed too) starts no handler on a lease the database may have handed on."""
    run_id = ctx.lease.run_id
    until = time.monotonic() + retry_for
    while not ctx.lost.is_set():
        try:
            journals = await runtime.pool.run(batch.journals_of, ctx.lease.community_id, [run_id])
        except DatabaseError as exc:
            if not isinstance(exc, DB_UNAVAILABLE) or time.monotonic() >= min(until, ctx.held_until):
                logger.warning("db_error run=%s: %s; the run is left to its lease", run_id, describe(exc))
                ctx.mark_lost("db_error")
                return False
            logger.warning("journal_read_failed run=%s: %s; retried in %.1f s", run_id, describe(exc), pause)
            await asyncio.sleep(pause)
            continue
        if time.monotonic() >= ctx.held_until:
            logger.warning("lease_lapsed run=%s: its journal was read past its lease; the run is left to it", run_id)
            ctx.mark_lost("lease_lapsed")
            return False
        ctx.set_journal(journals.get(run_id, []))
        return True
    return False


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, nested groups flattened (``exc`` alone when it
    is none)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _runtime_stop(exc: BaseException) -> str | None:
    """How the runtime's own control flow ended a handler that raised ``exc``: ``parked`` (the
    run parked on an approval), ``lost`` (:class:`RunAborted`, a cancel), or None (the handler's
    own failure). An exception group (``asyncio.TaskGroup``, a framework running tools at once)
    is judged by its leaves: one park among them is the park, whatever else its siblings
    raised (the park is written: the run waits for its approval, its lease released, so no
    failure of it can be written by this holder: those are logged); all of them the runtime's
    stops is ``lost``; any other leaf, with none parked, is the handler's failure, as before."""
    leaves = _leaves(exc)
    if any(isinstance(leaf, _Parked) for leaf in leaves):
        return "parked"
    if all(isinstance(leaf, RunAborted | asyncio.CancelledError) for leaf in leaves):
        return "lost"
    return None


async def run_claim(runtime: Runtime, ctx: AsyncContext, handler: Callable[..., Any]) -> str:
    """Run one claimed run to its next resting point: ``completed``, ``failed``, ``compensated``,
    ``compensation_failed``, ``parked``, ``lost``. The handler raising fails this run only."""
    if ctx.run.unwinding:
        ctx.failure_code = ctx.run.failure_code or "unwinding"
        outcome = await _fail(runtime, ctx.lease, ctx.failure_code)
        if isinstance(outcome, s.Unwinding):
            return await unwind(runtime, ctx.lease, outcome.seqs)
        return "failed" if isinstance(outcome, s.Finished) else "lost"
    if not ctx.journal_known:  # no handler without its journal (read_journal first)
        ctx.mark_lost("journal_unknown")
        return "lost"
    try:
        output = await _invoke(handler, ctx)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt... from user code: this run fails alone
        stop = _runtime_stop(exc)
        if stop != "parked" and ctx.parked is not None:  # the park written, swallowed on its way
            return parked_turn(ctx.lease, ctx.parked, ended_by(exc))
        if stop == "parked":
            if isinstance(exc, BaseExceptionGroup):
                others = [leaf for leaf in _leaves(exc) if not isinstance(leaf, _Parked)]
                if others:
                    logger.warning(
                        "parked_with_errors run=%s: the run parked; its handler also raised %s",
                        ctx.lease.run_id,
                        "; ".join(f"{type(leaf).__name__}: {str(leaf)[:200]}" for leaf in others),
                    )
            return "parked"
        if stop == "lost":
            return "lost"
        # Storable and cut, as the thread worker's (an AgentError's own code included).
        code = failure_code_of(exc) if isinstance(exc, AgentError) else "handler_error"
        if ctx.lost.is_set():
            return "lost"
        # A call of a task the handler started and left in flight is recorded first (failed
        # under it, the call was marked uncertain and compensated while the tool still ran: the
        # undo before the effect), as in the thread worker; and the failure is written under the
        # journal lock, so such a task's next call is not journaled as it is (closed uncertain
        # and undone by it, then made): it is refused after it.
        try:
            async with ctx.quiet():
                ctx.failure_code = code
                failed = await _fail(runtime, ctx.lease, code, failure_message_of(exc))
        except RunAborted:
            return "lost"
        if isinstance(failed, s.Unwinding):
            return await unwind(runtime, ctx.lease, failed.seqs)
        return "failed" if isinstance(failed, s.Finished) else "lost"
    if ctx.parked is not None:  # it returned after swallowing its park: the run waits all the same
        return parked_turn(ctx.lease, ctx.parked, ended_by(None))
    # A call the handler started in a task of its own and did not await is recorded first
    # (completed under it, its result could never be recorded, and with it alone in flight the
    # run is not 'running': the completion was refused, the run run again); the completion is
    # written under the journal lock (none journaled as it is: a later one is refused after it).
    try:
        prepared = batch.prepare_completion(ctx.lease, output)
    except Exception as exc:  # an output that cannot be stored fails this run
        try:
            async with ctx.quiet():
                ctx.failure_code = "handler_error"
                failed = await _fail(runtime, ctx.lease, "handler_error", failure_message_of(exc))
        except RunAborted:
            return "lost"
        if isinstance(failed, s.Unwinding):
            return await unwind(runtime, ctx.lease, failed.seqs)
        return "failed" if isinstance(failed, s.Finished) else "lost"
    # While the server still sees calls of this holder in flight (a call whose task was
    # cancelled as it was journaled, or while its async function ran), ask again for a bounded
    # time, then fail the run (its calls closed uncertain): never a run lost silently.
    settle = time.monotonic() + APPROVAL_SETTLE_SECONDS
    while True:
        try:
            async with ctx.quiet():
                done = await runtime.batcher.submit("complete", ctx.lease.community_id, ctx.lease.run_id, prepared)
                if not isinstance(done, s.CallsInFlight):
                    return "completed" if isinstance(done, s.Finished) else "lost"
                if time.monotonic() > settle or ctx.lost.is_set():
                    ctx.failure_code = "calls_in_flight"
                    seqs = ", ".join(map(str, done.seqs))
                    message = f"call(s) {seqs} of this run were never recorded; cannot complete"
                    failed = await _fail(runtime, ctx.lease, "calls_in_flight", message)
                    break
        except RunAborted:
            return "lost"
        await asyncio.sleep(APPROVAL_RETRY_SECONDS)
    if isinstance(failed, s.Unwinding):
        return await unwind(runtime, ctx.lease, failed.seqs)
    return "failed" if isinstance(failed, s.Finished) else "lost"

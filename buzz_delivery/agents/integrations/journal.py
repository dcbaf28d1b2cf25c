"""What every framework integration needs of a run's context, from the agent's event loop
(issue 35): a journaled call whose body is async, an approval and the output stream, the same
under the threaded runtime (:class:`ThreadJournal`) and the event-loop one (:class:`AsyncJournal`).

- :func:`idempotency_key`: inside a journaled call's body (a tool, a model request), the journal's
  key of that call; :func:`inside_call` says a body is running, so that what it calls itself (an
  agent used as a tool) is part of that call, not journaled again.
- :class:`ThreadJournal`: today's runtime calls the handler on a worker thread and journals on
  that thread's connection. The agent runs on an event loop of its own in a helper thread
  (:func:`run_threaded`, started in the handler thread's context: its journal scope, so an agent
  run by a tool on a thread in a ``ctx.scope`` of its own journals inside that scope); each call
  crosses a queue to the handler's thread, which makes the
  journal writes and runs the call's body back on the loop. While a body runs, the handler's
  thread keeps serving the queue, so a body may write the output stream (``emit``) as it goes.
- :class:`AsyncJournal`: an async runtime's ``ctx`` (``await ctx.call(...)``), called directly.
- :func:`tool_call_scope`: the replay scope a framework's tool call is journaled in, so the
  tool calls of one model response may run at once (each replayed from its own scope's entries).
- :class:`Durability`: one run's journal as an integration's model and tool wrappers call it
  (the usage cost of responses not yet charged goes with the next call).
- :class:`Chunks`: the run's output stream as an integration writes it, with the positions a
  resumed handler must reproduce (chunks already written are counted, not written again).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import decimal
import inspect
import json
import math
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

from pydantic_core import to_jsonable_python

from buzz_delivery import journal_scope
from buzz_delivery.agents import compensations as registry
from buzz_delivery.agents.exceptions import ApprovalBlockedByCalls
from buzz_delivery.agents.runtime import NOT_MADE
from buzz_delivery.agents.tool_threads import ToolThreads, noting_threads  # noqa: F401  (re-exported)

__all__ = [
    "AsyncJournal",
    "Chunks",
    "Durability",
    "Journal",
    "ThreadJournal",
    "as_stored",
    "idempotency_key",
    "inside_call",
    "journal_for",
    "journaled_in_order",
    "run_threaded",
    "tool_call_scope",
]

T = TypeVar("T")
AsyncBody = Callable[[Any, str], Coroutine[Any, Any, Any]]
_current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("buzz_integration_key", default=None)

# Written for an interrupted model request made again (after its partial chunks) in token mode.
RESTARTED = "\n[interrupted: the model request was made again]\n"
# The text of a chunk a resumed handler counts but never writes (its position is written already).
_COUNTED = "[already written]"


def idempotency_key() -> str | None:
    """The journal's idempotency key (``<run id>:<seq>``) of the tool call or model request being
    made, inside a tool (or a model) run by a durable agent; ``None`` elsewhere. Pass it to the
    service the tool calls."""
    return _current_key.get()


def inside_call() -> bool:
    """True inside a journaled call's body: what it calls is part of that call."""
    return _current_key.get() is not None


@contextlib.contextmanager
def keyed(key: str) -> Iterator[None]:
    """Run the block as the body of the journaled call ``key``."""
    token = _current_key.set(key)
    try:
        yield
    finally:
        _current_key.reset(token)


@contextlib.contextmanager
def tool_call_scope(parallel: bool, call_id: str | None) -> Iterator[None]:
    """Journal the block's calls (a framework's tool call, run at the same time as the other
    calls of its model response) in the scope of ``call_id`` (:func:`journal_scope.tool_call`):
    the id comes from the recorded (or replayed) model response, so each call's replay does not
    depend on which call reached the journal first. Not ``parallel`` (:attr:`Durability.parallel`:
    a runtime without replay scopes, or a run an earlier release journaled one call at a time)
    the calls stay in the scope current, and the integration makes them one at a time."""
    if not parallel:
        yield
        return
    with journal_scope.entered(journal_scope.tool_call(call_id)):
        yield


def remake(args: Any, key: str) -> Any:
    """Reconcile hook of a model request a crashed holder left pending: make it again (it has
    no effect the journal could compensate)."""
    return NOT_MADE


def as_stored(value: Any) -> Any:
    """A call's recorded JSON ``value`` as a replay reads it back from the journal: PostgreSQL's
    ``jsonb`` keeps an object's keys ordered by their length, then bytewise (Python's dict order
    is the order they were set in), and a number as ``numeric`` (no exponent, no negative zero:
    ``1e+20`` reads back as the int ``100000000000000000000``), so a first run that shows the
    model a result's text shows it the same text as its replay."""
    if isinstance(value, dict):
        ordered = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return {k: as_stored(value[k]) for k in ordered}
    if isinstance(value, list):
        return [as_stored(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        if value == 0:
            return 0.0
        # The JSON text of the float (its repr) as numeric prints it, read back as json does.
        return json.loads(format(decimal.Decimal(repr(value)), "f"))
    return value


def reconciler(hook: Callable[[Any, str], Any] | None) -> Callable[[Any, str], Any] | None:
    """A tool's reconcile hook answers with the tool's result (or ``NOT_MADE``): recorded as the
    call would have been (``{"return": result}``)."""
    if hook is None:
        return None

    def reconcile(args: Any, key: str) -> Any:
        found = hook(args, key)
        return found if found is NOT_MADE else {"return": to_jsonable_python(found)}

    return reconcile


class Journal(Protocol):
    """A run's context seen from the agent's event loop. ``parallel``: calls made in scopes of
    their own (``journal_scope``) may run at the same time, each replayed by its scope; False
    (a runtime without replay scopes, a custom one): an integration makes its calls one at a
    time, in the root scope."""

    ctx: Any
    parallel: bool

    async def call(self, tool_name: str, body: AsyncBody, args: Any, **options: Any) -> Any: ...

    async def request_approval(self, prompt: str, deadline_seconds: int) -> dict[str, Any]: ...

    async def emit(self, chunk: str) -> int | None: ...


class ThreadJournal:
    """The synchronous runtime's ``ctx`` seen from the agent's event loop: each call is handed to
    the handler's thread (:meth:`serve`), which makes the journal writes on its own connection and
    runs the call's body back on the loop while the agent waits, serving what the body asks for
    (``emit``) meanwhile."""

    def __init__(self, ctx: Any, loop: asyncio.AbstractEventLoop, enclosing: str | None = None) -> None:
        self.ctx, self.loop = ctx, loop
        # The key of the journaled call whose tool runs this agent (on a thread of its own), if
        # any: that call cannot end while an approval of this agent waits, so none can park.
        self.enclosing = enclosing
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.parallel = bool(getattr(ctx, "journal_scopes", False))
        self.over: set[object] = set()  # end markers of calls whose serving is below on the stack
        # Settled once the handler's thread serves no more (:func:`run_threaded` runs the loop
        # until then): a call's body still running when the agent ended (a sibling tool raised
        # and Pydantic AI cancelled the task awaiting it) runs to its end and is recorded.
        self.finished: asyncio.Future[None] = loop.create_future()

    async def call(self, tool_name: str, body: AsyncBody, args: Any, **options: Any) -> Any:
        def on_loop(call_args: Any, key: str) -> Any:
            done = object()
            future = asyncio.run_coroutine_threadsafe(body(call_args, key), self.loop)
            future.add_done_callback(lambda _: self.requests.put(done))
            self._serve_until(done)
            return future.result()

        return await self._ask(lambda: self.ctx.call(tool_name, on_loop, args, **options))

    async def request_approval(self, prompt: str, deadline_seconds: int) -> dict[str, Any]:
        if self.enclosing is not None:
            # The runtime would wait for the enclosing call to be recorded before parking, and
            # that call waits for this agent: it would wait for ever. Nothing is written.
            seq = self.enclosing.rpartition(":")[2]
            raise ApprovalBlockedByCalls(
                (int(seq),) if seq.isdigit() else (),
                "an agent run on a thread inside that call's tool asked for an approval: the run cannot park "
                "while the call waits for the agent; ask for it in the outer agent (a tool that needs "
                "approval there), before or after the call",
            )
        return await self._ask(lambda: self.ctx.request_approval(prompt, deadline_seconds))  # type: ignore[no-any-return]

    async def emit(self, chunk: str) -> int | None:
        return await self._ask(lambda: self.ctx.emit(chunk))  # type: ignore[no-any-return]

    async def _ask(self, work: Callable[[], Any]) -> Any:
        """Have the handler's thread do ``work`` in the asking task's journal scope (when the
        runtime has scopes: else in the root, one call at a time as the integration asks)."""
        future: asyncio.Future[Any] = self.loop.create_future()
        if self.parallel:
            scope = journal_scope.current()
            inner = work

            def work() -> Any:
                with journal_scope.entered(scope):
                    return inner()

        self.requests.put((work, future))
        return await future

    def _serve_until(self, stop: object) -> None:
        """Serve the agent's requests until ``stop`` (a call's end marker, None at close) came.
        Calls of several scopes at once: a call asked while another's body runs is made from
        inside that one's serving (each body runs on the loop meanwhile); a marker of a call
        below on this thread's stack is kept for it, so an outer call is recorded once the calls
        made inside its serving are."""
        while stop not in self.over:
            item = self.requests.get()
            if item is None and stop is None:
                return
            if not isinstance(item, tuple):
                self.over.add(item)  # the end of a call's body (this one's, or one below)
                continue
            work, future = item
            if future.cancelled():  # its asker was cancelled (a sibling tool failed): never made
                continue
            try:
                output = work()
            except BaseException as exc:  # a park (_Parked) included: carried to the agent's loop
                self.loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, future, output, None)
        self.over.discard(stop)

    def serve(self) -> None:
        """On the handler's thread: make the calls the agent asks for until it is done."""
        self._serve_until(None)

    def close(self) -> None:
        self.requests.put(None)

    def served(self) -> None:
        """On the handler's thread, once it serves no more: let the agent's loop stop."""
        self.loop.call_soon_threadsafe(_settle, self.finished, None, None)


def _settle(future: asyncio.Future[Any], output: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(output)


class AsyncJournal:
    """An async runtime's ``ctx`` (``await ctx.call(...)``): called directly, on the loop."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.parallel = bool(getattr(ctx, "journal_scopes", False))

    async def call(self, tool_name: str, body: AsyncBody, args: Any, **options: Any) -> Any:
        return await self.ctx.call(tool_name, body, args, **options)

    async def request_approval(self, prompt: str, deadline_seconds: int) -> dict[str, Any]:
        return await self.ctx.request_approval(prompt, deadline_seconds)  # type: ignore[no-any-return]

    async def emit(self, chunk: str) -> int | None:
        return await self.ctx.emit(chunk)  # type: ignore[no-any-return]


def journal_for(ctx: Any, loop: asyncio.AbstractEventLoop | None = None) -> Journal:
    """The adapter for ``ctx``: direct when its ``call`` is a coroutine function, else the thread
    bridge (``loop``: the agent's event loop)."""
    if inspect.iscoroutinefunction(getattr(ctx, "call", None)):
        return AsyncJournal(ctx)
    if loop is None:
        raise ValueError("a synchronous context needs the agent's event loop")
    return ThreadJournal(ctx, loop)


def run_threaded(ctx: Any, main: Callable[[Journal], Coroutine[Any, Any, Any]], name: str) -> Any:
    """The synchronous runtime's handler body: run ``main(journal)`` on an event loop of its own,
    in a helper thread, and serve its journal calls from this (the handler's) thread.

    Called on a thread a journaled call's tool started in its context (``asyncio.to_thread``:
    an agent run by another agent's tool), the agent is a run of its own, not part of that call:
    its model requests and tool calls are journaled (in the tool's scope, nested under the
    call's, so they are never visited once the call is recorded), and an approval it asks for
    raises :class:`ApprovalBlockedByCalls` at once (the run cannot park while the call waits for
    the agent). An event-loop runtime's context is refused (``TypeError``): await the
    handler's ``run(ctx)`` on the worker's loop."""
    if inspect.iscoroutinefunction(getattr(ctx, "call", None)):
        raise TypeError(
            f"{name}: the context is an event-loop runtime's (its call is a coroutine function): "
            "await the handler's run(ctx) on the worker's loop instead of calling the handler"
        )
    loop = asyncio.new_event_loop()
    journal = ThreadJournal(ctx, loop, enclosing=_current_key.get())
    box: dict[str, Any] = {}

    def agent_thread() -> None:
        _current_key.set(None)  # this thread's own context (a copy): the agent is no call's body
        try:
            box["output"] = loop.run_until_complete(main(journal))
        except BaseException as exc:
            box["error"] = exc
        finally:
            journal.close()
            try:
                # The bodies of calls still being made run on this loop: keep it running until
                # the handler's thread has recorded them (else it waits for them forever).
                loop.run_until_complete(journal.finished)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    # The agent's thread starts in this thread's context: its journal scope (an agent run by a
    # tool, on a thread in a ``ctx.scope`` of its own, journals inside that scope, not the root).
    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(agent_thread,), name=f"{name}-{ctx.lease.run_id}", daemon=True
    )
    thread.start()
    try:
        journal.serve()
    finally:
        journal.served()
        thread.join()
    if "error" in box:
        raise box["error"]
    return box["output"]


def journaled_in_order(ctx: Any, scope: str) -> bool:
    """True when the run has tool calls (not model requests, ``model:<name>``) journaled in the
    agent's own ``scope`` and none in a tool call's scope inside it: an earlier release made the
    agent's tool calls there one at a time (an integration now journals each in its call's
    scope), so they replay by position, as they were made. (A handler's own call made in that
    scope before the agent's first tool call does the same: the run goes on one at a time.)"""
    listed = getattr(ctx, "tools_journaled", None)
    if listed is None:
        return False
    entries = listed()
    calls = journal_scope.child(scope, "tool:")
    if any(name.startswith(calls) for name, _ in entries):
        return False
    return any(name == scope and not tool.startswith("model:") for name, tool in entries)


class Durability:
    """One run's journal as an integration's model and tool wrappers call it: ``owner`` is the
    ``DurableAgent`` (its :class:`JournalOptions`), ``uncharged`` the usage cost of the responses
    not yet charged to a call (charged with the next journaled call; while ``bearer`` names a
    tool call of the last response, with that call or the next model request)."""

    def __init__(self, owner: JournalOptions, journal: Journal) -> None:
        self.owner, self.journal = owner, journal
        self.chunks = Chunks(journal)
        self.uncharged = 0
        # Tool calls at once, each in its call's scope; not on a runtime without replay scopes,
        # nor for a run an earlier release journaled with its tool calls one at a time in the
        # agent's own scope (a run parked or lost across the upgrade): replayed as it was made.
        self.parallel = journal.parallel and not journaled_in_order(journal.ctx, journal_scope.current_key())
        self.bearer: str | None = None

    async def call(
        self, tool_name: str, body: AsyncBody, args: Any, cost: int, *, call_id: str | None = None, **options: Any
    ) -> Any:
        """A journaled call charging ``cost`` and, when it is a model request (``call_id`` None)
        or the tool call ``bearer`` names (any, with none named), the usage not yet charged."""
        # Taken before the call is made, by one call named by the recorded response, not by the
        # first to reach the journal: tool calls made at once charge it once in all, and a
        # resumed run whose calls reach the journal in another order (one replayed, one made
        # now) charges it with the same call as the first run, neither twice nor never.
        uncharged = 0
        if call_id is None or self.bearer in (None, call_id):
            uncharged, self.uncharged, self.bearer = self.uncharged, 0, None
        return await self.journal.call(tool_name, body, args, cost=cost + uncharged, **options)


class Chunks:
    """The run's output stream as one handler invocation writes it. ``ctx.emit`` is positional:
    emit ``n`` of a resumed handler is chunk ``n``, and chunks the run already has are counted,
    not written again. Text streamed while a model request runs (token mode) is written before
    the request is recorded, so its recording keeps how many chunks it wrote (:meth:`mark`,
    :meth:`since`) and a replay counts that many again (:meth:`count`); a request interrupted
    and made again finds the chunks its first attempt wrote (:meth:`restart`)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.position = 0  # the seq of the last chunk this invocation emitted or counted
        self.before = int(getattr(getattr(journal.ctx, "run", None), "output_chunks", 0) or 0)

    async def emit(self, text: str) -> None:
        if text:
            seq = await self.journal.emit(text)
            if seq:
                self.position = seq

    async def count(self, n: int) -> None:
        """Count ``n`` chunks this invocation wrote before it was interrupted (none is written:
        each position is at most the run's chunks when it was claimed)."""
        for _ in range(n):
            await self.emit(_COUNTED)

    async def restart(self) -> None:
        """At the start of a model request: if an interrupted attempt of it wrote chunks (the run
        has more than this invocation counted so far), count them and write :data:`RESTARTED`."""
        if (gap := self.before - self.position) > 0:
            await self.count(gap)
            await self.emit(RESTARTED)

    def mark(self) -> int:
        return self.position

    def since(self, mark: int) -> int:
        return self.position - mark


class JournalOptions:
    """The journal options both integrations' ``DurableAgent`` take (their ``__init__`` sets
    them with :meth:`set_journal_options`)."""

    compensations: dict[str, Any]
    reconcile: dict[str, Callable[[Any, str], Any]]
    destructive: frozenset[str]
    tool_costs: dict[str, int]
    request_cost: int
    usage_cost: Callable[[Any], int]
    approval_deadline_seconds: int
    stream_text: bool | str

    def set_journal_options(
        self,
        *,
        compensations: Any,
        reconcile: Any,
        destructive: Any,
        tool_costs: Any,
        request_cost: int,
        usage_cost: Callable[[Any], int],
        approval_deadline_seconds: int,
        stream_text: Any,
    ) -> None:
        """Check and set the options: a compensation not in the registry, or a ``stream_text``
        other than False, True or ``"tokens"``, is a ``ValueError`` when the handler is built,
        not at its first call."""
        self.compensations = dict(compensations or {})
        for fn in self.compensations.values():
            registry.name_of(fn)
        self.reconcile = dict(reconcile or {})
        self.destructive = frozenset(destructive)
        self.tool_costs = dict(tool_costs or {})
        self.request_cost = request_cost
        self.usage_cost = usage_cost
        self.approval_deadline_seconds = approval_deadline_seconds
        if stream_text not in (False, True, "tokens"):
            raise ValueError(f"stream_text must be False, True or 'tokens', got {stream_text!r}")
        self.stream_text = stream_text

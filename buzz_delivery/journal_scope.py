"""Replay scopes of an agent run's journal (Django-free: the thread and event-loop runtimes and
the remote one, ``gateway.remote_runs``, share it). SPEC 12 "Journal", docs/agents.md "Resume".

A journal entry is keyed for replay by its *scope* (text; ``""`` is the run's root) and its
*index* in that scope (1, 2, ... in the order the scope's own calls are made): a call made in
scope ``S`` is the ``k``-th call of ``S`` and a resumed handler replays it from entry ``(S, k)``,
whatever the calls of other scopes did meanwhile. Calls that run at the same time must be in
different scopes for their replay not to depend on timing: the scope is a context variable, so
an asyncio task inherits the scope it was created in, and a thread starts in the root scope
(``with ctx.scope(name):`` in the thread enters its own). ``seq`` stays the run's contiguous
count of journaled entries, in the order they were journaled.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator

ROOT = ""
MAX_SCOPE_CHARS = 200
SEPARATOR = "/"

_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("buzz_journal_scope", default=ROOT)


class ScopeError(ValueError):
    """A scope name that cannot key a journal entry."""


def current() -> str:
    """The scope the calling code's journal calls are made in (``""``: the run's root), as a
    full path (of any length: :func:`current_key` is how its entries are keyed)."""
    return _SCOPE.get()


def key(scope: str) -> str:
    """The text scope ``scope`` keys its entries by: the path itself when it is at most
    ``MAX_SCOPE_CHARS`` characters (as every journal written before deep paths), else its first
    128 characters, ``~sha256:`` and the SHA-256 of the whole path (200 characters: a path nested
    deep, say an agent run in a tool of an agent run in a tool of ..., keeps a stable key). The
    runtimes key calls with it and nest a call's body under it (:func:`inside_call` of the key),
    so a scope nested in that body still starts with the body's scope (:func:`within`)."""
    if len(scope) <= MAX_SCOPE_CHARS:
        return scope
    digest = hashlib.sha256(scope.encode()).hexdigest()
    return f"{scope[: MAX_SCOPE_CHARS - 8 - len(digest)]}~sha256:{digest}"


def current_key() -> str:
    """:func:`key` of the current scope: what a runtime journals and replays a call under."""
    return key(_SCOPE.get())


# Names the runtimes make themselves: a call's body (``#<index>``) and a framework's tool call
# (``tool:<id>``, :func:`tool_call`); a name a handler gives ``ctx.scope`` may not take these forms or hold the
# separator, or its calls could share a scope with those of a call's body or a tool call.
RESERVED_PREFIXES = ("#", "tool:")


def check_name(name: object) -> str:
    """A scope name: non-blank text without NUL (a path longer than 200 characters is keyed by
    :func:`key`)."""
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise ScopeError(f"a journal scope name must be non-blank text without NUL, got {name!r}")
    return name


def check_handler_name(name: object) -> str:
    """A name a handler gives ``ctx.scope``: :func:`check_name`, without the separator ``/`` and
    not starting with a form the runtimes reserve (``#``, ``tool:``)."""
    name = check_name(name)
    if SEPARATOR in name or name.startswith(RESERVED_PREFIXES):
        raise ScopeError(
            f"a journal scope name may not hold {SEPARATOR!r} nor start with {' or '.join(RESERVED_PREFIXES)}"
            f" (the runtimes' own scopes), got {name!r}"
        )
    return name


def check_scope(scope: object) -> str:
    """A scope as stored (:func:`key`): text of at most ``MAX_SCOPE_CHARS`` characters, no NUL."""
    if not isinstance(scope, str) or len(scope) > MAX_SCOPE_CHARS or "\x00" in scope:
        raise ScopeError(f"a journal scope must be text of at most {MAX_SCOPE_CHARS} characters without NUL")
    return scope


def child(parent: str, name: str) -> str:
    """The path of scope ``name`` inside ``parent``."""
    name = check_name(name)
    return f"{parent}{SEPARATOR}{name}" if parent else name


MAX_CALL_ID_CHARS = 64


def tool_call(call_id: str | None) -> str:
    """The scope of a framework's tool call ``call_id`` (Pydantic AI's ``tool_call_id``, the OpenAI
    Agents SDK's ``call_id``: part of the recorded model response, the same on a replay) inside
    the scope current: ``tool:<id>``; an id longer than ``MAX_CALL_ID_CHARS``, or holding NUL or
    the separator, by its SHA-256 (``tool:sha256:<hex>``), so the scope is always one name."""
    text = call_id or "?"
    if len(text) > MAX_CALL_ID_CHARS or "\x00" in text or SEPARATOR in text:
        text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return child(current(), f"tool:{text}")


@contextlib.contextmanager
def entered(scope: str) -> Iterator[str]:
    """Make the block's journal calls (and the tasks it creates) in ``scope`` (a full path; its
    calls are keyed by :func:`key` of it)."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def scoped(name: str) -> contextlib.AbstractContextManager[str]:
    """``ctx.scope(name)``: a context manager (for one ``with``) that makes its block's calls in
    scope ``name`` inside the scope current *where it is created*: create it in the code that
    starts a thread (inside a tool, say) and enter it in that thread, so the thread's calls nest
    under the tool's call, deterministically, whatever thread runs them."""
    return entered(child(current(), check_handler_name(name)))


def inside_call(scope: str, index: int) -> str:
    """The scope of the body of call ``index`` of ``scope``: scopes a tool creates nest under it
    (the outer call replayed, they are never visited again; none collides with another call's)."""
    return f"{scope}{SEPARATOR}#{index}" if scope else f"#{index}"


def within(scope: str, insides: tuple[str, ...]) -> bool:
    """True when ``scope`` is one of ``insides`` (the scopes of calls' bodies) or nested in one."""
    return any(scope == inside or scope.startswith(inside + SEPARATOR) for inside in insides)


class Positions:
    """The last index each scope handed out, for one handler invocation (the caller serialises)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def peek(self, scope: str) -> int:
        """The index the next call of ``scope`` will have."""
        return self._last.get(scope, 0) + 1

    def take(self, scope: str) -> int:
        """Hand out the next index of ``scope``."""
        index = self.peek(scope)
        self._last[scope] = index
        return index

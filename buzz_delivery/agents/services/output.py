"""Streamed output of agent runs (issue 29, SPEC 16 "Streamed output").

A holder appends text to its run's output stream while it works (``ctx.emit(chunk)``): one
fenced statement counts the chunk on the run (the run's ``output_chunks`` becomes its ``seq``,
gapless from 1; ``output_bytes`` grows by its UTF-8 size within ``MAX_STREAM_BYTES``) and inserts
it, only while the caller holds the run's current lease, exactly as a journal write is fenced: a
stale, cancelled or lapsed holder's chunk is refused (``LeaseLost``) and nothing is written.

Readers follow the stream by sequence number: :func:`read_output` returns one page after a seq;
:func:`stream_output` (and :func:`astream_output` on an event loop) yields chunks as they arrive
and ends once the run is terminal and every chunk has been read. Readers poll (a short interval,
``poll``): an emit carries no wake-up, so a reader costs one indexed read per interval.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.db import transaction

from buzz_delivery.agents.conf import get_settings
from buzz_delivery.agents.services import sql
from buzz_delivery.agents.services.common import lease_params, missed
from buzz_delivery.agents.services.journal import _fence_holds
from buzz_delivery.agents.services.types import (
    AlreadyTerminal,
    Emitted,
    LeaseLost,
    OutputChunk,
    OutputPage,
    TooLarge,
)
from buzz_delivery.agents.states import RUN_TERMINAL
from buzz_delivery.models import new_uuid7
from buzz_delivery.services import validation as v
from buzz_delivery.services.db import fetch_all, translated_errors
from buzz_delivery.services.tenancy import tenant_scoped

MAX_SEQ = 2**31 - 1
MAX_PAGE = 1000
DEFAULT_POLL_SECONDS = 0.25


def chunk_value(value: Any, max_bytes: int) -> tuple[str, int]:
    """``(value, its UTF-8 size)`` for a chunk PostgreSQL can store within ``max_bytes``, or
    ``ValidationError`` keyed ``chunk`` (before SQL)."""
    if not isinstance(value, str):
        raise v.invalid("chunk", f"must be a str, not {type(value).__name__}")
    if not value:
        raise v.invalid("chunk", "must not be empty")
    # A character is at least one byte: a string longer than the bound is refused unencoded.
    if len(value) > max_bytes:
        raise v.invalid("chunk", f"must be at most {max_bytes} bytes (UTF-8), got {len(value)} characters or more")
    text = v.storable_text(str.__str__(value), "chunk")
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise v.invalid("chunk", f"must be at most {max_bytes} bytes (UTF-8), got {size}")
    return text, size


@tenant_scoped
def emit_output(lease: Any, chunk: str) -> Emitted | TooLarge | AlreadyTerminal | LeaseLost:
    """Append ``chunk`` (text, 1..``MAX_CHUNK_BYTES`` bytes of UTF-8, no NUL) to the run's output
    stream under the holder's current lease, in one fenced statement.

    Returns :class:`Emitted` (its ``seq``), :class:`TooLarge` (the run's output would pass
    ``MAX_STREAM_BYTES``; nothing written), ``AlreadyTerminal`` or ``LeaseLost`` (a stale or
    cancelled holder's chunk is refused; nothing written). Raises ``ValidationError`` keyed
    ``chunk`` (or ``lease``) before SQL."""
    settings = get_settings()
    text, size = chunk_value(chunk, settings.max_chunk_bytes)
    params = lease_params(
        lease, chunk=text, size=size, max_stream_bytes=settings.max_stream_bytes, chunk_id=new_uuid7()
    )
    with transaction.atomic(), translated_errors():
        rows = fetch_all(sql.EMIT_IF_CURRENT_AND_WITHIN_BOUND, params)
        if rows:
            return Emitted(rows[0][0])
        if _fence_holds(params):
            used = fetch_all(sql.OUTPUT_USED, params)[0][0]
            return TooLarge("output", used, size, settings.max_stream_bytes)
        return missed(params)


def _page_args(community_id: Any, run_id: Any, after: Any, limit: Any) -> dict[str, Any]:
    return {
        "community_id": v.uuid_value(community_id, "community_id"),
        "run_id": v.uuid_value(run_id, "run_id"),
        "after": v.int_in_range(after, "after", 0, MAX_SEQ),
        "limit": v.int_in_range(limit, "limit", 1, MAX_PAGE),
    }


@tenant_scoped
def read_output(
    community_id: uuid.UUID | str, run_id: uuid.UUID | str, *, after: int = 0, limit: int = 200
) -> OutputPage:
    """Scoped read of the run's chunks with ``seq > after``, in order, at most ``limit``
    (1..1000), and whether the run was terminal before they were read. ``ValidationError`` keyed
    by the argument before SQL."""
    params = _page_args(community_id, run_id, after, limit)
    with transaction.atomic():
        state = fetch_all(sql.RUN_STATE, params)
        if not state:
            return OutputPage((), terminal=True, found=False)
        rows = fetch_all(sql.OUTPUT_AFTER, params)
    return OutputPage(tuple(OutputChunk(seq, chunk) for seq, chunk in rows), terminal=state[0][0] in RUN_TERMINAL)


def _poll_value(poll: Any) -> float:
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0.01 <= poll <= 60:
        raise v.invalid("poll", "must be a number of seconds in 0.01..60")
    return float(poll)


def stream_output(
    community_id: uuid.UUID | str,
    run_id: uuid.UUID | str,
    *,
    after: int = 0,
    follow: bool = True,
    poll: float = DEFAULT_POLL_SECONDS,
    timeout: float | None = None,
) -> Iterator[OutputChunk]:
    """Yield the run's chunks with ``seq > after`` as they arrive, in order. With ``follow``
    (the default) it waits for more (``poll`` seconds between reads) and ends once the run is
    terminal and every chunk is read, or after ``timeout`` seconds if given; without, it ends
    after the chunks there are now. An absent run (or another community's) yields nothing.
    Each read is its own short transaction: no transaction is held while waiting."""
    args = _page_args(community_id, run_id, after, 1)
    wait = _poll_value(poll)
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    after = args["after"]
    while True:
        page = read_output(args["community_id"], args["run_id"], after=after, limit=MAX_PAGE)
        for chunk in page.chunks:
            after = chunk.seq
            yield chunk
        if len(page.chunks) == MAX_PAGE:
            continue
        if not follow or page.terminal or (deadline is not None and time.monotonic() >= deadline):
            return
        time.sleep(wait)


async def astream_output(
    community_id: uuid.UUID | str,
    run_id: uuid.UUID | str,
    *,
    after: int = 0,
    follow: bool = True,
    poll: float = DEFAULT_POLL_SECONDS,
    timeout: float | None = None,
) -> AsyncIterator[OutputChunk]:
    """:func:`stream_output` for an event loop: the reads run on a thread of the stream's own
    (one database connection, closed when the stream ends), the waits are ``asyncio.sleep``."""
    import asyncio
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    args = _page_args(community_id, run_id, after, 1)
    wait = _poll_value(poll)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + float(timeout)
    after = args["after"]
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="output-reader")
    try:
        while True:
            read = functools.partial(read_output, args["community_id"], args["run_id"], after=after, limit=MAX_PAGE)
            page = await loop.run_in_executor(executor, read)
            for chunk in page.chunks:
                after = chunk.seq
                yield chunk
            if len(page.chunks) == MAX_PAGE:
                continue
            if not follow or page.terminal or (deadline is not None and loop.time() >= deadline):
                return
            await asyncio.sleep(wait)
    finally:
        executor.submit(connections.close_all)
        executor.shutdown(wait=False)

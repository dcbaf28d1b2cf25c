"""The record's side of a terminal move made outside the plan-cached settles (issue 31, stage 2):
the reaper, a cancelled run's expiry, the operator's force-fail.

Each deletes the live queue row, fenced as its one-table UPDATE was, and returns its final state
(:func:`buzz_delivery.services.sql.ended_columns`); :func:`end_on_record` then writes that state on
the delivery's record with one of the ``sql.END_*`` statements, in the same transaction. Two
statements, each naming its community (Citus refuses a statement that modifies two distributed
tables). The record of a live delivery is ``pending``; a record that is not is an invariant
broken (every writer rules it out, but no constraint does: the queue's foreign key names the
record, not its status, so a raw UPDATE can make it): the transaction is rolled back rather than
leave a delivery with neither a live row nor a terminal record, and the reaper logs and leaves
that community's batch rather than stop reaping the others.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from buzz_delivery.services.db import fetch_all

# The positions of sql.ended_columns.
_KEYS = (
    "ids",
    "statuses",
    "failure_codes",
    "failure_messages",
    "lease_generations",
    "attempts",
    "holders",
    "renewals",
    "histories",
)


class RecordOutOfStep(RuntimeError):
    """A deleted queue row whose record was not ``pending`` (an invariant every writer keeps; the
    schema does not refuse it)."""


def end_on_record(
    statement: str, community_id: object, now: object, ended: Sequence[Sequence[Any]], **params: object
) -> list[tuple[uuid.UUID, str]]:
    """Write the final state of the queue rows ``ended`` (rows of ``sql.ended_columns``, all of
    ``community_id``, just deleted in the caller's transaction) on their records with
    ``statement`` (an ``sql.END_*``), finished at ``now`` (the database clock the caller read);
    return the ``(id, status)`` of each record moved. ``params``: the statement's own (the
    actor). Raises :class:`RecordOutOfStep` (the caller's transaction must roll back) when a
    record did not move."""
    if not ended:
        return []
    values: dict[str, object] = {**params, "community_id": community_id, "now": now}
    for position, key in enumerate(_KEYS):
        values[key] = [row[position] for row in ended]
    rows = fetch_all(statement, values)
    if len(rows) != len(ended):
        raise RecordOutOfStep(
            f"{len(ended) - len(rows)} of {len(ended)} ended queue rows of community {community_id} "
            "had no pending record"
        )
    return [(row[0], str(row[1])) for row in rows]

"""PostgreSQL triggers of buzz_delivery, declared with django-pgtrigger.

- :func:`write_fence` goes on every community-scoped table (SPEC section 5): its three
  triggers run ``buzz_delivery_write_fence_row()`` (migrations 0014 and 0016), which calls
  ``buzz_delivery_check_write_fence(community_id, op)`` (migration 0002; 0019),
  which tries the community's fence advisory lock in shared mode (or, when it is held or
  awaited, meets a lifecycle move on the community row: any session may take an advisory lock,
  and one that did must not freeze the community's writes) and rejects
  the write (SQLSTATE ``BD001``) unless the community is ``active`` or the
  purge executor has identified itself for it. Once a transaction has found a community
  ``active`` under that lock it remembers so in the transaction-local setting
  ``buzz_delivery.fence_passed`` (the lock, held to the end of the transaction, keeps every
  other transaction's move out), and its later rows of that community skip the lookup (and,
  through the triggers' WHEN, the function call); a
  lifecycle move clears the setting, so a move made by the same transaction is seen at once.
  Like the purge executor's two settings, the setting is trusted: SQL that sets it by hand
  (any role can, a handler's too) passes the fence for that community. The fence guards against
  stale and buggy writers, not against SQL written to get past it: before this, ``SET LOCAL
  pgtrigger.ignore`` switched it off just as easily.
- :func:`lifecycle_forward_only` keeps ``Community.deletion_state`` moving one
  step forward at a time and bumps ``fence_generation`` on each move (``BD002``); a move
  takes the community's fence lock exclusively, so it waits for the writers inside a
  transaction and queues the later ones behind it.
- :func:`protect_retired_community` refuses to delete a community that left ``active``.
"""

from __future__ import annotations

from typing import Any

import pgtrigger

FENCE_SQLSTATE = "BD001"
LIFECYCLE_SQLSTATE = "BD002"
HISTORY_SQLSTATE = "BD003"
# First key of the two-int advisory locks; the second is hashtext(community id).
FENCE_LOCK_NAMESPACE = 0x42440001
IDENTITY_LOCK_NAMESPACE = 0x42440002
# Transaction-local: the community this transaction found active under its fence lock.
FENCE_PASSED_SETTING = "buzz_delivery.fence_passed"
# Every community-scoped table of the core (the core's deletion catalog; a test keeps them equal).
# Sibling apps refuse the tombstone move for their own tables with their own BEFORE UPDATE
# trigger on buzz_delivery_community (e.g. buzz_delivery.workflows, migration 0001), so this
# static list stays the core's; the test checks every catalog table is named by some guard.
TENANT_TABLES = (
    "buzz_delivery_settle_tally",
    "buzz_delivery_rate_limit",
    "buzz_delivery_delivery_queue",
    "buzz_delivery_delivery_record",
    "buzz_delivery_workflow_run",
    "buzz_delivery_event",
    "buzz_delivery_workflow",
)


# The row function every write-fence trigger runs (migration 0014).
WRITE_FENCE_ROW_FUNCTION = "buzz_delivery_write_fence_row"


class _WriteFence(pgtrigger.Trigger):
    """A trigger that runs the shared :data:`WRITE_FENCE_ROW_FUNCTION` directly, not the
    per-table function pgtrigger generates around ``func``: that wrapper first asks
    ``_pgtrigger_should_ignore``, whose exception block (a subtransaction, and a caught error
    when ``pgtrigger.ignore`` is unset) cost more than the fence itself on every row. So
    ``pgtrigger.ignore`` cannot switch the fence off; ``func`` stays as the same logic, unused."""

    def render_execute(self, model: Any) -> str:
        return f"{WRITE_FENCE_ROW_FUNCTION}()"


_FENCE_FUNC = """
            IF TG_OP = 'INSERT' THEN
                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);
                RETURN NEW;
            END IF;
            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);
            IF TG_OP = 'DELETE' THEN
                RETURN OLD;
            END IF;
            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN
                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);
            END IF;
            RETURN NEW;
        """


def _not_passed(row: str) -> pgtrigger.Condition:
    """True unless this transaction already found the row's community active under its fence
    lock (:data:`FENCE_PASSED_SETTING`): the row function's own first test, made in the
    trigger's WHEN so that a passed row costs no PL/pgSQL call at all."""
    return pgtrigger.Condition(
        f"current_setting('{FENCE_PASSED_SETTING}', true) IS DISTINCT FROM {row}.community_id::text"
    )


def write_fence() -> list[pgtrigger.Trigger]:
    """The write fence, as three BEFORE ROW triggers that run :data:`WRITE_FENCE_ROW_FUNCTION`
    (a model's ``Meta.triggers`` takes them with ``*triggers.write_fence()``):

    - ``community_write_fence``: INSERT or UPDATE, when the new row's community has not passed
      in this transaction;
    - ``community_write_fence_delete``: DELETE, when the old row's community has not passed;
    - ``community_write_fence_move``: UPDATE OF ``community_id`` that changes it (the row
      function then judges the old community and the new one).

    Together they call the function for every row the single INSERT/UPDATE/DELETE trigger of
    migration 0014 would have judged, except the rows whose community this transaction already
    found ``active`` under its lock: the function returned at once for those. A WHEN condition
    cannot name ``NEW`` on DELETE nor ``OLD`` on INSERT, hence three triggers. The PL/pgSQL call
    skipped for every passed row was a sixth of the server's CPU of a batched claim and settle
    (issue 16)."""
    return [
        _WriteFence(
            name="community_write_fence",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert | pgtrigger.Update,
            condition=_not_passed("NEW"),
            func=_FENCE_FUNC,
        ),
        _WriteFence(
            name="community_write_fence_delete",
            when=pgtrigger.Before,
            operation=pgtrigger.Delete,
            condition=_not_passed("OLD"),
            func=_FENCE_FUNC,
        ),
        _WriteFence(
            name="community_write_fence_move",
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf("community_id"),
            condition=pgtrigger.Condition("OLD.community_id IS DISTINCT FROM NEW.community_id"),
            func=_FENCE_FUNC,
        ),
    ]


_ANY_ROWS_LEFT = " OR ".join(f"EXISTS (SELECT 1 FROM {table} WHERE community_id = OLD.id)" for table in TENANT_TABLES)


def lifecycle_forward_only() -> pgtrigger.Trigger:
    """Community lifecycle moves: forward only, one step, each bumps ``fence_generation``."""
    return pgtrigger.Trigger(
        name="community_lifecycle_forward_only",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        declare=[("old_rank", "int"), ("new_rank", "int")],
        func=f"""
            IF NEW.id IS DISTINCT FROM OLD.id THEN
                RAISE EXCEPTION USING ERRCODE = '{LIFECYCLE_SQLSTATE}',
                    MESSAGE = 'buzz_delivery: a community id never changes';
            END IF;
            IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN
                -- The write fence's other side: writers hold this lock shared until they
                -- commit; taken here, on the node that owns the community row, it waits for
                -- them and queues later writers behind this move (SPEC sections 5, 15).
                PERFORM pg_advisory_xact_lock({FENCE_LOCK_NAMESPACE}, hashtext(OLD.id::text));
                -- This transaction's writers judge the community again from now on.
                PERFORM set_config('{FENCE_PASSED_SETTING}', '', true);
                old_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], OLD.deletion_state);
                new_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], NEW.deletion_state);
                IF new_rank IS DISTINCT FROM old_rank + 1 THEN
                    RAISE EXCEPTION USING ERRCODE = '{LIFECYCLE_SQLSTATE}',
                        MESSAGE = format('buzz_delivery: community %s cannot move from %s to %s '
                                         '(states move forward one step at a time)',
                                         OLD.id, OLD.deletion_state, NEW.deletion_state);
                END IF;
                IF NEW.deletion_state = 'tombstone' AND ({_ANY_ROWS_LEFT}) THEN
                    RAISE EXCEPTION USING ERRCODE = '{LIFECYCLE_SQLSTATE}',
                        MESSAGE = format('buzz_delivery: community %s still holds rows; '
                                         'purge it before it becomes tombstone', OLD.id);
                END IF;
                NEW.fence_generation := OLD.fence_generation + 1;
                NEW.state_changed_at := now();
            ELSIF NEW.fence_generation IS DISTINCT FROM OLD.fence_generation THEN
                RAISE EXCEPTION USING ERRCODE = '{LIFECYCLE_SQLSTATE}',
                    MESSAGE = 'buzz_delivery: fence_generation changes only with a lifecycle move';
            END IF;
            RETURN NEW;
        """,
    )


def protect_retired_community() -> pgtrigger.Protect:
    """A community that left ``active`` is never deleted (its tombstone stays)."""
    return pgtrigger.Protect(
        name="community_protect_retired",
        operation=pgtrigger.Delete,
        condition=pgtrigger.Q(old__deletion_state__in=["quiescing", "fenced", "tombstone"]),
    )


# A delivery's binding and JSON snapshots never change after commit (SPEC sections 2, 6).
IMMUTABLE_DELIVERY_COLUMNS = (
    "id",
    "community_id",
    "workflow_id",
    "run_id",
    "step_id",
    "target_pubkey",
    "definition_event_id",
    "message_event_id",
    "cause_kind",
    "cause_event_id",
    "cause_scheduled_for",
    "cause_webhook_invocation_id",
    "execution_trace",
    "trigger_context",
    "singleton_key",
)


# The queue row's key and the binding columns a claim selects by (issue 31, stage 2): copied from
# the record at commit, never changed (the record's own trigger guards its copies).
IMMUTABLE_QUEUE_COLUMNS = ("id", "community_id", "target_pubkey", "workflow_id")


def delivery_binding_immutable(
    name: str = "delivery_binding_immutable", columns: tuple[str, ...] = IMMUTABLE_DELIVERY_COLUMNS
) -> pgtrigger.Trigger:
    """Refuse any UPDATE that names a binding or snapshot column (``BD003``); ``name`` and
    ``columns``: the delivery queue's (:data:`IMMUTABLE_QUEUE_COLUMNS`), else the record's.

    ``UPDATE OF`` fires only when the statement's SET list names one of them, so the services'
    updates (which never do) pay nothing, and large snapshots are never compared."""
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=pgtrigger.UpdateOf(*columns),
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = format('buzz_delivery: delivery %s: its binding and snapshots never '
                                 'change; state changes go through buzz_delivery.services', OLD.id);
        """,
    )


def delivery_generation_monotonic() -> pgtrigger.Trigger:
    """Refuse an UPDATE that moves ``lease_generation`` backwards (``BD003``): a fence token
    must never be handed out twice (SPEC section 2)."""
    return pgtrigger.Trigger(
        name="delivery_generation_monotonic",
        when=pgtrigger.Before,
        operation=pgtrigger.Update,
        condition=pgtrigger.Condition("NEW.lease_generation < OLD.lease_generation"),
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = format('buzz_delivery: delivery %s: lease_generation cannot go back from %s to %s',
                                 OLD.id, OLD.lease_generation, NEW.lease_generation);
        """,
    )


# Entries a row's ``history`` keeps (models.HISTORY_LIMIT; repeated here, triggers import nothing).
HISTORY_LIMIT = 50


_TERMINALS = "('finished', 'failed', 'expired')"
# The statement that makes a live record terminal: its history extends the record's (see below).
_TERMINAL_EXTENDS = (
    f" OR (OLD.status NOT IN {_TERMINALS} AND NEW.status IN {_TERMINALS}"
    f" AND (jsonb_array_length(NEW.history) >= {HISTORY_LIMIT}"
    " OR (jsonb_array_length(NEW.history) > jsonb_array_length(OLD.history)"
    " AND jsonb_path_query_array(NEW.history, '$[0 to $n]',"
    " jsonb_build_object('n', jsonb_array_length(OLD.history) - 1)) = OLD.history)))"
)


def history_append_only(table: str, *, terminal_extends: bool = False) -> pgtrigger.Trigger:
    """Refuse an UPDATE that rewrites a row's ``history`` (``BD003``): a statement may only
    append one entry, dropping the oldest once :data:`HISTORY_LIMIT` are kept
    (``buzz_delivery_history_push``, migration 0008). ``table`` names the trigger.

    ``terminal_extends``: the delivery record since issue 31, stage 2 (core migration 0037). While
    a delivery is live its history grows on its queue row (which has this guard as it is), from
    the record's copy (the commit's, or the last requeue's); the statement that makes the record
    terminal writes the queue row's history plus its entry over that copy. That statement may
    therefore write more than one entry, provided they *extend* the record's copy: the copy
    first, entry for entry, then at least one more, or :data:`HISTORY_LIMIT` entries (the
    queue row dropped its oldest: without reading the queue row, which the record's trigger
    cannot do on Citus, a full history is taken as it comes). Every other statement (one that
    keeps the record live, one on a terminal record, a requeue) appends one entry, as before.

    ``UPDATE OF history`` with a WHEN condition: PostgreSQL evaluates the condition in the
    executor and calls the function only to raise, so an honest append pays two jsonb
    comparisons of the row's (short) array and no PL/pgSQL call."""
    return pgtrigger.Trigger(
        name=f"{table}_history_append_only",
        when=pgtrigger.Before,
        operation=pgtrigger.UpdateOf("history"),
        condition=pgtrigger.Condition(
            "NEW.history IS DISTINCT FROM OLD.history AND NOT ("
            "(NEW.history - (-1)) = OLD.history"
            f" OR (jsonb_array_length(OLD.history) >= {HISTORY_LIMIT} AND (NEW.history - (-1)) = (OLD.history - 0))"
            + (_TERMINAL_EXTENDS if terminal_extends else "")
            + ")"
        ),
        func=f"""
            RAISE EXCEPTION USING ERRCODE = '{HISTORY_SQLSTATE}',
                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '
                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);
        """,
    )

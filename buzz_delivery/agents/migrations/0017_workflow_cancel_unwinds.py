"""A cancelled workflow run sends its agent runs with compensations outstanding to unwind (issue 28:
no tool call is left uncompensated).

Before, the trigger ``buzz_agents_workflow_canceled`` ended every non-terminal agent run of the
workflow run ``cancelled`` at once: the succeeded (or still pending) calls they journaled with a
compensation were never undone. Now it does what the operator's ``cancel_agent_run`` does
(``CANCEL_TO_UNWIND_IF_OUTSTANDING`` in ``agents/services/sql.py``):

- it first locks the workflow run's non-terminal agent runs (``FOR NO KEY UPDATE``, id order), as
  the operator's cancel locks its run before judging the journal: a result or a journal entry a
  holder commits meanwhile is seen by the next statements (each takes a fresh snapshot);
- a run with compensations outstanding (a succeeded or uncertain call carrying one, or a pending
  call carrying one, not yet compensated, and none whose compensation failed) is fenced
  (generation + 1, lease released) and goes back to ``pending`` with ``unwinding`` and
  ``failure_code = 'workflow_canceled'``: a worker claims it, runs the compensations in reverse
  order, each once, and ``fail_run`` ends it ``cancelled`` (``END_STATE_OF_UNWOUND``). Its history
  entry is ``cancel`` / ``pending`` by ``engine``. A run already unwinding for a cancel (the
  operator's) is left to its compensator. The workers are woken (``pg_notify('buzz_agents')``);
- the others end ``cancelled`` at once, as before (history ``cancel`` / ``cancelled`` by
  ``engine``), and a call one of them left pending (no compensation: else it would unwind) is
  closed ``failed`` + uncertain, as the operator's cancel closes it;
- the pending approvals any of them waited for are expired in the same transaction (0006); the
  approval's own trigger then finds the run no longer ``waiting_approval`` and leaves it alone.

Every statement names the community (``NEW.community_id``: Citus router form) and the history
entries are built with IMMUTABLE operations over the columns (0013). The text is frozen here; the
reverse restores 0013's body (the latest before this one)."""

import importlib

from django.db import migrations

_0013 = importlib.import_module("buzz_delivery.agents.migrations.0013_history_entries_immutable")

_TERMINAL = "('completed', 'failed', 'cancelled', 'timeout')"


def _entry(status: str) -> str:
    """A ``cancel`` history entry by ``engine`` at generation + 1 (0013's immutable form)."""
    return (
        "history = buzz_delivery_history_push(r.history, jsonb_build_object('at', buzz_delivery_now())"
        f" || jsonb_object(ARRAY['event', 'cancel', 'status', '{status}', 'actor', ('engine')::text])"
        " || ('{\"generation\": ' || (r.lease_generation + 1)::text || ', \"renewals\": ' || (r.renewals)::text"
        " || '}')::jsonb)"
    )


_OUTSTANDING = """
          EXISTS (SELECT 1 FROM buzz_agents_journal AS j WHERE j.community_id = NEW.community_id AND j.run_id = r.id
                  AND j.compensation IS NOT NULL
                  AND (j.status = 'succeeded' OR (j.status = 'failed' AND j.uncertain)
                       OR (j.status = 'pending' AND j.kind = 'tool'))
                  AND j.compensation_status IS DISTINCT FROM 'compensated')
          AND NOT EXISTS (SELECT 1 FROM buzz_agents_journal AS j WHERE j.community_id = NEW.community_id
                          AND j.run_id = r.id AND j.compensation_status = 'compensation_failed')"""

CANCELED = f"""
CREATE OR REPLACE FUNCTION buzz_agents_workflow_canceled() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    unwound integer;
    ended uuid[];
    waited uuid[];
    waited_too uuid[];
BEGIN
    -- The runs first, then their journals: a holder's commit meanwhile is seen below.
    PERFORM 1 FROM buzz_agents_run AS r
    WHERE r.community_id = NEW.community_id AND r.source_run_id = NEW.run_id AND r.state NOT IN {_TERMINAL}
    ORDER BY r.id
    FOR NO KEY UPDATE;

    -- Compensations outstanding: fenced and back to pending, unwinding (the operator's cancel).
    WITH sent AS (
    UPDATE buzz_agents_run AS r
    SET state = 'pending', unwinding = true, lease_generation = r.lease_generation + 1, lease_until = NULL,
        claimed_at = NULL, next_attempt_at = NULL, failure_code = 'workflow_canceled', failure_message = NULL,
        {_entry("pending")}
    WHERE r.community_id = NEW.community_id AND r.source_run_id = NEW.run_id AND r.state NOT IN {_TERMINAL}
      AND NOT (r.unwinding AND coalesce(r.failure_code IN ('cancelled', 'workflow_canceled'), false))
      AND ({_OUTSTANDING})
    RETURNING r.approval_id
    ) SELECT count(*), array_agg(approval_id) FILTER (WHERE approval_id IS NOT NULL) INTO unwound, waited FROM sent;

    -- Nothing to undo: cancelled at once, as before.
    WITH cancelled AS (
    UPDATE buzz_agents_run AS r
    SET state = 'cancelled', lease_generation = r.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
        unwinding = false, failure_code = 'workflow_canceled', failure_message = NULL,
        finished_at = buzz_delivery_now(),
        {_entry("cancelled")}
    WHERE r.community_id = NEW.community_id AND r.source_run_id = NEW.run_id AND r.state NOT IN {_TERMINAL}
      AND NOT ({_OUTSTANDING})
    RETURNING r.id, r.approval_id
    ) SELECT array_agg(id), array_agg(approval_id) FILTER (WHERE approval_id IS NOT NULL) INTO ended, waited_too
      FROM cancelled;

    IF ended IS NOT NULL THEN
        UPDATE buzz_agents_journal AS j
        SET status = 'failed', uncertain = true, error = 'uncertain: the run ended while the call was pending',
            result_generation = r.lease_generation, finished_at = buzz_delivery_now()
        FROM buzz_agents_run AS r
        WHERE j.community_id = NEW.community_id AND j.run_id = ANY (ended) AND j.status = 'pending'
          AND j.kind = 'tool' AND r.community_id = NEW.community_id AND r.id = j.run_id AND r.state IN {_TERMINAL};
    END IF;

    waited := coalesce(waited, '{{}}'::uuid[]) || coalesce(waited_too, '{{}}'::uuid[]);
    IF cardinality(waited) > 0 THEN
        UPDATE buzz_workflows_approval AS a SET state = 'expired', closed_at = buzz_delivery_now()
        WHERE a.community_id = NEW.community_id AND a.id = ANY (waited) AND a.state = 'pending';
    END IF;
    IF unwound > 0 THEN
        PERFORM pg_notify('buzz_agents', NEW.community_id::text);  -- claimable: wake the workers
    END IF;
    RETURN NULL;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_agents", "0016_run_priority")]

    operations = [migrations.RunSQL(sql=CANCELED, reverse_sql=_0013.CANCELED)]

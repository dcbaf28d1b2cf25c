"""The fan-in trigger (``buzz_workflows_delivery_fan_in``, migration 0002) fires only for a delivery
that carries the message event of its run's step: the engine's ``send_message`` binds every
delivery it commits to ``message_event_id(run, step)`` = SHA-256 of
``buzz-workflows/message/<run id>/<step key>`` (``executor.message_event_id``), so the trigger's
WHEN now says so too. Every other delivery (the inbox's: no engine run behind it) became terminal
through one PL/pgSQL call per row that found no running engine run and returned; that queued AFTER
event, the call and its probe of ``buzz_workflows_run`` were 5-7 µs of a worker's ~100 µs of
server CPU per delivery (issue 31, ``bench.server_ladder``). The function is unchanged: it still
locks the run first and counts the delivery only in a waiting ``send_message`` step of a running
engine run. A delivery another producer committed under an engine run's step key is no longer
counted as one of the step's (it was never among the ``expected`` the step waits for).
``tests/test_wf_fan_in_filter.py`` keeps the SQL digest equal to the Python one."""

from django.db import migrations

from buzz_delivery.delivery_table import RunSQLOnTheDeliveryTable

TERMINAL = "('finished', 'failed', 'expired')"
TERMINALITY_CHANGES = f"((OLD.status IN {TERMINAL}) IS DISTINCT FROM (NEW.status IN {TERMINAL}))"
# The engine's message event id of the delivery's own run and step (executor.message_event_id).
ENGINE_MESSAGE = (
    "NEW.message_event_id = sha256(convert_to("
    "'buzz-workflows/message/' || NEW.run_id::text || '/' || NEW.step_id, 'UTF8'))"
)


def _trigger(when: str) -> str:
    return f"""
DROP TRIGGER buzz_workflows_delivery_fan_in ON buzz_delivery_delivery;
CREATE TRIGGER buzz_workflows_delivery_fan_in
AFTER UPDATE OF status ON buzz_delivery_delivery
FOR EACH ROW WHEN ({when})
EXECUTE FUNCTION buzz_workflows_count_delivery();
"""


class Migration(migrations.Migration):
    dependencies = [("buzz_workflows", "0022_step_concurrency_slots")]

    operations = [
        RunSQLOnTheDeliveryTable(
            sql=_trigger(f"{TERMINALITY_CHANGES} AND {ENGINE_MESSAGE}"),
            reverse_sql=_trigger(TERMINALITY_CHANGES),
        ),
    ]

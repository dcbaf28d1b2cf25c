"""The agent-run moves made by triggers append their history entry too (issue 17, core 0008):
an approval's decision or expiry resumes a run waiting on it (``approval``, actor: who decided,
or ``expired``), and a cancelled workflow run cancels the agent runs it started (``cancel``,
actor ``engine``). Both functions are re-created from migration 0002's text with the append in
the same UPDATE; their triggers are unchanged."""

import importlib

from django.db import migrations

_0002 = importlib.import_module("buzz_delivery.agents.migrations.0002_keys_and_triggers")


def _function(source: str, name: str) -> str:
    """``CREATE OR REPLACE`` text of one function of a migration's SQL (up to its closing ``$$;``)."""
    start = source.index(f"CREATE FUNCTION {name}()")
    end = source.index("$$;", source.index("$$", start) + 2) + 3
    return "CREATE OR REPLACE" + source[start + len("CREATE") : end] + "\n"


def _entry(event: str, status: str, generation: str, actor: str) -> str:
    return (
        f",\n            history = buzz_delivery_history_push(r.history, jsonb_build_object("
        f"'event', '{event}', 'status', '{status}', 'generation', {generation}, 'actor', {actor}, "
        f"'at', buzz_delivery_now(), 'renewals', r.renewals))"
    )


_RESUME = _function(_0002.APPROVAL_RESUME, "buzz_agents_approval_closed")
_EXPIRED = "failure_message = 'no decision before the approval deadline', next_attempt_at = NULL"
_DECIDED = "UPDATE buzz_agents_run AS r SET state = 'pending', next_attempt_at = NULL"
assert _RESUME.count(_EXPIRED) == 1 and _RESUME.count(_DECIDED) == 1
RESUME = _RESUME.replace(
    _EXPIRED, _EXPIRED + _entry("approval", "pending", "r.lease_generation", "coalesce(NEW.decided_by, 'expired')")
).replace(_DECIDED, _DECIDED + _entry("approval", "pending", "r.lease_generation", "NEW.decided_by"))

_CANCELED = _function(_0002.WAY_BACK, "buzz_agents_workflow_canceled")
_CANCEL_SET = "        finished_at = buzz_delivery_now()\n    WHERE r.community_id = NEW.community_id AND r.source_run_id"
assert _CANCELED.count(_CANCEL_SET) == 1
CANCELED = _CANCELED.replace(
    _CANCEL_SET,
    "        finished_at = buzz_delivery_now()"
    + _entry("cancel", "cancelled", "r.lease_generation + 1", "'engine'")
    + "\n    WHERE r.community_id = NEW.community_id AND r.source_run_id",
)


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_agents", "0003_run_history"),
    ]

    operations = [
        migrations.RunSQL(sql=RESUME, reverse_sql=_RESUME),
        migrations.RunSQL(sql=CANCELED, reverse_sql=_CANCELED),
    ]

"""A cancelled workflow run expires the pending approvals of the agent runs it cancels.

Before, the engine's cancel ended those agent runs at once but left an approval they waited for
pending in the approvals queue, where a decision was accepted and changed nothing (the demo's
finding). Now the same trigger closes it ``expired`` in the same transaction; the approval's own
trigger then finds the run already terminal and leaves it alone. Re-created from 0004's text."""

import importlib

from django.db import migrations

_0004 = importlib.import_module("buzz_delivery.agents.migrations.0004_approval_and_cancel_in_history")

_BEGIN = "RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n    UPDATE buzz_agents_run AS r"
_END = "      AND r.state NOT IN ('completed', 'failed', 'cancelled', 'timeout');\n    RETURN NULL;"
assert _0004.CANCELED.count(_BEGIN) == 1 and _0004.CANCELED.count(_END) == 1
CANCELED = _0004.CANCELED.replace(
    _BEGIN,
    "RETURNS trigger LANGUAGE plpgsql AS $$\nDECLARE\n    waited uuid[];\nBEGIN\n"
    "    WITH cancelled AS (\n    UPDATE buzz_agents_run AS r",
).replace(
    _END,
    "      AND r.state NOT IN ('completed', 'failed', 'cancelled', 'timeout')\n"
    "    RETURNING r.approval_id\n"
    "    ) SELECT array_agg(approval_id) FILTER (WHERE approval_id IS NOT NULL) INTO waited FROM cancelled;\n"
    "    IF waited IS NOT NULL THEN\n"
    "        UPDATE buzz_workflows_approval AS a SET state = 'expired', closed_at = buzz_delivery_now()\n"
    "        WHERE a.community_id = NEW.community_id AND a.id = ANY (waited) AND a.state = 'pending';\n"
    "    END IF;\n"
    "    RETURN NULL;",
)


class Migration(migrations.Migration):
    dependencies = [("buzz_agents", "0005_row_level_security")]

    operations = [migrations.RunSQL(sql=CANCELED, reverse_sql=_0004.CANCELED)]

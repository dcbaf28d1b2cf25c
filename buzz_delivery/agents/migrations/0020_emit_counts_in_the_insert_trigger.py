"""``ctx.emit`` in Citus's router form (issue 30): the chunk's statement becomes one INSERT ...
SELECT from its run row (the fence and the per-run bound in its WHERE, the row locked FOR NO KEY
UPDATE as the UPDATE it replaces locked it), and the run's counters move in the row trigger on the
chunk's insert, which already checked the sequence. The trigger reads and writes only its own
run's row (same community, same shard), so on Citus the whole emit is one task on one node; before,
Citus ran the UPDATE on the shard and pulled its row to the coordinator for the INSERT.

The trigger bumps ``output_chunks`` and ``output_bytes`` (the chunk's UTF-8 size) only when the
chunk's ``seq`` is the counter's next and one past the run's last chunk, else refuses (BD003): the
sequence stays gapless from 1 whoever inserts, and the counters stay the run's last seq and its
bytes."""

import importlib

from django.db import migrations

_0018 = importlib.import_module("buzz_delivery.agents.migrations.0018_run_output")

COUNT_ON_INSERT = """
CREATE OR REPLACE FUNCTION buzz_agents_output_seq() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    used integer;
    last_ integer;
BEGIN
    UPDATE buzz_agents_run
    SET output_chunks = output_chunks + 1, output_bytes = output_bytes + octet_length(NEW.chunk)
    WHERE community_id = NEW.community_id AND id = NEW.run_id AND output_chunks = NEW.seq - 1
    RETURNING output_chunks INTO used;
    SELECT max(seq) INTO last_ FROM buzz_agents_output
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id;
    IF used IS NULL OR NEW.seq <> coalesce(last_, 0) + 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'BD003',
            MESSAGE = format('buzz_agents: output seq %s is not the run''s next (last %s)', NEW.seq, last_);
    END IF;
    RETURN NEW;
END;
$$;
"""

_OLD = _0018.SEQUENCE.split("CREATE TRIGGER buzz_agents_output_seq", 1)[0]
assert _OLD.strip().startswith("CREATE FUNCTION buzz_agents_output_seq()")
CHECK_ONLY = _OLD.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_agents", "0019_run_concurrency_slots"),
    ]

    operations = [
        migrations.RunSQL(sql=COUNT_ON_INSERT, reverse_sql=CHECK_ONLY),
    ]

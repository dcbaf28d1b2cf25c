"""No session can freeze another community's writes through the write fence's advisory lock
(issue 27, SPEC 15: locks two sides must meet are taken on rows of the community).

Any role may take any advisory lock: a session that held a community's fence lock exclusively
(``pg_advisory_lock(1111752705, hashtext('<community id>'))``) stopped every writer of that
community until it let go. A writer now only *tries* the shared fence lock (the fast path, no
row written). When it is not free at once (a lifecycle move holds it or waits for it, or some
other session took it), the writer meets the move on the community row instead: it reads the
state ``FOR SHARE``. A move always holds that row (its UPDATE locks the row before the
lifecycle trigger runs, and the trigger then takes the fence lock exclusively), so either way
the writer waits for a move in progress and then sees its new state; a lock some other session
took no longer stops it. Only a role whose policies let it update the community row can lock
it: a tenant, only its own community's.

Why not the row alone: a steady stream of ``FOR SHARE`` lockers never queues behind a waiting
UPDATE in PostgreSQL, so a move could wait forever under load; a writer that finds the fence
lock taken or awaited (the lock manager queues a try behind a waiting exclusive request) takes
the row path and queues behind the move there.
"""

import importlib

from django.db import migrations

_0014 = importlib.import_module("buzz_delivery.migrations.0014_write_fence_runs_one_shared_function")

_LOCK_AND_READ = """    -- Shared with every other writer of this community; a lifecycle move takes it exclusively.
    PERFORM pg_advisory_xact_lock_shared(1111752705, hashtext(cid::text));
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community WHERE id = cid;
    ELSE
        -- A snapshot older than the lock: lock the community row so a lifecycle move committed
        -- after that snapshot raises 40001 (serialization failure) instead of being missed.
        SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community
            WHERE id = cid FOR SHARE;
    END IF;
"""
assert _0014.FENCE_FUNCTION.count(_LOCK_AND_READ) == 1

FENCE_FUNCTION = _0014.FENCE_FUNCTION.replace(
    _LOCK_AND_READ,
    """    -- The fast path: the fence lock, shared with every other writer of this community (a
    -- lifecycle move takes it exclusively), if it is free at once.
    IF pg_try_advisory_xact_lock_shared(1111752705, hashtext(cid::text)) THEN
        IF current_setting('transaction_isolation') = 'read committed' THEN
            SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community WHERE id = cid;
        ELSE
            -- A snapshot older than the lock: lock the community row so a lifecycle move committed
            -- after that snapshot raises 40001 (serialization failure) instead of being missed.
            SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community
                WHERE id = cid FOR SHARE;
        END IF;
    ELSE
        -- The fence lock is held or awaited: by a lifecycle move (which holds the community row
        -- too), or by a session that merely took it. Meet the move on the row: wait for it, then
        -- read the state it committed. Another session's advisory lock stops no writer.
        SELECT deletion_state, fence_generation INTO st, gen FROM buzz_delivery_community
            WHERE id = cid FOR SHARE;
    END IF;
""",
)


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0019_lease_functions_immutable_history")]

    operations = [migrations.RunSQL(sql=FENCE_FUNCTION, reverse_sql=_0014.FENCE_FUNCTION)]

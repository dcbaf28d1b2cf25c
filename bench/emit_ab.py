"""``ctx.emit``'s statement before and after it took Citus's router form (issue 30), in one run on
the benchmark database:

    python -m bench.emit_ab [--chunks 100] [--rounds 40]

Before: the fenced UPDATE of the run feeding the chunk's INSERT (agents migration 0018's
statement and its check-only sequence trigger). After: the INSERT ... SELECT from the locked run
row, the counters moved by the chunk's insert trigger (migration 0020). Each round emits
``--chunks`` chunks of 32 bytes through ``emit_output`` (the service, one short transaction a
chunk, as a handler's ``ctx.emit``) on a fresh claimed run with one and then the other (the
order alternates; the trigger's function is swapped between them): many short rounds, so that
load on a shared machine falls on both alike. Prints the median microseconds of one emit of each
(over every emit of every round) and the ratio after/before. Figures only, never asserted.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
import uuid

from bench import env

BEFORE_STATEMENT = """
WITH fenced AS (
    UPDATE buzz_agents_run AS r
    SET output_chunks = r.output_chunks + 1, output_bytes = r.output_bytes + %(size)s
    WHERE {lease} AND r.output_bytes + %(size)s <= %(max_stream_bytes)s
    RETURNING r.id, r.output_chunks, r.lease_generation
)
INSERT INTO buzz_agents_output (id, community_id, run_id, seq, chunk, generation)
SELECT %(chunk_id)s, %(community_id)s, fenced.id, fenced.output_chunks, %(chunk)s, fenced.lease_generation
FROM fenced
RETURNING seq
"""


def _round(community, agent: bytes, chunks: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Microseconds of each of ``chunks`` emits on a fresh claimed run."""
    from buzz_delivery.agents.services import claim_agent_runs, emit_output, intake_event

    intake_event(community.id, "bench", uuid.uuid4().hex, {}, agent)
    (claimed,) = claim_agent_runs(community.id, [agent], worker_id="bench", lease_seconds=300)
    text = "x" * 32
    times = []
    for _ in range(chunks):
        started = time.perf_counter()
        emit_output(claimed.lease, text)
        times.append((time.perf_counter() - started) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emit_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()

    from django.db import connection

    from buzz_delivery.agents.services import sql
    from buzz_delivery.testing import CommunityFactory, random32

    _0020 = importlib.import_module("buzz_delivery.agents.migrations.0020_emit_counts_in_the_insert_trigger")

    variants = {
        "before": (BEFORE_STATEMENT.format(lease=sql.CURRENT_RUN_LEASE), _0020.CHECK_ONLY),
        "after": (sql.EMIT_IF_CURRENT_AND_WITHIN_BOUND, _0020.COUNT_ON_INSERT),
    }
    community, agent = CommunityFactory(), random32()
    runs: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for round_ in range(args.rounds):
            for name in ["before", "after"] if round_ % 2 == 0 else ["after", "before"]:
                statement, trigger = variants[name]
                with connection.cursor() as cursor:
                    cursor.execute(trigger)
                sql.EMIT_IF_CURRENT_AND_WITHIN_BOUND = statement
                runs[name] += _round(community, agent, args.chunks)
    finally:
        sql.EMIT_IF_CURRENT_AND_WITHIN_BOUND = variants["after"][0]
        with connection.cursor() as cursor:
            cursor.execute(_0020.COUNT_ON_INSERT)
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    print(f"ctx.emit, one chunk a transaction: before {before:.0f} us/emit, after {after:.0f} us/emit, "
          f"after/before {after / before:.3f} (medians of {len(runs['after'])} emits each)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

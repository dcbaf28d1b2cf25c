"""Wake latency (issue 16): from a commit to its handler's start, woken by NOTIFY, at 200 jobs/s
offered one commit at a time, for our worker and for PgQueuer in the same run.

The consumer of each system runs in its own process (:mod:`bench.wake_agents`: our ``run_worker``
with 4 handler threads, PgQueuer's ``QueueManager`` with batch 10), both polling only every
10 s, so a job starts because its hint woke the consumer. The controller commits one job at a
time at the offered rate (ours: ``services.commit_deliveries`` of one binding; PgQueuer:
``Queries.enqueue`` of one job) and notes when each commit returned (the producer's own
statements are not counted: ours validates and inserts more than PgQueuer's enqueue, which is
the producer's cost, not the wake path's); the consumers note when each handler began, on the
same host clock. A handler may start a moment before its producer hears the commit back, so a
few latencies are slightly negative. Printed: p50 / p99 / max per system, and the producer's
commit time, the systems interleaved over the repetitions (their order rotating); the figure's
ratio is ours / PgQueuer of the p99 (target: no worse, <= 1.0x).

Before the measured commits, the controller waits (at most :data:`READY_SECONDS`) until the
consumer is woken by a hint: it commits probe jobs one at a time until one starts within
:data:`PROBE_SECONDS` of its commit, other than the first one started (the consumer's first poll
may take a job committed before it LISTENs); as both consumers poll only every 10 s, such a
start was woken by its hint. A consumer that exits or is not ready in time fails the run.

``BENCH_BEFORE_ROOT`` (a folder holding another source tree, e.g. ``git archive main`` extracted):
our consumer from that tree runs too (``ours_before``), interleaved with the others, on the same
database and tenant, for an A/B of the worker itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import data, env
from bench.context import Bench
from bench.report import Figure

RATE = 200.0  # jobs offered per second
READY_SECONDS = 60.0  # the longest a consumer may take to start (Django, LISTEN) and be woken
PROBE_SECONDS = 1.0  # a probe started this soon after its commit was woken by a hint (polls: 10 s)
WAIT_SECONDS = 15.0  # the longest the controller waits for the last handler to start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start_consumer(kind: str, bench: Bench, out: Path, *args: str, root: Path = env.ROOT) -> subprocess.Popen[bytes]:
    """Start ``bench.wake_agents`` of the source tree ``root`` (its ``buzz_delivery`` too)."""
    environ = {**os.environ, "LOG_LEVEL": "WARNING", "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "bench.wake_agents", kind, bench.url, str(out), *args]
    return subprocess.Popen(command, cwd=root, env=environ, stdout=subprocess.DEVNULL)


def _started(out: Path) -> dict[str, float]:
    """key -> when its handler began (the first start of each key), from a consumer's log."""
    started: dict[str, float] = {}
    for line in out.read_text().splitlines():
        key, _, at = line.partition(" ")
        started.setdefault(key, float(at))
    return started


def _await_ready(system: str, commit_one, out: Path, proc: subprocess.Popen[bytes]) -> None:
    """Commit probe jobs (``commit_one()``) one at a time until one other than the first one
    started begins within :data:`PROBE_SECONDS` of its commit: the consumer is woken by hints
    (see the module docstring). Raises RuntimeError if the consumer exits, or is not ready
    within :data:`READY_SECONDS`."""
    deadline = time.monotonic() + READY_SECONDS
    handled = 0
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"wake: the {system} consumer exited (code {proc.returncode}) before it was ready")
        if time.monotonic() >= deadline:
            proc.kill()
            raise RuntimeError(f"wake: the {system} consumer was not woken by a hint within {READY_SECONDS:.0f} s")
        key = commit_one()
        committed = time.monotonic()
        while time.monotonic() - committed < PROBE_SECONDS and proc.poll() is None:
            if key in _started(out):
                handled += 1
                break
            time.sleep(0.005)
        else:
            continue  # not started yet (still starting up): the next probe
        if handled >= 2:
            return


COMMIT_MS: dict[str, list[float]] = {}  # system -> the producer's commit times (ms), last run


def _offer(system: str, commit_one, n: int) -> dict[str, float]:
    """Call ``commit_one()`` (which returns the job's key) ``n`` times at :data:`RATE`; returns
    key -> time the commit returned."""
    committed: dict[str, float] = {}
    took: list[float] = []
    first = time.monotonic()
    for i in range(n):
        pause = first + i / RATE - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        began = time.time()
        key = commit_one()
        committed[key] = time.time()
        took.append((committed[key] - began) * 1000)
    COMMIT_MS[system] = took
    return committed


def _latencies(out: Path, began: dict[str, float], proc: subprocess.Popen[bytes]) -> list[float]:
    deadline = time.monotonic() + WAIT_SECONDS
    started: dict[str, float] = {}
    while time.monotonic() < deadline:
        started = _started(out)
        if all(key in started for key in began):
            break
        time.sleep(0.2)
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    missing = [key for key in began if key not in started]
    if missing:
        raise RuntimeError(f"wake: {len(missing)} of {len(began)} jobs never started")
    return [(started[key] - began[key]) * 1000 for key in began]


def _ours(
    bench: Bench, tenant: data.Tenant, n: int, tmp: Path, system: str = "ours", root: Path = env.ROOT
) -> list[float]:
    from buzz_delivery import services
    from buzz_delivery.models import Event

    data.clear_deliveries(bench.conn)
    target = data.target(0)
    event = Event.objects.get(pk=tenant.event_pk)
    out = tmp / f"{system}.log"
    out.write_text("")
    proc = _start_consumer("ours", bench, out, str(tenant.community_id), target.hex(), root=root)
    counter = iter(range(10**9))

    def commit_one() -> str:
        binding = services.Binding(
            community_id=tenant.community_id,
            workflow_id=tenant.workflow_id,
            run_id=tenant.run_id,
            step_id=f"wake-{next(counter)}-{os.urandom(4).hex()}",
            target_pubkey=target,
            definition_event_id=data.DEFINITION_EVENT_ID,
            message_event_id=tenant.event_id,
            cause=services.Cause.event(os.urandom(32)),
        )
        (delivery_id,) = services.commit_deliveries(tenant.community_id, event, [binding])
        return str(delivery_id)

    try:
        _await_ready(system, commit_one, out, proc)
    except BaseException:
        proc.kill()
        raise
    return _latencies(out, _offer(system, commit_one, n), proc)


def _pgqueuer(bench: Bench, n: int, tmp: Path) -> list[float]:
    import psycopg
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    async def install() -> None:
        aconn = await psycopg.AsyncConnection.connect(bench.url, autocommit=True)
        try:
            if (await (await aconn.execute("SELECT to_regclass('pgqueuer')")).fetchone())[0] is None:  # type: ignore[index]
                await Queries(PsycopgDriver(aconn)).install()
            await aconn.execute("TRUNCATE pgqueuer, pgqueuer_log")
        finally:
            await aconn.close()

    asyncio.run(install())
    out = tmp / "pgqueuer.log"
    out.write_text("")
    proc = _start_consumer("pgqueuer", bench, out)
    loop = asyncio.new_event_loop()
    aconn = loop.run_until_complete(psycopg.AsyncConnection.connect(bench.url, autocommit=True))
    queries = Queries(PsycopgDriver(aconn))
    counter = iter(range(10**9))

    def commit_one() -> str:
        key = f"job-{next(counter)}"
        loop.run_until_complete(queries.enqueue("wake", key.encode(), 0))
        return key

    try:
        try:
            _await_ready("pgqueuer", commit_one, out, proc)
        except BaseException:
            proc.kill()
            raise
        return _latencies(out, _offer("pgqueuer", commit_one, n), proc)
    finally:
        loop.run_until_complete(aconn.close())
        loop.close()


def run(bench: Bench) -> None:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        print("wake: PgQueuer is not installed (pip install -e '.[bench]'); skipped")
        return
    n = bench.scaled(1_000, 400)
    data.reset(bench.conn)
    (tenant,) = data.create_tenants(1)
    before = os.environ.get("BENCH_BEFORE_ROOT")
    systems = {
        "ours": lambda tmp: _ours(bench, tenant, n, tmp),
        "pgqueuer": lambda tmp: _pgqueuer(bench, n, tmp),
    }
    if before:
        systems["ours_before"] = lambda tmp: _ours(bench, tenant, n, tmp, "ours_before", Path(before))
    runs: dict[str, list[list[float]]] = {system: [] for system in systems}
    names = list(systems)
    with tempfile.TemporaryDirectory(prefix="bench_wake_") as tmp:
        for repeat in range(bench.repeats):  # interleaved, the order rotating
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for system in order:
                runs[system].append(systems[system](Path(tmp)))
            for system in order:
                latencies = runs[system][-1]
                print(
                    f"wake: {system} n={n} at {RATE:.0f}/s: p50 {_percentile(latencies, 0.5):.1f} ms"
                    f" p99 {_percentile(latencies, 0.99):.1f} ms max {max(latencies):.1f} ms"
                    f" (producer's commit p50 {_percentile(COMMIT_MS[system], 0.5):.1f} ms)",
                    flush=True,
                )
    # Issue 31's targets: p50 no worse than PgQueuer's, p99 kept ahead (both <= 1.0x).
    peers = [("pgqueuer", "PgQueuer", 1.0, "raw column = PgQueuer (batch 10) in the same run")]
    if before:
        note = f"raw column = the worker of BENCH_BEFORE_ROOT ({before}) in the same run"
        peers.append(("ours_before", "ours before", None, note))
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        for peer, name, target, note in peers:
            bench.report.add(
                Figure(
                    figure=f"wake latency, commit returned -> handler start, {RATE:.0f}/s offered (NOTIFY)",
                    case=f"{label}: ours vs {name}",
                    unit="ms",
                    ours_runs=[_percentile(r, q) for r in runs["ours"]],
                    raw_runs=[_percentile(r, q) for r in runs[peer]],
                    target_ratio=target,
                    lower_is_better=True,
                    note=note,
                )
            )

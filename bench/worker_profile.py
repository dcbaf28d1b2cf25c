"""Drain N no-op deliveries with run_worker in this process (for py-spy): prints the rate and
this process's client CPU µs/delivery.

    BENCH_DATABASE_URL=... python -m bench.worker_profile --deliveries 20000 [--threads --server]
    ... --processes 4 --rounds 3 --server   # K worker processes at once, CPU by phase and thread
    ... --replay                            # the handler thread's per-delivery path alone
"""

from __future__ import annotations

import argparse
import collections
import re
import resource
import time
from typing import Any

from bench import data, env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deliveries", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument(
        "--async",
        dest="is_async",
        action="store_true",
        help="the async def no-op handler (bench.handlers.anoop: tasks on the worker's loop), as worker_async",
    )
    parser.add_argument(
        "--idle-exit",
        type=float,
        default=0.3,
        help="the worker's idle exit, seconds (longer on a loaded machine: a slow start idled out at 0)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="drain with this many worker processes at once (spawned once, reused each round, as the"
        " peers harness's K): per-process CPU split into start-up, claims and stop, with each"
        " thread kind's CPU and the claims' sizes (empty and short claims)",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="no drain: claim 50 real deliveries once and time, on one thread (thread CPU, median of"
        " 50 passes), a handler thread's per-delivery path (_handle + _handed, no settle) and the"
        " dispatcher's per-round reads (_room, _working, the renewer's hung counts) with them held",
    )
    parser.add_argument("--services", action="store_true", help="claim 50 -> finish 50 loop, no worker")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="count the statements each Django connection sends (by kind) and the database's commits",
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="CPU seconds per delivery of each kind of worker thread (handler, settler, ...; the"
        " dispatcher is the rest of client_us)",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="server CPU µs/delivery: the bench database's backends (/proc, sampled every 50 ms;"
        " this script's own connections left out)",
    )
    args = parser.parse_args()
    thread_cpu: collections.Counter[str] = collections.Counter()
    if args.threads:
        _count_thread_cpu(thread_cpu)
    url = env.database_url()
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    conn = env.connect(url)
    from bench import baseline

    baseline.create_table(conn)
    data.reset(conn)
    (tenant,) = data.create_tenants(1)
    import gc

    from bench.handlers import anoop, noop
    from buzz_delivery.worker import WorkerConfig, run_worker

    gc_time = [0.0, 0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[2] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[2]
            gc_time[1] += 1

    gc.callbacks.append(on_gc)
    if args.freeze:
        gc.collect()
        gc.freeze()
    sent: collections.Counter[str] = collections.Counter()
    if args.statements:
        _count_statements(sent)
    if args.processes:
        _multi(args, url, conn, tenant)
        return
    if args.replay:
        _replay(conn, tenant, args.concurrency)
        return
    for _ in range(args.rounds):
        gc_time[0], gc_time[1] = 0.0, 0
        sent.clear()
        thread_cpu.clear()
        data.clear_deliveries(conn)
        data.load(conn, tenant, args.deliveries)
        data.analyze(conn)
        conn.execute("CHECKPOINT")
        commits0 = _commits(conn)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        sampler = _ServerCpu(url, exclude=_backend_pid(conn)) if args.server else None
        cpu, wall = time.process_time(), time.monotonic()
        if args.services:
            from buzz_delivery import services

            done = 0
            while claims := services.claim_deliveries(tenant.community_id, data.target(0), limit=50):
                services.finish_deliveries([c.lease for c in claims])
                done += len(claims)
            summary = {"finished": done}
        else:
            summary = run_worker(
                WorkerConfig(
                    community_id=tenant.community_id,
                    target_pubkey=data.target(0),
                    handler=anoop if args.is_async else noop,
                    concurrency=args.concurrency,
                    batch_size=50,
                    poll_interval=0.5,
                    idle_exit=args.idle_exit,
                ),
                handle_signals=False,
            )
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        server = sampler.stop() if sampler is not None else None
        if sampler is not None:
            cpu -= sampler.own_cpu  # the sampler thread's own CPU is not the drain's
            thread_cpu.pop("server-sampler", None)
        n = summary["finished"]
        print(dict(summary))
        print(
            f"finished={n} rate={n / wall:.0f}/s client_us={cpu / n * 1e6:.1f}"
            f" user_us={(r1.ru_utime - r0.ru_utime) / n * 1e6:.1f} sys_us={(r1.ru_stime - r0.ru_stime) / n * 1e6:.1f}"
            f" gc_us={gc_time[0] / n * 1e6:.1f} gcs={gc_time[1]} objs={len(gc.get_objects())}"
            f" vcsw/d={(r1.ru_nvcsw - r0.ru_nvcsw) / n:.2f} ivcsw/d={(r1.ru_nivcsw - r0.ru_nivcsw) / n:.2f}",
            flush=True,
        )
        if server is not None:
            print(
                f"server_us={server.get('client backend', 0.0) / n * 1e6:.1f} (client backends; all: "
                + " ".join(f"{kind.replace(' ', '_')}={sec / n * 1e6:.1f}" for kind, sec in sorted(server.items()))
                + ")"
            )
        if args.threads:
            rest = (cpu - sum(thread_cpu.values())) / n * 1e6  # the caller's thread: the dispatcher
            print(
                " ".join(f"{name}_us={sec / n * 1e6:.1f}" for name, sec in sorted(thread_cpu.items()))
                + f" dispatcher_us={rest:.1f}"
            )
        if args.statements:
            commits = _commits(conn) - commits0 - 1  # less this read's own transaction
            print(f"commits/delivery={commits / n:.4f} (the database's xact_commit, all sessions)")
            for kind, count in sent.most_common():
                print(f"  {count / n:.4f}/delivery {count:>7} {kind}")


# --- the per-delivery paths alone (--replay) -------------------------------------------------------


def _replay(conn: Any, tenant: Any, concurrency: int) -> None:
    import statistics
    import threading

    from bench import data
    from bench.handlers import noop
    from buzz_delivery import services
    from buzz_delivery.worker import WorkerConfig
    from buzz_delivery.worker import runtime as worker_runtime

    data.clear_deliveries(conn)
    data.load(conn, tenant, 60)
    data.analyze(conn)
    claims = services.claim_deliveries(tenant.community_id, data.target(0), limit=50)
    config = WorkerConfig(
        community_id=tenant.community_id,
        target_pubkey=data.target(0),
        handler=noop,
        concurrency=concurrency,
        batch_size=50,
    )
    worker = worker_runtime.Worker(config, threading.Event())
    lookup = getattr(worker_runtime, "thread_connection_lookup", None)  # (an older tree has none)
    out: dict[str, float] = {}

    def run() -> None:
        passes = []
        for _ in range(60):
            worker.renewer.hold_many([c.lease for c in claims])
            with worker._lock:
                worker.in_flight += len(claims)
                worker.handling += len(claims)
            claimed_at = time.monotonic()
            cpu = time.thread_time()
            extra = (lookup(),) if lookup is not None else ()
            for claim in claims:
                worker._handed(worker._handle(claim, claimed_at, *extra))
            passes.append((time.thread_time() - cpu) / len(claims) * 1e6)
            worker.settler._queue.queue.clear()  # no settle: the results are dropped
            worker.wake.clear()
        out["handler_path_us"] = statistics.median(passes[10:])
        worker.renewer.hold_many([c.lease for c in claims])
        passes = []
        for _ in range(60):
            cpu = time.thread_time()
            for _ in range(100):
                worker._room()
                worker._working()
                worker.renewer.timed_out_count()
                worker.renewer.timed_out_delivery_ids()
            passes.append((time.thread_time() - cpu) / 100 * 1e6)
        out["round_reads_us"] = statistics.median(passes[10:])
        for claim in claims:
            worker.renewer.release(claim.lease)

    thread = threading.Thread(target=run, name="replay")
    thread.start()
    thread.join()
    services.finish_deliveries([c.lease for c in claims])
    print(" ".join(f"{name}={value:.2f}" for name, value in out.items()), f"(held: {len(claims)})")


# --- K worker processes at once (--processes) ----------------------------------------------------


def _child(url: str, concurrency: int, idle_exit: float, tasks: Any, results: Any) -> None:
    """One worker process: for each (community id, start instant) task, wait for the start,
    run_worker, and report its CPU by phase and thread kind and its claims' sizes."""
    thread_cpu: collections.Counter[str] = collections.Counter()
    _count_thread_cpu(thread_cpu)
    env.setup_django(url)
    from bench import data
    from bench.handlers import noop
    from buzz_delivery import services
    from buzz_delivery.worker import WorkerConfig, run_worker
    from buzz_delivery.worker import runtime as worker_runtime

    sizes: collections.Counter[int] = collections.Counter()
    marks: dict[str, float] = {}
    claim = services.claim_deliveries

    def counted(*a: Any, **kw: Any) -> Any:
        before = time.process_time()
        marks.setdefault("first_claim", before)
        claims = claim(*a, **kw)
        sizes[len(claims)] += 1
        if claims:
            marks["last_claim"] = time.process_time()
        elif "first_empty" not in marks and "last_claim" in marks:
            marks["first_empty"] = before
        return claims

    worker_runtime.services.claim_deliveries = counted  # type: ignore[attr-defined]
    rounds = [0, 0]  # the dispatcher's rounds (``_room`` asked) and of those with no room
    room = worker_runtime.Worker._room

    def counted_room(self: Any) -> int:
        free = room(self)
        rounds[0] += 1
        rounds[1] += not free
        return free

    worker_runtime.Worker._room = counted_room  # type: ignore[method-assign]
    results.put("ready")
    while (task := tasks.get()) is not None:
        community_id, start_at = task
        thread_cpu.clear()
        sizes.clear()
        marks.clear()
        rounds[:] = [0, 0]
        while time.monotonic() < start_at:
            time.sleep(0.001)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0 = time.process_time()
        summary = run_worker(
            WorkerConfig(
                community_id=community_id,
                target_pubkey=data.target(0),
                handler=noop,
                concurrency=concurrency,
                batch_size=50,
                poll_interval=0.5,
                idle_exit=idle_exit,
            ),
            handle_signals=False,
        )
        cpu1 = time.process_time()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        from django.db import connections

        connections.close_all()
        results.put(
            {
                "finished": summary["finished"],
                "cpu": cpu1 - cpu0,
                "start": marks.get("first_claim", cpu1) - cpu0,
                "stop": cpu1 - marks.get("first_empty", cpu1),
                "threads": dict(thread_cpu),
                "sizes": dict(sizes),
                "rounds": list(rounds),
                "user": r1.ru_utime - r0.ru_utime,
                "sys": r1.ru_stime - r0.ru_stime,
                "vcsw": r1.ru_nvcsw - r0.ru_nvcsw,
                "ivcsw": r1.ru_nivcsw - r0.ru_nivcsw,
            }
        )


def _multi(args: Any, url: str, conn: Any, tenant: Any) -> None:
    """``--processes K``: each round loads the queue, starts the K processes' drains at one
    instant and prints per delivery (all processes together): client CPU, its start-up part
    (run_worker's entry to its first claim), its stop part (from the first empty claim after
    the last full one: the idle exit, the drain, the summary's count), each thread kind's CPU,
    the claims' sizes (how many came back empty, short or full) and the context switches."""
    import multiprocessing as mp

    from bench import data

    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue() for _ in range(args.processes)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(url, args.concurrency, args.idle_exit, q, results), daemon=True) for q in tasks
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        results.get(timeout=120)
    try:
        for _ in range(args.rounds):
            data.clear_deliveries(conn)
            data.load(conn, tenant, args.deliveries)
            data.analyze(conn)
            conn.execute("CHECKPOINT")
            sampler = _ServerCpu(url, exclude=_backend_pid(conn)) if args.server else None
            start_at = time.monotonic() + 0.3
            for q in tasks:
                q.put((tenant.community_id, start_at))
            got = [results.get(timeout=600) for _ in procs]
            wall = max(time.monotonic() - start_at, 1e-9)
            server = sampler.stop() if sampler is not None else None
            n = sum(g["finished"] for g in got)
            threads: collections.Counter[str] = collections.Counter()
            sizes: collections.Counter[int] = collections.Counter()
            for g in got:
                threads.update(g["threads"])
                sizes.update(g["sizes"])
            cpu = sum(g["cpu"] for g in got)
            rest = cpu - sum(threads.values())
            claims = sum(sizes.values())
            print(
                f"K={args.processes} finished={n} rate~{n / wall:.0f}/s client_us={cpu / n * 1e6:.1f}"
                f" (user {sum(g['user'] for g in got) / n * 1e6:.1f} sys {sum(g['sys'] for g in got) / n * 1e6:.1f})"
                f" start_us={sum(g['start'] for g in got) / n * 1e6:.1f}"
                f" stop_us={sum(g['stop'] for g in got) / n * 1e6:.1f}"
                f" vcsw/d={sum(g['vcsw'] for g in got) / n:.2f} ivcsw/d={sum(g['ivcsw'] for g in got) / n:.2f}"
                + (f" server_us={server.get('client backend', 0.0) / n * 1e6:.1f}" if server else ""),
                flush=True,
            )
            print(
                "  "
                + " ".join(f"{name}_us={sec / n * 1e6:.1f}" for name, sec in sorted(threads.items()))
                + f" dispatcher_us={rest / n * 1e6:.1f}"
            )
            print(
                f"  claims={claims} per_delivery={claims / n:.4f} empty={sizes.get(0, 0)}"
                f" short={sum(c for k, c in sizes.items() if 0 < k < 50)} full={sizes.get(50, 0)}"
                f" dispatcher rounds/delivery={sum(g['rounds'][0] for g in got) / n:.3f}"
                f" (no room {sum(g['rounds'][1] for g in got) / n:.3f})"
                f" per process finished={[g['finished'] for g in got]}"
            )
    finally:
        for q in tasks:
            q.put(None)
        for proc in procs:
            proc.join(timeout=30)


def _backend_pid(conn: Any) -> int:
    return int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])


class _ServerCpu:
    """CPU seconds of the bench database's backends (user + system, ``/proc/<pid>/stat``) from
    now to :meth:`stop`, sampled every 50 ms on a connection of its own (left out, as is
    ``exclude``); a backend that ends between samples loses at most its last 50 ms."""

    def __init__(self, url: str, exclude: int) -> None:
        import threading

        self.conn = env.connect(url)
        self.exclude = {exclude, _backend_pid(self.conn)}
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.halt = threading.Event()
        self.own_cpu = 0.0  # this sampler thread's CPU seconds (left out of client_us)
        self.sample(initial=True)
        self.thread = threading.Thread(target=self.run, name="server-sampler", daemon=True)
        self.thread.start()

    def sample(self, initial: bool = False) -> None:
        from bench.scenarios.peers import _ticks

        rows = self.conn.execute(
            "SELECT pid, backend_type FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
        for pid, kind in rows:
            self.kinds[pid] = kind
            if pid in self.exclude:
                continue
            ticks = _ticks(pid)
            if ticks is None:
                continue
            self.first.setdefault(pid, ticks if initial else 0)
            self.last[pid] = ticks

    def run(self) -> None:
        while not self.halt.wait(0.05):
            self.sample()
        self.own_cpu = time.thread_time()

    def stop(self) -> dict[str, float]:
        """CPU seconds by backend type (``client backend``, ``autovacuum worker``, ...)."""
        import os

        self.halt.set()
        self.thread.join()
        self.sample()
        self.conn.close()
        seconds: collections.Counter[str] = collections.Counter()
        for pid, last in self.last.items():
            seconds[self.kinds[pid]] += (last - self.first[pid]) / os.sysconf("SC_CLK_TCK")
        return dict(seconds)


def _commits(conn: Any) -> int:
    """The bench database's committed transactions so far (``pg_stat_database``; the stats
    snapshot cleared first so the figure is current)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0])


def _count_thread_cpu(cpu: collections.Counter[str]) -> None:
    """Add each thread's CPU time (``thread_time`` at its end) to ``cpu`` by its name less a
    trailing number (``buzz-delivery-handler-N``: all handler threads together)."""
    import threading

    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def counted(self: threading.Thread) -> None:
        try:
            bootstrap(self)
        finally:
            cpu[re.sub(r"^buzz-delivery-|-\d+$", "", self.name)] += time.thread_time()

    threading.Thread._bootstrap_inner = counted  # type: ignore[attr-defined]


_FUNCTION = re.compile(r"FROM (\w+)\(")
_WORDS = re.compile(r"^\s*(\w+(?: \w+)?)")


def _count_statements(sent: collections.Counter[str]) -> None:
    """Count every statement sent through a Django connection of this process (each thread's
    own), by the function it calls or its first words."""
    from django.db.backends.signals import connection_created

    def wrapper(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        text = str(sql)
        match = _FUNCTION.search(text) or _WORDS.search(text)
        sent[match.group(1) if match else text[:40]] += 1
        return execute(sql, params, many, context)

    def on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
        if wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(wrapper)

    connection_created.connect(on_connection, weak=False)
    from django.db import connection

    if connection.connection is not None:
        on_connection(None, connection)


if __name__ == "__main__":
    main()

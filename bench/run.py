"""Run the benchmarks: ``python -m bench.run [--quick] [--only NAME ...]``.

Creates (if needed) and migrates the ``bench_f`` database (``BENCH_DATABASE_URL`` overrides it;
the name must start with ``bench_f``), runs each scenario, prints every figure as it is taken
and writes ``bench/results/latest.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as ``python bench/run.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import baseline, env
from bench.context import Bench
from bench.report import Report

# Scenario name -> module under bench.scenarios, in run order.
SCENARIOS = {
    "throughput": "throughput",
    "worker": "worker",
    "producer": "producer",
    "latency": "latency",
    "reap": "reap",
    "overhead": "overhead",
    "peers": "peers",
    "isolation": "isolation",
    "wake": "wake",
    "citus": "citus",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke form: 1 run per figure, small sizes")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SCENARIOS),
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--repeats", type=int, help="runs per figure (default 3; 1 with --quick)")
    parser.add_argument("--duration", type=float, help="seconds per throughput run (default 2; 1 with --quick)")
    parser.add_argument(
        "--workers",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="worker process counts for the throughput figures (default 1,4,16)",
    )
    parser.add_argument(
        "--synchronous-commit",
        choices=["on", "off"],
        help="set synchronous_commit for every benchmark session (default: the server's setting); "
        "'off' takes WAL flush waits out of the figures to show CPU costs",
    )
    parser.add_argument(
        "--peers",
        type=lambda s: tuple(x for x in s.split(",") if x),
        help="systems of the peers scenario, comma-separated (default: all; see bench/peers.py)",
    )
    parser.add_argument(
        "--peer-jobs",
        type=int,
        help="jobs per drain of the peers scenario's fast systems (default 12,000; 2,500 with --quick): "
        "raise it where a drain lasts about a second",
    )
    parser.add_argument("--note", default="", help="a line to print with the results (e.g. 'busy machine')")
    parser.add_argument("--output", type=Path, help="where to write the markdown (default bench/results/latest.md)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = env.database_url()
    if args.synchronous_commit:  # libpq reads PGOPTIONS: every connection, child processes too
        os.environ["PGOPTIONS"] = f"{os.environ.get('PGOPTIONS', '')} -c synchronous_commit={args.synchronous_commit}"
    env.ensure_database(url)
    env.setup_django(url)
    env.migrate()
    conn = env.connect(url)
    for table in ("buzz_delivery_delivery_record", "buzz_delivery_delivery_queue"):  # in case a run was killed
        conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")
    baseline.create_table(conn)
    repeats = args.repeats or (1 if args.quick else 3)
    report = Report(
        facts=env.facts(url),
        quick=args.quick,
        repeats=repeats,
        note=args.note,
        command="python -m bench.run " + shlex.join(argv if argv is not None else sys.argv[1:]),
    )
    print(report.markdown(), flush=True)
    bench = Bench(
        url=url,
        conn=conn,
        report=report,
        quick=args.quick,
        repeats=repeats,
        duration=args.duration or (1.0 if args.quick else 2.0),
        workers=args.workers or (1, 4, 16),
        peers=args.peers,
        peer_jobs=args.peer_jobs,
    )
    for name, module in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        started = time.monotonic()
        print(f"\n### scenario {name}", flush=True)
        importlib.import_module(f"bench.scenarios.{module}").run(bench)
        print(f"### scenario {name} took {time.monotonic() - started:.0f} s", flush=True)
    path = report.write(args.output)
    print(f"\nwrote {path}")
    conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

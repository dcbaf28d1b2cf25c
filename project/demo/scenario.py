"""The demo's scenario: set up, start the workers, produce, kill one worker, reap, fence one
community, drain, stop, report. Used by ``manage.py demo``."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from buzz_delivery import services
from buzz_delivery.models import TERMINAL_STATUSES, WorkflowAgentDelivery
from project.demo import audit
from project.demo.models import DemoRun, HandlerCall
from project.demo.report import ReaperTally, RunFacts, WorkerOutcome, build_report
from project.demo.system import STARTUP_TIMEOUT_SECONDS, SystemScenario, build_system_checks, system_facts_json
from project.demo.workers import WorkerProcess, start_worker, stop_all, worker_env
from project.demo.workload import Producer, Tenant, create_tenants

HANDLER = "project.demo.handlers:handle"
STUCK_HANDLER = "project.demo.handlers:hang"
STUCK_CONCURRENCY = 2
REAP_EVERY_SECONDS = 1.0
TICK_SECONDS = 0.25
KILL_AFTER_SECONDS = 5.0
POLL_INTERVAL_SECONDS = 0.5


class DemoError(Exception):
    """The demo could not run its scenario (a worker did not start, a setup step failed)."""


@dataclass(frozen=True)
class ScenarioOptions:
    """The demo's knobs (see ``manage.py demo --help``); seconds for times."""

    deliveries: int = 3000
    communities: int = 4
    agents: int = 3
    rate: float = 150.0
    concurrency: int = 2
    lease_seconds: float = 4.0
    timeout: float = 180.0
    seed: int | None = None
    system: bool = True  # the second act: workflows, agent runs, approvals (project.demo.system)
    system_timeout: float = 120.0


class Scenario:
    """One run of the demo. :meth:`run` returns the report (see :mod:`project.demo.report`)."""

    def __init__(self, options: ScenarioOptions, console: Console, verbosity: int = 1) -> None:
        self.options = options
        self.console = console
        self.verbosity = verbosity
        self.seed = options.seed if options.seed is not None else random.randrange(2**31)
        self.workers: list[WorkerProcess] = []
        self.killed: set[int] = set()
        self.reaper = ReaperTally()
        self.notes: list[str] = []
        self.fenced: Tenant | None = None
        self.exited_early: set[int] = set()

    def say(self, message: str) -> None:
        if self.verbosity >= 1:
            self.console.print(message, highlight=False)

    def run(self) -> dict[str, Any]:
        if connection.in_atomic_block:
            raise DemoError("the demo must run in autocommit mode: its workers read what it commits")
        started = time.monotonic()
        self._check_connection_budget()
        quiet = self.verbosity < 2
        service_logger = logging.getLogger("buzz_delivery")
        level = service_logger.level
        if quiet:  # the reaper logs each run at INFO; the report sums them up
            service_logger.setLevel(logging.WARNING)
        try:
            return self._run(started)
        finally:
            service_logger.setLevel(level)

    def _check_connection_budget(self) -> None:
        """Warn when the workers may need more connections than the server has left."""
        o = self.options
        workers = o.communities * o.agents + 1
        # dispatcher + listener + renewer + one per handler thread, per worker; plus ours.
        needed = o.communities * o.agents * (o.concurrency + 3) + STUCK_CONCURRENCY + 3 + 2
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int"
                " - current_setting('superuser_reserved_connections')::int"
                " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
            )
            (free,) = cursor.fetchone()
        if needed > free:
            message = (
                f"{workers} workers may open up to {needed} database connections, but the server has only "
                f"{free} left: lower --concurrency, --agents or --communities, or raise max_connections"
            )
            self.notes.append(message)
            self.say(f"[yellow]Warning:[/yellow] {message}")

    def _run(self, started: float) -> dict[str, Any]:
        o = self.options
        run = DemoRun.objects.create(options={**asdict(o), "seed": self.seed})
        tenants = create_tenants(o.communities, o.agents, label=run.started_at.strftime("%H:%M:%S"))
        audit.install(run.id, [t.id for t in tenants])
        producer = Producer(tenants, o.deliveries, o.rate, seed=self.seed)
        # $BUZZ_DEMO_LOG_DIR: where the workers' logs go (the tests give a temporary folder).
        logs = os.environ.get("BUZZ_DEMO_LOG_DIR") or Path(getattr(settings, "BASE_DIR", Path.cwd())) / "var" / "demo"
        log_dir = Path(logs) / str(run.id)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_workers(run.id, tenants, log_dir)
            self.say(
                f"Started {len(self.workers)} worker processes for {o.communities} communities x {o.agents} "
                f"agents (logs in {log_dir})"
            )
            self._wait_until_ready()
            producer.start()
            self._drive(run, tenants, producer)
        finally:
            stop_all(self.workers, timeout=max(10.0, o.lease_seconds * 3))
            if producer.ident is not None:
                producer.join(timeout=30)
            audit.remove(run.id)
        facts = RunFacts(
            run_id=run.id,
            community_ids=[t.id for t in tenants],
            committed_by_community=producer.committed_by_community,
            committed=producer.committed,
            runs=producer.runs,
            deduplicated=producer.deduplicated,
            fenced_id=self.fenced.id if self.fenced else None,
            workers=[
                WorkerOutcome(
                    name=w.name,
                    application_name=w.application_name,
                    pid=w.pid,
                    killed=w.pid in self.killed,
                    returncode=w.process.returncode,
                    summary=w.summary(),
                )
                for w in self.workers
            ],
            reaper=self.reaper,
            seconds=time.monotonic() - started,
            producer_error=repr(producer.error) if producer.error else None,
            notes=self.notes,
        )
        report = build_report(facts)
        if o.system:
            self._second_act(run, log_dir, report)
        run.report = report
        run.passed = report["passed"]
        run.finished_at = timezone.now()
        run.save(update_fields=["report", "passed", "finished_at"])
        return report

    def _second_act(self, run: DemoRun, log_dir: Path, report: dict[str, Any]) -> None:
        """Workflows, agent runs, approvals, a cancel and killed workers of the other two kinds
        (:mod:`project.demo.system`); its per-layer summary and checks join the report."""
        label = run.started_at.strftime("%H:%M:%S")
        act = SystemScenario(run.id, label, log_dir / "system", self.say, timeout=self.options.system_timeout)
        act.log_dir.mkdir(parents=True, exist_ok=True)
        facts = act.run()
        layers, checks = build_system_checks(facts)
        report["system"] = {"facts": system_facts_json(facts), "layers": layers, "checks": [vars(c) for c in checks]}
        report["passed"] = report["passed"] and all(c.passed for c in checks)

    def _start_workers(self, run_id: uuid.UUID, tenants: list[Tenant], log_dir: Path) -> None:
        o = self.options
        env = worker_env(connection.settings_dict, run_id, min_lease_seconds=min(1.0, o.lease_seconds))
        stuck_tenant = tenants[0]
        plan = [
            (f"c{i}-a{j}", t, agent, HANDLER, o.concurrency)
            for i, t in enumerate(tenants, 1)
            for j, agent in enumerate(t.agents, 1)
        ]
        plan.append(("c1-a1-stuck", stuck_tenant, stuck_tenant.agents[0], STUCK_HANDLER, STUCK_CONCURRENCY))
        for name, tenant, agent, handler, concurrency in plan:
            self.workers.append(
                start_worker(
                    name=name,
                    community_id=tenant.id,
                    target_hex=agent.hex(),
                    handler=handler,
                    env=env,
                    concurrency=concurrency,
                    log_dir=log_dir,
                    lease_seconds=o.lease_seconds,
                    poll_interval=POLL_INTERVAL_SECONDS,
                    idle_exit=o.timeout + 60,  # a safety net should the demo itself die
                )
            )

    def _wait_until_ready(self) -> None:
        """Wait until every worker has connected to the database (by application_name)."""
        names = {w.application_name for w in self.workers}
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT DISTINCT application_name FROM pg_stat_activity WHERE datname = current_database()"
                )
                present = {row[0] for row in cursor.fetchall()}
            if names <= present:
                return
            dead = [w for w in self.workers if w.process.poll() is not None]
            if dead:
                log = dead[0].stderr_path.read_text()[-2000:]
                raise DemoError(f"worker {dead[0].name} exited {dead[0].process.returncode} at start:\n{log}")
            time.sleep(TICK_SECONDS)
        raise DemoError(
            f"workers not connected after {STARTUP_TIMEOUT_SECONDS:g} s: {sorted(names - present)} "
            "(still starting: is the machine overloaded? their logs are in the directory printed above)"
        )

    def _drive(self, run: DemoRun, tenants: list[Tenant], producer: Producer) -> None:
        """Reap, kill, fence and watch until every delivery of an active community is settled."""
        o = self.options
        ids = [t.id for t in tenants]
        stuck = self.workers[-1]
        production_started = time.monotonic()
        deadline = production_started + o.timeout
        next_reap = production_started
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.verbosity < 1 or not self.console.is_terminal,
        ) as progress:
            committed_task = progress.add_task("committed", total=o.deliveries)
            settled_task = progress.add_task("settled  ", total=o.deliveries)
            while True:
                now = time.monotonic()
                if now >= next_reap:
                    reaped = services.reap()
                    self.reaper.add(reaped)
                    # Counted like a reap_deliveries pass (buzz_maintenance_runs_total on /metrics).
                    services.record_maintenance_run("reap_deliveries", {"outcome": "ok", **asdict(reaped)})
                    next_reap = now + REAP_EVERY_SECONDS
                if stuck.pid not in self.killed:
                    self._maybe_kill(run, stuck, now - production_started)
                if self.fenced is None and len(tenants) > 1 and producer.committed >= o.deliveries // 2:
                    self._fence(tenants[-1])
                active = [t.id for t in tenants if t is not self.fenced]
                open_rows = WorkflowAgentDelivery.objects.filter(community_id__in=active).exclude(
                    status__in=TERMINAL_STATUSES
                )
                remaining = open_rows.count()
                settled = WorkflowAgentDelivery.objects.filter(
                    community_id__in=ids, status__in=TERMINAL_STATUSES
                ).count()
                progress.update(committed_task, completed=producer.committed)
                progress.update(settled_task, completed=settled)
                for worker in self.workers:
                    gone = worker.pid not in self.killed and worker.process.poll() is not None
                    if gone and worker.pid not in self.exited_early:
                        self.exited_early.add(worker.pid)
                        self.notes.append(f"worker {worker.name} exited early ({worker.process.returncode})")
                if not producer.is_alive() and remaining == 0 and stuck.pid in self.killed:
                    break
                if not producer.is_alive() and producer.error is not None:
                    break
                if now >= deadline:
                    self.notes.append(f"timed out after {o.timeout:g} s with {remaining} deliveries unsettled")
                    self.say(f"Timed out with {remaining} deliveries of active communities unsettled")
                    break
                time.sleep(TICK_SECONDS)
        self.say(f"Stopping the {len(self.workers) - len(self.killed)} running workers with SIGTERM")

    def _maybe_kill(self, run: DemoRun, stuck: WorkerProcess, elapsed: float) -> None:
        held = HandlerCall.objects.filter(run=run, worker_pid=stuck.pid, outcome="hang").count()
        if held >= STUCK_CONCURRENCY or elapsed >= KILL_AFTER_SECONDS:
            os.kill(stuck.pid, signal.SIGKILL)
            stuck.process.wait()
            self.killed.add(stuck.pid)
            self.say(
                f"Killed worker {stuck.name} (pid {stuck.pid}) with SIGKILL while it held {held} leases; "
                "the reaper will reclaim them once they lapse"
            )

    def _fence(self, tenant: Tenant) -> None:
        self.fenced = tenant
        services.advance_community(tenant.id, "quiescing")
        services.advance_community(tenant.id, "fenced")
        self.say(
            f"Fenced community '{tenant.community.name}' midway: the database now refuses its writes "
            "(its workers' settles are refused, its producer stops)"
        )

"""The demo's second act: the whole system on top of the inbox (workflows, agent runs, the
journal, compensation, approvals, a cancel, a fenced community, killed workers of the three
other kinds: workflow, in-process agent, remote agent through the gateway).

Two communities run workflows in the engine's definition format: function steps (registered
in :mod:`project.demo.steps`), a condition, a sub-workflow and ``send_message`` steps with
``await: agent_run`` to the agents of :mod:`project.demo.agent_handlers`. A simulated inbox (the
demo's acceptor) claims each delivery to an agent and accepts it (``accept_delivery``: the
delivery settles and its agent run starts in one transaction); real ``run_workflow_worker``
and ``run_agent_worker`` processes do the rest. Midway one workflow worker and one agent worker
are killed with SIGKILL while they hold a lease (the maintenance reclaims, a replacement worker
resumes), and so is the remote ``work-runs`` worker after its run's first call (a replacement
holder resumes that run from its journal through the gateway); a simulated operator decides the
approvals, an agent's and a workflow's ``approval`` step alike (and tries once more, to be told
it was decided already), and one workflow run is cancelled while its agent waits for a human. A
third community is fenced (``advance_community``: active -> quiescing -> fenced) while its
workflow worker holds a step: nothing of it may move after that, and the others still complete.

:func:`build_system_checks` reads the database afterwards and checks each layer exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection

from buzz_delivery import services as core
from buzz_delivery.agents import services as agents
from buzz_delivery.agents.models import AgentRun, JournalEntry
from buzz_delivery.gateway import nip98
from buzz_delivery.gateway import services as gateway
from buzz_delivery.models import TERMINAL_STATUSES, Community, Workflow, WorkflowAgentDelivery
from buzz_delivery.services import Cause
from buzz_delivery.workflows import services as engine
from buzz_delivery.workflows.models import Approval, Run, Step
from buzz_delivery.workflows.services.maintenance import reap_workflow_steps
from project.demo import audit
from project.demo.models import StateChange, ToolEffect
from project.demo.report import Check
from project.demo.workers import application_name, worker_env

AGENT_HANDLER = "project.demo.agent_handlers:handle"
REMOTE_HANDLER = "project.demo.remote_agents:handle"
REMOTE_DELIVERY_HANDLER = "project.demo.remote_agents:on_delivery"
LEASE_SECONDS = 3.0
TICK_SECONDS = 0.25
# How long a started process (a worker, the gateway) may take to be ready: 13 processes import
# Django at once, which took over a minute on a busy 2-core machine (or where
# PYTHONDONTWRITEBYTECODE keeps every process compiling the sources).
STARTUP_TIMEOUT_SECONDS = 300.0
REAP_EVERY_SECONDS = 1.0
AGENT_NAMES = ("lookup", "refund", "provision", "charge")
REMOTE_NAMES = ("remote", "courier")  # agent runs through `work-runs`; plain deliveries through `work`
INBOX = ("lookup", "refund", "provision", "charge", "remote")  # whose deliveries the inbox accepts
TERMINAL_RUN = {"succeeded", "failed", "canceled"}
TERMINAL_STEP = {"succeeded", "failed", "skipped", "canceled"}
TERMINAL_AGENT = {"completed", "failed", "cancelled", "timeout"}
OPERATOR = "operator (simulated)"


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[str]
    stdout_path: Path
    files: list[Any] = field(default_factory=list)
    killed: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class SystemFacts:
    """What the checks need besides the database (ids and what the driver saw)."""

    run_id: uuid.UUID
    community_ids: list[uuid.UUID]
    workflow_run_ids: list[uuid.UUID]
    cancelled_run_id: uuid.UUID | None = None
    decisions: dict[str, str] = field(default_factory=dict)  # approval id -> first outcome
    second_decisions: dict[str, str] = field(default_factory=dict)  # approval id -> outcome of the retry
    after_cancel: dict[str, str] = field(default_factory=dict)  # the cancelled run's approval -> a late decision
    accepted: int = 0
    gateway_url: str = ""
    remote_agents: dict[str, str] = field(default_factory=dict)  # name -> pubkey hex
    accept_misses: int = 0
    killed: dict[str, str] = field(default_factory=dict)  # kind -> worker name
    kill_leases: dict[str, str] = field(default_factory=dict)  # kind -> what it held (step / agent run id)
    kill_holders: dict[str, str] = field(default_factory=dict)  # kind -> the killed holder's name (its worker id)
    fenced_id: uuid.UUID | None = None  # the community fenced midway (not in community_ids)
    fenced_run_ids: list[uuid.UUID] = field(default_factory=list)
    fenced_at: str | None = None  # database clock (ISO) once the fence was in place
    fenced_snapshot: dict[str, str] = field(default_factory=dict)  # its run/step/agent run id -> state at the fence
    release_run_id: uuid.UUID | None = None  # the run with the workflow-level approval step
    reaped: Counter[str] = field(default_factory=Counter)
    workers: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _definitions(keys: dict[str, bytes], child_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    def send(key: str, agent: str, content: str, **extra: Any) -> dict[str, Any]:
        return {
            "key": key,
            "kind": "send_message",
            "targets": [keys[agent].hex()],
            "content": content,
            "await": "agent_run",
            **extra,
        }

    def fn(key: str, function: str, **extra: Any) -> dict[str, Any]:
        return {"key": key, "kind": "function", "function": function, **extra}

    return {
        "triage": {
            "steps": [
                fn("classify", "demo.classify", input={"text": {"$ref": "input.text"}}),
                fn(
                    "enrich",
                    "demo.enrich",
                    depends_on=["classify"],
                    input={"words": {"$ref": "steps.classify.output.words"}},
                ),
                send(
                    "escalate",
                    "lookup",
                    "lookup: the customer's last three orders",
                    depends_on=["classify"],
                    when={"ref": "steps.classify.output.urgent", "equals": True},
                ),
                {"key": "file", "kind": "sub_workflow", "depends_on": ["enrich"], "workflow": str(child_id)},
            ]
        },
        "refund": {
            "steps": [
                fn("check", "demo.summarize"),
                send("ask_agent", "refund", "refund: order 7 arrived broken", depends_on=["check"]),
                fn("close", "demo.summarize", depends_on=["ask_agent"]),
            ]
        },
        "provision": {
            "steps": [
                fn("prepare", "demo.summarize"),
                send(
                    "provision", "provision", "provision: a build machine", depends_on=["prepare"], on_error="continue"
                ),
                fn("cleanup", "demo.summarize", depends_on=["provision"]),
            ]
        },
        "crunch": {
            "steps": [
                fn("crunch", "demo.crunch", retry={"max_attempts": 3, "base_seconds": 1, "cap_seconds": 2}),
                send("bill", "charge", "charge: 12 EUR for the computation", depends_on=["crunch"]),
                fn("close", "demo.summarize", depends_on=["bill"]),
            ]
        },
        "remote help": {
            "steps": [
                fn("ask", "demo.summarize"),
                send("look_up", "remote", "lookup remotely: the order history", depends_on=["ask"]),
                {
                    "key": "notify",
                    "kind": "send_message",
                    "targets": [keys["courier"].hex()],
                    "content": "notify: your answer is ready",
                    "await": "delivered",
                    "depends_on": ["look_up"],
                },
                fn("close", "demo.summarize", depends_on=["notify"]),
            ]
        },
        "file ticket": {"steps": [fn("file", "demo.file_ticket")]},
        # A workflow-level approval step: the run waits for the operator, then ships.
        "release": {
            "steps": [
                fn("build", "demo.summarize"),
                {
                    "key": "sign_off",
                    "kind": "approval",
                    "depends_on": ["build"],
                    "deadline_seconds": 600,
                    "prompt": "ship the release?",
                },
                fn("ship", "demo.summarize", depends_on=["sign_off"]),
            ]
        },
        # The fenced community's work: a slow step the fence lands in, then an agent.
        "ledger": {
            "steps": [
                fn("open", "demo.summarize"),
                fn("tally", "demo.tally", depends_on=["open"]),
                send("ask", "lookup", "lookup: the ledger's open items", depends_on=["tally"]),
                fn("close", "demo.summarize", depends_on=["ask"]),
            ]
        },
    }


class SystemScenario:
    """One run of the second act; :meth:`run` returns :class:`SystemFacts`."""

    def __init__(self, run_id: uuid.UUID, label: str, log_dir: Path, say: Any, timeout: float = 120.0) -> None:
        self.run_id = run_id
        self.label = label
        self.log_dir = log_dir
        self.say = say
        self.timeout = timeout
        self.procs: list[Proc] = []
        self.keys = {name: os.urandom(32) for name in AGENT_NAMES}
        # Agents served through the gateway: their secret keys stay with the remote worker.
        self.secrets = {name: os.urandom(32) for name in REMOTE_NAMES}
        self.keys.update({name: nip98.public_key_of(secret) for name, secret in self.secrets.items()})
        self.effects_path = log_dir / "remote-effects.jsonl"
        self.env = {
            **worker_env(connection.settings_dict, run_id, min_lease_seconds=1.0),
            "BUZZ_MIN_LEASE_SECONDS": "1",
        }

    # -- processes ---------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> Proc:
        return self._start_raw(name, [sys.executable, "-m", "django", *args])

    def _start_raw(self, name: str, command: list[str], extra_env: dict[str, str] | None = None) -> Proc:
        out_path, err_path = self.log_dir / f"{name}.out", self.log_dir / f"{name}.log"
        out, err = out_path.open("w"), err_path.open("w")
        process = subprocess.Popen(
            command,
            cwd=str(getattr(settings, "BASE_DIR", Path.cwd())),
            env={
                **self.env,
                "PGAPPNAME": application_name(name),
                "BUZZ_DEMO_EFFECTS": str(self.effects_path),
                "PYTHONPATH": str(getattr(settings, "BASE_DIR", Path.cwd())),
                **(extra_env or {}),
            },
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
        )
        proc = Proc(name, process, out_path, [out, err])
        self.procs.append(proc)
        return proc

    def _workflow_worker(self, name: str, community: uuid.UUID, concurrency: int) -> Proc:
        return self._start(
            name,
            [
                "run_workflow_worker",
                "--community",
                str(community),
                "--concurrency",
                str(concurrency),
                "--lease-seconds",
                f"{LEASE_SECONDS:g}",
                "--poll-interval",
                "0.5",
                "--shutdown-grace",
                "5",
                "--idle-exit",
                f"{self.timeout + 60:g}",
            ],
        )

    def _agent_worker(self, name: str, agent_names: list[str], communities: list[uuid.UUID]) -> Proc:
        args = [
            "run_agent_worker",
            "--handler",
            AGENT_HANDLER,
            "--concurrency",
            "2",
            "--lease-seconds",
            f"{LEASE_SECONDS:g}",
            "--poll-seconds",
            "0.5",
            "--shutdown-grace",
            "5",
            "--worker-id",
            application_name(name),
            "--no-accept",  # the demo's own inbox accepts (_accept), to show accept_delivery's outcomes
        ]
        for agent in agent_names:
            args += ["--agent", self.keys[agent].hex()]
        for community in communities:
            args += ["--community", str(community)]
        return self._start(name, args)

    def _gateway(self) -> str:
        """Serve the example project's gateway with gunicorn (docs/gateway.md) on a free local
        port; returns its base URL once it answers."""
        import socket

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.env.update(BUZZ_GATEWAY_POLL_SECONDS="0.5", BUZZ_GATEWAY_MAX_WAIT_SECONDS="10")
        proc = self._start_raw(
            "gateway",
            [
                sys.executable,
                "-m",
                "gunicorn",
                "project.wsgi:application",
                "--worker-class",
                "gthread",
                "--workers",
                "1",
                "--threads",
                "8",
                "--bind",
                f"127.0.0.1:{port}",
                "--timeout",
                "60",
                "--graceful-timeout",
                "5",
                "--no-control-socket",
            ],
        )
        base = f"http://127.0.0.1:{port}/gateway/v1"
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if proc.process.poll() is not None:
                raise RuntimeError(f"the gateway exited {proc.process.returncode}: see {self.log_dir}/gateway.log")
            try:
                if httpx.get(base + "/openapi.json", timeout=1).status_code == 200:
                    return base
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(
            f"the gateway did not answer within {STARTUP_TIMEOUT_SECONDS:g} s: see {self.log_dir}/gateway.log"
        )

    def _remote_worker(self, name: str, mode: str, agent: str, handler: str, base: str, *, hang: bool = False) -> Proc:
        """A remote worker (``work`` or ``work-runs``) through the gateway. Its ``work-runs``
        holder name is ``buzz-demo-<name>`` (``--worker-id``), so a run's history tells which
        one held each lease. ``hang``: its agent runs stop after their first call (the demo kills
        it with SIGKILL there, see :func:`project.demo.remote_agents.handle`)."""
        key_file = self.log_dir / f"{agent}.key"
        key_file.write_text(self.secrets[agent].hex())
        key_file.chmod(0o600)
        # work-runs: the demo's own inbox accepts (_accept), as for run_agent_worker, so the
        # remote worker does not accept the same deliveries itself (--no-accept).
        holder = ["--worker-id", application_name(name), "--no-accept"] if mode == "work-runs" else []
        return self._start_raw(
            name,
            [
                sys.executable,
                "-m",
                "buzz_delivery.gateway.client",
                mode,
                "--url",
                base,
                "--key-file",
                str(key_file),
                "--handler",
                handler,
                "--lease-seconds",
                "5",
                "--wait-seconds",
                "2",
                "--renew-every",
                "1",
                "--shutdown-grace",
                "5",
                *holder,
            ],
            extra_env={"BUZZ_DEMO_REMOTE_HANG": "1"} if hang else None,
        )

    def _kill(self, proc: Proc) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.process.wait()
        proc.killed = True

    def _stop_all(self) -> None:
        """SIGTERM every worker and wait for it to drain, then the gateway: the remote workers
        settle and release through the gateway while they drain, so it goes last (stopped
        together, a remote worker's last settle could find it gone and end its drain abandoned)."""
        workers = [p for p in self.procs if p.name != "gateway"]
        gateway = [p for p in self.procs if p.name == "gateway"]
        for group in (workers, gateway):
            for proc in group:
                if proc.process.poll() is None:
                    proc.process.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.process.kill()
                    proc.process.wait()
                for f in proc.files:
                    f.close()

    # -- setup -------------------------------------------------------------------------------
    def _setup(self) -> None:
        self.ops = [Community.objects.create(name=f"demo {self.label} ops #{i}") for i in (1, 2)]
        # A third community, fenced midway (active -> quiescing -> fenced, the core lifecycle).
        self.doomed = Community.objects.create(name=f"demo {self.label} ops #3 (fenced midway)")
        self.workflows: dict[tuple[uuid.UUID, str], uuid.UUID] = {}
        for community in [*self.ops, self.doomed]:
            child = Workflow.objects.create(community=community, name="file ticket")
            definitions = _definitions(self.keys, child.id)
            for name, definition in definitions.items():
                workflow = child if name == "file ticket" else Workflow.objects.create(community=community, name=name)
                engine.publish_definition(community.id, workflow.id, definition)
                self.workflows[(community.id, name)] = workflow.id

    def _start_run(self, community: Community, name: str, input: dict[str, Any]) -> uuid.UUID:
        run = engine.start_run(
            community.id, self.workflows[(community.id, name)], input, cause=Cause.event(os.urandom(32))
        )
        self.facts.workflow_run_ids.append(run.pk)
        return run.pk

    # -- the act -----------------------------------------------------------------------------
    def run(self) -> SystemFacts:
        started = time.monotonic()
        self._setup()
        ops1, ops2 = self.ops
        self.facts = SystemFacts(self.run_id, [c.id for c in self.ops], [], fenced_id=self.doomed.id)
        audit.install_states(self.run_id, [*self.facts.community_ids, self.doomed.id])
        try:
            # A workflow worker alone on ops #2, whose first step never ends on its first attempt.
            crunch_run = self._start_run(ops2, "crunch", {})
            wf_stuck = self._workflow_worker("wf-ops2-stuck", ops2.id, 1)
            ag_stuck = self._agent_worker("agent-charge-stuck", ["charge"], [ops2.id])
            self._workflow_worker("wf-ops1", ops1.id, 2)
            self._workflow_worker("wf-ops3", self.doomed.id, 1)
            self._agent_worker("agent-main", ["lookup", "refund", "provision"], [ops1.id, ops2.id, self.doomed.id])
            self.facts.fenced_run_ids = [self._start_run(self.doomed, "ledger", {"book": n}) for n in (1, 2, 3)]
            self.facts.workflow_run_ids = [r for r in self.facts.workflow_run_ids if r not in self.facts.fenced_run_ids]
            for i, text in enumerate(
                ("urgent: the site is down", "a question about invoices", "URGENT refund please", "thanks for the help")
            ):
                self._start_run(ops1 if i % 2 == 0 else ops2, "triage", {"text": text, "customer": f"c{i}"})
            for secret_name in REMOTE_NAMES:
                gateway.enroll(ops1.id, self.keys[secret_name], enrolled_by="demo")
            base = self._gateway()
            # This remote worker stops after its run's first call; it is killed there (SIGKILL).
            remote_stuck = self._remote_worker(
                "remote-work-runs-stuck", "work-runs", "remote", REMOTE_HANDLER, base, hang=True
            )
            self._remote_worker("remote-work", "work", "courier", REMOTE_DELIVERY_HANDLER, base)
            self.facts.gateway_url = base
            for n in (1, 2):
                self._start_run(ops1, "remote help", {"n": n})
            refund_runs = [self._start_run(ops1, "refund", {"order": n}) for n in (7, 8)]
            self.facts.cancelled_run_id = refund_runs[1]
            self._start_run(ops1, "provision", {})
            self.facts.release_run_id = self._start_run(ops1, "release", {"version": "1.0"})
            self.say(
                f"Second act: {len(self.facts.workflow_run_ids) + len(self.facts.fenced_run_ids)} workflow runs "
                "in 3 communities (one to be fenced midway); "
                f"{len(self.procs)} processes: workflow and agent workers, the gateway and its remote workers "
                f"(logs in {self.log_dir})"
            )
            self._drive(crunch_run, wf_stuck, ag_stuck, remote_stuck, base)
        finally:
            self._stop_all()
            audit.remove_states(self.run_id)
            self._import_remote_effects()
        self.facts.remote_agents = {name: self.keys[name].hex() for name in REMOTE_NAMES}
        self.facts.workers = [
            {
                "name": p.name,
                "pid": p.pid,
                "killed": p.killed,
                "returncode": p.process.returncode,
                "summary": _summary(p.stdout_path),
            }
            for p in self.procs
        ]
        self.facts.seconds = round(time.monotonic() - started, 1)
        return self.facts

    def _drive(self, crunch_run: uuid.UUID, wf_stuck: Proc, ag_stuck: Proc, remote_stuck: Proc, base: str) -> None:
        facts = self.facts
        ops1, ops2 = self.ops
        deadline = time.monotonic() + self.timeout
        next_reap = 0.0
        while True:
            now = time.monotonic()
            if now >= next_reap:
                self._reap()
                next_reap = now + REAP_EVERY_SECONDS
            self._accept()
            if not wf_stuck.killed:
                step = Step.objects.filter(community_id=ops2.id, run_id=crunch_run, key="crunch").first()
                if step is not None and step.state == "running":
                    time.sleep(0.5)
                    self._kill(wf_stuck)
                    facts.killed["workflow"] = wf_stuck.name
                    facts.kill_leases["workflow"] = str(step.id)
                    self.say(f"Killed workflow worker {wf_stuck.name} with SIGKILL while it ran step 'crunch'")
                    self._workflow_worker("wf-ops2", ops2.id, 2)
            if not ag_stuck.killed:
                held = AgentRun.objects.filter(
                    community_id=ops2.id, agent_pubkey=self.keys["charge"], state__in=("running", "waiting_tool")
                ).first()
                if held is not None and ToolEffect.objects.filter(run_id=self.run_id, tool="charge").exists():
                    self._kill(ag_stuck)
                    facts.killed["agent"] = ag_stuck.name
                    facts.kill_leases["agent"] = str(held.id)
                    self.say(
                        f"Killed agent worker {ag_stuck.name} with SIGKILL mid-call (the charge was made, not recorded)"
                    )
                    self._agent_worker("agent-charge", ["charge"], [ops2.id])
            if not remote_stuck.killed:
                holder = application_name(remote_stuck.name)
                held = AgentRun.objects.filter(
                    community_id=ops1.id, agent_pubkey=self.keys["remote"], worker_id=holder, state="running"
                ).first()
                if (
                    held is not None
                    and JournalEntry.objects.filter(
                        community_id=ops1.id, run_id=held.id, kind="tool", status="succeeded"
                    ).exists()
                ):
                    self._kill(remote_stuck)
                    facts.killed["remote"] = remote_stuck.name
                    facts.kill_leases["remote"] = str(held.id)
                    facts.kill_holders["remote"] = holder
                    self.say(
                        f"Killed remote worker {remote_stuck.name} (gateway) with SIGKILL mid-lease, "
                        "after its run's first call"
                    )
                    self._remote_worker("remote-work-runs", "work-runs", "remote", REMOTE_HANDLER, base)
            if facts.fenced_at is None:
                self._maybe_fence()
            self._operate()
            if self._all_done():
                break
            if now >= deadline:
                facts.notes.append(f"second act timed out after {self.timeout:g} s")
                self.say("[yellow]Second act timed out[/yellow]")
                break
            time.sleep(TICK_SECONDS)
        self._reap()

    def _maybe_fence(self) -> None:
        """Fence the third community once its work is midway: a step succeeded and its slow
        ``tally`` step is held by the workflow worker. Records the database time the fence was
        in place and a snapshot of its runs', steps' and agent runs' states, which must not move."""
        doomed = self.doomed.id
        steps = Step.objects.filter(community_id=doomed)
        if not (steps.filter(state="succeeded").exists() and steps.filter(key="tally", state="running").exists()):
            return
        core.advance_community(doomed, "quiescing")
        core.advance_community(doomed, "fenced")
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            self.facts.fenced_at = cursor.fetchone()[0].isoformat()
        self.facts.fenced_snapshot = _states_of(doomed)
        self.say(
            f"Fenced community '{self.doomed.name}' midway (active -> quiescing -> fenced): "
            f"{sum(1 for v in self.facts.fenced_snapshot.values() if v not in TERMINAL_STEP | TERMINAL_RUN)} "
            "of its runs and steps were live; the database refuses their writes from now on"
        )

    def _import_remote_effects(self) -> None:
        """The remote tools' effects (JSON lines) into :class:`ToolEffect`, for the checks."""
        import json

        if not self.effects_path.exists():
            return
        rows = [json.loads(line) for line in self.effects_path.read_text().splitlines() if line.strip()]
        ToolEffect.objects.bulk_create(
            ToolEffect(run_id=self.run_id, key=r["key"], kind=r["kind"], tool=r["tool"], worker_pid=r["pid"])
            for r in rows
        )

    def _reap(self) -> None:
        d = core.reap()
        w = reap_workflow_steps()
        a = agents.reap_agent_runs()
        self.facts.reaped["deliveries_reclaimed"] += d.reclaimed
        self.facts.reaped["steps_reclaimed"] += w.reclaimed
        self.facts.reaped["agent_runs_reclaimed"] += a.reclaimed

    def _accept(self) -> None:
        """The inbox: claim each delivery to an agent and accept it (its agent run starts)."""
        live = self.ops if self.facts.fenced_at else [*self.ops, self.doomed]
        for community in live:
            for name in INBOX:
                key = self.keys[name]
                for claim in core.claim_deliveries(
                    community.id, key, limit=10, lease_seconds=15, holder="buzz-demo-inbox"
                ):
                    outcome = agents.accept_delivery(claim.lease, input={"agent": name})
                    if isinstance(outcome, agents.Accepted):
                        self.facts.accepted += 1
                    else:
                        self.facts.accept_misses += 1

    def _operate(self) -> None:
        """The simulated operator: cancel the chosen run once its agent waits for a human;
        decide every approval in the queue once (approve), then try each once more: the agents'
        approvals and the workflows' ``approval`` steps alike."""
        facts = self.facts
        ops1 = self.ops[0]
        queue: list[tuple[uuid.UUID, str]] = []
        for agent_run in AgentRun.objects.filter(community_id__in=facts.community_ids, state="waiting_approval"):
            target = facts.cancelled_run_id
            if target is not None and agent_run.source_run_id == target and "cancel" not in facts.reaped:
                cancelled = engine.cancel_run(ops1.id, target)
                facts.reaped["cancel"] = 1
                facts.after_cancel[str(agent_run.approval_id)] = ""
                self.say(
                    f"Cancelled workflow run {target} midway (its agent waited "
                    f"for an approval): {type(cancelled).__name__}"
                )
            queue.append((agent_run.community_id, str(agent_run.approval_id)))
        # Workflow-level approval steps (``kind: approval``) wait in the same queue.
        for community, approval in Approval.objects.filter(
            community_id__in=facts.community_ids, state="pending", step__isnull=False
        ).values_list("community_id", "id"):
            queue.append((community, str(approval)))
        for community_id, approval_id in queue:
            if approval_id in facts.decisions:
                continue
            outcome = engine.decide_approval(community_id, approval_id, "approved", OPERATOR)
            if approval_id in facts.after_cancel:
                # The workflow cancel expired it (agents migration 0006): a late decision is refused.
                facts.after_cancel[approval_id] = type(outcome).__name__
                self.say(
                    f"The operator tried approval …{approval_id[-8:]} of the cancelled run: {type(outcome).__name__}"
                )
                continue
            facts.decisions[approval_id] = type(outcome).__name__
            again = engine.decide_approval(community_id, approval_id, "rejected", "a second operator")
            facts.second_decisions[approval_id] = type(again).__name__
            self.say(
                f"The operator approved approval …{approval_id[-8:]}: {type(outcome).__name__}; "
                f"a second decision: {type(again).__name__}"
            )

    def _all_done(self) -> bool:
        ids = self.facts.community_ids
        open_runs = Run.objects.filter(community_id__in=ids).exclude(state__in=TERMINAL_RUN).exists()
        open_agents = AgentRun.objects.filter(community_id__in=ids).exclude(state__in=TERMINAL_AGENT).exists()
        open_deliveries = (
            WorkflowAgentDelivery.objects.filter(community_id__in=ids).exclude(status__in=TERMINAL_STATUSES).exists()
        )
        return (
            not (open_runs or open_agents or open_deliveries)
            and len(self.facts.killed) == 3
            and self.facts.fenced_at is not None
        )


def system_facts_json(facts: SystemFacts) -> dict[str, Any]:
    """``facts`` as JSON (stored in the run's report; :func:`system_facts_from` reads it back)."""
    data = asdict(facts)
    data["run_id"] = str(facts.run_id)
    data["community_ids"] = [str(c) for c in facts.community_ids]
    data["workflow_run_ids"] = [str(r) for r in facts.workflow_run_ids]
    data["cancelled_run_id"] = str(facts.cancelled_run_id) if facts.cancelled_run_id else None
    data["fenced_id"] = str(facts.fenced_id) if facts.fenced_id else None
    data["fenced_run_ids"] = [str(r) for r in facts.fenced_run_ids]
    data["release_run_id"] = str(facts.release_run_id) if facts.release_run_id else None
    data["reaped"] = dict(facts.reaped)
    return data


def system_facts_from(data: dict[str, Any]) -> SystemFacts:
    return SystemFacts(
        **{
            **data,
            "run_id": uuid.UUID(data["run_id"]),
            "community_ids": [uuid.UUID(c) for c in data["community_ids"]],
            "workflow_run_ids": [uuid.UUID(r) for r in data["workflow_run_ids"]],
            "cancelled_run_id": uuid.UUID(data["cancelled_run_id"]) if data["cancelled_run_id"] else None,
            "fenced_id": uuid.UUID(data["fenced_id"]) if data.get("fenced_id") else None,
            "fenced_run_ids": [uuid.UUID(r) for r in data.get("fenced_run_ids", [])],
            "release_run_id": uuid.UUID(data["release_run_id"]) if data.get("release_run_id") else None,
            "reaped": Counter(data["reaped"]),
        }
    )


def _states_of(community_id: uuid.UUID) -> dict[str, str]:
    """The state of each workflow run, step and agent run of a community, by id."""
    states = {str(i): st for i, st in Run.objects.filter(community_id=community_id).values_list("pk", "state")}
    states.update((str(i), st) for i, st in Step.objects.filter(community_id=community_id).values_list("id", "state"))
    states.update(
        (str(i), st) for i, st in AgentRun.objects.filter(community_id=community_id).values_list("pk", "state")
    )
    return states


def _summary(path: Path) -> dict[str, Any] | None:
    import json

    for line in reversed(path.read_text().splitlines()):
        if line.strip().startswith("{") and line.strip().endswith("}"):
            try:
                return {k: v for k, v in json.loads(line).items() if isinstance(v, int)}
            except ValueError:
                return None
    return None


def _moves_into_terminal(run_id: uuid.UUID) -> Counter[tuple[str, uuid.UUID]]:
    """Per (table, row): how many recorded state changes moved it from a live state into a terminal one."""
    terminal = TERMINAL_STEP | TERMINAL_AGENT | {"approved", "rejected", "expired"}
    counts: Counter[tuple[str, uuid.UUID]] = Counter()
    for table, row_id, old, new in StateChange.objects.filter(run_id=run_id).values_list(
        "table", "row_id", "old_state", "new_state"
    ):
        if new in terminal and old not in terminal:
            counts[(table, row_id)] += 1
    return counts


def _settled_once_by_holder(history: list[dict[str, Any]]) -> bool:
    """One ``settle`` entry in a delivery's history, made by the actor that claimed that generation."""
    claims = {e.get("generation"): e.get("actor") for e in history if e.get("event") == "claim"}
    settles = [e for e in history if e.get("event") == "settle"]
    return len(settles) == 1 and claims.get(settles[0].get("generation")) == settles[0].get("actor")


def _terminal_moves(history: list[dict[str, Any]], terminal: set[str]) -> int:
    """How many entries of a row's history moved it into a terminal state."""
    count = 0
    for entry in history or []:
        to = entry.get("to") or entry.get("state") or entry.get("status")
        if to in terminal:
            count += 1
    return count


def _fence_check(facts: SystemFacts) -> tuple[bool, dict[str, Any]]:
    """Whether the fenced community's rows stayed as the fence found them, and the evidence:
    its state now; states that differ from the snapshot taken at the fence; state changes the
    audit recorded after the fence (database clock); history entries of its steps, agent runs
    and deliveries stamped after it; and how many of its runs the fence left live."""
    if facts.fenced_id is None or facts.fenced_at is None:
        return False, {"fenced": "never"}
    from datetime import datetime

    at = datetime.fromisoformat(facts.fenced_at)
    community = Community.objects.filter(id=facts.fenced_id).first()
    now = _states_of(facts.fenced_id)
    moved = {k for k in set(now) | set(facts.fenced_snapshot) if now.get(k) != facts.fenced_snapshot.get(k)}
    audited = StateChange.objects.filter(run_id=facts.run_id, community_id=facts.fenced_id, at__gt=at).count()
    stamped = 0
    for model in (Step, AgentRun, WorkflowAgentDelivery):
        for history in model.objects.filter(community_id=facts.fenced_id).values_list("history", flat=True):
            stamped += sum(1 for e in history or [] if e.get("at") and datetime.fromisoformat(e["at"]) > at)
    live = [r for r in facts.fenced_run_ids if now.get(str(r)) not in TERMINAL_RUN]
    detail = {
        "state": community.deletion_state if community else None,
        "moved": len(moved),
        "changes_after": audited,
        "history_after": stamped,
        "live_runs": len(live),
    }
    ok = detail["state"] == "fenced" and not moved and not audited and not stamped and bool(live)
    return ok, detail


def build_system_checks(facts: SystemFacts) -> tuple[dict[str, Any], list[Check]]:
    """The per-layer summary and checks of the second act, read from the database."""
    ids = facts.community_ids
    checks: list[Check] = []
    layers: dict[str, Any] = {}

    # Workflows: every run and step terminal, each once.
    runs = list(Run.objects.filter(community_id__in=ids))
    steps = list(Step.objects.filter(community_id__in=ids))
    run_states = Counter(r.state for r in runs)
    step_states = Counter(s.state for s in steps)
    open_runs = [r for r in runs if r.state not in TERMINAL_RUN]
    open_steps = [s for s in steps if s.state not in TERMINAL_STEP]
    moves = _moves_into_terminal(facts.run_id)
    twice = [s for s in steps if moves[("buzz_workflows_step", s.id)] > 1]
    silent = [s for s in steps if s.state in TERMINAL_STEP and moves[("buzz_workflows_step", s.id)] == 0]
    layers["workflows"] = {
        "runs": dict(run_states),
        "sub_workflow_runs": sum(1 for r in runs if r.parent_run_id),
        "steps": dict(step_states),
        "reclaimed_steps": facts.reaped.get("steps_reclaimed", 0),
    }
    checks.append(
        Check(
            "workflows: every run and every step is terminal",
            not open_runs and not open_steps,
            f"{len(open_runs)} runs, {len(open_steps)} steps not terminal",
        )
    )
    checks.append(
        Check(
            "workflows: each step became terminal exactly once (the audit of its state)",
            not twice and not silent,
            f"{len(twice)} more than once, {len(silent)} terminal without a recorded move",
        )
    )
    cancelled = next((r for r in runs if r.pk == facts.cancelled_run_id), None)
    checks.append(
        Check(
            "workflows: the run cancelled midway ended canceled",
            cancelled is not None and cancelled.state == "canceled",
            f"state {cancelled.state if cancelled else None}",
        )
    )
    killed_step = next((s for s in steps if str(s.id) == facts.kill_leases.get("workflow")), None)
    checks.append(
        Check(
            "workflows: the step held by the killed workflow worker was reclaimed and succeeded on a later attempt",
            killed_step is not None and killed_step.state == "succeeded" and killed_step.attempts >= 2,
            f"state {killed_step.state if killed_step else None}, "
            f"attempts {killed_step.attempts if killed_step else 0}",
        )
    )

    # Deliveries of the second act: every one settled, each once.
    deliveries = list(WorkflowAgentDelivery.objects.filter(community_id__in=ids))
    delivery_states = Counter(d.status for d in deliveries)
    terminal = {str(s) for s in TERMINAL_STATUSES}
    open_d = [d for d in deliveries if d.status not in terminal]
    twice_d = [d for d in deliveries if _terminal_moves(d.history or [], terminal) > 1]
    not_by_holder = [d for d in deliveries if d.status == "finished" and not _settled_once_by_holder(d.history or [])]
    layers["deliveries"] = {
        "status": dict(delivery_states),
        "accepted": facts.accepted,
        "accept_misses": facts.accept_misses,
    }
    checks.append(
        Check(
            "deliveries of the second act: every one is terminal, settled once, by the holder of its lease",
            not open_d and not twice_d and not not_by_holder,
            f"{len(open_d)} open, {len(twice_d)} settled twice, {len(not_by_holder)} not by the lease's "
            "claimer (the inbox, or the remote worker through the gateway)",
        )
    )
    # The inbox accepts in the community fenced midway too, until the fence (a loaded run gets
    # there first): its accepted runs, their deliveries and their journal count here as well.
    with_fenced = [*ids, facts.fenced_id] if facts.fenced_id is not None else ids
    accepted_runs = AgentRun.objects.filter(community_id__in=with_fenced, delivery_id__isnull=False).count()
    courier_hex = facts.remote_agents.get("courier", "")
    to_agents = [
        d
        for d in WorkflowAgentDelivery.objects.filter(community_id__in=with_fenced)
        if bytes(d.target_pubkey).hex() != courier_hex
    ]
    finished = sum(1 for d in to_agents if d.status == "finished")
    checks.append(
        Check(
            "deliveries to agents: each accepted delivery started exactly one agent run",
            accepted_runs == facts.accepted == finished,
            f"{facts.accepted} accepted, {accepted_runs} runs, {finished} finished",
        )
    )

    # Agent runs and their journal.
    agent_runs = list(AgentRun.objects.filter(community_id__in=ids))
    agent_states = Counter(r.state for r in agent_runs)
    entries = list(JournalEntry.objects.filter(community_id__in=ids))
    # Calls of runs the inbox accepted in the fenced community before its fence: journaled there.
    journaled = set(
        JournalEntry.objects.filter(community_id__in=with_fenced, kind="tool").values_list("idempotency_key", flat=True)
    )
    effects = Counter((e.key, e.kind) for e in ToolEffect.objects.filter(run_id=facts.run_id))
    tool_entries = [e for e in entries if e.kind == "tool"]
    made_twice = [e for e in tool_entries if effects[(e.idempotency_key, "call")] > 1]
    unjournaled = [k for (k, kind), n in effects.items() if kind == "call" and k not in journaled]
    succeeded_without = [
        e for e in tool_entries if e.status == "succeeded" and effects[(e.idempotency_key, "call")] != 1
    ]
    # A call recorded under another lease than the one that journaled it: a resumed run reconciled it.
    reconciled = [e for e in tool_entries if e.result_generation is not None and e.result_generation != e.generation]
    layers["agents"] = {
        "runs": dict(agent_states),
        "tool_calls": len(tool_entries),
        "reconciled": len(reconciled),
        "reclaimed_runs": facts.reaped.get("agent_runs_reclaimed", 0),
    }
    agent_twice = [r for r in agent_runs if moves[("buzz_agents_run", r.id)] != 1]
    checks.append(
        Check(
            "agents: every agent run is terminal, and became so exactly once",
            all(r.state in TERMINAL_AGENT for r in agent_runs) and bool(agent_runs) and not agent_twice,
            f"{sum(1 for r in agent_runs if r.state not in TERMINAL_AGENT)} of {len(agent_runs)} open, "
            f"{len(agent_twice)} not terminal exactly once",
        )
    )
    checks.append(
        Check(
            "journal: every journaled call made its effect at most once (a resumed one reconciled, not made again)",
            not made_twice and not unjournaled and not succeeded_without,
            f"{len(tool_entries)} calls, {len(made_twice)} made twice, {len(unjournaled)} effects without an entry, "
            f"{len(succeeded_without)} succeeded without exactly one effect, {len(reconciled)} reconciled",
        )
    )
    killed_run = next((r for r in agent_runs if str(r.id) == facts.kill_leases.get("agent")), None)
    checks.append(
        Check(
            "agents: the run held by the killed agent worker was reclaimed, resumed from its journal and completed",
            killed_run is not None
            and killed_run.state == "completed"
            and any(e.run_id == killed_run.id for e in reconciled),
            f"state {killed_run.state if killed_run else None}, "
            f"{sum(1 for e in reconciled if killed_run and e.run_id == killed_run.id)} of its calls reconciled",
        )
    )

    # Compensations.
    with_comp = [e for e in tool_entries if e.compensation]
    comp_done = [e for e in with_comp if e.compensation_status == "compensated"]
    comp_wrong = [
        e
        for e in with_comp
        if effects[(f"{e.idempotency_key}:compensate", "compensate")]
        != (1 if e.compensation_status == "compensated" else 0)
    ]
    stray = [
        k
        for (k, kind), n in effects.items()
        if kind == "compensate" and k.removesuffix(":compensate") not in {e.idempotency_key for e in with_comp}
    ]
    failed_agent = [r for r in agent_runs if r.state == "failed" and r.failure_code != "approval_expired"]
    layers["compensation"] = {
        "compensable_calls": len(with_comp),
        "compensated": len(comp_done),
        "failed_runs": len(failed_agent),
    }
    checks.append(
        Check(
            "compensation: the failed agent run's calls were compensated, each exactly once",
            bool(comp_done) and not comp_wrong and not stray,
            f"{len(comp_done)} compensated, {len(comp_wrong)} with another count of effects, {len(stray)} stray",
        )
    )

    # Approvals.
    approvals = list(Approval.objects.filter(community_id__in=ids))
    approval_states = Counter(a.state for a in approvals)
    decided = [a for a in approvals if a.state in ("approved", "rejected")]
    wrong_decider = [
        a
        for a in decided
        if a.decided_by != OPERATOR
        or facts.decisions.get(str(a.id)) != "Decided"
        or moves[("buzz_workflows_approval", a.id)] != 1
    ]
    second_ok = all(facts.second_decisions.get(str(a.id)) == "AlreadyDecided" for a in decided)
    undecided = [a for a in approvals if a.state == "pending"]
    layers["approvals"] = {
        "states": dict(approval_states),
        "decided": len(decided),
        "second_decisions_refused": sum(1 for v in facts.second_decisions.values() if v == "AlreadyDecided"),
    }
    checks.append(
        Check(
            "approvals: every approval decided exactly once, by the operator's one decision (a second decision refused)",  # noqa: E501
            bool(decided)
            and not wrong_decider
            and second_ok
            and not undecided
            and len(facts.decisions) == len(decided)
            and all(outcome == "Expired" for outcome in facts.after_cancel.values()),
            f"{len(decided)} decided, {len(wrong_decider)} not by the operator's one decision, "
            f"{len(undecided)} left pending, second decisions {sorted(set(facts.second_decisions.values()))}, "
            f"the cancelled run's approval: {sorted(set(facts.after_cancel.values())) or 'none'}",
        )
    )

    # The gateway: agent runs and deliveries worked by the remote worker over HTTP.
    remote_key = bytes.fromhex(facts.remote_agents.get("remote", "00" * 32))
    courier_key = bytes.fromhex(facts.remote_agents.get("courier", "00" * 32))
    remote_runs = [r for r in agent_runs if bytes(r.agent_pubkey) == remote_key]
    remote_calls = [e for e in tool_entries if e.run_id in {r.id for r in remote_runs}]
    courier = [d for d in deliveries if bytes(d.target_pubkey) == courier_key]
    courier_effects = sum(n for (k, kind), n in effects.items() if kind == "delivery")
    layers["gateway"] = {
        "remote_agent_runs": dict(Counter(r.state for r in remote_runs)),
        "remote_tool_calls": len(remote_calls),
        "remote_deliveries": dict(Counter(d.status for d in courier)),
    }
    checks.append(
        Check(
            "gateway: the remote worker's agent runs completed with their calls journaled, its deliveries finished once",  # noqa: E501
            bool(remote_runs)
            and all(r.state == "completed" for r in remote_runs)
            and bool(remote_calls)
            and bool(courier)
            and all(d.status == "finished" for d in courier)
            and courier_effects == len(courier),
            f"{len(remote_runs)} remote runs, {len(remote_calls)} calls, {len(courier)} deliveries, "
            f"{courier_effects} handled",
        )
    )

    # The remote worker killed mid-lease: its run went back by the reaper, and the replacement's
    # lease settled it, once; the call it had made was replayed from the journal, not made again.
    remote_killed = next((r for r in agent_runs if str(r.id) == facts.kill_leases.get("remote")), None)
    history = (remote_killed.history or []) if remote_killed else []
    claims = {e.get("generation"): e.get("actor") for e in history if e.get("event") == "claim"}
    settles = [e for e in history if e.get("event") == "settle"]
    dead = facts.kill_holders.get("remote")
    settler = claims.get(settles[0].get("generation")) if len(settles) == 1 else None
    its_calls = [e for e in tool_entries if remote_killed and e.run_id == remote_killed.id]
    checks.append(
        Check(
            "gateway: the run held by the killed remote worker was reaped, then settled once by its new holder "
            "(its first call replayed from the journal, made once)",
            remote_killed is not None
            and remote_killed.state == "completed"
            and dead in claims.values()
            and any(e.get("event") == "reap" for e in history)
            and len(settles) == 1
            and settler == settles[0].get("actor")
            and settler not in (None, dead)
            and moves[("buzz_agents_run", remote_killed.id)] == 1
            and bool(its_calls)
            and all(effects[(e.idempotency_key, "call")] == 1 for e in its_calls),
            f"state {remote_killed.state if remote_killed else None}, holders {sorted(set(claims.values()))}, "
            f"{len(settles)} settles (by {[e.get('actor') for e in settles]}), "
            f"effects per call {[effects[(e.idempotency_key, 'call')] for e in its_calls]}",
        )
    )
    unsettled = [r for r in agent_runs if r.state == "completed" and not _settled_once_by_holder(r.history or [])]
    checks.append(
        Check(
            "agents: every completed agent run was settled once, by the holder of that lease (its history)",
            not unsettled,
            f"{len(unsettled)} of {sum(1 for r in agent_runs if r.state == 'completed')} completed runs not",
        )
    )

    # The workflow-level approval step: decided once by the operator, its step resumed once.
    release_steps = [s for s in steps if s.run_id == facts.release_run_id]
    sign_off = next((s for s in release_steps if s.kind == "approval"), None)
    ship = next((s for s in release_steps if s.key == "ship"), None)
    its_approvals = [a for a in approvals if sign_off is not None and a.step_id == sign_off.id]
    resumed = Counter(
        row_id
        for row_id, old in StateChange.objects.filter(
            run_id=facts.run_id, table="buzz_workflows_step", old_state="waiting"
        ).values_list("row_id", "old_state")
    )
    layers["approvals"]["workflow_approval_steps"] = len(its_approvals)
    checks.append(
        Check(
            "approvals: the workflow's approval step was decided once by the operator and its step resumed once",
            sign_off is not None
            and len(its_approvals) == 1
            and its_approvals[0].state == "approved"
            and its_approvals[0].decided_by == OPERATOR
            and moves[("buzz_workflows_approval", its_approvals[0].id)] == 1
            and sign_off.state == "succeeded"
            and resumed[sign_off.id] == 1
            and ship is not None
            and ship.state == "succeeded"
            and moves[("buzz_workflows_step", ship.id)] == 1,
            f"{len(its_approvals)} approvals ({[a.state for a in its_approvals]}), step "
            f"{sign_off.state if sign_off else None} resumed {resumed[sign_off.id] if sign_off else 0} times, "
            f"next step {ship.state if ship else None}",
        )
    )

    # The community fenced midway: nothing of it moved after the fence; the others completed.
    fenced_ok, fenced_detail = _fence_check(facts)
    layers["fence"] = fenced_detail
    checks.append(
        Check(
            "fence: the community fenced midway stayed where the fence found it (no state change, no history "
            "entry after it); the other communities' runs completed",
            fenced_ok and not open_runs,
            ", ".join(f"{k} {v}" for k, v in fenced_detail.items()) + f"; {len(open_runs)} other runs open",
        )
    )

    # Workers of the act.
    bad = [
        f"{w['name']} exited {w['returncode']}"
        for w in facts.workers
        if not w["killed"] and (w["returncode"] != 0 or (w["summary"] is None and w["name"] != "gateway"))
    ]
    checks.append(
        Check(
            "second act: each kind of worker killed with SIGKILL mid-lease; the others stopped cleanly",
            set(facts.killed) == {"workflow", "agent", "remote"} and not bad,
            "; ".join(bad) or f"killed {sorted(facts.killed.values())}",
        )
    )
    return layers, checks

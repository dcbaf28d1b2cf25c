"""Printing the demo's progress and report with rich (tables, colours when on a terminal)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from project.demo.report import STATUSES


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def print_report(console: Console, report: dict[str, Any]) -> None:
    """Print the report: deliveries per community and status, the fleet figures, the checks."""
    table = Table(title="Deliveries by community and status", title_justify="left")
    table.add_column("community")
    table.add_column("state")
    table.add_column("committed", justify="right")
    for status in STATUSES:
        table.add_column(status, justify="right")
    for c in report["communities"]:
        table.add_row(c["name"], c["state"], str(c["committed"]), *(str(c["status"][s]) for s in STATUSES))
    table.add_row("all", "", str(report["committed"]), *(str(report["status"][s]) for s in STATUSES), style="bold")
    console.print(table)

    reaper = report["reaper"]
    lat, first = report["latency_ms"], report["latency_ms_first_attempt"]
    console.print(
        f"Workflow runs: {report['workflow_runs']:,}; producer retries that found their deliveries "
        f"already committed: {report['producer_retries_deduplicated']}\n"
        f"Reaper: {reaper['runs']} runs, {reaper['reclaimed']} lapsed leases reclaimed "
        f"({report['reclaimed_from_dead_holders']} from the killed worker), {reaper['exhausted']} attempts "
        f"exhausted, {reaper['expired']} expired, {reaper['skipped_fenced']} left alone in fenced communities\n"
        f"Stale settles refused (workers' lease_lost): {report['stale_settles_refused']}\n"
        f"Commit-to-settle latency: p50 {_ms(lat['p50'])}, p99 {_ms(lat['p99'])} (all terminal deliveries, "
        f"incl. retry backoff and lapsed leases); settled on the first attempt: p50 {_ms(first['p50'])}, "
        f"p99 {_ms(first['p99'])}\n"
        f"Took {report['seconds']:.1f} s",
        highlight=False,
    )

    workers = Table(title="Workers", title_justify="left")
    for name in ("worker", "pid", "exit", "claimed", "finished", "failed", "retried", "lease_lost", "renewed"):
        workers.add_column(name, justify="left" if name == "worker" else "right")
    for w in report["workers"]:
        summary = w["summary"] or {}
        exit_text = "SIGKILL" if w["killed"] else str(w["returncode"])
        counts = [
            str(summary.get(k, "-")) for k in ("claimed", "finished", "failed", "retried", "lease_lost", "renewed")
        ]
        workers.add_row(w["name"], str(w["pid"]), exit_text, *counts)
    console.print(workers)

    console.print("[bold]Exactly-once settlement check[/bold]")
    for check in report["checks"]:
        mark = "[green]passed[/green]" if check["passed"] else "[bold red]FAILED[/bold red]"
        console.print(f"  {mark}  {check['name']} ({check['detail']})", highlight=False)
    system = report.get("system")
    if system:
        _print_system(console, system)
    verdict = "[bold green]passed[/bold green]" if report["passed"] else "[bold red]FAILED[/bold red]"
    console.print(f"Exactly-once check: {verdict}")


def _print_system(console: Console, system: dict[str, Any]) -> None:
    """The second act: what happened per layer, its workers, and its checks."""
    facts, layers = system["facts"], system["layers"]
    console.print(f"\n[bold]Second act: workflows, agent runs, approvals[/bold] (took {facts['seconds']:.1f} s)")
    table = Table(title="What happened, per layer", title_justify="left")
    table.add_column("layer")
    table.add_column("what happened")
    for layer, values in layers.items():
        table.add_row(layer, ", ".join(f"{k} {v}" for k, v in values.items()))
    console.print(table)
    workers = Table(title="Workflow and agent workers", title_justify="left")
    for name in ("worker", "pid", "exit", "summary"):
        workers.add_column(name)
    for w in facts["workers"]:
        summary = ", ".join(f"{k} {v}" for k, v in (w["summary"] or {}).items() if v) or "-"
        workers.add_row(w["name"], str(w["pid"]), "SIGKILL" if w["killed"] else str(w["returncode"]), summary)
    console.print(workers)
    for note in facts.get("notes", []):
        console.print(f"  note: {note}", highlight=False)
    console.print("[bold]Exactly-once checks, per layer[/bold]")
    for check in system["checks"]:
        mark = "[green]passed[/green]" if check["passed"] else "[bold red]FAILED[/bold red]"
        console.print(f"  {mark}  {check['name']} ({check['detail']})", highlight=False)

"""The verdict of a chaos run: the workers' JSONL logs compared with the final rows."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TERMINAL = ("finished", "failed", "expired")
# failure_message prefix of every worker-recorded failure; the reaper writes its own messages.
WORKER_MESSAGE = "chaos:"
# A settle is "late" when it starts this long after the holder's lease deadline (same host clock
# as the database: the statement's now() can only be later than the call's start).
CLOCK_SLACK_SECONDS = 0.01


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of one JSONL log; a line torn by SIGKILL (the last one) is dropped. A process
    SIGKILLed before it opened its log has none: that reads as no records."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


@dataclass
class Audit:
    """What the logs and the database say, and every disagreement between them."""

    rows_by_status: Counter[str] = field(default_factory=Counter)
    settled_terminal_by_status: Counter[str] = field(default_factory=Counter)
    reaper_ended_by_status: Counter[str] = field(default_factory=Counter)
    in_doubt_by_status: Counter[str] = field(default_factory=Counter)
    settle_calls: int = 0
    results: Counter[str] = field(default_factory=Counter)
    late_after_pause: Counter[str] = field(default_factory=Counter)
    late_settles_refused: int = 0
    violations: list[str] = field(default_factory=list)

    def accounted_by_status(self) -> dict[str, int]:
        """Terminal rows per status as the logs account for them."""
        return dict(self.settled_terminal_by_status + self.in_doubt_by_status + self.reaper_ended_by_status)

    def terminal_rows_by_status(self) -> dict[str, int]:
        return {s: n for s, n in self.rows_by_status.items() if s in TERMINAL}

    def summary(self) -> str:
        return (
            f"rows by status {dict(self.rows_by_status)}; settled by workers {dict(self.settled_terminal_by_status)}"
            f" (+{dict(self.in_doubt_by_status)} in doubt at SIGKILL, applied); ended by the reaper"
            f" {dict(self.reaper_ended_by_status)}; settle calls {self.settle_calls}, results {dict(self.results)};"
            f" late settles refused {self.late_settles_refused}, after a pause {dict(self.late_after_pause)}"
        )


def audit(
    logs: Iterable[Path],
    killed_logs: set[Path],
    pauses: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    active_communities: set[str],
) -> Audit:
    """Compare the workers' settle logs with the final rows (see tests/test_chaos.py for the rules).

    ``rows``: every delivery as ``{"id", "community", "status", "gen", "failure_message"}``.
    """
    report = Audit()
    accepted: dict[str, list[dict[str, Any]]] = defaultdict(list)  # terminal settles the database took
    in_doubt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    settled_per_lease: Counter[tuple[str, int]] = Counter()
    retried_pending: list[dict[str, Any]] = []
    pause_windows = defaultdict(list)
    for pause in pauses:
        pause_windows[pause["log"]].append(pause)

    for path in logs:
        if not path.exists() and path not in killed_logs:
            report.violations.append(f"{path.name}: a worker that was not killed left no log")
        records = read_log(path)
        intents = {r["seq"]: r for r in records if r["kind"] == "settle_intent"}
        for record in records:
            if record["kind"] == "resettle":
                if record["result"] != "AlreadyTerminal":
                    report.violations.append(f"idempotent re-settle of {record['id']} got {record['result']}")
                continue
            if record["kind"] in ("renew",) and record.get("result") == "Renewed":
                if record["t_before"] > record["lease_until"] + CLOCK_SLACK_SECONDS:
                    report.violations.append(f"late renew accepted: {record}")
                continue
            if record["kind"] != "settle":
                continue
            intents.pop(record["seq"], None)
            report.settle_calls += 1
            report.results[record["result"]] += 1
            late = record["t_before"] > record["lease_until"] + CLOCK_SLACK_SECONDS
            if record["result"] == "Settled":
                settled_per_lease[(record["id"], record["gen"])] += 1
                if late:
                    report.violations.append(f"a stale holder's settle was accepted: {record}")
                if record["status"] in TERMINAL:
                    accepted[record["id"]].append(record)
                else:
                    retried_pending.append(record)
            elif record["result"] == "AlreadyTerminal":
                if record["errors"] == 0:
                    report.violations.append(f"AlreadyTerminal without an earlier attempt by this holder: {record}")
                accepted[record["id"]].append(record)
            if late and record["result"] == "LeaseLost":
                report.late_settles_refused += 1
            for pause in pause_windows.get(path, []):
                # the first settles after waking, under a lease that ran out while the process was stopped
                if record["lease_until"] < pause["resumed"] <= record["t_before"] < pause["resumed"] + 1:
                    report.late_after_pause[record["result"]] += 1
        leftover = list(intents.values())
        if leftover:
            if path not in killed_logs or len(leftover) > 1:
                report.violations.append(f"{path.name}: settle intents without a result: {leftover}")
            for intent in leftover:
                in_doubt[intent["id"]].append(intent)

    for (delivery, gen), count in settled_per_lease.items():
        if count > 1:
            report.violations.append(f"delivery {delivery} settled {count} times under generation {gen}")

    final = {row["id"]: row for row in rows}
    for row in rows:
        report.rows_by_status[row["status"]] += 1
        terminal = row["status"] in TERMINAL
        if row["community"] in active_communities and not terminal:
            report.violations.append(f"delivery {row['id']} of an active community ended {row['status']}")
        mine = accepted.get(row["id"], [])
        if not terminal:
            if mine:
                report.violations.append(f"non-terminal {row['id']} has accepted terminal settles {mine}")
            continue
        reaper_ended = row["status"] != "finished" and not (row["failure_message"] or "").startswith(WORKER_MESSAGE)
        if reaper_ended:
            report.reaper_ended_by_status[row["status"]] += 1
            if mine:
                report.violations.append(f"{row['id']} ended by the reaper but a worker's settle was accepted: {mine}")
            continue
        if len(mine) == 1:
            record = mine[0]
            if record["gen"] != row["gen"] or record["status"] != row["status"]:
                report.violations.append(f"{row['id']}: accepted settle {record} but the row is {row}")
            report.settled_terminal_by_status[row["status"]] += 1
        elif not mine:
            doubt = [r for r in in_doubt.get(row["id"], []) if r["gen"] == row["gen"]]
            expected = {"finished": "finished", "failed": "failed", "retry": "failed"}
            if len(doubt) == 1 and expected[doubt[0]["outcome"]] == row["status"]:
                report.in_doubt_by_status[row["status"]] += 1
            else:
                report.violations.append(f"{row['id']} is {row['status']} but no settle by its holder is logged")
        else:
            report.violations.append(f"{row['id']} was settled by {len(mine)} holders: {mine}")

    for record in retried_pending:
        row = final.get(record["id"])
        if row is not None and row["community"] in active_communities and row["gen"] <= record["gen"]:
            report.violations.append(f"retry of {record['id']} at generation {record['gen']} but the row is {row}")
    return report


def fetch_rows(cursor: Any) -> list[dict[str, Any]]:
    cursor.execute(
        "SELECT id::text, community_id::text, status, lease_generation, failure_message FROM buzz_delivery_delivery"
    )
    return [
        {"id": r[0], "community": r[1], "status": r[2], "gen": r[3], "failure_message": r[4]} for r in cursor.fetchall()
    ]

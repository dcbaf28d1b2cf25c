"""Figures and their report: medians, ratios to the baseline, targets, and ``results/latest.md``."""

from __future__ import annotations

import datetime as dt
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

RESULTS = Path(__file__).resolve().parent / "results"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Figure:
    """One line of the results table.

    ``ours`` / ``raw``: the medians of the runs (``ours_runs`` / ``raw_runs``). ``target``: a
    minimum (or, with ``lower_is_better``, a maximum) for ``ratio`` = ours / raw, unless
    ``target_value`` is set, which is then compared with ``ours`` itself."""

    figure: str
    case: str
    unit: str
    ours_runs: list[float]
    raw_runs: list[float] = field(default_factory=list)
    target_ratio: float | None = None
    target_value: float | None = None
    lower_is_better: bool = False
    note: str = ""

    @property
    def ours(self) -> float:
        return median(self.ours_runs)

    @property
    def raw(self) -> float | None:
        return median(self.raw_runs) if self.raw_runs else None

    @property
    def ratio(self) -> float | None:
        raw = self.raw
        return self.ours / raw if raw else None

    @property
    def target(self) -> str:
        sign = "<=" if self.lower_is_better else ">="
        if self.target_ratio is not None:
            return f"{sign} {self.target_ratio:g}x"
        if self.target_value is not None:
            return f"{sign} {self.target_value:,.0f}"
        return ""

    @property
    def met(self) -> str:
        if self.target_ratio is not None and self.ratio is not None:
            value, bound = self.ratio, self.target_ratio
        elif self.target_value is not None:
            value, bound = self.ours, self.target_value
        else:
            return ""
        ok = value <= bound if self.lower_is_better else value >= bound
        return "yes" if ok else "**MISSED**"


def _fmt(value: float | None, runs: list[float]) -> str:
    if value is None:
        return ""
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"
    if len(runs) > 1:
        lo, hi = min(runs), max(runs)
        spread = f"{lo:,.0f}-{hi:,.0f}" if abs(value) >= 100 else f"{lo:.3g}-{hi:.3g}"
        text += f" ({spread})"
    return text


@dataclass
class Report:
    """Everything a run produced: machine facts, figures, and free-text sections (EXPLAIN...)."""

    facts: dict[str, str]
    quick: bool
    repeats: int
    command: str
    note: str = ""
    figures: list[Figure] = field(default_factory=list)
    sections: list[tuple[str, str]] = field(default_factory=list)
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        print(self.table([figure], header=False), flush=True)
        return figure

    def section(self, title: str, text: str) -> None:
        self.sections.append((title, text))
        print(f"\n## {title}\n{text}\n", flush=True)

    @staticmethod
    def table(figures: list[Figure], header: bool = True) -> str:
        rows = [
            [
                f.figure,
                f.case,
                f.unit,
                _fmt(f.ours, f.ours_runs),
                _fmt(f.raw, f.raw_runs),
                f"{f.ratio:.2f}x" if f.ratio is not None else "",
                f.target,
                f.met,
                f.note,
            ]
            for f in figures
        ]
        headers = ["figure", "case", "unit", "ours (min-max)", "raw SQL (min-max)", "ours/raw", "target", "met", "note"]
        text = tabulate(rows, headers=headers, tablefmt="github")
        return text if header else "\n".join(text.splitlines()[2:])

    def markdown(self) -> str:
        finished = dt.datetime.now(dt.UTC)
        facts = [[k, v] for k, v in self.facts.items()]
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        facts.append(["load average at the end", load])
        parts = [
            "# buzz_delivery benchmark results",
            "",
            f"- date: {self.started:%Y-%m-%d %H:%M} UTC ({(finished - self.started).total_seconds():.0f} s)",
            f"- command: `{self.command}`",
            f"- form: {'quick (smoke; not for comparison)' if self.quick else 'full'}, "
            f"median of {self.repeats} run(s) per figure, (min-max) over the runs",
            *([f"- note: {self.note}"] if self.note else []),
            "- baseline: plain psycopg on `bench_raw_delivery` (same columns; primary key, identity unique "
            "key and the two partial indexes only; no CHECK constraints, foreign keys, write-fence trigger "
            "or other indexes), measured in the same run, interleaved with ours",
            "",
            tabulate(facts, headers=["machine / server", "value"], tablefmt="github"),
            "",
            "## Figures",
            "",
            self.table(self.figures),
        ]
        for title, text in self.sections:
            parts += ["", f"## {title}", "", text]
        return "\n".join(parts) + "\n"

    def write(self, path: Path | None = None) -> Path:
        path = path or RESULTS / "latest.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.markdown())
        return path

"""The trial table of `clusterfit sweep status`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from clusterfit.plots import pyplot


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def sweep_table(name: str, rows: list[dict[str, Any]], direction: str) -> Table:
    table = Table(title=f"sweep {name} ({direction}), best first")
    for column in ("trial", "parameters", "state", "metric", "reports", "wall s", "job", "job state"):
        table.add_column(column)
    for row in rows:
        params = ", ".join(
            f"{field.rsplit('.', 1)[-1]}={_number(v) if isinstance(v, float) else v}"
            for field, v in row["params"].items()
        )
        table.add_row(  # the search space's values and a failure's words as they are, never rich markup
            str(row["trial"]),
            escape(params),
            row["state"],
            _number(row["value"]),
            str(row["reports"]),
            _number(row["wall_s"], 3),
            row["job"] or "-",
            escape(row["job_state"] or (row["why"] or "-")),
        )
    return table


def plot_trials(name: str, metric: str, curves: dict[int, tuple[str, dict[int, float]]], path: Path) -> Path:
    """Every trial's reported metric against its step on one chart (a pruned trial's line simply ends)."""
    plt = pyplot("clusterfit sweep status --plot", "sweep")
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for number, (state, values) in sorted(curves.items()):
        steps = sorted(values)
        axes.plot(steps, [values[s] for s in steps], marker="o", label=f"trial {number} ({state.lower()})")
    axes.set_xlabel("epoch" if metric.startswith("val_") else "step")
    axes.set_ylabel(metric)
    axes.set_title(f"sweep {name}")
    axes.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path

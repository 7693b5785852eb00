"""The trial table of `clusterfit sweep status`."""

from __future__ import annotations

from typing import Any

from rich.table import Table


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
        table.add_row(
            str(row["trial"]),
            params,
            row["state"],
            _number(row["value"]),
            str(row["reports"]),
            _number(row["wall_s"], 3),
            row["job"] or "-",
            row["job_state"] or (row["why"] or "-"),
        )
    return table

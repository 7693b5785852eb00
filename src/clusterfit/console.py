"""What every `clusterfit` command prints through: results on stdout, messages on stderr, and a user's mistake
as `error:` lines and an exit code instead of a traceback."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)
_WIDEST = 10_000  # columns a piped table may take
# Help texts are Markdown: a docstring's paragraphs reflow to the terminal, `code` shows as code, and an extra's
# `clusterfit[bench]` stays whole (rich's own markup took `[bench]` for a style and dropped it).
HELP_MARKUP = "markdown"


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `message` as error lines; raise what this returns to leave with `code` (2: fix the input)."""
    for line in message.splitlines():
        errors.print(f"[red]error:[/red] {escape(line)}", soft_wrap=True)
    return typer.Exit(code)


def print_table(table: Table) -> None:
    """`table` fitted to the terminal; piped or redirected, whole: a script that greps a job's name must find
    it, not a name cut to the 80 columns rich assumes without a terminal."""
    if console.is_terminal:
        console.print(table)
        return
    whole = console.options.update_width(_WIDEST)  # measured unclamped, not within the 80 columns
    width = Measurement.get(console, whole, table).maximum
    # A console of the table's width: print(width=) would clamp it to this console's 80.
    Console(highlight=False, width=max(width, console.width), file=console.file).print(table)


def print_json(value: Any) -> None:
    """What `--json` prints: the HTTP API's fields, for scripts (`| jq`), never wrapped or coloured."""
    console.print(json.dumps(value, indent=2, default=str), markup=False, highlight=False, soft_wrap=True)

"""What every `clusterfit` command prints through: results on stdout, messages on stderr, and a user's mistake
as `error:` lines and an exit code instead of a traceback."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `message` as error lines; raise what this returns to leave with `code` (2: fix the input)."""
    for line in message.splitlines():
        errors.print(f"[red]error:[/red] {escape(line)}", soft_wrap=True)
    return typer.Exit(code)

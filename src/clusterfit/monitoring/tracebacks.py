"""Keeps Python tracebacks off the live console until it is clear they matter.

When one rank fails, its peers usually fail after it with long secondary tracebacks ("Connection reset by
peer"), and those arrive on the console before the job service has named the cause. The live view therefore
holds each log's traceback back: it is shown as soon as that rank writes on (a traceback the program caught
and survived), or at the end of a job that succeeded; a failed job's console leads with its cause instead,
and the held tracebacks stay in the rank logs, pointed to by one line."""

from __future__ import annotations

import enum
import re

# torch prefixes every line a rank prints on its way out with "[rankN]: ".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
_TRACEBACK_START = "Traceback (most recent call last):"
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


class _Where(enum.Enum):
    FRAMES = "frames"  # between "Traceback ..." and the exception's own line
    AFTER = "after"  # the exception line was seen; a chained traceback may still follow


class HeldTracebacks:
    """Feed it labelled lines (`[rank0] text`, as LogFollower gives them); it returns the lines to show now."""

    def __init__(self) -> None:
        self._held: dict[str, list[str]] = {}
        self._where: dict[str, _Where] = {}

    def feed(self, line: str) -> list[str]:
        label, _, text = line.partition("] ")
        text = _TORCH_RANK_PREFIX.sub("", text)
        where = self._where.get(label)
        if where is None:
            if text.startswith(_TRACEBACK_START):
                self._where[label] = _Where.FRAMES
                self._held.setdefault(label, []).append(line)
                return []
            return [line]
        continued = not text.strip() or text[0].isspace() or text.startswith(_TRACEBACK_START) or text in _CHAIN_MARKERS
        if where is _Where.FRAMES:
            self._held[label].append(line)
            if not continued:  # the exception's own line ends the frames
                self._where[label] = _Where.AFTER
            return []
        if continued:  # a chained exception, or the indented rest of a long message
            self._held[label].append(line)
            if text.startswith(_TRACEBACK_START):
                self._where[label] = _Where.FRAMES
            return []
        del self._where[label]  # the rank writes on: it survived this traceback, so show it now
        return [*self._held.pop(label), line]

    def held_labels(self) -> list[str]:
        """The logs (e.g. `[rank0`) whose tracebacks are being held, in the order they began."""
        return [label.lstrip("[") for label in self._held]

    def release(self) -> list[str]:
        """Everything held, per log in order; nothing is held afterwards."""
        lines = [line for held in self._held.values() for line in held]
        self._held.clear()
        self._where.clear()
        return lines

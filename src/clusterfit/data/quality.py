"""Bad input files, counted: which were skipped, why, and whether there are too many to go on.

Pure bookkeeping, no torch and no collectives: the worker merges the tallies of every rank and
DataLoader worker and asks `verdict` whether the job must stop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# (file, reason): one failed attempt to read a sample.
BadRead = tuple[str, str]

_NAMED_IN_ERRORS = 3


class BadInputError(RuntimeError):
    """Too many unreadable input files; the message is one line naming the worst of them."""


@dataclass
class InputTally:
    """Every file skipped so far, with its reason and how often it was tried; identical on every rank
    once merged."""

    reads: int = 0  # attempts to read a sample, good or bad
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # file -> {"reason", "count"}

    def add(self, reads: int, bad: list[BadRead]) -> None:
        self.reads += reads
        for file, reason in bad:
            entry = self.files.setdefault(file, {"reason": reason, "count": 0})
            entry["count"] += 1

    @property
    def skipped_files(self) -> int:
        return len(self.files)

    def by_reason(self) -> dict[str, int]:
        return dict(Counter(entry["reason"] for entry in self.files.values()).most_common())

    def worst(self, n: int) -> list[tuple[str, str, int]]:
        """The n files skipped most often (ties by name): the ones to look at first."""
        ranked = sorted(self.files.items(), key=lambda item: (-item[1]["count"], item[0]))
        return [(file, entry["reason"], entry["count"]) for file, entry in ranked[:n]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "skipped_files": self.skipped_files,
            "by_reason": self.by_reason(),
            "files": [{"file": f, "reason": r, "count": c} for f, r, c in self.worst(len(self.files))],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> InputTally:
        tally = cls(reads=int((data or {}).get("reads", 0)))
        for entry in (data or {}).get("files", []):
            tally.files[entry["file"]] = {"reason": entry["reason"], "count": int(entry["count"])}
        return tally


def verdict(tally: InputTally, samples_per_epoch: int, max_bad_fraction: float) -> str | None:
    """None while the job may go on, else the one-line reason to stop.

    The job stops once more distinct files were skipped than `max_bad_fraction` of the samples in one epoch.
    The count only grows, so stopping early never stops a job that would have passed at the end."""
    allowed = max_bad_fraction * samples_per_epoch
    if tally.skipped_files <= allowed:
        return None
    worst = "; ".join(f"{file} ({reason})" for file, reason, _ in tally.worst(_NAMED_IN_ERRORS))
    more = tally.skipped_files - min(_NAMED_IN_ERRORS, tally.skipped_files)
    return (
        f"{tally.skipped_files} unreadable input files, over trainer.data.max_bad_fraction = {max_bad_fraction:g} "
        f"of {samples_per_epoch} samples per epoch; worst: {worst}{f' and {more} more' if more else ''}; "
        "fix or remove them, or raise max_bad_fraction"
    )


def describe(tally: InputTally) -> str:
    """One line for the end of a run."""
    if not tally.files:
        return f"input: {tally.reads} samples read, none skipped"
    reasons = ", ".join(f"{count} {reason}" for reason, count in tally.by_reason().items())
    worst = ", ".join(file for file, _, _ in tally.worst(_NAMED_IN_ERRORS))
    return f"input: skipped {tally.skipped_files} unreadable files ({reasons}), e.g. {worst}; see summary.json"

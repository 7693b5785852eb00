"""`clusterfit.spec.SpecError` is the spec's member of clusterfit's error types (clusterfit/errors.py), and the
phrasing its messages share."""

import difflib

from clusterfit.errors import SpecError

__all__ = ["SpecError", "did_you_mean"]


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """` (did you mean X?)` when `word` is a likely misspelling of one of `choices` (`modle` -> `model`), as git
    names the command a mistyped one was closest to; empty otherwise."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""

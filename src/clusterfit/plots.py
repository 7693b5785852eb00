"""matplotlib for the commands that draw a PNG, imported only when one is drawn (it is an extra)."""

from __future__ import annotations

from typing import Any

from clusterfit.errors import SpecError


def pyplot(command: str, extra: str) -> Any:
    """matplotlib.pyplot on the file-only backend, or a one-line error naming the extra that brings it."""
    try:
        import matplotlib
    except ImportError:
        raise SpecError(f"{command} draws its chart with matplotlib: pip install 'clusterfit[{extra}]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt

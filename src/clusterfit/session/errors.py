"""The one error a user's script gets from clusterfit.session: a mistake in a call, named in one line."""

from __future__ import annotations

from clusterfit.errors import ClusterfitError


class SessionError(ClusterfitError, ValueError):
    """A wrong argument to the session API (a non-numeric metric, a negative step); never retried: the script
    would make it again."""

"""`clusterfit.spec.SpecError` is the spec's member of clusterfit's error types (clusterfit/errors.py)."""

from clusterfit.errors import SpecError

__all__ = ["SpecError"]

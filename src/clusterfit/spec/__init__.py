"""The job spec: the one description of a training job that every other layer reads."""

from clusterfit.spec.errors import SpecError
from clusterfit.spec.load import apply_override, load_spec, load_spec_text, validate_spec
from clusterfit.spec.model import JobSpec

__all__ = ["JobSpec", "SpecError", "apply_override", "load_spec", "load_spec_text", "validate_spec"]

"""job.yaml: the resolved spec the workers run, written by the launching side before any worker starts."""

from __future__ import annotations

import yaml

from clusterfit.spec.model import JobSpec


def resolved_spec_text(spec: JobSpec) -> str:
    """The spec as YAML with every default filled in; secrets come out as null (they travel in the environment)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)

"""Read a job.yaml, apply `--set a.b=c` overrides, validate, and phrase every mistake as one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clusterfit.spec.errors import SpecError
from clusterfit.spec.model import JobSpec


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such job file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the job file ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{path}: {problem}{where}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a job file must be a YAML mapping (name:, trainer:, ...), not {type(raw).__name__}")
    for override in overrides or []:
        apply_override(raw, override)
    return validate_spec(raw, source=str(path))


def validate_spec(raw: dict[str, Any], source: str = "job") -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError("\n".join(f"{source}: {_describe(err)}" for err in exc.errors())) from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in place; the value is parsed as YAML so `2`, `null`, `[1, 2]` keep their types."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {override!r}: expected KEY=VALUE, e.g. --set trainer.epochs=2")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise SpecError(
                f"--set {key}: {prefix} is {child!r}, not a section, so it has no field {parts[depth + 1]!r}"
            )
        node = child
    node[parts[-1]] = value


def _describe(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(err["loc"][:-1])
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"{field}: unknown key{hint}"
    if err["type"] == "missing":
        return f"{field}: required but missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        # Model-level checks phrase the whole problem themselves.
        return f"{field}: {msg}" if loc else msg
    return f"{field} = {err.get('input')!r}: {msg}"


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] | None = JobSpec
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        model = next((t for t in _types_in(annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return list(model.model_fields) if model else []


def _types_in(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    return list(args) if args else [annotation]

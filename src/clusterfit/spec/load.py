"""Read a job.yaml, apply `--set a.b=c` overrides, validate, and phrase every mistake as one line."""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from clusterfit.spec.errors import SpecError, did_you_mean
from clusterfit.spec.model import JobSpec


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such job file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the job file ({exc.strerror})") from None
    return load_spec_text(text, overrides, source=str(path))


# A job spec is a few hundred YAML nodes. These bounds refuse what only an attack needs (an alias "billion
# laughs" that expands 500 bytes into millions of nodes, a list nested thousands deep) before anything walks it.
MAX_SPEC_CHARS = 256 * 1024
MAX_SPEC_DEPTH = 32
MAX_SPEC_NODES = 20_000  # after aliases are expanded
_MAX_SHOWN = 200  # characters of a bad value quoted in an error


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 integers, which made `instance_count: 1:2` the number 62."""


_INT = "tag:yaml.org,2002:int"
_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


def spec_yaml(text: str) -> Any:
    """One YAML document as a spec reads it (no base-60 integers)."""
    return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader


class _BoundedLoader(_SpecLoader):
    """PyYAML's safe loader that refuses deep nesting while composing and counts the expanded node tree."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise _TooLarge(f"nested more than {MAX_SPEC_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooLarge(Exception):
    pass


def _expanded_nodes(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes of the tree with every alias expanded, each shared node counted once per use (memoised)."""
    if id(node) in sizes:
        return sizes[id(node)]
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_nodes(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_nodes(k, sizes) + _expanded_nodes(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


def _bounded_yaml(text: str, source: str) -> Any:
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(
            f"{source}: {len(text)} characters; a job spec is at most {MAX_SPEC_CHARS} (is it the right file?)"
        )
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_nodes(node, {}) > MAX_SPEC_NODES:
            raise _TooLarge(f"more than {MAX_SPEC_NODES} values once its aliases are expanded")
        return loader.construct_document(node) if node is not None else None
    except _TooLarge as exc:
        raise SpecError(f"{source}: {exc}; a job spec is a few hundred values, write it out plainly") from None
    finally:
        loader.dispose()


def load_spec_text(text: str, overrides: list[str] | None = None, source: str = "job") -> JobSpec:
    """A job spec from YAML text (what a client sends the job service), with the same checks as a file, and
    bounds on its size, depth and alias expansion."""
    try:
        raw = _bounded_yaml(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{source}: {problem}{where}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: a job file must be a YAML mapping (name:, trainer:, ...), not {type(raw).__name__}")
    for override in overrides or []:
        apply_override(raw, override)
    return validate_spec(raw, source=source)


def validate_spec(raw: dict[str, Any], source: str = "job") -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        # A bad strategy name also fails its options; the name is the mistake to report.
        bad_strategy = {err["loc"][:-1] for err in errors if err["loc"][-1:] == ("strategy",)}
        errors = [err for err in errors if not any(_under(err["loc"], (*p, "strategy_options")) for p in bad_strategy)]
        raise SpecError("\n".join(f"{source}: {describe_error(err)}" for err in errors)) from None


def _under(loc: tuple[Any, ...], prefix: tuple[Any, ...]) -> bool:
    return loc[: len(prefix)] == prefix


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in place; the value is parsed as YAML so `2`, `null`, `[1, 2]` keep their types."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {override!r}: expected KEY=VALUE, e.g. --set trainer.epochs=2")
    try:
        value = spec_yaml(text)
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


def describe_error(err: ErrorDetails, root: type[BaseModel] = JobSpec) -> str:
    """One of pydantic's errors for `root` (a job spec, a sweep) as the user's one line: the field as written
    in YAML, the value and what is wrong with it."""
    path, model = _walk(err["loc"], root)
    field = ".".join(path) or "(top level)"
    if err["type"] == "extra_forbidden":
        fields = model.model_fields if model else {}
        allowed = [name for name, info in fields.items() if not info.exclude]  # excluded: internal union tags
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else "; this section takes no keys here"
        return f"{field}: unknown key{did_you_mean(path[-1] if path else '', allowed)}{hint}"
    if err["type"] == "missing":
        return f"{field}: required but missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        # Model-level checks phrase the whole problem themselves.
        return f"{field}: {msg}" if path else msg
    return f"{field} = {_shown(err.get('input'))}: {msg}"


def _shown(value: Any) -> str:
    """A bad value as the error quotes it: its repr, cut short (a value may be large, or shared many times)."""
    shortener = reprlib.Repr()
    shortener.maxlevel, shortener.maxstring, shortener.maxother = 3, _MAX_SHOWN, _MAX_SHOWN
    text = shortener.repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _walk(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[list[str], type[BaseModel] | None]:
    """The user-facing path of an error location, and the model in which its last key was looked up.

    Discriminated unions put their tag in the location (`strategy_options.fsdp.x`); users never write
    that tag, so it is left out of the path."""
    path: list[str] = []
    holder: type[BaseModel] | None = root  # the model whose fields the next part names
    owner: type[BaseModel] | None = None
    choices: list[type[BaseModel]] = []  # the members of a union whose tag comes next
    for raw_part in loc:
        part = str(raw_part)
        if choices:
            holder, choices = next((m for m in choices if _tag(m) == part), None), []
            continue
        path.append(part)
        owner = holder
        field = holder.model_fields.get(part) if holder else None
        members = _models_in(field.annotation) if field else []
        holder = members[0] if len(members) == 1 else None
        choices = members if len(members) > 1 else []
    return path, owner


def _tag(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("strategy")
    return field.default if field else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in getattr(annotation, "__args__", ()) for model in _models_in(arg)]

"""sweep.yaml: a base job spec, a search space over its fields, an objective, a budget and a pruning policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clusterfit.errors import SpecError
from clusterfit.spec import load_spec
from clusterfit.spec.load import apply_override, describe_error, spec_yaml
from clusterfit.spec.model import is_url


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Choice(_Strict):
    choice: list[Any] = Field(min_length=1)


class Uniform(_Strict):
    uniform: tuple[float, float]


class LogUniform(_Strict):
    loguniform: tuple[float, float]

    @model_validator(mode="after")
    def _positive(self) -> LogUniform:
        if self.loguniform[0] <= 0:
            raise ValueError(f"loguniform {list(self.loguniform)}: the low end must be > 0")
        return self


class RandInt(_Strict):
    randint: tuple[int, int]


Distribution = Choice | Uniform | LogUniform | RandInt
VAL_METRICS = {"val_top1": "top1", "val_top5": "top5", "val_loss": "loss"}  # as the trainer's val records name them


class ObjectiveSpec(_Strict):
    metric: str = Field(
        "val_top1",
        description="val_top1, val_top5 or val_loss (the trainer's validations, one per epoch), or a metric a "
        "script reports through clusterfit.session (one per report)",
    )
    goal: Literal["maximize", "minimize"] = "maximize"


class EarlyStoppingSpec(_Strict):
    policy: Literal["none", "median", "hyperband"] = "median"
    warmup_reports: int = Field(
        1, ge=0, description="reports (epochs for val_* metrics) a trial makes before it may be stopped"
    )
    min_trials: int = Field(2, ge=1, description="median: trials that must have reported a step before comparing")


class SweepSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,40}$")
    job: str = Field(description="the base job spec, relative to the sweep file")
    search_space: dict[str, Distribution] = Field(min_length=1)
    objective: ObjectiveSpec = ObjectiveSpec()
    max_trials: int = Field(8, ge=1, le=10_000)
    max_concurrent: int = Field(2, ge=1, le=256, description="trials queued or running at once")
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    early_stopping: EarlyStoppingSpec = EarlyStoppingSpec()
    seed: int = Field(0, ge=0, description="the sampler's seed")
    first_trials: list[dict[str, Any]] = Field(
        default_factory=list,
        description="parameter sets to try before sampling (a known-good configuration, say), each naming "
        "every search-space field",
    )
    outputs_dir: str = Field(description="each trial's outputs go to <outputs_dir>/trial-NNN")
    job_overrides: list[str] = Field(
        default_factory=list,
        description="KEY=VALUE changes to the base job of every trial, as `--set` gives them (e.g. "
        "trainer.epochs=4); a searched field cannot be one",
    )

    @field_validator("search_space", mode="before")
    @classmethod
    def _one_kind_per_field(cls, space: Any) -> Any:
        if not isinstance(space, dict):
            return space
        kinds = {"choice": Choice, "uniform": Uniform, "loguniform": LogUniform, "randint": RandInt}
        made = {}
        for field, value in space.items():
            kind = next(iter(value), None) if isinstance(value, dict) and len(value) == 1 else None
            if kind not in kinds:
                raise ValueError(f"{field}: give one of {', '.join(kinds)}, e.g. {{loguniform: [0.001, 0.1]}}")
            try:
                made[field] = kinds[kind].model_validate(value)
            except ValidationError as exc:
                raise ValueError(f"{field}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return made

    @model_validator(mode="after")
    def _first_trials_name_every_field(self) -> SweepSpec:
        for index, params in enumerate(self.first_trials):
            if set(params) != set(self.search_space):
                raise ValueError(
                    f"first_trials[{index}] names {sorted(params)}; give exactly the search_space fields "
                    f"{sorted(self.search_space)}"
                )
        return self

    @model_validator(mode="after")
    def _searched_fields_are_not_overridden(self) -> SweepSpec:
        for line in self.job_overrides:
            if line.partition("=")[0].strip() in self.search_space:
                raise ValueError(
                    f"job_overrides: {line!r} sets a field the sweep searches; drop it, or drop the field from "
                    "search_space"
                )
        return self

    @model_validator(mode="after")
    def _choices_are_scalars(self) -> SweepSpec:
        for field, dist in self.search_space.items():
            if isinstance(dist, Choice) and not all(isinstance(v, str | int | float | bool) for v in dist.choice):
                raise ValueError(f"search_space.{field}: choices must be numbers, strings or booleans")
        return self

    @model_validator(mode="after")
    def _grid_needs_choices(self) -> SweepSpec:
        if self.sampler == "grid":
            ranged = [field for field, dist in self.search_space.items() if not isinstance(dist, Choice)]
            if ranged:
                raise ValueError(f"sampler grid needs `choice` for every field; {ranged[0]} is a range")
        return self


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepSpec, Path]:
    """The sweep and its base job file; each search-space field is checked against the job spec at once.
    `overrides` (`--set KEY=VALUE`) change the sweep's own fields (max_trials, objective.metric, ...); any other
    key changes the base job of every trial (it joins job_overrides)."""
    path = Path(path)
    try:
        raw = spec_yaml(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read the sweep ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a sweep is a YAML mapping (name:, job:, search_space:, ...)")
    for line in overrides or []:
        if line.partition("=")[0].strip().split(".")[0] in SweepSpec.model_fields:
            apply_override(raw, line)
        else:
            raw["job_overrides"] = [*raw.get("job_overrides", []), line]
    try:
        sweep = SweepSpec.model_validate(raw)
    except ValidationError as exc:
        # One line: a misspelt key first, as it is also why its field is missing.
        first = min(exc.errors(), key=lambda err: err["type"] != "extra_forbidden")
        raise SpecError(f"{path}: {describe_error(first, SweepSpec)}") from None
    job_file = (path.parent / sweep.job).resolve()
    if not is_url(sweep.outputs_dir):  # read from where the sweep runs, as a job's outputs.dir is
        sweep = sweep.model_copy(update={"outputs_dir": str(Path(sweep.outputs_dir).expanduser().resolve())})
    try:
        load_spec(job_file, sweep.job_overrides)
    except SpecError as exc:
        raise SpecError(f"{path}: job_overrides: {exc}") from None
    for field, distribution in sweep.search_space.items():
        example = example_value(distribution)
        try:
            load_spec(job_file, [*sweep.job_overrides, override(field, example)])
        except SpecError as exc:
            raise SpecError(f"{path}: search_space.{field} (tried {example!r}): {exc}") from None
    return sweep, job_file


def example_value(distribution: Distribution) -> Any:
    if isinstance(distribution, Choice):
        return distribution.choice[0]
    if isinstance(distribution, Uniform):
        return distribution.uniform[0]
    if isinstance(distribution, LogUniform):
        return distribution.loguniform[0]
    return distribution.randint[0]


def override(field: str, value: Any) -> str:
    """`--set FIELD=VALUE` for a sampled value: JSON is YAML, so numbers and strings keep their types; an
    environment variable (how a script usually takes its hyperparameters) gets the value's text."""
    if field.startswith("environment_variables."):
        value = str(value)
    return f"{field}={json.dumps(value)}"

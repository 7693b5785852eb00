"""The sweep driver: asks Optuna for trials, runs each as an ordinary job of the job service (priority, capacity,
retries, logs and cancel all apply), feeds it the trial's metric as the job reports it, stops the trials the
pruner gives up on the way a cancel stops them, and records how each ended. Everything it needs to continue is
in the study and the job store, so running it again resumes a sweep where it was."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterfit.service.jobs import JobService, Refused, ServiceError
from clusterfit.service.states import JobState
from clusterfit.spec.model import is_url
from clusterfit.sweep.spec import VAL_METRICS, Choice, LogUniform, RandInt, SweepSpec, Uniform, override
from clusterfit.sweep.study import find_study, open_study, storage_url, sweep_names

if TYPE_CHECKING:
    import optuna

JOB_ID = "job_id"  # trial user attributes
OUTPUTS = "outputs_dir"
WHY = "why"
CANCELLED = "cancelled"  # study user attributes: `sweep cancel` was asked
METRIC = "metric"  # the objective's name


def distributions(sweep: SweepSpec) -> dict[str, optuna.distributions.BaseDistribution]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made: dict[str, optuna.distributions.BaseDistribution] = {}
    for field, dist in sweep.search_space.items():
        if isinstance(dist, Choice):
            made[field] = CategoricalDistribution(dist.choice)
        elif isinstance(dist, Uniform):
            made[field] = FloatDistribution(*dist.uniform)
        elif isinstance(dist, LogUniform):
            made[field] = FloatDistribution(*dist.loguniform, log=True)
        elif isinstance(dist, RandInt):
            made[field] = IntDistribution(*dist.randint)
    return made


def tell(study: optuna.Study, trial: optuna.Trial | int, value: float | None = None, **kwargs: Any) -> None:
    """`study.tell`, but the end of a grid is no error: once every grid point was tried, Optuna's grid sampler
    calls `study.stop()`, which raises outside `study.optimize` (this driver asks and tells instead). The trial
    is stored before that (Optuna's `finally`), and `trial_budget` already ends the sweep there."""
    try:
        study.tell(trial, value, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def trial_budget(sweep: SweepSpec) -> int:
    """max_trials, or fewer when a grid has fewer points."""
    if sweep.sampler != "grid":
        return sweep.max_trials
    points = math.prod(len(dist.choice) for dist in sweep.search_space.values())  # type: ignore[union-attr]
    return min(sweep.max_trials, points)


def job_name(sweep: str, trial: int) -> str:
    return f"{sweep}-t{trial:03d}"


def reported_values(records: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) of the objective as the job recorded it: per epoch for the trainer's validation metrics,
    per report for a script's own."""
    if metric in VAL_METRICS:
        key = VAL_METRICS[metric]
        return [(int(r["epoch"]), float(r[key])) for r in records if r.get("kind") == "val" and key in r]
    return [(int(r["step"]), float(r[metric])) for r in records if r.get(metric) is not None]


@dataclass
class SweepDriver:
    sweep: SweepSpec
    job_file: Path
    jobs: JobService
    poll_s: float = 2.0
    say: Callable[[str], None] = print

    def run(self) -> optuna.Study:
        import optuna

        study = open_study(self.sweep)
        study.set_user_attr(METRIC, self.sweep.objective.metric)
        if not study.trials:
            for params in self.sweep.first_trials:  # Optuna asks these before sampling
                study.enqueue_trial(params)
        running = {t.number: t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING}
        live = {number: optuna.Trial(study, frozen._trial_id) for number, frozen in running.items()}
        if live:
            self.say(f"sweep {self.sweep.name}: resuming with {len(live)} trial(s) running")
        budget = trial_budget(self.sweep)
        unanswered = False
        while True:
            if study.user_attrs.get(CANCELLED):
                self.say(f"sweep {self.sweep.name} was cancelled")
                break
            try:
                self._step(study, live, budget)
            except Refused:
                raise
            except ServiceError as exc:  # the job service is down or restarting: the jobs and the study wait
                if not unanswered:
                    self.say(f"sweep {self.sweep.name}: {exc}; trying again every {self.poll_s:g} s")
                unanswered = True
            else:
                if unanswered:
                    self.say(f"sweep {self.sweep.name}: the job service answers again")
                unanswered = False
                if not live:
                    break
            time.sleep(self.poll_s)
        return study

    def _step(self, study: optuna.Study, live: dict[int, optuna.Trial], budget: int) -> None:
        """One look: the running trials polled, new ones submitted up to the concurrency limit and the budget."""
        for number in list(live):
            if self._poll(study, live[number]):
                del live[number]
        while len(live) < self.sweep.max_concurrent and len(study.trials) < budget:
            trial = study.ask(distributions(self.sweep))
            live[trial.number] = trial  # before submitting: if the service does not answer, the next look retries
            if not self._submit(study, trial):
                del live[trial.number]

    def _submit(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        import optuna

        outputs = trial_outputs(self.sweep.outputs_dir, trial.number)
        overrides = [*self.sweep.job_overrides, *(override(field, value) for field, value in trial.params.items())]
        overrides += [f"name={job_name(self.sweep.name, trial.number)}", f"outputs.dir={outputs}"]
        trial.set_user_attr(OUTPUTS, str(outputs))
        try:
            job_id = self.jobs.submit(self.job_file, overrides)["id"]
        except Refused as exc:  # a sampled value the job refuses: that trial fails, the sweep goes on
            trial.set_user_attr(WHY, str(exc))
            tell(study, trial, state=optuna.trial.TrialState.FAIL)
            self.say(f"trial {trial.number} {trial.params}: refused: {exc}")
            return False
        trial.set_user_attr(JOB_ID, job_id)
        self.say(f"trial {trial.number} {trial.params}: job {job_id}")
        return True

    def _adopt(self, trial: optuna.Trial) -> str | None:
        """The job of a trial whose driver was stopped between submitting it and recording its id."""
        name = job_name(self.sweep.name, trial.number)
        found = [row["id"] for row in self.jobs.list_jobs(None, 1000) if row["name"] == name]
        if found:
            trial.set_user_attr(JOB_ID, found[0])  # newest first
            return found[0]
        return None

    def _poll(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        """Report the trial's new values and end it if its job ended or the pruner stops it; True once ended."""
        import optuna

        frozen = study._storage.get_trial(trial._trial_id)  # noqa: SLF001 - the live trial's stored values
        job_id = frozen.user_attrs.get(JOB_ID) or self._adopt(trial)
        if job_id is None:
            return self._submit(study, trial) is False  # its driver stopped before submitting it
        state = JobState(self.jobs.status(job_id)["state"])
        values = reported_values(self.jobs.metrics(job_id), self.sweep.objective.metric)
        for step, value in values:
            if step not in frozen.intermediate_values:
                trial.report(value, step)
        if not state.is_terminal and values and trial.should_prune():
            with contextlib.suppress(ServiceError):  # it may have ended meanwhile
                self.jobs.cancel(job_id)
            tell(study, trial, state=optuna.trial.TrialState.PRUNED)
            self.say(
                f"trial {trial.number}: pruned at step {values[-1][0]} ({values[-1][1]:.4g}); job {job_id} cancelled"
            )
            return True
        if not state.is_terminal:
            return False
        if state is JobState.SUCCEEDED and values:
            tell(study, trial, values[-1][1])
            self.say(f"trial {trial.number}: {self.sweep.objective.metric} {values[-1][1]:.4g}")
        else:
            trial.set_user_attr(WHY, f"job {job_id} ended {state.value}")
            tell(study, trial, state=optuna.trial.TrialState.FAIL)
            self.say(f"trial {trial.number}: job {job_id} ended {state.value}")
        return True


def sweep_curves(name: str) -> tuple[str, dict[int, tuple[str, dict[int, float]]]]:
    """The objective's name and each trial's (state, {step: value}) as reported, for the plot."""
    study = find_study(name)
    metric = study.user_attrs.get(METRIC, "metric")
    return metric, {t.number: (t.state.name, dict(t.intermediate_values)) for t in study.trials}


def sweep_rows(name: str, jobs: JobService) -> tuple[list[dict[str, Any]], str]:
    """`sweep status`: one row per trial, best first, and the study's direction."""
    study = find_study(name)
    rows = []
    for frozen in study.trials:
        job_id = frozen.user_attrs.get(JOB_ID)
        job_state = None
        if job_id:
            with contextlib.suppress(ServiceError):
                job_state = jobs.status(job_id)["state"]
        value = frozen.value
        if value is None and frozen.intermediate_values:
            value = frozen.intermediate_values[max(frozen.intermediate_values)]
        ended = frozen.datetime_complete or None
        wall = (ended - frozen.datetime_start).total_seconds() if ended and frozen.datetime_start else None
        rows.append(
            {
                "trial": frozen.number,
                "params": frozen.params,
                "state": frozen.state.name,
                "value": value,
                "reports": len(frozen.intermediate_values),
                "wall_s": wall,
                "job": job_id,
                "job_state": job_state,
                "outputs": frozen.user_attrs.get(OUTPUTS),
                "why": frozen.user_attrs.get(WHY),
            }
        )
    maximize = study.direction.name == "MAXIMIZE"
    rows.sort(key=lambda r: (r["value"] is None, -(r["value"] or 0) if maximize else (r["value"] or 0)))
    return rows, study.direction.name.lower()


def sweep_list() -> list[dict[str, Any]]:
    """Every sweep of this service home, for the dashboard: its objective, trial counts and best value. Empty
    where the sweep extra is not installed (a server need not have it)."""
    try:
        import optuna
    except ImportError:
        return []
    listed = []
    storage = optuna.storages.RDBStorage(storage_url())  # one connection pool for every study of the page
    for summary in optuna.get_all_study_summaries(storage=storage, include_best_trial=True):
        states = [t.state.name for t in optuna.load_study(study_name=summary.study_name, storage=storage).trials]
        listed.append(
            {
                "name": summary.study_name,
                "metric": summary.user_attrs.get(METRIC),
                "direction": summary.direction.name.lower(),
                "trials": len(states),
                "complete": states.count("COMPLETE"),
                "pruned": states.count("PRUNED"),
                "running": states.count("RUNNING"),
                "best_value": summary.best_trial.value if summary.best_trial else None,
            }
        )
    return listed


def sweep_view(name: str, jobs: JobService) -> dict[str, Any]:
    """One sweep for the dashboard: the status table's rows (best first) and every trial's curve."""
    try:
        known = sweep_names()
    except ImportError:  # no sweep extra here: no sweeps either
        known = []
    if name not in known:
        raise Refused(f"no sweep named {name!r} here; known: {', '.join(known) or 'none'}", 404)
    rows, direction = sweep_rows(name, jobs)
    metric, curves = sweep_curves(name)
    return {
        "name": name,
        "metric": metric,
        "direction": direction,
        "rows": rows,
        "curves": {number: sorted(values.items()) for number, (_, values) in curves.items()},
    }


def cancel_sweep(name: str, jobs: JobService) -> list[str]:
    """Stop every trial's job and the driver (which checks the study's flag); returns the cancelled job ids."""
    import optuna

    study = find_study(name)
    study.set_user_attr(CANCELLED, True)
    cancelled = []
    for frozen in study.trials:
        job_id = frozen.user_attrs.get(JOB_ID)
        if frozen.state != optuna.trial.TrialState.RUNNING or not job_id:
            continue
        with contextlib.suppress(ServiceError):
            jobs.cancel(job_id)
            cancelled.append(job_id)
        with contextlib.suppress(RuntimeError, ValueError):  # the driver may have recorded it first
            tell(study, frozen.number, state=optuna.trial.TrialState.FAIL)
    return cancelled


def trial_outputs(outputs_dir: str, number: int) -> str:
    """A trial's outputs.dir: a folder under the sweep's, or a path under its URL (a URL is not a Path: "az://"
    would lose a slash)."""
    name = f"trial-{number:03d}"
    return f"{outputs_dir.rstrip('/')}/{name}" if is_url(outputs_dir) else str(Path(outputs_dir) / name)

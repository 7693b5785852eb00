"""Where sweeps keep their Optuna studies: in the job store's own PostgreSQL database, in a schema of their
own, so every machine (and the server's dashboard) that shares the store sees them; beside a SQLite job store,
in `sweeps.db` in the service home.

NOTE: never in the job store's own tables' schema: Optuna migrates its tables with Alembic under the default
version table, which the job store's migrations use too."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import create_engine, text
from sqlalchemy.engine.url import make_url

from clusterfit.errors import SpecError
from clusterfit.service.home import database_url, service_home

if TYPE_CHECKING:
    import optuna

    from clusterfit.sweep.spec import SweepSpec


def require_optuna() -> None:
    """A one-line refusal, before anything runs, when the sweep extra is not installed."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SpecError("clusterfit sweep needs Optuna: pip install 'clusterfit[sweep]'") from None


SWEEPS_SCHEMA = "clusterfit_sweeps"


def storage_url() -> str:
    """Optuna's storage URL (with the store's password: for the process's own connection, never shown)."""
    store = make_url(database_url())
    if store.get_backend_name() != "postgresql":
        return f"sqlite:///{service_home() / 'sweeps.db'}"
    engine = create_engine(store)
    try:
        with engine.begin() as connection:
            connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SWEEPS_SCHEMA}"))
    finally:
        engine.dispose()
    in_schema = store.update_query_dict({"options": f"-csearch_path={SWEEPS_SCHEMA}"})
    return in_schema.render_as_string(hide_password=False)


def _sampler(sweep: SweepSpec, seed: int) -> optuna.samplers.BaseSampler:
    import optuna

    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sweep.sampler == "grid":
        grid = {field: list(dist.choice) for field, dist in sweep.search_space.items()}  # type: ignore[union-attr]
        return optuna.samplers.GridSampler(grid, seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(sweep: SweepSpec) -> optuna.pruners.BasePruner:
    import optuna

    policy = sweep.early_stopping
    if policy.policy == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=policy.min_trials, n_warmup_steps=policy.warmup_reports)
    if policy.policy == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, policy.warmup_reports))
    return optuna.pruners.NopPruner()


def open_study(sweep: SweepSpec) -> optuna.Study:
    """The sweep's study, created on first use and continued afterwards (same name, same storage)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    asked = len(find_study(sweep.name).trials) if sweep.name in sweep_names() else 0
    return optuna.create_study(
        study_name=sweep.name,
        storage=storage_url(),
        # A resumed driver must not replay the draws of the one before it: the seed moves on with the trials.
        sampler=_sampler(sweep, sweep.seed + asked),
        pruner=_pruner(sweep),
        direction=sweep.objective.goal,
        load_if_exists=True,
    )


def find_study(name: str) -> optuna.Study:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=storage_url())


def sweep_names() -> list[str]:
    import optuna

    return optuna.get_all_study_names(storage=storage_url())

"""Sweeps for real: trials are jobs of the local job service's queue, run side by side by their supervisors;
Optuna chooses and prunes; the study outlives the driver."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli_command, run_cli, tiny_job, wait_for, write_job
from PIL import Image

from clusterfit.service.migrate import open_store
from clusterfit.sweep.study import find_study


def _write_sweep(tmp_path: Path, job: dict, **sweep: object) -> Path:
    write_job(tmp_path / "job.yaml", job)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"job": "job.yaml", "outputs_dir": str(tmp_path / "trials"), **sweep}))
    return path


def test_trials_run_side_by_side_and_the_best_is_found(tmp_path: Path, tiny_imagefolder: Path) -> None:
    # Paths relative to where the sweep is run, as in examples/sweep/: each trial's job runs in its own outputs
    # folder, so they must be made absolute at submission.
    data = {"train": "data/train", "val": "data/val", "num_classes": None}
    assert tiny_imagefolder == tmp_path / "data"
    job = tiny_job(Path("unused"), epochs=1, steps_per_epoch=2, data=data)
    job["distribution"]["process_count_per_instance"] = 1  # two trials fit this machine's 2 slots at once
    sweep = _write_sweep(
        tmp_path,
        job,
        name="lr",
        search_space={"trainer.optimizer.lr": {"loguniform": [0.01, 1.0]}},
        objective={"metric": "val_top1", "goal": "maximize"},
        max_trials=8,
        max_concurrent=2,
        sampler="random",
        early_stopping={"policy": "none"},
    )
    # --set changes a sweep field and, for any other key, every trial's job.
    changes = ["--set", "max_trials=6", "--set", "trainer.epochs=2"]
    # The driver is killed once its first two trials are queued; run again, it takes them up and goes on.
    driver = subprocess.Popen(
        cli_command("sweep", "run", str(sweep), *changes, "--poll", "0.3"), stdout=subprocess.DEVNULL, cwd=tmp_path
    )
    wait_for(lambda: len(open_store().list_jobs()) == 2, 60, "two trials to be submitted")
    driver.kill()
    driver.wait()
    result = run_cli("sweep", "run", str(sweep), *changes, "--poll", "0.3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming with 2 trial(s) running" in result.stdout, result.stdout
    # The first two are not new, and none failed (": job X ended FAILED").
    assert result.stdout.count(": job ") == 4 and "best: trial" in result.stdout, result.stdout

    study = find_study("lr")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 6
    assert all(t.intermediate_values.keys() == {1, 2} for t in study.trials)  # one report per validated epoch
    store = open_store()
    jobs = {t.number: store.get(t.user_attrs["job_id"]) for t in study.trials}
    assert {job.name for job in jobs.values()} == {f"lr-t00{n}" for n in range(6)}
    assert all((Path(t.user_attrs["outputs_dir"]) / "summary.json").is_file() for t in study.trials)
    # Side by side: two trials' jobs ran at the same time. (Not necessarily the first two: the driver is killed
    # between submitting the second and asking the scheduler to start it, which then waits for a slot to free.)
    pairs = itertools.combinations(jobs.values(), 2)
    assert any(a.started_at < b.ended_at and b.started_at < a.ended_at for a, b in pairs)
    # ... and never more than max_concurrent of them.
    assert all(
        sum(other.started_at <= one.started_at < other.ended_at for other in jobs.values()) <= 2
        for one in jobs.values()
    )

    status = run_cli("sweep", "status", "lr")
    assert status.returncode == 0, status.stderr
    values = [t.value for t in sorted(study.trials, key=lambda t: -t.value)]
    listed = [int(line.split()[1]) for line in status.stdout.splitlines() if line.startswith("│ ")]
    assert [study.trials[n].value for n in listed] == values, status.stdout  # best first
    assert len({t.params["trainer.optimizer.lr"] for t in study.trials}) == 6  # the resumed driver drew anew
    assert values[0] == study.best_value
    assert (Path(study.best_trial.user_attrs["outputs_dir"]) / "model" / "model.safetensors").is_file()
    assert f"best: trial {study.best_trial.number}" in status.stdout

    # Run again: the budget is spent, nothing new is submitted.
    again = run_cli("sweep", "run", str(sweep), *changes, "--poll", "0.3", cwd=tmp_path)
    assert again.returncode == 0 and ": job " not in again.stdout
    assert len(find_study("lr").trials) == 6


def scaled_sweep(tmp_path: Path) -> Path:
    """A sweep of 2 trials of a script that reports (step + 1) x SCALE: the first trial (SCALE 1) sets the median,
    the second (sampled below 1) is worse at every step and is stopped after its first report past the warm-up."""
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "sweep_trial.py", code)
    job = {
        "name": "scaled",
        "command": "python sweep_trial.py",
        "code": str(code),
        "environment_variables": {"SCALE": "1"},
        "distribution": {"type": "pytorch", "process_count_per_instance": 1},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(tmp_path / "unused")},
    }
    return _write_sweep(
        tmp_path,
        job,
        name="scaled",
        search_space={"environment_variables.SCALE": {"uniform": [0.01, 0.9]}},
        first_trials=[{"environment_variables.SCALE": 1.0}],
        objective={"metric": "score", "goal": "maximize"},
        max_trials=2,
        max_concurrent=1,
        sampler="random",
        early_stopping={"policy": "median", "min_trials": 1, "warmup_reports": 1},
    )


def test_a_losing_trial_is_pruned_and_its_job_cancelled(tmp_path: Path) -> None:
    sweep = scaled_sweep(tmp_path)
    result = run_cli("sweep", "run", str(sweep), "--poll", "0.2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = find_study("scaled").trials
    assert (first.state.name, first.value, first.params) == ("COMPLETE", 12.0, {"environment_variables.SCALE": 1.0})
    assert second.state.name == "PRUNED" and "pruned at step" in result.stdout
    assert len(second.intermediate_values) < 12  # stopped before its end
    # The steps spent (one report per step) are fewer than without pruning, where each trial runs its 12.
    assert len(first.intermediate_values) + len(second.intermediate_values) < 2 * 12
    pruned_job = second.user_attrs["job_id"]
    wait_for(lambda: open_store().get(pruned_job).state == "CANCELLED", 60, "the pruned trial's job to stop")
    status = run_cli("sweep", "status", "scaled", "--plot", str(tmp_path / "curves.png"))
    assert "PRUNED" in status.stdout and "plot: " in status.stdout
    with Image.open(tmp_path / "curves.png") as png:
        assert png.size[0] > 400


@pytest.mark.parametrize(
    ("sweep", "words"),
    [
        ({"search_space": {"trainer.optimiser.lr": {"uniform": [0.1, 1]}}}, ["search_space.trainer.optimiser.lr"]),
        ({"search_space": {"trainer.optimizer.lr": {"loguniform": [0, 1]}}}, ["loguniform", "> 0"]),
        ({"search_space": {"trainer.optimizer.lr": {"uniform": [0.1, 1]}}, "sampler": "grid"}, ["grid", "choice"]),
        ({"first_trials": [{"x": 1}]}, ["first_trials[0]"]),
        ({"job_overrides": ["trainer.optimizer.lr=0.1"]}, ["job_overrides", "a field the sweep searches"]),
        ({"job_overrides": ["trainer.epochz=2"]}, ["job_overrides", "trainer.epochz: unknown key (did you mean epoch"]),
        ({"max_trails": 3}, ["max_trails: unknown key (did you mean max_trials?); allowed keys here: name, job"]),
        ({"search_space": {"trainer.batch_size": {"choice": ["big", 8]}}}, ["trainer.batch_size", "valid integer"]),
    ],
)
def test_a_bad_sweep_is_refused_in_one_line(tmp_path: Path, sweep: dict, words: list[str]) -> None:
    job = tiny_job(tmp_path / "out")
    path = _write_sweep(
        tmp_path, job, name="bad", **{"search_space": {"trainer.optimizer.lr": {"uniform": [0.1, 1]}}, **sweep}
    )
    result = run_cli("sweep", "run", str(path))
    assert result.returncode == 2
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    for word in words:
        assert word in message, message


def test_status_of_an_unknown_sweep_names_the_known_ones() -> None:
    result = run_cli("sweep", "status", "nope")
    assert result.returncode == 2 and "no sweep named 'nope'" in result.stderr


def test_a_trial_s_outputs_go_under_the_sweep_s_folder_or_url() -> None:
    from clusterfit.sweep.driver import trial_outputs

    assert trial_outputs("runs/lr-sweep", 3) == "runs/lr-sweep/trial-003"
    assert trial_outputs("az://runs/lr-sweep/", 12) == "az://runs/lr-sweep/trial-012"


def test_the_example_sweep_and_set_overrides_validate_against_its_job(tmp_path: Path) -> None:
    from clusterfit.spec import load_spec
    from clusterfit.sweep.spec import load_sweep

    example = REPO / "examples" / "sweep" / "sweep.yaml"
    sweep, job_file = load_sweep(example, ["max_trials=4", "trainer.epochs=3"])
    assert (sweep.max_trials, sweep.max_concurrent, job_file.name) == (4, 2, "small-dataset.yaml")
    assert sweep.job_overrides[-1] == "trainer.epochs=3"
    trial = load_spec(job_file, sweep.job_overrides)
    assert (trial.trainer.epochs, trial.distribution.process_count_per_instance) == (3, 1)


def test_the_last_point_of_a_grid_is_told_without_an_error() -> None:
    """Optuna's grid sampler stops the study after its last point, which raises outside `study.optimize`; the
    driver's `tell` stores the trial and goes on (a full-grid sweep ended in a traceback before)."""
    import optuna

    from clusterfit.sweep.driver import tell

    grid = {"x": [1, 2]}

    def walk(told: Callable[..., object]) -> list[str]:
        study = optuna.create_study(sampler=optuna.samplers.GridSampler(grid, seed=0))
        for _ in range(2):
            trial = study.ask({"x": optuna.distributions.CategoricalDistribution([1, 2])})
            told(study, trial, float(trial.params["x"]))
        return [t.state.name for t in study.trials]

    assert walk(tell) == ["COMPLETE", "COMPLETE"]
    with pytest.raises(RuntimeError, match="Study.stop"):
        walk(lambda study, trial, value: study.tell(trial, value))


def test_a_sweep_through_a_server_waits_out_the_server_s_restart(tmp_path: Path) -> None:
    """The driver talks to a server (--server); the server is stopped after the first trial is submitted and
    started again on the same port: the driver says so, waits, and the sweep ends as it would have."""
    from service_server import ServerProcess, make_token

    sweep = scaled_sweep(tmp_path)
    admin = make_token("admin")  # the trials are command jobs
    server = ServerProcess().start()
    port = server.url.rstrip("/").rsplit(":", 1)[1]
    driver = subprocess.Popen(
        cli_command("sweep", "run", str(sweep), "--poll", "0.2", "--server", server.url, "--token", admin),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: open_store().list_jobs(), 60, "the first trial's job")
        server.stop()
        time.sleep(1)  # a few of the driver's looks find nobody there
        restarted = ServerProcess("--port", port).start()
        try:
            said, _ = driver.communicate(timeout=180)
        finally:
            restarted.stop()
    finally:
        driver.kill()
    assert driver.returncode == 0, said[-3000:]
    assert "cannot reach the clusterfit server" in said and "trying again every 0.2 s" in said, said[-3000:]
    assert "the job service answers again" in said
    assert [t.state.name for t in find_study("scaled").trials] == ["COMPLETE", "PRUNED"]


def test_the_trial_table_shows_values_and_reasons_as_they_are() -> None:
    from rich.console import Console

    from clusterfit.sweep.render import sweep_table

    row = {"trial": 0, "params": {"trainer.augment.preset": "[bold]"}, "state": "FAIL", "value": None, "reports": 0}
    row |= {"wall_s": 1.0, "job": None, "job_state": None, "why": "bad value [red] in the spec"}
    console = Console(width=200, record=True)
    console.print(sweep_table("s", [row], "maximize"))
    text = console.export_text()
    assert "preset=[bold]" in text and "bad value [red] in the spec" in text, text

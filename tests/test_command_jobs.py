"""Command jobs: a user's own program instead of the built-in trainer, with the environment contract of its
`distribution.type`, run for real by torchrun on 2 local processes through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_command, run_cli, tiny_job, wait_for, write_job

from clusterfit.outputs import JobOutputs, read_records
from clusterfit.spec import SpecError, validate_spec
from clusterfit.worker.command import direct_argv, missing_framework, mpi_env, tf_config
from clusterfit.worker.command import main as command_worker

CONTRACT_SCRIPT = REPO / "tests" / "scripts" / "env_contract.py"
MPI_SCRIPT = REPO / "tests" / "scripts" / "mpi_allreduce.py"
TENSORFLOW_SCRIPT = REPO / "tests" / "scripts" / "tf_multiworker.py"


def command_job(out_dir: Path, code: Path, command: str, kind: str = "pytorch", processes: int = 2) -> dict[str, Any]:
    return {
        "name": f"command-{kind}",
        "command": command,
        "code": str(code),
        "environment_variables": {"FROM_SPEC": "yes"},
        "distribution": {"type": kind, "process_count_per_instance": processes},
        "resources": {"instance_count": 1, "backend": "local"},
        "outputs": {"dir": str(out_dir)},
    }


def user_code(root: Path) -> Path:
    code = root / "src"
    code.mkdir(parents=True)
    shutil.copy(CONTRACT_SCRIPT, code / CONTRACT_SCRIPT.name)
    return code


def framework_code(root: Path) -> Path:
    """The contract script, the mpi4py program and the TensorFlow program, in one code folder."""
    code = user_code(root)
    shutil.copy(MPI_SCRIPT, code)
    shutil.copy(TENSORFLOW_SCRIPT, code)
    return code


def rank_logs(out_dir: Path) -> str:
    return "\n".join(path.read_text() for path in sorted((out_dir / "logs").glob("rank-*.log")))


def assert_one_tensorflow_cluster_learned(out_dir: Path, workers: int) -> None:
    """Every worker of tf_multiworker.py saw all of them as replicas, ended with the same weights, and the
    loss fell at least fourfold."""
    reports = [json.loads(line) for line in rank_logs(out_dir).splitlines() if line.startswith('{"replicas"')]
    assert len(reports) == workers, rank_logs(out_dir)[-3000:]
    assert {report["replicas"] for report in reports} == {workers}
    assert len({report["digest"] for report in reports}) == 1, reports
    assert all(report["last"] < report["first"] / 4 for report in reports), reports


def test_a_job_is_a_trainer_or_a_command_never_both_or_neither(tmp_path: Path) -> None:
    both = {**tiny_job(tmp_path), "command": "python x.py"}
    with pytest.raises(SpecError, match="one of trainer: .*, command: .* or scorer: .*not trainer and command"):
        validate_spec(both)
    neither = {key: value for key, value in tiny_job(tmp_path).items() if key != "trainer"}
    with pytest.raises(SpecError, match="has none"):
        validate_spec(neither)
    mpi_trainer = tiny_job(tmp_path)
    mpi_trainer["distribution"]["type"] = "mpi"
    with pytest.raises(SpecError, match="distribution.type = 'mpi'.*set distribution.type: pytorch"):
        validate_spec(mpi_trainer)
    with pytest.raises(SpecError, match="code is only for command jobs"):
        validate_spec({**tiny_job(tmp_path), "code": "."})


def test_mpi_and_tensorflow_environment_from_torchrun_layout() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert mpi_env(torchrun) == {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
    }
    assert tf_config(["10.0.0.1:5000", "10.0.0.2:5001"], 1) == (
        '{"cluster": {"worker": ["10.0.0.1:5000", "10.0.0.2:5001"]}, "task": {"type": "worker", "index": 1}}'
    )


# After the contract check, each kind's own framework program: mpi4py's MPI_Init forms one world of both ranks
# (under torchrun each would be a world of its own); TF_CONFIG names both workers, so
# MultiWorkerMirroredStrategy allreduces across them and their reports reach the job's metrics.
FRAMEWORK_PROGRAM = {"pytorch": "", "mpi": " && python mpi_allreduce.py", "tensorflow": " && python tf_multiworker.py"}


@pytest.mark.parametrize("kind", ["pytorch", "mpi", "tensorflow"])
def test_each_distribution_type_gives_its_environment_and_its_framework_one_world(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    job = command_job(out, framework_code(tmp_path), f"python env_contract.py {kind}{FRAMEWORK_PROGRAM[kind]}", kind)
    spec = write_job(tmp_path / "job.yaml", job)
    if kind == "mpi":
        assert "mpirun -np 2" in run_cli("run", str(spec), "--dry-run").stdout
    result = run_cli("run", str(spec))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        # The script ran in the copy of `code` under outputs.dir, and its output streamed to the console.
        assert f"env ok: {kind} rank {rank}/2 in code" in rank_logs(out)
        assert f"[rank{rank}] env ok: {kind} rank {rank}/2 in code" in result.stdout
    assert (out / "code" / "env_contract.py").exists()
    assert "finished" in result.stdout
    if kind == "mpi":
        for rank in range(2):
            assert f"[rank{rank}] mpi world of 2: rank {rank} agrees on the sum 3" in result.stdout, result.stdout
            assert f"mpi world of 2: rank {rank} agrees" in (out / "logs" / f"rank-{rank}.log").read_text()
    if kind == "tensorflow":
        assert_one_tensorflow_cluster_learned(out, workers=2)
        losses = [record["loss"] for record in read_records(JobOutputs.at(out).metrics) if "loss" in record]
        assert len(losses) == 4 * 8 and losses[-1] < losses[0] / 4  # 4 epochs of 8 global batches, from rank 0


def test_a_tensorflow_job_without_tensorflow_stops_at_start_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # what `import tensorflow` finds when it is not installed
    assert missing_framework("tensorflow", "bash train.sh") is None  # another program: not ours to judge
    assert missing_framework("pytorch", "python train.py") is None
    job = command_job(tmp_path / "out", user_code(tmp_path), "python train.py", "tensorflow")
    spec = write_job(tmp_path / "job.yaml", job)
    with pytest.raises(SystemExit) as stopped:
        command_worker(["--spec", str(spec)])
    assert str(stopped.value) == (
        f"error: distribution.type = 'tensorflow': TensorFlow is not installed for {sys.executable}; "
        "pip install 'clusterfit[tensorflow]' (or tensorflow) in the workers' environment"
    )


def test_parameter_server_training_is_refused_in_one_line(tmp_path: Path) -> None:
    job = command_job(tmp_path / "out", user_code(tmp_path), "python x.py", "tensorflow")
    job["distribution"]["parameter_server_count"] = 1
    result = run_cli("validate", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "distribution.parameter_server_count: 1: parameter-server training is not supported; set 0" in result.stderr


def test_an_mpi_job_without_mpirun_is_refused_in_one_line(tmp_path: Path) -> None:
    from clusterfit.backends.mpi import find_mpirun

    assert find_mpirun(python=str(tmp_path / "bin" / "python"), path=str(tmp_path)) is None
    job = command_job(tmp_path / "out", user_code(tmp_path), "python x.py", "mpi")
    interpreter = tmp_path / "bin" / "python"  # an interpreter with no mpirun beside it, and no mpirun on PATH
    interpreter.parent.mkdir()
    interpreter.symlink_to(shutil.which("python3") or "/usr/bin/python3")
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from clusterfit.cli import main; sys.executable = sys.argv.pop(1); main()",
         str(interpreter), "validate", str(write_job(tmp_path / "job.yaml", job))],
        capture_output=True, text=True, env={**os.environ, "PATH": "/nonexistent"}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: distribution.type = 'mpi': no mpirun beside {interpreter} or on PATH; pip install "
        "'clusterfit[mpi]' (Open MPI's mpirun and mpi4py), or install Open MPI on this machine"
    )


def test_a_failing_command_fails_the_job_with_its_exit_code(tmp_path: Path) -> None:
    job = command_job(tmp_path / "out", user_code(tmp_path), "echo about to fail; exit 7", processes=1)
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 1
    assert "job command-pytorch" in result.stderr and "rank 0 exited with code 7" in result.stderr
    assert "about to fail" in result.stdout
    assert "exitcode  : 7" in (tmp_path / "out" / "logs" / "agent.log").read_text()


def test_dry_run_shows_the_command_wrapper_and_the_backend_flag_overrides_the_spec(tmp_path: Path) -> None:
    job = command_job(tmp_path / "out", user_code(tmp_path), "python env_contract.py mpi", "mpi")
    path = write_job(tmp_path / "job.yaml", job)
    result = run_cli("run", str(path), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "-m clusterfit.worker.command --spec" in result.stdout
    assert f"code: {(tmp_path / 'out' / 'code').resolve()}" in result.stdout
    wrong = run_cli("run", str(path), "--backend", "nowhere", "--dry-run")
    assert wrong.returncode == 2
    assert "resources.backend = 'nowhere'" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_a_missing_code_folder_is_one_line(tmp_path: Path) -> None:
    job = command_job(tmp_path / "out", tmp_path / "nope", "python x.py")
    result = run_cli("validate", str(write_job(tmp_path / "job.yaml", job)))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "code = " in result.stderr and "no such folder" in result.stderr


def _start_deaf_job(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, list[int]]:
    """`clusterfit run` of a 1-rank job whose worker ignores SIGTERM, once that worker runs: the launcher (its
    output in tmp_path/run.out) and the worker's pids."""
    out = tmp_path / "out"
    marker = f"deaf to SIGTERM in {tmp_path}"  # unique: other runs' processes never count
    stubborn = f"trap '' TERM; echo {marker}; while true; do sleep 0.2; done"
    job = command_job(out, user_code(tmp_path), stubborn, processes=1)
    printed = tmp_path / "run.out"
    with printed.open("wb") as sink:
        launcher = subprocess.Popen(
            cli_command("run", str(write_job(tmp_path / "job.yaml", job))),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
            start_new_session=True,
        )
    log = out / "logs" / "rank-0.log"
    wait_for(lambda: log.exists() and marker in log.read_text(), 120, "the worker to start")
    pids = (int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit())
    worker = [pid for pid in pids if marker.encode() in _cmdline(Path(f"/proc/{pid}"))]
    assert worker
    return launcher, printed, worker


def test_cancel_stops_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    """torchrun puts each worker in a session of its own: a worker deaf to SIGTERM is still killed on cancel."""
    launcher, _, worker = _start_deaf_job(tmp_path)
    try:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(120) == 130
    finally:
        launcher.kill()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in worker), 10, "the deaf worker to be killed")


def test_a_second_ctrl_c_leaves_at_once_and_the_next_command_stops_what_is_left(tmp_path: Path) -> None:
    """The first Ctrl-C waits for every worker to stop (here the 20 s grace of a worker deaf to SIGTERM); a
    second leaves at once and says how to stop what is left: any command that reads the store finds the job's
    supervisor gone and stops its processes."""
    launcher, printed, worker = _start_deaf_job(tmp_path)
    try:
        launcher.send_signal(signal.SIGINT)
        wait_for(lambda: "cancel requested; stopping every process" in printed.read_text(), 30, "the cancel")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(10) == 130
    finally:
        launcher.kill()
    job_id = printed.read_text().split()[1]
    left = f"job {job_id}: left without waiting for its workers; `clusterfit status {job_id}` stops them"
    assert left in printed.read_text()
    assert any(Path(f"/proc/{pid}").exists() for pid in worker)  # deaf, and nobody waited to kill it
    result = run_cli("status", job_id)
    assert result.returncode == 0 and "CANCELLED" in result.stdout, result.stderr
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in worker), 10, "the deaf worker to be killed")


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("python train.py --steps 30", ["python", "train.py", "--steps", "30"]),
        ("  python   x.py ", ["python", "x.py"]),
        ("python train.py && echo done", None),
        ("env | sort", None),
        ("echo private > private.txt", None),
        ("echo a\necho b", None),
        ("echo $HOME", None),
        ("python -c 'print(1)'", ["python", "-c", "print(1)"]),  # quoted as sh would read it
        ("FOO=1 python x.py", None),
        ("cd sub", None),
        ("python x.py # a comment", None),
        ("python 'unclosed", None),
    ],
)
def test_a_plain_command_becomes_the_rank_s_process_and_shell_syntax_gets_a_shell(
    command: str, argv: list[str] | None
) -> None:
    """Debian's /bin/sh forks even one program, so a program killed by SIGKILL looked like a rank exiting 137."""
    assert direct_argv(command) == argv

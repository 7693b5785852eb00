"""Warm starts (`clusterfit warm-start`): local agents forked from one process that imported torch once.

Most of the suite's local jobs start this way (conftest's `warm_start`); these tests cover what those do not:
what must start cold, how the process ends, and who may use it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import (
    cli_command,
    processes_mentioning,
    run_cli,
    tiny_job,
    wait_for,
    wait_for_first_checkpoint,
    write_job,
)
from service_server import ServerProcess, make_token

from clusterfit.backends.agent import AGENT_MODULE
from clusterfit.backends.warm_start import (
    READY_LINE,
    WARM_START_ENV,
    AgentRequest,
    WarmStartUnavailable,
    load_time_differences,
    own_umask,
    process_context,
    runs_the_agent,
    start_agent,
    why_cold,
)
from clusterfit.service.migrate import open_store


def test_variables_read_while_starting_must_match_and_the_rest_may_differ() -> None:
    own = {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/src"}
    same_start = {**own, "PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "CLUSTERFIT_FAULT": "x", "HOME": "/job"}
    assert load_time_differences(same_start, own) == []  # threads are set after the fork; the rest is read later
    other = {**same_start, "OMP_WAIT_POLICY": "ACTIVE", "LD_PRELOAD": "/lib/x.so", "TORCH_LOGS": "dynamo"}
    del other["PYTHONPATH"]
    assert load_time_differences(other, own) == ["LD_PRELOAD", "OMP_WAIT_POLICY", "PYTHONPATH", "TORCH_LOGS"]

    agent = AgentRequest([sys.executable, "-m", AGENT_MODULE, "--standalone"], own, "/", 0o022, [0])
    context = process_context()
    assert process_context(os.getpid()) == context  # as the warm start reads its launcher's
    assert why_cold(agent, context, own, context) is None
    another_python = AgentRequest(["/usr/bin/python3", *agent.command[1:]], own, "/", 0o022, [0])
    assert "not this Python's agent" in why_cold(another_python, context, own, context)
    other_env = AgentRequest(agent.command, {**own, "OMP_WAIT_POLICY": "x"}, "/", 0, [0])
    assert "OMP_WAIT_POLICY differs from" in why_cold(other_env, context, own, context)
    limited = {**context, "RLIMIT_NOFILE": "(64, 64)", "cgroup": "0::/limited\n"}
    assert why_cold(agent, limited, own, context) == (
        "the launcher's RLIMIT_NOFILE, cgroup differ from the warm-start process's"
    )
    # A nicer launcher's (a Ray actor's: 15) agent takes its niceness; a less nice one's cannot, unprivileged.
    assert why_cold(agent, {**context, "niceness": "15"}, own, {**context, "niceness": "0"}) is None
    assert why_cold(agent, context, own, {**context, "niceness": "19"}) == (
        f"the launcher's niceness {context['niceness']} is below the warm-start process's 19"
    )


def test_another_name_of_the_same_python_in_its_folder_runs_the_agent(tmp_path: Path) -> None:
    """`python3` and `python` of one virtual environment are one interpreter (a console script names the first,
    the tests the second); the same binary linked from another folder is another environment's."""
    interpreter = Path(sys.executable).resolve()
    venv, other = tmp_path / "venv" / "bin", tmp_path / "other" / "bin"
    for folder in (venv, other):
        folder.mkdir(parents=True)
        (folder / "python3").symlink_to(interpreter)
    (venv / "python").symlink_to("python3")
    assert runs_the_agent([str(venv / "python3"), "-m", AGENT_MODULE, "--standalone"], str(venv / "python"))
    assert not runs_the_agent([str(other / "python3"), "-m", AGENT_MODULE], str(venv / "python"))
    assert not runs_the_agent(["python3", "-m", AGENT_MODULE], "python3")  # found on PATH: maybe another
    assert not runs_the_agent([str(venv / "python"), "-m", "clusterfit.worker"], str(venv / "python"))


@pytest.fixture
def own_warm_start(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A warm-start process of the test's own, to stop or kill."""
    socket_path = tmp_path / "private" / "agents.sock"
    process = subprocess.Popen(
        cli_command("warm-start", "--socket", str(socket_path)), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().startswith(READY_LINE)
    yield process, socket_path
    if process.poll() is None:
        process.kill()
        process.wait()


def _paced_job(tmp_path: Path, socket_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A 2-rank job through the given warm start, paced to run for about 10 s, once it has a checkpoint."""
    out = tmp_path / "out"
    job = tiny_job(out, steps_per_epoch=40, checkpoint={"every_steps": 2, "keep": 2, "min_interval_s": 0})
    job["environment_variables"] = {"CLUSTERFIT_FAULT": "slow:rank=0:step=1:seconds=0.25"}
    env = {**os.environ, WARM_START_ENV: str(socket_path), "COLUMNS": "200"}
    launcher = subprocess.Popen(
        cli_command("run", str(write_job(tmp_path / "job.yaml", job))),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_first_checkpoint(out, launcher)
    return launcher, out


def test_a_stopped_warm_start_takes_no_more_jobs_and_ends_after_its_last_one(
    tmp_path: Path, own_warm_start: tuple[subprocess.Popen[str], Path]
) -> None:
    """SIGTERM: the socket goes at once (a new job would start cold), the running job trains to its end,
    and the process ends with it."""
    process, socket_path = own_warm_start
    launcher, out = _paced_job(tmp_path, socket_path)
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: not socket_path.exists(), 5, "the socket to be removed")
    with pytest.raises(WarmStartUnavailable, match="no warm start at"), open(os.devnull, "w") as log:
        start_agent(str(socket_path), AgentRequest([sys.executable], {}, "/", 0o022, [0]), log)
    assert process.poll() is None, "it must wait for the job it started"
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-3000:]
    assert (out / "model" / "model.safetensors").exists()
    assert process.wait(30) == 0


def test_a_killed_warm_start_stops_its_jobs_which_resume_from_their_checkpoint(
    tmp_path: Path, own_warm_start: tuple[subprocess.Popen[str], Path]
) -> None:
    """SIGKILL: the agents' exit codes are lost with it, so their launchers stop the jobs, leaving nothing
    running, and a rerun (cold: the warm start is gone) resumes from the last checkpoint."""
    process, socket_path = own_warm_start
    launcher, out = _paced_job(tmp_path, socket_path)
    process.kill()
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0, output[-3000:]
    wait_for(lambda: not processes_mentioning(str(out)), 30, "the job's processes to end")
    assert not (out / "model").exists()
    rerun = run_cli("run", str(tmp_path / "job.yaml"), env={**os.environ, WARM_START_ENV: str(socket_path)})
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming from" in rerun.stdout
    assert "no warm start at" in (out / "logs" / "agent.log").read_text()


def test_an_agent_ends_with_its_warm_start_while_its_launcher_looks_away(
    tmp_path: Path, own_warm_start: tuple[subprocess.Popen[str], Path]
) -> None:
    """A lost Ray node loses its warm start and the job's actor at once: then no launcher is left to stop the
    agent, and the kernel does (its parent-death signal), as it stops a cold agent whose launcher died. Here
    the launcher (this test) holds its connection and never reads it."""
    process, socket_path = own_warm_start
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(600)\n")
    command = [sys.executable, "-m", AGENT_MODULE, "--standalone", "--nproc-per-node=1", str(script)]
    cpus = sorted(os.sched_getaffinity(0))
    request = AgentRequest(command, dict(os.environ), str(tmp_path), own_umask(), cpus)
    with open(tmp_path / "agent.log", "w") as log:
        agent = start_agent(str(socket_path), request, log)
    forked = psutil.Process(agent.pid)
    assert forked.ppid() == process.pid
    worker = wait_for(lambda: forked.children(), 60, "the agent's worker")[0]
    process.kill()
    gone, alive = psutil.wait_procs([forked, worker], timeout=30)
    assert not alive, (tmp_path / "agent.log").read_text()[-3000:]
    assert agent.wait(10) == -signal.SIGTERM  # the connection closed: the launcher learns it was stopped


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to try as another account")
def test_only_its_own_account_may_connect(warm_start) -> None:  # noqa: ANN001 - conftest's WarmStart
    """The socket and its folder are the account's alone: a job's environment, secrets included, goes through."""
    assert warm_start.socket.stat().st_mode & 0o777 == 0o600
    assert warm_start.socket.parent.stat().st_mode & 0o077 == 0
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('refused')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(warm_start.socket)], capture_output=True, text=True)
    assert result.stdout.strip() == "refused", result.stdout + result.stderr


# A launcher that claims the warm start's own context in its request (the request's format, written out by hand).
CLAIMING_PROBE = """
import json, os, socket, struct, sys
from clusterfit.backends.agent import AGENT_MODULE
from clusterfit.backends.warm_start import process_context
socket_path, warm_start_pid = sys.argv[1], int(sys.argv[2])
claimed = process_context(warm_start_pid)
command = [sys.executable, "-m", AGENT_MODULE, "--no-such-flag"]
body = json.dumps({"command": command, "env": dict(os.environ), "cwd": "/", "umask": 0o022, "cpus": [0],
                   "context": claimed}).encode()
connection = socket.socket(socket.AF_UNIX)
connection.connect(socket_path)
with open(os.devnull, "w") as log:
    socket.send_fds(connection, [struct.pack("!I", len(body))], [log.fileno()])
connection.sendall(body)
print(connection.makefile().readline().strip())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a mount namespace")
def test_a_launcher_in_a_namespace_of_its_own_starts_cold_whatever_its_request_claims(warm_start) -> None:  # noqa: ANN001
    """The launcher's namespaces, cgroup and limits are read from its process (the socket names its pid), not
    taken from its request: a confined job's process that claims the warm start's own would otherwise have an
    agent forked outside its confinement."""
    probe = subprocess.run(
        ["unshare", "--mount", sys.executable, "-c", CLAIMING_PROBE, str(warm_start.socket), str(warm_start.pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    answer = json.loads(probe.stdout)
    assert answer == {"cold": "the launcher's mnt namespace differs from the warm-start process's"}, answer


def test_a_socket_path_it_must_not_take_is_refused_in_one_line(tmp_path: Path, warm_start) -> None:  # noqa: ANN001
    """A file of the user's is never deleted to make room, and a running warm start is never taken over."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    notes = private / "notes.txt"
    notes.write_text("mine\n")
    result = run_cli("warm-start", "--socket", str(notes), timeout=60)
    assert result.returncode == 2 and notes.read_text() == "mine\n"
    refusal = result.stderr.strip().splitlines()[-1]
    assert refusal == f"error: {notes}: exists and is not a socket (kept); pick another --socket", result.stderr
    result = run_cli("warm-start", "--socket", str(warm_start.socket), timeout=60)
    assert result.returncode == 2
    assert "another warm-start process listens there" in result.stderr.strip().splitlines()[-1], result.stderr
    # Still answering: asked for another Python's agent, it says why not.
    with open(os.devnull, "w") as log, pytest.raises(WarmStartUnavailable, match="not this Python's agent"):
        start_agent(str(warm_start.socket), AgentRequest(["/bin/true"], {}, "/", 0o022, [0]), log)


def test_a_socket_in_a_shared_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    result = run_cli("warm-start", "--socket", str(shared / "agents.sock"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {shared}: not a private folder of this account; pick --socket in one that is"
    ), result.stderr


def test_a_server_with_warm_start_forks_its_jobs_agents_from_its_own(tmp_path: Path) -> None:
    """`clusterfit server --warm-start` runs a warm start of its own beside it, whatever its environment names
    (here: none), and the agent of a job it runs is forked from it; stopped, the server stops it too."""
    out = tmp_path / "out"
    job = tiny_job(out, steps_per_epoch=20)
    job["environment_variables"] = {"CLUSTERFIT_FAULT": "slow:rank=0:step=1:seconds=0.25"}  # about 5 s
    with ServerProcess("--warm-start", env={WARM_START_ENV: ""}) as server:
        assert server.process is not None
        [own] = [p for p in psutil.Process(server.process.pid).children() if "warm-start" in p.cmdline()]
        token = ["--server", server.url, "--token", make_token("submit")]
        submitted = run_cli("submit", str(write_job(tmp_path / "job.yaml", job)), *token)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        rank0 = out / "logs" / "rank-0.log"
        wait_for(lambda: rank0.exists() and " step " in rank0.read_text(), 120, "the job to train")
        parent_of_titled = {
            p.pid: p.info["ppid"]
            for p in psutil.process_iter(["cmdline", "ppid"])
            if AGENT_MODULE in (line := " ".join(p.info["cmdline"] or [])) and str(out) in line
        }
        # The agent's own children show its command line until they retitle themselves: the agent is the one
        # whose parent does not.
        assert [ppid for ppid in parent_of_titled.values() if ppid not in parent_of_titled] == [own.pid]
        ended = ("SUCCEEDED", "FAILED", "CANCELLED")
        state = wait_for(lambda: (s := open_store().get(job_id).state) in ended and s, 120, "the job's end")
        assert state == "SUCCEEDED", run_cli("status", job_id, *token).stdout
        assert "started cold" not in (out / "logs" / "agent.log").read_text()
    own.wait(30)  # raises unless it ended with the server (not its child: no exit code to read)
    assert f"export {WARM_START_ENV}" not in "".join(server.output), "the server sets it; nobody need export it"

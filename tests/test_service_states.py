"""The job service's pure decisions: state transitions, retries, and failure causes from evidence or errors."""

from __future__ import annotations

import json
import pickle
import socket
from pathlib import Path

import pytest
from conftest import tiny_job

from clusterfit.backends.kubernetes import api_refusal
from clusterfit.backends.slurm import sbatch_refusal
from clusterfit.data.staging import StagingError
from clusterfit.errors import ClusterfitError, DataError, EngineError, SpecError
from clusterfit.outputs import JobOutputs, Phase, RankBeat, write_heartbeat
from clusterfit.outputs.logs import rank_process_exit_line
from clusterfit.service.causes import (
    Evidence,
    RankException,
    classify,
    failure_for_error,
    fatal_in_logs,
    gather_evidence,
)
from clusterfit.service.outputs_claim import OutputsInUse
from clusterfit.service.states import (
    Decision,
    FailureCause,
    IllegalTransition,
    JobState,
    check_transition,
    decide_after_failure,
)
from clusterfit.spec import JobSpec, validate_spec

Q, ST, R, RT, OK, F, C = (
    JobState.QUEUED,
    JobState.STAGING,
    JobState.RUNNING,
    JobState.RETRYING,
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.CANCELLED,
)
ALLOWED = {
    (Q, ST), (Q, F), (Q, C),
    (ST, R), (ST, RT), (ST, F), (ST, C),
    (R, OK), (R, RT), (R, F), (R, C),
    (RT, ST), (RT, F), (RT, C),
}  # fmt: skip


@pytest.mark.parametrize("current", list(JobState))
@pytest.mark.parametrize("target", list(JobState))
def test_every_transition_is_allowed_or_refused_as_the_table_says(current: JobState, target: JobState) -> None:
    if (current, target) in ALLOWED:
        assert check_transition(current, target) is target
    else:
        with pytest.raises(IllegalTransition, match=f"a {current.value} job cannot become {target.value}"):
            check_transition(current, target)


def test_terminal_and_active_states() -> None:
    assert {state for state in JobState if state.is_terminal} == {OK, F, C}
    assert {state for state in JobState if state.is_active} == {ST, R, RT}


@pytest.mark.parametrize(
    ("cause", "attempt", "max_retries", "decision"),
    [
        (FailureCause.EXCEPTION, 1, 0, Decision.FAIL),
        (FailureCause.EXCEPTION, 1, 1, Decision.RETRY),
        (FailureCause.EXCEPTION, 2, 1, Decision.FAIL),
        (FailureCause.HANG, 2, 3, Decision.RETRY),
        (FailureCause.OOM, 1, 2, Decision.RETRY),
        (FailureCause.NODE_LOST, 2, 2, Decision.RETRY),
        (FailureCause.NODE_LOST, 3, 2, Decision.FAIL),
        (FailureCause.CANCELLED, 1, 5, Decision.FAIL),
        (FailureCause.BAD_SPEC, 1, 5, Decision.FAIL),
        (FailureCause.ENGINE, 1, 5, Decision.FAIL),
        (FailureCause.UNAVAILABLE, 1, 0, Decision.FAIL),
        (FailureCause.UNAVAILABLE, 1, 1, Decision.RETRY),
        (FailureCause.UNAVAILABLE, 2, 1, Decision.FAIL),
    ],
)
def test_retry_decisions(cause: FailureCause, attempt: int, max_retries: int, decision: Decision) -> None:
    assert decide_after_failure(cause, attempt, max_retries).decision is decision


@pytest.mark.parametrize(
    ("cause", "attempt", "pause_s"),
    [
        (FailureCause.UNAVAILABLE, 1, 5.0),
        (FailureCause.UNAVAILABLE, 2, 10.0),
        (FailureCause.UNAVAILABLE, 9, 30.0),  # the longest pause
        (FailureCause.EXCEPTION, 1, 0.0),
        (FailureCause.NODE_LOST, 2, 0.0),
    ],
)
def test_only_an_unavailable_engine_or_store_is_waited_for_before_the_next_attempt(
    cause: FailureCause, attempt: int, pause_s: float
) -> None:
    decision = decide_after_failure(cause, attempt, max_retries=10)
    assert decision.decision is Decision.RETRY and decision.pause_s == pause_s
    assert decision.reason.endswith(f"retrying from the last checkpoint in {pause_s:g} s" if pause_s else "checkpoint")


def _slurm_spec() -> JobSpec:
    job = tiny_job(Path("/shared/runs/tiny"))
    job["resources"] = {"backend": "slurm", "slurm": {"partition": "nope"}}
    return validate_spec(job)


def _sbatch(message: str) -> EngineError:
    return sbatch_refusal(f"sbatch: error: Batch job submission failed: {message}\n", _slurm_spec())


ERRORS = [
    pytest.param(SpecError("job.yaml: trainer.epochs = 0: ..."), FailureCause.BAD_SPEC, Decision.FAIL, id="spec"),
    pytest.param(
        OutputsInUse("outputs.dir /x is in use by job a1"), FailureCause.BAD_SPEC, Decision.FAIL, id="outputs"
    ),
    pytest.param(
        DataError("trainer.data.train = '/d': no such folder", retryable=False),
        FailureCause.BAD_SPEC,
        Decision.FAIL,
        id="data-missing",
    ),
    pytest.param(
        StagingError("trainer.data.train = 'az://c/d': cannot reach the storage service", retryable=True),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="store-unreachable",
    ),
    pytest.param(
        _sbatch("Unable to contact slurm controller (connect failure)"),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="slurm-controller-down",
    ),
    pytest.param(
        _sbatch("Socket timed out on send/recv operation"), FailureCause.UNAVAILABLE, Decision.RETRY, id="slurm-timeout"
    ),
    pytest.param(
        _sbatch("Slurm temporarily unable to accept job, sleeping and retrying"),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="slurm-busy",
    ),
    pytest.param(
        _sbatch("Invalid partition name specified"), FailureCause.ENGINE, Decision.FAIL, id="slurm-bad-partition"
    ),
    pytest.param(
        _sbatch("Invalid account or account/partition combination specified"),
        FailureCause.ENGINE,
        Decision.FAIL,
        id="slurm-bad-account",
    ),
    pytest.param(
        api_refusal(503, "Service Unavailable", "", "tiny", "default"),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="k8s-503",
    ),
    pytest.param(
        api_refusal(429, "Too Many Requests", "", "tiny", "default"),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="k8s-429",
    ),
    pytest.param(
        api_refusal(422, "Unprocessable Entity", '{"message": "spec.x: Invalid value"}', "tiny", "default"),
        FailureCause.ENGINE,
        Decision.FAIL,
        id="k8s-422",
    ),
    pytest.param(api_refusal(403, "Forbidden", "", "tiny", "team-a"), FailureCause.ENGINE, Decision.FAIL, id="k8s-403"),
    pytest.param(
        EngineError("resources.ray_address = 'head:6379': no Ray cluster answers there", retryable=True),
        FailureCause.UNAVAILABLE,
        Decision.RETRY,
        id="ray-unreachable",
    ),
    pytest.param(FileNotFoundError(2, "No such file"), FailureCause.ENGINE, Decision.FAIL, id="unforeseen"),
]


@pytest.mark.parametrize(("error", "cause", "decision"), ERRORS)
def test_an_error_before_any_worker_maps_to_its_cause_and_retry_decision(
    error: Exception, cause: FailureCause, decision: Decision
) -> None:
    failure = failure_for_error(error)
    assert failure.cause is cause and cause.before_any_worker
    assert failure.summary == str(error) and "\n" not in failure.summary
    assert decide_after_failure(failure.cause, attempt=1, max_retries=3).decision is decision


def test_an_engines_error_is_named_after_the_engine_but_a_spec_mistake_is_not() -> None:
    engine = EngineError("sbatch refused the job (x)", retryable=False)
    assert failure_for_error(engine, "slurm").summary == "slurm: sbatch refused the job (x)"
    assert failure_for_error(SpecError("environment_variables.X = 'y': ..."), "ray").summary.startswith("environment")


def test_one_line_with_the_fix_for_engine_refusals() -> None:
    assert str(_sbatch("Invalid partition name specified")) == (
        "resources.slurm.partition = 'nope': sbatch refused it (Invalid partition name specified); "
        "give a partition that sinfo lists, or null for the cluster's default"
    )
    assert str(api_refusal(422, "Unprocessable Entity", '{"message": "spec.x:\\n  Invalid"}', "tiny", "ns")) == (
        "the Kubernetes API refused the job (422 Unprocessable Entity: spec.x: Invalid); check resources.kubernetes "
        "against the manifests `clusterfit run --dry-run` prints"
    )


@pytest.mark.parametrize(
    "error",
    [
        SpecError("bad"),
        EngineError("busy", retryable=True),
        DataError("gone", retryable=False),
        StagingError("unreachable", retryable=True),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_keeps_its_type_and_retry_decision_across_processes(error: ClusterfitError) -> None:
    """Errors are pickled between processes (a Ray actor's error reaches the launcher)."""
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.retryable) == (type(error), str(error), error.retryable)


def test_a_spec_mistake_is_still_a_value_error_and_never_retryable() -> None:
    assert isinstance(SpecError("x"), ValueError)  # callers that catch ValueError keep catching it
    assert SpecError("x").retryable is False


def _exception(rank: int, timestamp: int, message: str = "ValueError: boom") -> RankException:
    return RankException(rank, message, ('  File "train.py", line 3, in step', message), timestamp)


@pytest.mark.parametrize(
    ("evidence", "cause", "summary_has"),
    [
        pytest.param(
            Evidence(exit_code=1, exceptions=(_exception(1, 10), _exception(0, 12, "RuntimeError: later"))),
            FailureCause.EXCEPTION,
            "rank 1: ValueError: boom",
            id="first-exception-is-the-root-cause",
        ),
        pytest.param(
            Evidence(exit_code=1, rank_exits={1: -9}, oom_kills=1),
            FailureCause.OOM,
            "rank 1 killed by the kernel's OOM killer",
            id="sigkill-with-an-oom-kill",
        ),
        pytest.param(
            Evidence(
                exit_code=1, rank_exits={1: -9}, oom_kills=1, rank_pids={1: 123}, oom_killed_pids=frozenset({123})
            ),
            FailureCause.OOM,
            "rank 1 killed by the kernel's OOM killer",
            id="sigkill-the-kernel-log-names-this-pid",
        ),
        pytest.param(
            Evidence(exit_code=1, rank_exits={1: -9}, oom_kills=1, rank_pids={1: 123}, oom_killed_pids=frozenset({77})),
            FailureCause.SIGNAL,
            "rank 1 killed by SIGKILL (signal 9)",
            id="sigkill-while-another-process-on-the-node-was-oom-killed",
        ),
        pytest.param(
            Evidence(exit_code=1, rank_exits={0: 1, 1: -9}),
            FailureCause.SIGNAL,
            "rank 1 killed by SIGKILL (signal 9) (by another process or the OOM killer",
            id="sigkill-without-oom",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 1, "RuntimeError: Connection reset by peer"),),
                rank_exits={0: 1, 1: -9},
                root_rank=1,
            ),
            FailureCause.SIGNAL,
            "rank 1 killed by SIGKILL",
            id="a-killed-root-cause-beats-its-peers-exceptions",
        ),
        pytest.param(
            Evidence(exit_code=1, rank_exits={0: -15}),
            FailureCause.SIGNAL,
            "rank 0 killed by SIGTERM (signal 15)",
            id="sigterm",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(
                    _exception(0, 1, "RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error"),
                ),
                log_tails={
                    0: (
                        "ERROR: Unexpected bus error encountered in worker. This might be caused by "
                        "insufficient shared memory (shm).",
                    )
                },
            ),
            FailureCause.SHM,
            "rank 0: out of shared memory (/dev/shm)",
            id="shared-memory",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 1, "OSError: [Errno 28] No space left on device"),),
                log_tails={
                    0: (
                        '  File "/usr/lib/python3.11/multiprocessing/synchronize.py", line 57, in __init__',
                        "    sl = self._semlock = _multiprocessing.SemLock(",
                        "OSError: [Errno 28] No space left on device",
                    )
                },
            ),
            FailureCause.SHM,
            "rank 0: out of shared memory (/dev/shm)",
            id="shared-memory-semaphores",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 1, "OSError: [Errno 28] No space left on device"),),
                log_tails={
                    0: (
                        '  File "/usr/lib/python3.11/shutil.py", line 200, in _copyfileobj',
                        "OSError: [Errno 28] No space left on device",
                    )
                },
            ),
            FailureCause.EXCEPTION,
            "rank 0: OSError: [Errno 28] No space left on device",
            id="a-full-disk-is-not-shared-memory",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(1, 1, "DistBackendError: timeout"),),
                log_tails={
                    1: (
                        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                        "Timed out waiting 1800000ms for recv operation to complete",
                    )
                },
            ),
            FailureCause.COLLECTIVE_TIMEOUT,
            "rank 1: a collective timed out",
            id="gloo-timeout",
        ),
        pytest.param(
            Evidence(exit_code=1, agent_tail=("torch.distributed.elastic.rendezvous.api.RendezvousClosedError",)),
            FailureCause.NODE_LOST,
            "a node left the rendezvous",
            id="rendezvous-closed",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                agent_tail=(
                    "RuntimeError: The server socket has failed to listen on any local network address. port: 29400, "
                    "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
                    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
                    "store has failed. See inner exception for details.",
                ),
            ),
            FailureCause.UNAVAILABLE,
            "the rendezvous port 29400 was taken by another process before the job's agent could bind it; "
            "a retry picks another port",
            id="rendezvous-port-taken",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(
                    _exception(
                        0,
                        10,
                        "DistNetworkError: The server socket has failed to listen on any local network "
                        "address. port: 37021, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
                        "already in use",
                    ),
                ),
                rank_exits={0: 1},
                root_rank=0,
            ),
            FailureCause.UNAVAILABLE,
            "rank 0: its store's port 37021 was taken by another process before it could bind it; a retry picks "
            "another port",
            id="rank-0-store-port-taken",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 10, "OSError: [Errno 98] Address already in use"),),
                rank_exits={0: 1},
                root_rank=0,
            ),
            FailureCause.EXCEPTION,
            "rank 0: OSError: [Errno 98] Address already in use",
            id="a-program-s-own-server-port-taken-is-its-exception",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 10, "RuntimeError: [pair.cc:561] Connection closed by peer [::1]:1962"),),
                rank_exits={0: 1},
                root_rank=0,
                oom_kills=1,
                rank_pids={0: 50, 1: 123},
                oom_killed_pids=frozenset({123}),
            ),
            FailureCause.OOM,
            "rank 1 killed by the kernel's OOM killer",
            id="oom-killed-rank-missing-from-the-agent-s-summary",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(
                    _exception(0, 10, "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:35204"),
                    _exception(1, 10, "InjectedFault: injected failure on rank 1 after step 2"),
                ),
                rank_exits={0: 1},
                root_rank=0,
            ),
            FailureCause.EXCEPTION,
            "rank 1: InjectedFault: injected failure on rank 1 after step 2",
            id="the-raising-rank-not-its-peer-that-exited-first",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 10, "RuntimeError: [pair.cc:545] Read error: Connection reset by peer."),),
                rank_exits={0: 1},
                root_rank=0,
                log_tails={0: ("RuntimeError: Connection reset by peer",), 1: ("[rank1] epoch 1 step 3",)},
            ),
            FailureCause.SIGNAL,
            "rank 1 killed by a signal",
            id="a-killed-rank-missing-from-the-agent-s-summary-of-forked-ranks",
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                exceptions=(_exception(0, 10, "RuntimeError: Connection reset by peer"),),
                rank_exits={0: 1},
                root_rank=0,
                stopped_by_agent=frozenset({1}),
                log_tails={0: ("RuntimeError: Connection reset by peer",), 1: ("[rank1] epoch 1 step 3",)},
            ),
            FailureCause.EXCEPTION,
            "rank 0: RuntimeError: Connection reset by peer",
            id="a-rank-the-agent-stopped-did-not-vanish",
        ),
        pytest.param(
            Evidence(exit_code=1, rank_exits={1: 3}, log_tails={1: ("last words",)}),
            FailureCause.EXIT_CODE,
            "rank 1 exited with code 3",
            id="plain-exit-code",
        ),
        pytest.param(
            Evidence(exit_code=-9), FailureCause.SIGNAL, "the job's agent was killed by SIGKILL", id="agent-killed"
        ),
        pytest.param(
            Evidence(
                exit_code=1,
                agent_tail=("json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)",),
                oom_kills=1,
                rank_pids={0: 50, 1: 123},
                oom_killed_pids=frozenset({123}),
            ),
            FailureCause.OOM,
            "rank 1 killed by the kernel's OOM killer",
            id="the-agent-failed-without-its-summary-after-an-oom-kill-of-a-rank",
        ),
        pytest.param(
            Evidence(exit_code=1, oom_kills=1, rank_pids={0: 50, 1: 123}, oom_killed_pids=frozenset({77})),
            FailureCause.EXIT_CODE,
            "the job exited with code 1",
            id="the-agent-failed-while-another-process-was-oom-killed",
        ),
    ],
)
def test_failure_causes_from_evidence(evidence: Evidence, cause: FailureCause, summary_has: str) -> None:
    failure = classify(evidence)
    assert failure.cause is cause
    assert summary_has in failure.summary


def test_an_exception_carries_its_traceback_tail() -> None:
    failure = classify(Evidence(exit_code=1, exceptions=(_exception(1, 10),)))
    assert 'File "train.py", line 3, in step' in failure.detail


AGENT_SUMMARY = """\
Failures:
[1]:
  time      : 2026-11-22_02:44:50
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 22249)
  error_file: /x/logs/rank-0.error.json
  traceback : Traceback (most recent call last):
  RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer.
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:44:50
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 22250)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 22250
============================================================
"""


# What a second node's agent prints after the first node's rank was killed: its own rank failed "because of"
# that, later; it names itself as its root cause.
PEER_SUMMARY = """\
============================================================
clusterfit.worker FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:44:51
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7757)
  error_file: /x/logs/rank-0.error.json
  traceback : Traceback (most recent call last):
  RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:12203: Connection reset by peer.
============================================================
"""


def test_a_killed_forked_rank_left_out_of_torchruns_summary_is_named_with_its_signal(tmp_path: Path) -> None:
    """The summary of forked ranks names rank 0's lost peer alone ("<NO_OTHER_FAILURES>"); the agent's line for
    each rank process, matched to its rank by the pid in its heartbeat, names rank 1's SIGKILL."""
    outputs = JobOutputs(tmp_path)
    outputs.logs.mkdir()
    host = socket.gethostname()
    exits = [rank_process_exit_line(7757, host, 1), rank_process_exit_line(7758, host, -9)]
    (outputs.logs / "agent.log").write_text("\n".join([*exits, PEER_SUMMARY]))
    (outputs.logs / "rank-0.error.json").write_text(
        json.dumps({"message": {"message": "RuntimeError: Read error: Connection reset by peer.", "extraInfo": {}}})
    )
    for rank, pid in [(0, 7757), (1, 7758)]:
        write_heartbeat(outputs, RankBeat(rank, Phase.TRAINING.value, 3, 0.0, None, pid, host, 1))
    evidence = gather_evidence(outputs, 2, exit_code=1)
    assert evidence.rank_exits == {0: 1, 1: -9} and evidence.rank_pids == {0: 7757, 1: 7758}
    assert classify(evidence).summary.startswith("rank 1 killed by SIGKILL (signal 9)")
    # The agent ending rank 1 after rank 0 failed of its own: rank 1's SIGTERM is never the cause.
    terminated = "W1128 01:50:50.050000 2608 spawn.py:165] Terminating process 7758 via signal SIGTERM"
    stopped = [terminated, rank_process_exit_line(7757, host, 1), rank_process_exit_line(7758, host, -15)]
    (outputs.logs / "agent.log").write_text("\n".join([*stopped, PEER_SUMMARY]))
    (outputs.logs / "rank-0.error.json").write_text(
        json.dumps({"message": {"message": "ValueError: a bad batch", "extraInfo": {}}})
    )
    evidence = gather_evidence(outputs, 2, exit_code=1)
    assert evidence.rank_exits == {0: 1, 1: -15} and evidence.stopped_by_agent == {1}
    assert classify(evidence).summary == "rank 0: ValueError: a bad batch"
    # Another node's process with the same pid is not this rank's.
    (outputs.logs / "agent.log").write_text("\n".join([rank_process_exit_line(7758, "another-node", -9), PEER_SUMMARY]))
    assert gather_evidence(outputs, 2, exit_code=1).rank_exits == {0: 1}


def test_with_several_agents_the_first_summary_written_names_the_root_cause(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    (logs / "agent.log").write_text(AGENT_SUMMARY + PEER_SUMMARY)
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1)
    assert evidence.root_rank == 1 and evidence.rank_exits == {0: 1, 1: -9}
    assert classify(evidence).summary.startswith("rank 1 killed by SIGKILL (signal 9)")


def test_a_killed_rank_beats_a_peers_connection_reset_even_when_reported_second(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    (logs / "agent.log").write_text(PEER_SUMMARY + AGENT_SUMMARY)
    (logs / "rank-0.error.json").write_text(
        json.dumps({"message": {"message": "RuntimeError: Read error: Connection reset by peer.", "extraInfo": {}}})
    )
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1)
    assert evidence.root_rank == 0 and len(evidence.exceptions) == 1
    assert classify(evidence).summary.startswith("rank 1 killed by SIGKILL (signal 9)")


def test_an_earlier_attempts_summary_is_not_evidence(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    earlier = AGENT_SUMMARY.replace("exitcode  : -9 (pid: 22250)  (SIGKILL)", "exitcode  : -15 (pid: 22250)")
    (logs / "agent.log").write_text(earlier)
    start = (logs / "agent.log").stat().st_size
    with open(logs / "agent.log", "a") as log:
        log.write(PEER_SUMMARY)
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1, agent_log_start=start)
    assert evidence.root_rank == 0 and evidence.rank_exits == {0: 1}


def test_torchruns_failure_summary_is_read_with_its_root_cause(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    (logs / "agent.log").write_text(AGENT_SUMMARY)
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1)
    assert evidence.rank_exits == {0: 1, 1: -9}
    assert evidence.root_rank == 1
    assert classify(evidence).summary.startswith("rank 1 killed by SIGKILL (signal 9)")


# What the agent printed in CI after rank 1 was SIGKILLed: it stopped rank 0 itself, and since rank 0's "connection
# reset" error file is older than the moment the agent noticed rank 1, torchrun named rank 0 the root cause.
AGENT_STOPPED_THE_PEER = """\
W1123 18:50:50.050000 2608 api.py:1028] Sending process 2617 closing signal SIGTERM
E1123 18:50:50.166000 2608 api.py:1002] failed (exitcode: -15) local_rank: 0 (pid: 2617) of binary: python
Failures:
[0]:
  time      : 2026-11-23_18:50:50
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 2618)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 2618
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-23_18:50:49
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 2617)  (SIGTERM)
  error_file: /x/logs/rank-0.error.json
  traceback : RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer.
============================================================
"""


def test_a_rank_the_agent_stopped_itself_is_never_the_cause(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    (logs / "agent.log").write_text(AGENT_STOPPED_THE_PEER)
    (logs / "rank-0.error.json").write_text(
        json.dumps({"message": {"message": "RuntimeError: Read error: Connection reset by peer.", "extraInfo": {}}})
    )
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1)
    assert evidence.root_rank == 0 and evidence.stopped_by_agent == {0}
    assert classify(evidence).summary.startswith("rank 1 killed by SIGKILL (signal 9)")


def test_when_the_agent_stopped_every_rank_they_are_still_named() -> None:
    evidence = Evidence(exit_code=-15, rank_exits={0: -15, 1: -15}, root_rank=0, stopped_by_agent=frozenset({0, 1}))
    assert classify(evidence).summary == "rank 0 killed by SIGTERM (signal 15)"


def test_a_full_shm_in_a_running_ranks_log_dooms_the_job_at_once(tmp_path: Path) -> None:
    """The DataLoader's queue feeder thread prints the error and drops the batch: the rank itself never fails."""
    outputs = JobOutputs(tmp_path)
    outputs.logs.mkdir()
    outputs.rank_log(0).write_text("12:00:01 epoch 1/1 step 2/8 loss 2.3\n")
    outputs.rank_log(1).write_text("12:00:01 epoch 1/1 step 2/8 loss 2.3\n")
    assert fatal_in_logs(outputs, 2) is None
    with open(outputs.rank_log(1), "a") as log:
        log.write(
            '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 244, in _feed\n'
            "RuntimeError: unable to allocate shared memory(shm) for file </t_1>: No space left on device (28)\n"
        )
    failure = fatal_in_logs(outputs, 2)
    assert failure is not None and failure.cause is FailureCause.SHM and failure.summary.startswith("rank 1: out of")


# After `sh -c "python train.py && ..."` saw its python SIGKILLed on rank 1: the shell exited 137, and the agent
# stopped rank 0 (before, the summary blamed rank 0's -15).
AGENT_STOPPED_THE_PEER_OF_A_SHELL = """\
W1125 14:26:36.216000 18794 api.py:1028] Sending process 18798 closing signal SIGTERM
E1125 14:26:36.218000 18794 api.py:1002] failed (exitcode: 137) local_rank: 1 (pid: 18799) of binary: python
Failures:
[1]:
  time      : 2026-11-25_14:26:36
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 18798)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 18798
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_14:26:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 137 (pid: 18799)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_shell_s_killed_program_is_named_on_its_rank_not_on_the_rank_the_agent_stopped(tmp_path: Path) -> None:
    logs = JobOutputs(tmp_path).logs
    logs.mkdir()
    (logs / "agent.log").write_text(AGENT_STOPPED_THE_PEER_OF_A_SHELL)
    evidence = gather_evidence(JobOutputs(tmp_path), 2, exit_code=1)
    assert evidence.rank_exits == {0: -15, 1: 137} and evidence.stopped_by_agent == {0}
    assert classify(evidence).summary == (
        "rank 1 exited with code 137 (128 + 9: its program was killed by SIGKILL (signal 9))"
    )


def test_without_the_agents_summary_the_ranks_pids_come_from_their_heartbeats(tmp_path: Path) -> None:
    """torchrun's agent can fail before it writes its summary; the pids of this node's ranks are still known."""
    outputs = JobOutputs(tmp_path)
    outputs.logs.mkdir()
    (outputs.logs / "agent.log").write_text("json.decoder.JSONDecodeError: Expecting value: line 1 column 1\n")
    for rank, pid, host in [(0, 50, socket.gethostname()), (1, 123, socket.gethostname()), (2, 9, "another-node")]:
        write_heartbeat(outputs, RankBeat(rank, Phase.TRAINING.value, 2, 0.0, None, pid, host, 1))
    assert gather_evidence(outputs, 2, exit_code=1).rank_pids == {0: 50, 1: 123}
    (outputs.logs / "agent.log").write_text(AGENT_SUMMARY)
    assert gather_evidence(outputs, 2, exit_code=1).rank_pids[1] == 22250, "the agent's summary, where there is one"

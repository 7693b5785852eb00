"""Why an attempt failed, in words. Evidence is gathered from files every engine leaves in the outputs
folder (torchrun's error files, the agent's log, the ranks' logs) plus the kernel's OOM-kill counter;
`classify` is a pure function of that evidence, tested without any process. An attempt stopped before any
worker started has an error instead of evidence: `failure_for_error` maps it to its cause, as purely."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from clusterfit.errors import ClusterfitError, DataError, SpecError
from clusterfit.files import read_regular, read_whole_regular
from clusterfit.outputs import JobOutputs, read_heartbeats
from clusterfit.outputs.layout import rank_error_file_name, rank_files
from clusterfit.outputs.logs import rank_logs, rank_process_exits
from clusterfit.service.states import FailureCause

_LARGEST_ERROR_FILE = 4 * 1024 * 1024  # torchrun's error file with a deep traceback is a few hundred kB

# torchrun's failure summary: "rank    : 1 (local_rank: 1)" then "exitcode  : -9 (pid: 123)", or one line
# "rank: 1 (local_rank: 1), exitcode: -9 (pid: 123)" depending on the version.
_AGENT_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank")
_AGENT_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
_AGENT_EXIT_PID = re.compile(r"exitcode\s*:\s*-?\d+\s*\(pid:\s*(\d+)\)")
# The agent stopping a rank: torchrun's subprocesses ("Sending process"), its forked ranks when one failed
# ("Terminating process") and when the agent itself stops ("Closing process").
_AGENT_CLOSED = re.compile(r"Sending process (\d+) closing signal|(?:Terminating|Closing) process (\d+) via signal")
# Enough to reach past the tracebacks that follow a first error (a DataLoader worker's error is followed by the
# rank's own traceback and its peers' "connection closed"); tail_lines reads at most 64 KiB anyway.
_TAIL_LINES = 1000
_TRACEBACK_LINES = 6

_SHM = re.compile(
    r"(/dev/shm|shared memory|unable to (write to file|allocate) .*shm|Bus error|"
    r"DataLoader worker \(pid \d+\) is killed by signal: Bus error)",
    re.IGNORECASE,
)
# multiprocessing keeps its semaphores in /dev/shm, so a full /dev/shm can also surface as ENOSPC from SemLock
# (a full disk raises ENOSPC too, but never through SemLock).
_SEMAPHORE = re.compile(r"_multiprocessing\.SemLock|multiprocessing/synchronize\.py")
_NO_SPACE = re.compile(r"No space left on device")
_COLLECTIVE_TIMEOUT = re.compile(
    r"(Watchdog caught collective operation timeout|NCCL.*timeout|Timed out waiting .*for.*(recv|send|collective)|"
    r"\[Gloo\].*[Tt]imed out|gloo.*Timed out|DistBackendError.*[Tt]imed? ?out)",
)
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe")
# The store hosting the rendezvous could not bind its port: another process took it after it was chosen.
_PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
_TAKEN_PORT = re.compile(r"port:? (\d+)")
# torch's TCPStore in a rank (rank 0's store of each round) that could not bind: not a user's own server.
_STORE_PORT_TAKEN = re.compile(r"DistNetworkError.*(EADDRINUSE|[Aa]ddress already in use)")
_RENDEZVOUS_LOST = re.compile(r"(RendezvousClosedError|RendezvousTimeoutError|RendezvousConnectionError|node .* lost)")


@dataclass(frozen=True)
class RankException:
    rank: int
    message: str
    traceback_tail: tuple[str, ...]
    timestamp: int = 0


@dataclass(frozen=True)
class Evidence:
    """What one failed attempt left behind."""

    exit_code: int | None  # the engine's (the agent's) exit code
    exceptions: tuple[RankException, ...] = ()  # from torchrun's per-rank error files, oldest first
    rank_exits: dict[int, int] = field(default_factory=dict)  # rank -> exit code, from the agent's summary
    log_tails: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> last lines of its log
    agent_tail: tuple[str, ...] = ()
    root_rank: int | None = None  # the first failure torchrun observed ("Root Cause" in its summary)
    # Ranks the agent itself terminated because another rank had failed: never a cause, even when torchrun
    # names one as its root cause (a SIGKILLed rank has no error file, so a peer's later one can look older).
    stopped_by_agent: frozenset[int] = frozenset()
    oom_kills: int = 0  # OOM kills the kernel counted on this node during the attempt
    rank_pids: dict[int, int] = field(default_factory=dict)  # rank -> pid: the agent's summary, else heartbeats
    # Pids the kernel's log says the OOM killer killed; None where that log cannot be read (no CAP_SYSLOG).
    oom_killed_pids: frozenset[int] | None = None


@dataclass(frozen=True)
class Failure:
    cause: FailureCause
    summary: str  # one line
    detail: str = ""  # e.g. the last lines of a traceback

    def text(self) -> str:
        return f"{self.summary}\n{self.detail}".rstrip()


def classify(evidence: Evidence) -> Failure:
    """The most specific cause the evidence supports; the first failing rank is the root cause."""
    for rank, lines in sorted(evidence.log_tails.items()):
        if _out_of_shared_memory(lines):
            return _shm_failure(rank)
    for rank, lines in sorted(evidence.log_tails.items()):
        hits = [line for line in lines if _COLLECTIVE_TIMEOUT.search(line)]
        if hits:
            return Failure(
                FailureCause.COLLECTIVE_TIMEOUT,
                f"rank {rank}: a collective timed out; another rank stopped taking part",
                hits[-1].strip(),
            )
    stopped = evidence.stopped_by_agent
    if stopped.issuperset(evidence.rank_exits):  # the agent stopped every rank (its own stop): blame among them
        stopped = frozenset()
    root_rank = evidence.root_rank if evidence.root_rank not in stopped else None
    root_code = evidence.rank_exits.get(root_rank) if root_rank is not None else None
    if root_code is not None and root_code < 0:  # the others' errors ("connection reset") only follow from it
        return _killed(root_rank, root_code, evidence)  # type: ignore[arg-type]
    signalled = {rank: code for rank, code in evidence.rank_exits.items() if code < 0 and rank not in stopped}
    oom_killed = [rank for rank, pid in sorted(evidence.rank_pids.items()) if pid in (evidence.oom_killed_pids or ())]
    # NOTE: torchrun's summary names the first rank exit the agent noticed, and a peer's "connection closed"
    # can come before the OOM-killed rank's exit (the kernel first frees its memory); the kernel's log names it.
    signalled = dict(sorted(({rank: -signal.SIGKILL for rank in oom_killed} | signalled).items()))
    # A peer's "connection closed" only follows from another rank's failure: what a rank raised of its own.
    own = tuple(e for e in evidence.exceptions if not _PEER_LOST.search(e.message))
    if signalled and not own:
        # Only a lost peer was raised: the killed rank is the cause, whichever agent reported first.
        return _killed(*next(iter(signalled.items())), evidence)
    if not evidence.rank_exits and oom_killed:
        # The agent ended without its summary of the ranks' exits (torchrun itself failed), but the kernel's log
        # names a rank of this job that it OOM-killed: the other ranks' errors followed from that.
        return _killed(oom_killed[0], -signal.SIGKILL, evidence)
    # NOTE: torchrun's summary of forked ranks names only the first exit its agent saw. A rank that raised
    # nothing, is missing from it and was not stopped by the agent ended before the ranks that only lost it.
    vanished = [
        rank
        for rank in sorted(evidence.log_tails)
        if rank not in evidence.rank_exits
        and rank not in evidence.stopped_by_agent
        and all(e.rank != rank for e in evidence.exceptions)
    ]
    if evidence.rank_exits and evidence.exceptions and not own and vanished:
        rank = vanished[0]
        return Failure(
            FailureCause.SIGNAL,
            f"rank {rank} killed by a signal (another process, the OOM killer), or its program ended early: it "
            "ended first with no error of its own, and the other ranks only lost it",
            _last(evidence, rank),
        )
    if evidence.exceptions:
        # The rank that lost its peer can exit first and be torchrun's root cause: the rank whose own exception
        # it was is the cause.
        raised = own or evidence.exceptions
        first = next((e for e in raised if e.rank == root_rank), raised[0])
        if _STORE_PORT_TAKEN.search(first.message):  # rank 0's store, on a port the agent chose a moment before
            port = _TAKEN_PORT.search(first.message)
            return Failure(
                FailureCause.UNAVAILABLE,
                f"rank {first.rank}: its store's port{f' {port[1]}' if port else ''} was taken by another process "
                "before it could bind it; a retry picks another port",
                first.message,
            )
        return Failure(FailureCause.EXCEPTION, f"rank {first.rank}: {first.message}", "\n".join(first.traceback_tail))
    taken = next((line for line in evidence.agent_tail if _PORT_TAKEN.search(line)), None)
    if taken is not None:
        port = _TAKEN_PORT.search(taken)
        return Failure(
            FailureCause.UNAVAILABLE,
            f"the rendezvous port{f' {port[1]}' if port else ''} was taken by another process before the job's "
            "agent could bind it; a retry picks another port",
            taken.strip(),
        )
    if any(_RENDEZVOUS_LOST.search(line) for line in evidence.agent_tail):
        return Failure(FailureCause.NODE_LOST, "a node left the rendezvous (its agent or machine is gone)")
    failed = {rank: code for rank, code in sorted(evidence.rank_exits.items()) if code != 0}
    failed = {rank: code for rank, code in failed.items() if rank not in stopped} or failed
    if failed:
        rank = root_rank if root_rank in failed else next(iter(failed))
        code = failed[rank]
        # A shell reports its program killed by signal N as 128 + N (a command job with shell syntax).
        by_shell = (
            f" (128 + {code - 128}: its program was killed by {_signal_name(code - 128)})" if 128 < code < 160 else ""
        )
        return Failure(FailureCause.EXIT_CODE, f"rank {rank} exited with code {code}{by_shell}", _last(evidence, rank))
    # No rank failed: the agent itself did (a rendezvous that never formed, a worker that could not start).
    agent_tail = "\n".join([line for line in evidence.agent_tail if line.strip()][-_TRACEBACK_LINES:])
    if evidence.exit_code is not None and evidence.exit_code < 0:
        return Failure(
            FailureCause.SIGNAL, f"the job's agent was killed by {_signal_name(-evidence.exit_code)}", agent_tail
        )
    return Failure(FailureCause.EXIT_CODE, f"the job exited with code {evidence.exit_code}", agent_tail)


def failure_for_error(error: Exception, engine: str = "") -> Failure:
    """The cause of an attempt that an error stopped before any worker started; `engine` names the engine the
    error came from, if it did.

    Any error that says a retry can help (an engine or a data store that did not answer) -> UNAVAILABLE;
    a mistake in the spec or its data -> BAD_SPEC; the engine's refusal of this job, or an error of no clusterfit
    type from an engine call that no backend foresaw -> ENGINE."""
    said = f"{engine}: {error}" if engine else str(error)
    if isinstance(error, ClusterfitError) and error.retryable:
        return Failure(FailureCause.UNAVAILABLE, said)
    if isinstance(error, (SpecError, DataError)):
        return Failure(FailureCause.BAD_SPEC, str(error))
    return Failure(FailureCause.ENGINE, said)


def fatal_in_logs(outputs: JobOutputs, world_size: int) -> Failure | None:
    """A failure the built-in trainer never recovers from, seen in a rank's log while the job still runs.

    NOTE: a DataLoader batch that does not fit in /dev/shm can fail inside multiprocessing's queue feeder thread,
    which prints the error and drops the batch: the rank then waits for it until the collective timeout (ten
    minutes by default) instead of failing. Reading it in the log ends such a job within seconds."""
    for rank, path in rank_logs(outputs.logs, world_size).items():
        if _out_of_shared_memory(tuple(tail_lines(path, _TAIL_LINES))):
            return _shm_failure(rank)
    return None


def _shm_failure(rank: int) -> Failure:
    hint = "raise the container's /dev/shm (e.g. docker --shm-size=8g) or set trainer.data.loader_workers: 0"
    return Failure(FailureCause.SHM, f"rank {rank}: out of shared memory (/dev/shm); {hint}")


def _out_of_shared_memory(lines: tuple[str, ...]) -> bool:
    if any(_SHM.search(line) for line in lines):
        return True
    return any(_SEMAPHORE.search(line) for line in lines) and any(_NO_SPACE.search(line) for line in lines)


def _killed(rank: int, code: int, evidence: Evidence) -> Failure:
    oom_kills = evidence.oom_kills
    pid = evidence.rank_pids.get(rank)
    if evidence.oom_killed_pids is not None and pid is not None:
        # NOTE: the node-wide counter also counts other jobs' OOM kills; the kernel's log names the very pid.
        # (Inside a container with its own pid namespace the pids differ, but such a container cannot read
        # the kernel's log either, and the counter decides there.)
        oom_kills = int(pid in evidence.oom_killed_pids)
    if code == -signal.SIGKILL and oom_kills > 0:
        return Failure(
            FailureCause.OOM,
            f"rank {rank} killed by the kernel's OOM killer ({oom_kills} OOM kill(s) on the node); "
            "lower trainer.batch_size or trainer.data.loader_workers, or use more memory",
        )
    who = " (by another process or the OOM killer; the kernel counted no OOM kill)" if code == -signal.SIGKILL else ""
    return Failure(FailureCause.SIGNAL, f"rank {rank} killed by {_signal_name(-code)}{who}")


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


def _last(evidence: Evidence, rank: int) -> str:
    lines = [line for line in evidence.log_tails.get(rank, ()) if line.strip()]
    return "\n".join(lines[-_TRACEBACK_LINES:])


def gather_evidence(
    outputs: JobOutputs, world_size: int, exit_code: int | None, oom_kills: int = 0, agent_log_start: int = 0
) -> Evidence:
    """`agent_log_start`: the agent log's size when the attempt began; the log is shared by every attempt and,
    on several nodes, by every node's agent."""
    log_dir = outputs.logs
    agent_lines = lines_since(outputs.agent_log, agent_log_start)
    exits, root_rank, pids = _agent_rank_exits(agent_lines)
    beats = read_heartbeats(outputs, world_size)
    # The agent's line for each forked rank's exit, whose pid a heartbeat names: every rank's, where torchrun's
    # summary has only the first. The summary's own exits stay as they are.
    process_exits = rank_process_exits(agent_lines)
    for rank, beat in beats.items():
        code = process_exits.get((beat.host, beat.pid))
        if code is not None and rank not in exits:
            exits[rank] = code
            pids[rank] = beat.pid
    # The ranks whose process the agent sent a closing signal to.
    closed_pids = {int(match[1] or match[2]) for line in agent_lines if (match := _AGENT_CLOSED.search(line))}
    stopped_by_agent = frozenset(rank for rank, pid in pids.items() if pid in closed_pids)
    if not pids:  # no summary from the agent: the pids the ranks on this node gave in their heartbeats
        host = socket.gethostname()
        pids = {rank: beat.pid for rank, beat in beats.items() if beat.host == host}
    return Evidence(
        exit_code=exit_code,
        exceptions=tuple(_exceptions(log_dir, world_size)),
        rank_exits=exits,
        root_rank=root_rank,
        stopped_by_agent=stopped_by_agent,
        log_tails={rank: tuple(tail_lines(path, _TAIL_LINES)) for rank, path in rank_logs(log_dir, world_size).items()},
        agent_tail=tuple(agent_lines[-_TAIL_LINES:]),
        oom_kills=oom_kills,
        rank_pids=pids,
        oom_killed_pids=oom_killed_pids() if oom_kills else None,
    )


def tail_lines(path: Path, count: int, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        data, _ = read_regular(path, -max_bytes)
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:]


def _exceptions(log_dir: Path, world_size: int) -> list[RankException]:
    found: list[RankException] = []
    for rank, path in rank_files(log_dir, rank_error_file_name, world_size).items():
        try:
            record = json.loads(read_whole_regular(path, _LARGEST_ERROR_FILE))["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(record, dict):
            continue
        message = " ".join(str(record.get("message", "")).split())
        extra = record.get("extraInfo", {}) or {}
        # Python 3.11+ underlines the failing expression with ^ and ~: noise in a summary.
        stack = [line for line in str(extra.get("py_callstack", "")).splitlines() if line.strip(" ^~")]
        found.append(RankException(rank, message, tuple(stack[-_TRACEBACK_LINES:]), int(extra.get("timestamp", 0))))
    return sorted(found, key=lambda e: (e.timestamp, e.rank))


def lines_since(path: Path, start: int, max_bytes: int = 1 << 20) -> list[str]:
    """The lines written from byte `start` on; at most the last `max_bytes` of them."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(start if start <= size else 0, size - max_bytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _agent_rank_exits(agent_lines: list[str]) -> tuple[dict[int, int], int | None, dict[int, int]]:
    """rank -> exit code from the failure summaries torchrun prints when workers fail, and the rank named as
    the root cause (the first failure observed) in the first summary written: with several nodes each agent
    prints its own, and a later one is a peer failing because of the first (e.g. "connection reset"). Also each
    failed rank's pid."""
    exits: dict[int, int] = {}
    pids: dict[int, int] = {}
    rank: int | None = None
    root_rank: int | None = None
    in_root_section = False
    for line in agent_lines:
        if "Root Cause" in line:
            in_root_section = root_rank is None
        elif line.startswith("====="):
            in_root_section = False
        rank_match = _AGENT_RANK.search(line)
        if rank_match:
            rank = int(rank_match.group(1))
            if in_root_section and root_rank is None:
                root_rank = rank
        exit_match = _AGENT_EXIT.search(line)
        if exit_match and rank is not None:
            exits[rank] = int(exit_match.group(1))
            pid_match = _AGENT_EXIT_PID.search(line)
            if pid_match:
                pids[rank] = int(pid_match.group(1))
            rank = None
    return exits, root_rank, pids


_KERNEL_OOM_KILL = re.compile(r"Killed process (\d+) \(")


def oom_killed_pids() -> frozenset[int] | None:
    """The pids the kernel's log (/dev/kmsg, still in its ring buffer) says the OOM killer killed; None where
    that log cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    pids = set()
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:  # the end of the buffer
                break
            except BrokenPipeError:  # a record was overwritten while reading; the next read goes on
                continue
            except OSError:  # anything else would repeat on every read: use what was read so far
                break
            if match := _KERNEL_OOM_KILL.search(record):
                pids.add(int(match.group(1)))
    finally:
        os.close(fd)
    return frozenset(pids)


def oom_kill_count() -> int:
    """The kernel's count of OOM kills on this machine since boot (0 where it cannot be read)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0

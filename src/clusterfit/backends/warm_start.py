"""Warm starts: one long-lived process on a machine imports torch, torchvision and the trainer once, and the
agents that machine starts are forked from it instead of starting as new interpreters that import them again.

A job's agent (backends/agent.py) spends about 3 s of CPU importing before it starts a rank, more than a small
job's training on 2 cores, and a sweep of short trials pays it per trial. `clusterfit warm-start` runs this
process; `clusterfit run` and the job service fork their local agents from it while CLUSTERFIT_WARM_START names
its socket, and so does each Ray node's actor (backends/ray.py) where the node runs one. It is the zygote of
Android or the daemon of Gradle and Bazel, for torchrun's agent.

The forked agent is the agent the launcher would have started: its own session and process group, the job's
environment, working folder, umask, CPU affinity and log file, its command line as `ps` shows it, then the
same `agent.main`. What cannot change after the fork starts cold, with a line in the agent log that says why:
a job whose variables read while starting (`load_time_differences`) differ from this process's, and a
launcher in another namespace, cgroup or limit (`process_context`), whose job must stay confined as its
launcher is. So does any job the socket cannot reach. The launcher keeps its connection open for the job's
life: the agent's exit code comes back over it, and a launcher that dies closes it, which stops the agent as
the kernel's parent-death signal does for a cold start; the agent also gets that signal if this process dies.

Only processes of this account may connect (the socket's folder is private, and the peer's uid is checked):
a job's environment holds its secrets."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

from clusterfit.errors import ClusterfitError
from clusterfit.processes import (
    exit_code_of,
    exit_without_teardown,
    is_running,
    kill_if_same,
    long_lived_imports,
    process_start_time,
    stop_with_parent,
)

WARM_START_ENV = "CLUSTERFIT_WARM_START"  # the socket of `clusterfit warm-start`; unset: every agent starts cold
READY_LINE = "warm start ready at "

# What the interpreter and the native libraries under torch read only while starting or loading, and which a
# forked agent would therefore keep from this process. Named variables and prefixes.
_READ_AT_START = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONHASHSEED",
        "PYTHONOPTIMIZE",
        "PYTHONWARNINGS",
        "PYTHONDEVMODE",
        "PYTHONMALLOC",
        "PYTHONNOUSERSITE",
        "PYTHONSAFEPATH",
        "PYTHONUTF8",
        "PYTHONIOENCODING",
    }
)
_READ_AT_LOAD_PREFIXES = ("LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_", "PYTORCH_")
# ... except these, which the forked agent applies itself (threads, stream buffering) or which torchrun reads
# only when it runs.
_APPLIED_AFTER_FORK = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})

_HEADER = struct.Struct("!I")  # the request's length, sent with the log file's descriptor
_LARGEST_REQUEST = 1 << 20
_REQUEST_TIMEOUT_S = 5.0


class WarmStartUnavailable(ClusterfitError):
    """The warm-start process cannot start this job's agent; the agent starts cold instead."""

    retryable = True


@dataclass(frozen=True)
class AgentRequest:
    """What the launcher sends: the agent's command as `torchrun_command` renders it, and where it runs."""

    command: list[str]
    env: dict[str, str]
    cwd: str
    umask: int
    cpus: list[int]  # the launcher's CPU affinity, which the agent takes


def default_socket_path() -> Path:
    """A socket in a folder only this account can enter: the session's runtime folder, else the temp folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(runtime) / f"clusterfit-{os.getuid()}" / "warm-start.sock"


@contextlib.contextmanager
def running_warm_start(socket_path: Path) -> Iterator[subprocess.Popen[str]]:
    """`clusterfit warm-start` at `socket_path`, started beside this process and yielded once it listens; asked
    to stop after, when it ends once the agents it started have ended. The kernel stops it too if this process
    dies (SIGTERM: the same graceful end)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "clusterfit", "warm-start", "--socket", str(socket_path), "--quiet"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=stop_with_parent,  # noqa: PLW1509 - before this process starts any thread
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # once torch, torchvision and the trainer are imported
        if not ready.startswith(READY_LINE):
            raise WarmStartUnavailable(f"clusterfit warm-start did not start at {socket_path}; its error is above")
        yield process
    finally:
        process.terminate()


def load_time_differences(job_env: Mapping[str, str], own_env: Mapping[str, str]) -> list[str]:
    """Names of the variables read while starting or loading whose value differs between a job's environment
    and this process's (set in one, unset in the other counts)."""

    def read_early(name: str) -> bool:
        if name in _APPLIED_AFTER_FORK:
            return False
        return name in _READ_AT_START or name.startswith(_READ_AT_LOAD_PREFIXES)

    names = {name for name in (*job_env, *own_env) if read_early(name)}
    return sorted(name for name in names if job_env.get(name) != own_env.get(name))


_NICENESS = "niceness"  # the one part of the context a forked agent takes itself, if no lower (why_cold)
_STATUS_FIELDS = ("Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")


def process_context(pid: int = 0) -> dict[str, str]:
    """What process `pid` (0: this one) passes to the processes it starts besides their environment, folder and
    umask, and which a forked agent would take from the warm-start process instead of its launcher: the
    namespaces (a container, a private /dev/shm), the cgroup (a memory or CPU limit), the root folder, resource
    limits, groups, capabilities and niceness. A launcher whose context differs gets a cold start, so a job is
    never confined less than its launcher; but for a higher niceness, which the forked agent takes itself
    (why_cold). Raises OSError if the process is gone or not this account's to read."""
    proc = Path("/proc", str(pid) if pid else "self")
    context = {f"{name} namespace": os.readlink(proc / "ns" / name) for name in sorted(os.listdir(proc / "ns"))}
    context["cgroup"] = (proc / "cgroup").read_text()
    context["root folder"] = os.readlink(proc / "root")
    for name in sorted(dir(resource)):
        if name.startswith("RLIMIT_"):
            context[name] = str(resource.prlimit(pid, getattr(resource, name)))
    for line in (proc / "status").read_text().splitlines():
        field, _, value = line.partition(":")
        if field in _STATUS_FIELDS:
            context[field] = value.strip()
    context[_NICENESS] = str(os.getpriority(os.PRIO_PROCESS, pid))
    return context


def runs_the_agent(command: list[str], python: str) -> bool:
    """Whether `command` runs torchrun's agent with `python`, or with another name of it in its folder
    (`python3` for `python`: a console script's and Ray's workers' name for the one that tests call `python`).
    The folder must match: it is what makes a virtual environment's interpreter that environment's."""
    from clusterfit.backends.agent import AGENT_MODULE

    if len(command) < 3 or command[1:3] != ["-m", AGENT_MODULE]:
        return False
    named, own = Path(command[0]), Path(python)
    return named.is_absolute() and named.parent == own.parent and named.resolve() == own.resolve()


def why_cold(
    request: AgentRequest,
    launcher_context: Mapping[str, str],
    own_env: Mapping[str, str],
    own_context: Mapping[str, str],
    python: str = sys.executable,
) -> str | None:
    """Why this process cannot fork the requested agent, or None if it can. `launcher_context` is read from
    the launcher's process (process_context), never taken from its request: a confined job could claim any."""
    from clusterfit.backends.agent import AGENT_MODULE

    if not runs_the_agent(request.command, python):
        return f"the command is not this Python's agent ({python} -m {AGENT_MODULE})"
    differing = load_time_differences(request.env, own_env)
    if differing:
        return f"{_differ(differing)} from the warm-start process's (read while starting)"
    keys = {*launcher_context, *own_context} - {_NICENESS}
    differing = sorted(key for key in keys if launcher_context.get(key) != own_context.get(key))
    if differing:
        return f"the launcher's {_differ(differing)} from the warm-start process's"
    wanted, own = launcher_context.get(_NICENESS), own_context.get(_NICENESS)
    if wanted != own and (wanted is None or own is None or int(wanted) < int(own)):
        # A process may lower its own priority (Ray's workers run at niceness 15), never raise it unprivileged.
        return f"the launcher's niceness {wanted} is below the warm-start process's {own}"
    return None


def _differ(names: list[str]) -> str:
    return f"{', '.join(names)} {'differs' if len(names) == 1 else 'differ'}"


# --- the launcher's side -------------------------------------------------------------------------------------


class WarmAgent:
    """A forked agent as its launcher sees it, shaped as `subprocess.Popen` is where LocalRun uses one: its
    pid, and its exit code once the warm-start process reports it."""

    def __init__(self, connection: socket.socket, pid: int) -> None:
        self._connection = connection
        self._unread = b""
        self._start_time = process_start_time(pid) or ""
        self._orphaned = False
        # One reader of the connection at a time, as Popen allows poll() while another thread waits (a Ray
        # actor's does): a timeout set by one would change the other's, and a read exit code could be lost.
        self._reading = threading.Lock()
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._reading.acquire(blocking=False):  # else another thread reads it
            try:
                self._read(timeout=0)
            finally:
                self._reading.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reading.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._wait_holding_the_lock(deadline)
            finally:
                self._reading.release()
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0)
        return self.returncode

    def _wait_holding_the_lock(self, deadline: float | None) -> None:
        self._read(None if deadline is None else max(0.0, deadline - time.monotonic()))
        while self._orphaned and self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.1)
            self._read(0)

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if self._orphaned:
            if not is_running(self.pid, self._start_time):
                self.returncode = -signal.SIGTERM
            return
        self._connection.settimeout(timeout)
        try:
            chunk = self._connection.recv(4096)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            # The warm-start process is gone, and the exit code with it: the agent is stopped as a cold one is
            # when its launcher dies (SIGTERM: torchrun stops its workers), and the job fails once it has
            # ended. A retry or a rerun resumes from the last checkpoint.
            self._connection.close()
            self._orphaned = True
            kill_if_same(self.pid, self._start_time, signal.SIGTERM)
            return
        self._unread += chunk
        if b"\n" in self._unread:
            self.returncode = int(json.loads(self._unread.split(b"\n", 1)[0])["exit"])
            self._connection.close()


def warm_started_agent(
    command: list[str], env: dict[str, str], cwd: str | Path | None, log: IO[str]
) -> WarmAgent | None:
    """The agent forked by `clusterfit warm-start` when CLUSTERFIT_WARM_START names one: `command` as its
    launcher would start it with Popen (`env`, `cwd`; stdout and stderr to `log`). None to start it cold, with
    the reason in `log` when a warm start was asked for and failed."""
    socket_path = os.environ.get(WARM_START_ENV)
    if not socket_path or not runs_the_agent(command, sys.executable):
        return None
    try:
        folder = os.path.abspath(cwd or os.getcwd())  # where Popen would start it: relative to this process
        cpus = sorted(os.sched_getaffinity(0))
        request = AgentRequest(command, env, folder, own_umask(), cpus)
        return start_agent(socket_path, request, log)
    except (OSError, WarmStartUnavailable) as exc:  # OSError: this process's folder is gone, which Popen allows
        print(f"{_COLD_START_PREFIX}{exc}{_COLD_START_SUFFIX}", file=log, flush=True)
        return None


# How warm_started_agent says in the agent log that it starts an agent cold, and why; the supervisor repeats it.
_COLD_START_PREFIX, _COLD_START_SUFFIX = "clusterfit: ", "; starting the agent cold"


def cold_start_reasons(agent_log_lines: list[str]) -> list[str]:
    """Why a warm start that was asked for was not taken, as lines of an agent log say."""
    return [
        line.removeprefix(_COLD_START_PREFIX).removesuffix(_COLD_START_SUFFIX)
        for line in agent_log_lines
        if line.startswith(_COLD_START_PREFIX) and line.endswith(_COLD_START_SUFFIX)
    ]


def start_agent(socket_path: str, request: AgentRequest, log: IO[bytes] | IO[str]) -> WarmAgent:
    """Asks the warm-start process at `socket_path` to fork the agent, writing to `log`; raises
    WarmStartUnavailable with the reason when it cannot."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(_REQUEST_TIMEOUT_S * 2)
        connection.connect(socket_path)
        body = json.dumps(request.__dict__).encode()
        socket.send_fds(connection, [_HEADER.pack(len(body))], [log.fileno()])
        connection.sendall(body)
        answer = json.loads(_read_line(connection))
    except (OSError, ValueError) as exc:
        connection.close()
        raise WarmStartUnavailable(f"no warm start at {socket_path}: {exc}") from None
    if "pid" not in answer:
        connection.close()
        raise WarmStartUnavailable(f"the warm-start process starts this job cold: {answer.get('cold', answer)}")
    return WarmAgent(connection, int(answer["pid"]))


def _read_line(connection: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            raise ValueError("it closed the connection")
        line += chunk
    return line


def own_umask() -> int:
    """This process's umask, read without setting it (which would race with other threads' file creation)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


# --- the warm-start process ----------------------------------------------------------------------------------


def serve(socket_path: Path) -> None:
    """Imports what agents need, then forks one per request until SIGTERM or SIGINT; then it takes no more
    and ends once the agents it started have ended (their launchers wait for its reports of their exits)."""
    from clusterfit.backends import agent

    agent.hold_the_process_title()
    _check_socket_path(socket_path)  # a socket it cannot use is said at once, not after the imports
    with long_lived_imports():
        importlib.import_module(agent.TRAINER_MAIN)
        import torch.distributed.elastic.multiprocessing.errors  # noqa: F401 - what agent.main imports
        import torch.distributed.run  # noqa: F401
    # NOTE: listening only now: a launcher that came during the imports would have waited for them, given up
    # and started cold, and the agent forked for it later would have run the same job twice.
    listener = _listen(socket_path)

    # A stop signal wakes the loop at once through this pair; its handler does nothing else.
    stop_signals, signal_writer = socket.socketpair()
    signal_writer.setblocking(False)
    signal.set_wakeup_fd(signal_writer.fileno())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(stop_signals, selectors.EVENT_READ, "stop")
    agents: dict[int, _Agent] = {}
    own = [listener, stop_signals, signal_writer]
    print(f"{READY_LINE}{socket_path}", flush=True)
    try:
        while listener.fileno() >= 0 or agents:
            for key, _ in selector.select():
                if key.data == "stop":
                    stop_signals.recv(64)
                    if listener.fileno() >= 0:  # new jobs start cold from now on; running ones go on
                        selector.unregister(listener)
                        listener.close()
                        socket_path.unlink(missing_ok=True)
                elif key.data == "listener":
                    _accept(listener, selector, agents, own)
                else:
                    try:
                        key.data(selector, agents)
                    except OSError:  # one launcher's or agent's trouble never ends the others' jobs
                        traceback.print_exc()
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)


def _check_socket_path(socket_path: Path) -> None:
    folder = socket_path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ClusterfitError(f"{folder}: cannot be made ({exc.strerror}); pick --socket elsewhere") from None
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise ClusterfitError(f"{folder}: not a private folder of this account; pick --socket in one that is")
    if len(os.fsencode(socket_path)) > 107:
        raise ClusterfitError(f"{socket_path}: longer than a Unix socket path may be (107 bytes); pick a shorter one")
    if socket_path.is_symlink() or (socket_path.exists() and not socket_path.is_socket()):
        raise ClusterfitError(f"{socket_path}: exists and is not a socket (kept); pick another --socket")
    if socket_path.exists() and _answers(socket_path):
        raise ClusterfitError(f"{socket_path}: another warm-start process listens there; stop it or pick another")


def _answers(socket_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(socket_path))
        except OSError:  # refused: a socket left by a process that ended
            return False
    return True


def _listen(socket_path: Path) -> socket.socket:
    socket_path.unlink(missing_ok=True)  # a socket its previous run left (checked above: nothing answers)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(socket_path))
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    return listener


@dataclass
class _Agent:
    """A forked agent and its launcher's connection, until the exit code is sent."""

    pid: int
    pidfd: int
    connection: socket.socket | None

    def exited(self, selector: selectors.BaseSelector, agents: dict[int, _Agent]) -> None:
        _, status = os.waitpid(self.pid, 0)
        selector.unregister(self.pidfd)
        os.close(self.pidfd)
        del agents[self.pid]
        if self.connection is not None:
            with contextlib.suppress(OSError):
                self.connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            self._forget_launcher(selector)

    def launcher_left(self, selector: selectors.BaseSelector, agents: dict[int, _Agent]) -> None:
        """The launcher closed its end (it ended, or was killed): the agent gets SIGTERM, as a cold agent gets
        from the kernel when its launcher dies, and stops its workers."""
        if self.connection is None:
            return
        try:
            left = self.connection.recv(1) == b""
        except BlockingIOError:
            return
        except OSError:  # reset: gone as well
            left = True
        if left:
            self._forget_launcher(selector)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def _forget_launcher(self, selector: selectors.BaseSelector) -> None:
        if self.connection is not None:
            selector.unregister(self.connection)
            self.connection.close()
            self.connection = None


def _accept(
    listener: socket.socket,
    selector: selectors.BaseSelector,
    agents: dict[int, _Agent],
    own: list[socket.socket],
) -> None:
    try:
        connection, _ = listener.accept()
    except OSError:  # out of descriptors, or the launcher gave up already: it starts its agent cold
        return
    log_fd = None
    try:
        launcher, uid = _peer(connection)
        if uid != os.getuid():
            raise PermissionError("another account's process")
        connection.settimeout(_REQUEST_TIMEOUT_S)
        request, log_fd = _receive(connection)
        try:
            launcher_context = process_context(launcher)
        except OSError as exc:
            launcher_context, refusal = {}, f"the launcher's process cannot be read ({exc.strerror})"
        else:
            refusal = why_cold(request, launcher_context, os.environ, process_context())
        if refusal is not None:
            connection.sendall(json.dumps({"cold": refusal}).encode() + b"\n")
            connection.close()
            return
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become_agent(
                request,
                log_fd,
                parent,
                int(launcher_context[_NICENESS]),
                keep_nothing_of=[*own, connection, *agents.values()],
                selector=selector,
            )
    except (OSError, ValueError, KeyError, TypeError):
        connection.close()  # a launcher that cannot be answered starts its agent cold
        return
    finally:
        if log_fd is not None:
            os.close(log_fd)
    started = _Agent(pid, os.pidfd_open(pid), connection)
    agents[pid] = started
    selector.register(started.pidfd, selectors.EVENT_READ, started.exited)
    try:
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the launcher left before it knew the agent: stop it as if it had left after
        connection.close()
        started.connection = None
        os.kill(pid, signal.SIGTERM)
        return
    connection.setblocking(False)
    selector.register(connection, selectors.EVENT_READ, started.launcher_left)


def _peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process that connected, from the kernel."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", credentials)
    return pid, uid


def _receive(connection: socket.socket) -> tuple[AgentRequest, int]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 1)
    if len(header) != _HEADER.size or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request without its header and log file")
    (length,) = _HEADER.unpack(header)
    if length > _LARGEST_REQUEST:
        os.close(fds[0])
        raise ValueError("a request too large")
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            os.close(fds[0])
            raise ValueError("a request cut short")
        body += chunk
    fields = json.loads(body)
    request = AgentRequest(
        command=[str(arg) for arg in fields["command"]],
        env={str(name): str(value) for name, value in fields["env"].items()},
        cwd=str(fields["cwd"]),
        umask=int(fields["umask"]),
        cpus=[int(cpu) for cpu in fields["cpus"]],
    )
    return request, fds[0]


def _become_agent(
    request: AgentRequest,
    log_fd: int,
    parent: int,
    niceness: int,
    *,
    keep_nothing_of: list[socket.socket | _Agent],
    selector: selectors.BaseSelector,
) -> NoReturn:
    """In the forked child: the agent's process, as its launcher (`LocalBackend`, a Ray node's `NodeAgent`)
    would have started it, then `agent.main`."""
    code = 1
    try:
        os.setsid()  # its own session and process group, which its pid names: how cancels reach its helpers
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        selector.close()
        for held in keep_nothing_of:
            if isinstance(held, _Agent):
                os.close(held.pidfd)
                held = held.connection  # noqa: PLW2901
            if held is not None:
                held.close()
        _standard_streams(log_fd)
        # Stopped when this process dies, as when its launcher dies (a lost node's both die at once).
        stop_with_parent()
        if os.getppid() != parent:
            print("clusterfit: the warm-start process ended before this job's agent started", flush=True)
            return
        os.chdir(request.cwd)
        os.umask(request.umask)
        os.sched_setaffinity(0, request.cpus)
        os.setpriority(os.PRIO_PROCESS, 0, niceness)  # its only thread: and so every thread and process it starts
        os.environ.clear()
        os.environ.update(request.env)
        code = _run_agent(request.command)
    except BaseException:  # noqa: BLE001 - reported in the job's agent log, which the launcher shows
        traceback.print_exc()
    finally:
        exit_without_teardown(code)


def _standard_streams(log_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to the job's agent log, buffered as the job's environment says."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=sys.stdout.encoding,
            errors=errors,
            line_buffering=not unbuffered,
            write_through=unbuffered,
        )

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = writer(1, "strict")
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace")


def _run_agent(command: list[str]) -> int:
    import setproctitle
    import torch

    from clusterfit.backends import agent
    from clusterfit.backends.torchrun import THREADS_ENV

    threads = os.environ.get(THREADS_ENV)
    if threads:
        torch.set_num_threads(int(threads))  # OpenMP read this process's value when it loaded
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # as a new interpreter's would be; Python's own reseeds at fork
    args = command[3:]
    sys.argv = [agent.__file__, *args]
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    setproctitle.setproctitle(shlex.join(command))
    return exit_code_of(lambda: agent.main(args))

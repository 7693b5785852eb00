"""torchrun's elastic agent, as `python -m clusterfit.backends.agent` with torchrun's own arguments.

What differs is how the built-in trainer's ranks (`-m clusterfit.worker`) start. torchrun starts each as a
new interpreter that imports torch, torchvision and the trainer again: 3 s of CPU per rank on 2 cores, more
than a small job's training. Here the agent imports them once, then forks multiprocessing's fork server from
itself before any thread of its own starts, and every rank, restarted ranks included, is forked from that
server: torchrun's own `--run-path` with `--start-method forkserver`. Ranks are not forked from the agent
itself: once torchrun runs, the agent has threads (its rendezvous store, log tailing) whose locks a forked
child could inherit held; the server never starts one and never touches CUDA. Command jobs
(`-m clusterfit.worker.command`) start as torchrun starts them: they replace themselves with the user's
program, which imports what it needs."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shlex
import signal
import socket
import sys
import traceback

import setproctitle

from clusterfit.processes import exit_code_of, exit_without_teardown, long_lived_imports

AGENT_MODULE = "clusterfit.backends.agent"
TRAINER_MODULE = "clusterfit.worker"
TRAINER_MAIN = f"{TRAINER_MODULE}.__main__"
_FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    hold_the_process_title()
    # The imports' objects (355,000 with the trainer's) live as long as the agent and every forked rank.
    with long_lived_imports():
        # torch, torchvision and the trainer, imported once for every rank
        trainer = importlib.import_module(TRAINER_MAIN) if runs_the_trainer(argv) else None
        # NOTE: imported here: the launcher renders this command with the module's names and never imports torch.
        import torch.distributed.run as torchrun
        from torch.distributed.elastic.multiprocessing.errors import record

    args = torchrun.parse_args(argv)
    pick_rank_zero_ports_outside_the_ephemeral_range()
    if trainer is not None:
        multiprocessing.set_forkserver_preload([TRAINER_MAIN])  # a server not forked from here imports them
        _fork_the_fork_server()
        args.module, args.run_path = False, True
        args.training_script, args.start_method = trainer.__file__, "forkserver"
        report_every_rank_exit()
    try:
        # As torchrun's own main: a failed rank's error file becomes the agent's summary of the job's failure.
        record(torchrun.run)(args)
    finally:
        _stop_fork_server()


def hold_the_process_title() -> None:
    """Makes setproctitle find this process's command line now, for the fork server and the ranks to retitle
    themselves later. setproctitle finds it once, walking back from the first environment variable's text,
    and if anything has set that variable again by then it silently retitles nothing: a fork server then
    showed the agent's command, and a test on Ray took it for a second agent."""
    setproctitle.getproctitle()


def pick_rank_zero_ports_outside_the_ephemeral_range() -> None:
    """Rank 0 hosts a store of its own each rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, set in
    backends/torchrun.py) on a port the agent picks and releases before rank 0 binds it. torch picks it among the
    kernel's ephemeral ports, where any connect() on the machine may take it in between: rank 0 then failed
    with EADDRINUSE (once in a run of the tests). `clusterfit.network.free_port` picks outside them; torch's
    own pick stays where its module no longer has that function."""
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    from clusterfit.network import free_port

    if callable(getattr(rendezvous_api, "get_free_port", None)):
        rendezvous_api.get_free_port = free_port


def runs_the_trainer(argv: list[str]) -> bool:
    """Whether torchrun's arguments start the built-in trainer (`-m clusterfit.worker`, as torchrun_command
    renders it), known before torchrun's parser is imported with torch."""
    return any(flag == "-m" and module == TRAINER_MODULE for flag, module in itertools.pairwise(argv))


def _fork_the_fork_server() -> None:
    """Starts multiprocessing's fork server as a fork of this process, which has imported the trainer, rather
    than as a new interpreter that imports it again. multiprocessing starts its server with
    `util.spawnv_passfds` and a `-c` command; that one call is replaced, for the server alone, by a fork that
    closes the other descriptors, as the spawn does, and runs the same command. A Python that starts its server
    otherwise gets a new interpreter, which imports the trainer itself (the preload)."""
    spawn = multiprocessing.util.spawnv_passfds

    def fork_instead(path: str, args: list[str], passfds: list[int]) -> int:
        if not os.fsdecode(args[-1]).startswith(_FORK_SERVER_COMMAND):
            return spawn(path, args, passfds)
        pid = os.fork()
        if pid:
            return pid
        ended = 1
        try:
            _close_all_but(passfds)
            command = [os.fsdecode(arg) for arg in args]
            setproctitle.setproctitle(shlex.join(command))  # as `ps` would show it spawned
            exec(command[-1], {})  # multiprocessing's own command, as the new interpreter would run it
            ended = 0
        except SystemExit:  # how the server ends once the agent is gone
            ended = 0
        except BaseException:
            traceback.print_exc()  # to the agent's log, where the spawned server's would go
        finally:
            os._exit(ended)  # never back into the agent's code; its exit handlers and buffers are the agent's

    multiprocessing.util.spawnv_passfds = fork_instead
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawn


def report_every_rank_exit() -> None:
    """Writes every forked rank's exit to the agent's log once the ranks have failed. torchrun's summary of
    forked ranks names only the first exit its agent saw: when rank 1 was SIGKILLed and rank 0 then failed on
    the lost connection before the agent looked, the summary blamed rank 0's "connection reset". torchrun has
    every exit code by then (its ProcessContext.join ends the other ranks before it raises) but reports none;
    its join is wrapped here, in this process alone, to write them."""
    from torch.multiprocessing import ProcessContext, ProcessExitedException, ProcessRaisedException

    from clusterfit.outputs.logs import rank_process_exit_line

    join, host = ProcessContext.join, socket.gethostname()

    def join_then_report(context: ProcessContext, *args: object, **kwargs: object) -> bool:
        try:
            return join(context, *args, **kwargs)
        except (ProcessExitedException, ProcessRaisedException):
            for process in context.processes:
                if process.pid is not None and process.exitcode is not None:
                    print(rank_process_exit_line(process.pid, host, process.exitcode), file=sys.stderr, flush=True)
            raise

    ProcessContext.join = join_then_report


def _close_all_but(kept: list[int]) -> None:
    start = 3  # stdin, stdout and stderr stay, as the spawn keeps them
    for fd in sorted(kept):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def _stop_fork_server() -> None:
    """Ends the fork server once torchrun has ended every rank. Left alone, it would notice the agent's exit
    and end by itself a moment later, seen by a test as a process of the job outliving it. multiprocessing has
    no public call for this; without its private one (another Python), the server still ends by itself."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()  # reaps it and removes its socket


if __name__ == "__main__":
    # Ends as a program ends, minus the interpreter's teardown of torch's modules (0.4 s of CPU or more).
    exit_without_teardown(exit_code_of(main))

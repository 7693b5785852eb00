"""torchrun's elastic agent, as `python -m clusterfit.backends.agent` with torchrun's own arguments.

What differs is how the built-in trainer's ranks (`-m clusterfit.worker`) start. torchrun starts each as a
new interpreter that imports torch, torchvision and the trainer again: 3 s of CPU per rank on 2 cores, more
than a small job's training. Here a multiprocessing fork server imports them once and forks every rank from
it, restarted ranks included: torchrun's own `--run-path` with `--start-method forkserver`. A fork server, not
a fork of the agent: the agent runs threads (its rendezvous store, log tailing) whose locks a forked child
could inherit held; the server has one thread and never touches CUDA. Command jobs
(`-m clusterfit.worker.command`) start as torchrun starts them: they replace themselves with the user's
program, which imports what it needs."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys

AGENT_MODULE = "clusterfit.backends.agent"
TRAINER_MODULE = "clusterfit.worker"
_TRAINER_MAIN = f"{TRAINER_MODULE}.__main__"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    forks_the_trainer = runs_the_trainer(argv)
    if forks_the_trainer:
        multiprocessing.set_forkserver_preload([_TRAINER_MAIN])
        # NOTE: started before the agent imports torch, so that the server's imports overlap the agent's own
        # and its rendezvous rather than follow them.
        multiprocessing.forkserver.ensure_running()
    # NOTE: imported here: the launcher renders this command with the module's names and never imports torch.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    args = torchrun.parse_args(argv)
    if forks_the_trainer:
        trainer = importlib.util.find_spec(_TRAINER_MAIN)
        assert trainer is not None and trainer.origin is not None
        args.module, args.run_path = False, True
        args.training_script, args.start_method = trainer.origin, "forkserver"
    try:
        # As torchrun's own main: a failed rank's error file becomes the agent's summary of the job's failure.
        record(torchrun.run)(args)
    finally:
        _stop_fork_server()


def runs_the_trainer(argv: list[str]) -> bool:
    """Whether torchrun's arguments start the built-in trainer (`-m clusterfit.worker`, as torchrun_command
    renders it), known before torchrun's parser is imported with torch."""
    return any(flag == "-m" and module == TRAINER_MODULE for flag, module in itertools.pairwise(argv))


def _stop_fork_server() -> None:
    """Ends the fork server once torchrun has ended every rank. Left alone, it notices the agent's exit and
    tears down the modules it imported: 1 to 2 s of CPU after the job has ended, seen by a test as a process of
    the job outliving it. multiprocessing has no public call for this; without its private one (another
    Python), the server still ends by itself."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()  # reaps it and removes its socket


if __name__ == "__main__":
    main()

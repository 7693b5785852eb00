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

import importlib.util
import multiprocessing

AGENT_MODULE = "clusterfit.backends.agent"
TRAINER_MODULE = "clusterfit.worker"
_TRAINER_MAIN = f"{TRAINER_MODULE}.__main__"


def main(argv: list[str] | None = None) -> None:
    # NOTE: imported here: the launcher renders this command with the module's names and never imports torch.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    args = torchrun.parse_args(argv)
    if args.module and args.training_script == TRAINER_MODULE:
        multiprocessing.set_forkserver_preload([_TRAINER_MAIN])
        trainer = importlib.util.find_spec(_TRAINER_MAIN)
        assert trainer is not None and trainer.origin is not None
        args.module, args.run_path = False, True
        args.training_script, args.start_method = trainer.origin, "forkserver"
    # As torchrun's own main: a failed rank's error file becomes the agent's summary of the job's failure.
    record(torchrun.run)(args)


if __name__ == "__main__":
    main()

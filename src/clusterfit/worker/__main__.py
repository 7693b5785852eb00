"""Worker entry point, started by torchrun on every engine: `python -m clusterfit.worker --spec job.yaml`. It
trains, or, for a spec with `scorer:`, scores images with an exported model."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import setproctitle
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from clusterfit.data.staging import stage_inputs
from clusterfit.files import write_atomically
from clusterfit.outputs import RANK_LOG_ENV, JobOutputs, Phase
from clusterfit.processes import exit_without_teardown, finish_cleanly
from clusterfit.spec import load_spec
from clusterfit.worker.dist import read_dist_env, shutdown_distributed
from clusterfit.worker.heartbeat import Heartbeat
from clusterfit.worker.train import train


class WholeErrorFile(ErrorHandler):
    """torch's handler for `record`, writing the error file whole or not at all. torch's own opens the file and
    then writes it: a rank whose peer had failed, writing its own "connection reset" error when the agent's
    SIGTERM came, left the file empty, and the agent died parsing it before it noted any rank's exit, so the
    job's cause (the peer's OOM kill) was lost. The data is torch's format, which the agent and the job
    service read."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        extra = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}
        message = {"message": f"{type(e).__name__}: {e}", "extraInfo": extra}
        write_atomically(Path(path), json.dumps({"message": message}))


# `record` writes the exception to torchrun's error file, so the agent can name the failing rank and cause.
@functools.partial(record, error_handler=WholeErrorFile())
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterfit.worker")
    parser.add_argument("--spec", required=True, help="resolved job spec (YAML) written by the launcher")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # logs must reach rank-N.log and the console live
    if os.environ.get(RANK_LOG_ENV):
        # stdout already goes to logs/rank-N.log; send stderr (tracebacks, warnings) to the same file.
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    try:
        # Inputs at URLs are copied to this node first (one rank copies, the others wait), so the trainer
        # only ever sees local paths.
        run_token = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getppid()))
        spec = load_spec(args.spec)
        env = read_dist_env()
        outputs = JobOutputs.at(spec.outputs.dir)
        Heartbeat(outputs, env.rank, spec.limits.hang_timeout, 0).beat(Phase.STAGING, 0, force=True)
        spec = stage_inputs(spec, run_token, log=logging.getLogger("clusterfit.data").info)
        if spec.scorer is not None:
            from clusterfit.scoring.batch import score

            score(spec, env)
        else:
            train(spec, env)
    finally:
        shutdown_distributed()
    return 0


def run_forked_rank() -> None:
    """A rank that torchrun's agent forked from the process that had imported this module
    (clusterfit.backends.agent): `ps` shows the command it would have run, `main` records a failure once,
    whole, and multiprocessing ends the process once this returns."""
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", "clusterfit.worker", *sys.argv[1:]]))
    # NOTE: a forked child inherits the fork server's start method. The rank's own children (DataLoader
    # workers) start by fork, as a program's do on Linux: through a fork server, a 2-rank job on shards with
    # 2 loader workers per rank took 45 s instead of 13 s.
    multiprocessing.set_start_method("fork", force=True)
    try:
        main(sys.argv[1:])
    except SystemExit:
        raise
    except BaseException:
        # As an uncaught exception would at a program's exit; raising it further would make torchrun's own
        # `record` write the error file again, torn if the agent's SIGTERM comes meanwhile (WholeErrorFile).
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        finish_cleanly()


if __name__ == "__main__":
    if multiprocessing.parent_process() is None:
        exit_without_teardown(main())
    else:
        run_forked_rank()

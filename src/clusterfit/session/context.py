"""The job a user's script runs in, read once from the environment the command wrapper and torchrun set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from clusterfit.outputs import ATTEMPT_ENV, SPEC_ENV
from clusterfit.worker.dist_env import read_dist_env

# Outside a job (a plain `python train.py`) a report still counts as progress for this long, should it ever
# be watched; nothing is written then.
_DEFAULT_HANG_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class JobContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    job_name: str | None  # None outside a clusterfit job
    attempt: int  # which run of the job this is, from 1 (a retry or a requeue runs the script again)
    outputs_dir: Path | None  # the job's outputs.dir; None outside a clusterfit job
    hang_timeout: float  # limits.hang_timeout: seconds without a report before the job counts as hung
    restart_token: str  # differs between any two runs of the job, the same on every rank of one run

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def in_job(self) -> bool:
        return self.outputs_dir is not None


def read_context(environ: Mapping[str, str] | None = None) -> JobContext:
    env = os.environ if environ is None else environ
    dist = read_dist_env(env)
    name, outputs_dir, hang_timeout = None, None, _DEFAULT_HANG_TIMEOUT_S
    if env.get(SPEC_ENV):
        from clusterfit.spec import load_spec  # pydantic: only inside a job

        spec = load_spec(env[SPEC_ENV])
        name, outputs_dir, hang_timeout = spec.name, Path(spec.outputs.dir), float(spec.limits.hang_timeout)
    attempt = int(env.get(ATTEMPT_ENV, "1"))
    # NOTE: a retry bumps the attempt, a Slurm requeue its restart count, torchrun's own restart its count.
    restarts = [
        env.get(ATTEMPT_ENV, "1"),
        env.get("SLURM_RESTART_COUNT", "0"),
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    ]
    return JobContext(
        rank=dist.rank,
        local_rank=dist.local_rank,
        world_size=dist.world_size,
        local_world_size=dist.local_world_size,
        node_rank=dist.node_rank,
        job_name=name,
        attempt=attempt,
        outputs_dir=outputs_dir,
        hang_timeout=hang_timeout,
        restart_token="r" + ".".join(restarts),
    )

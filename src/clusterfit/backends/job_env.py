"""The environment a job of the job service starts with: an allow-list, never the server's own.

The server holds what its jobs must not see (CLUSTERFIT_HOME, CLUSTERFIT_DATABASE_URL with its password,
CLUSTERFIT_CAPACITY, whatever else its operator exported). A job gets a small fixed base, then the
distribution contract clusterfit sets, the spec's `environment_variables` and its own secrets, in that
order. `clusterfit run` is different: the user runs their own job in their own shell and it keeps that
shell's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# NOTE: PYTHONPATH is the operator's, not the job's (a spec cannot set it): the workers must import the
# same clusterfit as the server that started them. CUDA_VISIBLE_DEVICES is the operator's choice of GPUs.
# TMPDIR stays the machine's: sockets live there (DataLoader workers, torch's shared memory manager), and a
# path under a deep outputs folder is longer than a Unix socket path may be (108 bytes). OMP_WAIT_POLICY is the
# operator's tuning of a shared machine: PASSIVE OpenMP threads sleep between parallel regions instead of
# spinning, which on oversubscribed cores took several times the CPU of the work itself.
_KEPT = ("PATH", "LANG", "TZ", "TMPDIR", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OMP_WAIT_POLICY")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def job_base_env(outputs_dir: str | Path, server_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The fixed base: PATH, locale, time zone, temp folder and import path from the server; HOME is the job's
    own outputs folder, so nothing of the server's account is named."""
    server_env = os.environ if server_env is None else server_env
    base = {name: server_env[name] for name in _KEPT if name in server_env}
    base.update({name: value for name, value in server_env.items() if name.startswith("LC_")})
    base.setdefault("PATH", _DEFAULT_PATH)
    outputs = Path(outputs_dir)
    base["HOME"] = str(outputs)
    return base


def job_env(
    outputs_dir: str | Path,
    *layers: Mapping[str, str],
    server_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of a job's processes: the base, then each layer (contract, spec, secrets)."""
    env = job_base_env(outputs_dir, server_env)
    for layer in layers:
        env.update(layer)
    return env

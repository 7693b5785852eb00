"""The local engine's rendering (what `--dry-run` prints) compared to its expected text, for a trainer job and a
command job; the Slurm and Kubernetes renderings have their own expected texts in tests/data."""

from __future__ import annotations

import shlex
from pathlib import Path

from conftest import REPO, tiny_job

from clusterfit.backends.torchrun import torchrun_command
from clusterfit.spec import validate_spec

EXPECTED = REPO / "tests" / "data" / "local"


def test_local_agent_commands_match_the_expected_text() -> None:
    trainer = validate_spec(tiny_job(Path("runs/tiny")))
    command = validate_spec(
        {
            "name": "my-script",
            "command": "python train.py",
            "code": "src",
            "distribution": {"type": "mpi", "process_count_per_instance": 4, "max_restarts": 2},
            "outputs": {"dir": "runs/my-script"},
        }
    )
    rendered = "\n".join(shlex.join(torchrun_command(spec, python="python")) for spec in (trainer, command)) + "\n"
    assert rendered == (EXPECTED / "agent-commands.txt").read_text()

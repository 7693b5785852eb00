"""Where everything lives inside one job's outputs folder (`outputs.dir`): the one place these names are spelt."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESOLVED_SPEC = "job.yaml"
LOG_DIR = "logs"
AGENT_LOG = "agent.log"
SUPERVISOR_LOG = "supervisor.log"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
HEARTBEAT_DIR = "heartbeats"
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"
SUMMARY_FILE = "summary.json"
CONFUSION_PNG = "confusion_matrix.png"
BEST_WEIGHTS = "best.safetensors"  # in the checkpoints folder, beside (and never rotated with) the step-N ones
CODE_DIR = "code"
LOCK_FILE = ".clusterfit-lock"
WRITER_FILE = ".clusterfit-writer.json"  # only in a store's copy (outputs.dir: URL): the job that writes it
PREDICTIONS_FILE = "predictions.parquet"  # a scoring job's result, one row per image, ordered by file
PREDICTIONS_CSV = "predictions.csv"
PREDICTION_PARTS_DIR = "predictions"  # its per-rank chunk files, each published by one rename
# An mpi job on Ray: node 0's mpirun asks the other nodes for its daemons here (backends/mpi_remote.py)
MPI_LAUNCH_DIR = ".mpi-launch"

WEIGHTS_FILE = "model.safetensors"
TORCHSCRIPT_FILE = "model.torchscript.pt"
ONNX_FILE = "model.onnx"
MODEL_CARD_FILE = "model_card.json"


@dataclass(frozen=True)
class JobOutputs:
    """One job's outputs folder. Every side of clusterfit builds paths through this: the launcher and the engines
    (job.yaml, code/, logs/), the workers (logs, heartbeats, metrics, checkpoints, model, summary) and the job
    service and CLI that read them back."""

    root: Path

    @classmethod
    def at(cls, folder: str | Path) -> JobOutputs:
        return cls(Path(folder))

    @property
    def resolved_spec(self) -> Path:
        return self.root / RESOLVED_SPEC

    @property
    def logs(self) -> Path:
        return self.root / LOG_DIR

    @property
    def agent_log(self) -> Path:
        return self.logs / AGENT_LOG

    def node_agent_log(self, node: int) -> Path:
        """Where node `node`'s agent writes when each node has a folder of its own: node 0's is the agent log
        (its agent hosts the rendezvous), the others' sit beside it under their own names in the store."""
        return self.agent_log if node == 0 else self.logs / f"agent.node-{node}.log"

    @property
    def supervisor_log(self) -> Path:
        return self.logs / SUPERVISOR_LOG

    def rank_log(self, rank: int) -> Path:
        return self.logs / rank_log_name(rank)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def heartbeats(self) -> Path:
        return self.root / HEARTBEAT_DIR

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / heartbeat_name(rank)

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINT_DIR

    @property
    def model(self) -> Path:
        return self.root / MODEL_DIR

    @property
    def best_weights(self) -> Path:
        return self.checkpoints / BEST_WEIGHTS

    @property
    def confusion_png(self) -> Path:
        return self.root / CONFUSION_PNG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def code(self) -> Path:
        return self.root / CODE_DIR

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def predictions(self) -> Path:
        return self.root / PREDICTIONS_FILE

    @property
    def predictions_csv(self) -> Path:
        return self.root / PREDICTIONS_CSV

    @property
    def prediction_parts(self) -> Path:
        return self.root / PREDICTION_PARTS_DIR

    def mpi_launches(self, run_id: str) -> Path:
        """The common prefix of one run's requests from node 0's mpirun to the other nodes (`PREFIX.node-N.sh`,
        each removed by the node that takes it): a request that a stopped run left is never another run's."""
        return self.root / MPI_LAUNCH_DIR / run_id


def rank_log_name(rank: int) -> str:
    return f"rank-{rank}.log"


def heartbeat_name(rank: int) -> str:
    return f"rank-{rank}.json"


def rank_files(folder: Path, name_of: Callable[[int], str], world_size: int) -> dict[int, Path]:
    """rank -> its file in `folder`, for each of a job's ranks whose file is there (a link too: readers refuse
    it). Found by name, never by listing the folder: a job may fill its folders with any number of files, and
    the job service reads them at every status and every second of a run."""
    return {rank: path for rank in range(world_size) if os.path.lexists(path := folder / name_of(rank))}


def rank_error_file_name(rank: int) -> str:
    """torchrun's error file for a rank (the failing exception as JSON), beside its log."""
    return f"rank-{rank}.error.json"


def model_weights(model_dir: str | Path) -> Path:
    """The safetensors file of an exported model folder (a job's `model/`, or a copy of it anywhere)."""
    return Path(model_dir) / WEIGHTS_FILE


def model_torchscript(model_dir: str | Path) -> Path:
    return Path(model_dir) / TORCHSCRIPT_FILE


def model_onnx(model_dir: str | Path) -> Path:
    return Path(model_dir) / ONNX_FILE


def model_card_file(model_dir: str | Path) -> Path:
    """What a scorer needs beside the weights: classes in order, the exact preprocessing, metrics, provenance."""
    return Path(model_dir) / MODEL_CARD_FILE

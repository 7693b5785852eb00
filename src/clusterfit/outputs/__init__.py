"""The outputs folder: the contract between the launching side (CLI, job service, engines) and the workers.

Every name inside a job's `outputs.dir`, every environment variable clusterfit passes to the workers, and the
writer and reader of each file format live here side by side, so both sides import this package and neither
imports the other. Torch-free: the launcher, the job service and the dashboard read what the workers wrote
without loading the training stack. docs/architecture.md has the table of files."""

from clusterfit.outputs.env import (
    ATTEMPT_ENV,
    FAULT_ENV,
    LIVENESS_ENV,
    RANK_LOG_ENV,
    SPEC_ENV,
    STORAGE_SAS_TOKEN_ENV,
)
from clusterfit.outputs.heartbeats import Phase, RankBeat, clear_heartbeats, read_heartbeats, write_heartbeat
from clusterfit.outputs.layout import JobOutputs, model_torchscript, model_weights
from clusterfit.outputs.metrics import (
    MembershipChange,
    MetricsTail,
    MetricsWriter,
    RecordKind,
    last_record,
    membership_changes,
    metrics_text,
    own_metrics,
    read_records,
    recent_records,
)
from clusterfit.outputs.summary import finished_this_run, read_summary, write_summary

__all__ = [
    "ATTEMPT_ENV",
    "FAULT_ENV",
    "LIVENESS_ENV",
    "RANK_LOG_ENV",
    "SPEC_ENV",
    "STORAGE_SAS_TOKEN_ENV",
    "JobOutputs",
    "MembershipChange",
    "MetricsTail",
    "MetricsWriter",
    "Phase",
    "RankBeat",
    "RecordKind",
    "clear_heartbeats",
    "finished_this_run",
    "last_record",
    "membership_changes",
    "metrics_text",
    "model_torchscript",
    "model_weights",
    "own_metrics",
    "read_heartbeats",
    "read_records",
    "recent_records",
    "read_summary",
    "write_heartbeat",
    "write_summary",
]

"""torchrun log layout for clusterfit: `<log-dir>/rank-N.log` per global rank, older attempts kept.

torchrun loads this class by name (`--logs-specs clusterfit`, an entry point in pyproject.toml); its own
tee then echoes each file to the console with the `--log-line-prefix-template` label.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

from clusterfit.outputs import RANK_LOG_ENV
from clusterfit.outputs.layout import rank_error_file_name, rank_log_name
from clusterfit.outputs.logs import rotate


class RankLogsSpecs(LogsSpecs):
    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if not log_dir:
            raise ValueError("--logs-specs clusterfit needs --log-dir")
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        tee = to_map(self._tee, len(envs))
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            path = Path(self.root_log_dir) / rank_log_name(rank)
            rotate(path)
            # NOTE: only stdout is redirected; the worker points its stderr at the same file descriptor
            # (it reads RANK_LOG_ENV), because two handles opened on one file would overwrite each other.
            dest.stdouts[local_rank] = str(path)
            dest.stderrs[local_rank] = ""
            env[RANK_LOG_ENV] = str(path)
            if tee[local_rank] & Std.OUT and (not self._local_ranks_filter or local_rank in self._local_ranks_filter):
                dest.tee_stdouts[local_rank] = str(path)
            error_file = Path(self.root_log_dir) / rank_error_file_name(rank)
            error_file.unlink(missing_ok=True)
            dest.error_files[local_rank] = str(error_file)
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        return dest

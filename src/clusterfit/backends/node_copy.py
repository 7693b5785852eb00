"""One node's own copy of a job's outputs at a URL, where the nodes share no folder (Ray's nodes, Kubernetes pods
without a ReadWriteMany claim): emptied and filled from the store before the node's agent starts (the code, the
newest complete checkpoint), copied to the store while the agent runs and once more when it ends, then removed,
since the store holds it all. What goes which way is the mirror's NODE role (storage/outputs_mirror.py).

Ray's node actor uses `NodeCopy` itself; a Kubernetes pod and a Slurm task run their agent under this module:

    python -m clusterfit.backends.node_copy --url URL --folder DIR [--every S] [--node-spec] [--agent-log NAME] \
        -- torchrun ...

which exits with the agent's code, after the last copy. `--node-spec` makes the job.yaml it fills name DIR as
outputs.dir (Slurm's nodes each have their own DIR; a pod's is one path, in the job.yaml it mounts);
`--agent-log` sends the agent's output to DIR/logs/NAME instead of this process's. Torch-free."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from clusterfit.backends.torchrun import resolved_spec_file
from clusterfit.errors import ClusterfitError
from clusterfit.files import write_atomically
from clusterfit.outputs import STORAGE_SAS_TOKEN_ENV, JobOutputs
from clusterfit.spec import load_spec
from clusterfit.storage.filesystems import Credentials
from clusterfit.storage.outputs_mirror import MirrorRole, OutputsMirror, Uploader


class NodeCopy:
    def __init__(self, folder: Path, url: str, creds: Credentials, every_s: float, say: Callable[[str], None]) -> None:
        self.outputs = JobOutputs.at(folder)
        self.url, self.creds, self.every_s, self.say = url, creds, every_s, say
        self._uploader: Uploader | None = None

    def fill(self, *, node_spec: bool = False) -> None:
        """Empties the folder (the store is the truth: what an earlier agent of this node left would go up again)
        and fills it from the store; then copies it back every `every_s` seconds. `node_spec`: the job.yaml filled
        is rewritten to name this folder as outputs.dir (the launcher's names its own). StorageError if the store
        cannot be read."""
        shutil.rmtree(self.outputs.root, ignore_errors=True)
        mirror = OutputsMirror(self.outputs, self.url, self.creds, role=MirrorRole.NODE)
        mirror.pull()
        if node_spec:
            spec = load_spec(self.outputs.resolved_spec)
            own = spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"dir": str(self.outputs.root)})})
            for path, text in resolved_spec_file(own).items():  # never uploaded: the store keeps the launcher's
                write_atomically(Path(path), text)
        self._uploader = Uploader(mirror, self.every_s, self.say).__enter__()

    def close(self) -> None:
        """The last copy to the store, then the folder goes; if the store never takes it, the folder stays and
        that is said."""
        if self._uploader is None:
            return
        try:
            self._uploader.finish()
            shutil.rmtree(self.outputs.root, ignore_errors=True)
        except ClusterfitError as exc:
            self.say(f"outputs: {exc}; this node's copy stays in {self.outputs.root}")


def node_copy_command(
    url: str,
    folder: str,
    every_s: float,
    creds: Credentials,
    command: Sequence[str],
    python: str = "python",
    *,
    node_spec: bool = False,
    agent_log: str | None = None,
) -> list[str]:
    """`command` (a node's agent) run under this module: the node's copy of the outputs around it. Only what
    is not secret goes on the command line; a SAS token comes from the environment."""
    options = ["--url", url, "--folder", folder, "--every", f"{every_s:g}"]
    options += ["--node-spec"] if node_spec else []
    options += ["--agent-log", agent_log] if agent_log else []
    if creds.account_name:
        options += ["--account-name", creds.account_name]
    if creds.endpoint:
        options += ["--endpoint", creds.endpoint]
    return [python, "-m", __name__, *options, "--", *command]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the store of the job's outputs")
    parser.add_argument("--folder", required=True, help="this node's own folder for them")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between copies to the store")
    parser.add_argument("--account-name")
    parser.add_argument("--endpoint")
    parser.add_argument("--node-spec", action="store_true", help="make the filled job.yaml name --folder")
    parser.add_argument("--agent-log", help="the agent's output to this file under --folder/logs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the node's agent command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the agent's command after --")
    creds = Credentials(args.account_name, args.endpoint, os.environ.get(STORAGE_SAS_TOKEN_ENV) or None)

    def say(line: str) -> None:
        print(f"[clusterfit] {line}", file=sys.stderr, flush=True)

    copy = NodeCopy(Path(args.folder), args.url, creds, args.every, say)
    try:
        copy.fill(node_spec=args.node_spec)
    except ClusterfitError as exc:
        say(str(exc))
        return 1
    output = None
    if args.agent_log:
        copy.outputs.logs.mkdir(parents=True, exist_ok=True)
        output = open(copy.outputs.logs / Path(args.agent_log).name, "ab")  # noqa: SIM115 - open while the agent runs
    agent = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if output else None)
    # NOTE: a pod's stop (SIGTERM) is for the agent, which stops its workers; the last copy follows its exit.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _frame: agent.send_signal(received))
    code = agent.wait()
    if output is not None:
        output.close()
    copy.close()
    return code


if __name__ == "__main__":
    sys.exit(main())

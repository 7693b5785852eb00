"""A real one-node Slurm cluster on localhost for tests: munged, slurmctld and slurmd from Debian's
`slurm-wlm` and `munge` packages, with a generated slurm.conf, free ports, and every state, spool, socket
and log file in a temp folder. The daemons run as root (they switch users for jobs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from services import find, skip_reason


def missing_reason() -> str | None:
    """Why a Slurm cluster cannot run here, or None (`make services` installs the packages when it can)."""
    return skip_reason("slurm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name: str) -> str:
    return find(name) or name


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        # As /run/munge: every account's srun reaches the socket; the key stays in a folder of root's only.
        self.munge_socket = root / "munge-socket" / "munge.socket"
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """What client commands (sbatch, squeue, scontrol, scancel) need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        for folder in ("munge", "munge-socket", "state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        os.chmod(self.root / "munge-socket", 0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn(
            _daemon("munged"),
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
        )
        self._wait_for(lambda: self.munge_socket.exists(), "munged")
        self.conf.write_text(self._config())
        self._spawn(*self._controller_command)
        self._wait_for(self._controller_answers, "slurmctld")
        self._spawn(_daemon("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf))
        self._wait_for(self._node_idle, "slurmd")

    def stop_controller(self) -> None:
        """Stop slurmctld alone, as an outage would: it saves its state, slurmd keeps running, and clients get
        "Unable to contact slurm controller" until `start_controller`."""
        controller = self._controller()
        if controller.poll() is None:
            controller.send_signal(signal.SIGTERM)
            controller.wait(30)

    def start_controller(self) -> None:
        """Start slurmctld again (nothing to do while it runs); returns once it answers and the node is idle."""
        if self._controller().poll() is None:
            return
        self.processes[self.processes.index(self._controller())] = self._popen(*self._controller_command)
        self._wait_for(self._controller_answers, "slurmctld")
        self._wait_for(self._node_idle, "slurmd to register with the new slurmctld")

    def stop(self) -> None:
        # Jobs first: a job step's processes outlive slurmd, so stopping the daemons alone would leave them.
        if self.processes and self.processes[-1].poll() is None:
            self.run("scancel", "--full", "--user=root")
            deadline = time.monotonic() + 60
            while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60)

    def _config(self) -> str:
        root = self.root
        cpus = len(os.sched_getaffinity(0))
        return "\n".join(
            [
                "ClusterName=clusterfit-test",
                "SlurmctldHost=localhost",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # cred_expire is also how long Slurm holds a requeued job before it may start again (default
                # 120 s): a test needs it short, and starting the job sooner by hand races slurmd's cleanup.
                f"AuthInfo=socket={self.munge_socket},cred_expire=5",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerParameters=sched_interval=2",  # a requeued job starts soon after its hold, not a minute after
                "MpiDefault=none",
                "SwitchType=switch/none",
                "ReturnToService=2",
                "KillWait=10",
                "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` (no accounting here)
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    @property
    def _controller_command(self) -> tuple[str, ...]:
        return (_daemon("slurmctld"), "-D", "-f", str(self.conf))

    def _controller(self) -> subprocess.Popen[bytes]:
        return next(p for p in self.processes if Path(p.args[0]).name == "slurmctld")

    def _spawn(self, *command: str) -> None:
        self.processes.append(self._popen(*command))

    def _popen(self, *command: str) -> subprocess.Popen[bytes]:
        log = open(self.root / "log" / f"{Path(command[0]).name}.out", "ab")  # noqa: SIM115 - lives with the daemon
        return subprocess.Popen(
            command,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _controller_answers(self) -> bool:
        return self.run("scontrol", "ping").returncode == 0 and "UP" in self.run("scontrol", "ping").stdout

    def _node_idle(self) -> bool:
        state = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
        return state.startswith("idle")

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:  # noqa: ANN001 - a predicate
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f.read_text()[-1500:] for f in sorted((self.root / "log").glob("*")))
                raise RuntimeError(f"{what} did not start (exited: {dead}); logs:\n{logs}")
            time.sleep(0.2)

"""A Ray cluster: a placement group with one bundle per node, and in each bundle one actor that runs
torchrun's elastic agent, exactly the command every other engine runs on a node.

Ray only places and supervises the agents; they rendezvous among themselves (c10d, hosted by node 0's agent
on a port node 0's actor picks), so the workers see the usual RANK / WORLD_SIZE / MASTER_ADDR environment.

A folder `outputs.dir` (and relative data paths, resolved from the launcher's working directory) must be on a
filesystem every node sees, like NFS: every rank's log lands in `outputs.dir/logs/rank-N.log`, where the
launcher follows it as it does for every engine, and rank 0 publishes checkpoints there. With outputs at a URL
the nodes share only the store: each node works in a folder of its own under `outputs.cache_dir`, filled from
the store when its agent starts (code, the newest checkpoint) and copied back to it while the job runs and once
more before the node reports its agent's end; the launcher reads the nodes' logs, metrics and heartbeats back
from the store (storage/outputs_mirror.py).

The actors and the placement group are detached and named after the job: `status` and `cancel` find them
from any process, and a job survives the launcher (the launcher's Ctrl-C cancels it; a job service keeps
its `EngineRef`). Whoever sees the job end (the handle, or `cancel`) removes them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from clusterfit.backends.base import EngineRef, EngineStatus, Rendered
from clusterfit.backends.job_env import job_env
from clusterfit.backends.job_folder import JobAccount, account_name, open_agent_log, put_job_files
from clusterfit.backends.mpi import (
    INSTALL_HINT,
    find_mpirun,
    launched_by_mpirun,
    ray_launch_env,
    ray_node_command,
    refuse_outputs_at_url,
)
from clusterfit.backends.node_copy import NodeCopy
from clusterfit.backends.polled import wait_for_exit
from clusterfit.backends.torchrun import (
    THREADS_ENV,
    as_launched,
    resolved_spec_file,
    ship_code,
    storage_secret_env,
    torchrun_command,
    worker_env,
)
from clusterfit.backends.warm_start import WarmAgent, warm_started_agent
from clusterfit.errors import ClusterfitError, EngineError, SpecError
from clusterfit.files import read_text_or_none, write_atomically
from clusterfit.network import free_port
from clusterfit.outputs import JobOutputs
from clusterfit.processes import descendants, is_running, kill_if_same, process_start_time, stop_with_parent
from clusterfit.spec.model import JobSpec
from clusterfit.storage.filesystems import Credentials, job_credentials, public
from clusterfit.storage.outputs_mirror import MirrorRole, OutputsMirror

NAMESPACE = "clusterfit"
PLACEMENT_STRATEGY = "STRICT_SPREAD"  # one bundle per Ray node, never two agents on one node
_PLACEMENT_TIMEOUT_S = 120.0
_STOP_GRACE_S = 20.0
_NODE0_RDZV = "<node 0 IP>:<free port>"
_LOST_NODE_EXIT = 1  # the exit code of a node whose actor died with its agent
_GROW_EVERY_S = 5.0  # an elastic job looks for nodes with room this often
_JOIN_TIMEOUT_S = 30.0  # an actor Ray has not placed by then lost its node's room to someone else
_LAST_UPLOAD_S = 120.0  # a stopped node's last copy to the store, before its actor is killed regardless


@dataclass(frozen=True)
class NodeStore:
    """Outputs at a URL: the store the nodes share, and where on each node its own folder goes."""

    url: str
    creds: Credentials
    cache_dir: str  # as the spec says it: `~` is the node's home
    upload_every_s: float

    def folder(self, job_id: str, node: int) -> Path:
        """This node's folder for one node slot of one job: never another job's or another slot's, also when
        several Ray nodes share a host."""
        return Path(self.cache_dir).expanduser() / "nodes" / f"{job_id}-node-{node}"


@dataclass(frozen=True)
class AgentState:
    """One node's agent as its actor sees it: still running (exit_code None) or exited, and when."""

    exit_code: int | None
    finished_at: float | None = None


def job_exit_code(states: list[AgentState], *, elastic: bool = False) -> int | None:
    """The job's exit code: the first non-zero agent exit (the others cannot finish without that node),
    0 once every agent exited cleanly, None while the job runs. An elastic job's is node 0's (`states[0]`),
    whose agent hosts the rendezvous: the others may come and go while it trains on."""
    if elastic:
        return states[0].exit_code
    failed = [s for s in states if s.exit_code not in (None, 0)]
    if failed:
        return min(failed, key=lambda s: s.finished_at or 0.0).exit_code
    if all(s.exit_code == 0 for s in states):
        return 0
    return None


def cluster_address(spec: JobSpec) -> str:
    return spec.resources.ray_address or os.environ.get("RAY_ADDRESS") or "auto"


def threads_per_process(spec: JobSpec) -> int:
    """CPU threads per rank: the job's OMP_NUM_THREADS, else 1; the bundle reserves that many cores per rank."""
    value = spec.environment_variables.get(THREADS_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise SpecError(
            f"environment_variables.{THREADS_ENV} = {value!r}: the ray backend reserves that many CPUs per process; "
            "give a whole number of at least 1"
        )
    return int(value)


def bundle(spec: JobSpec) -> dict[str, float]:
    """What each node's bundle reserves; with GPUs, Ray also gives the node's actor (and so torchrun and its
    workers) those devices in CUDA_VISIBLE_DEVICES."""
    cpus = {"CPU": float(spec.distribution.process_count_per_instance * threads_per_process(spec))}
    gpus = spec.resources.gpus_per_instance
    return {**cpus, "GPU": float(gpus)} if gpus else cpus


def _holds(total: dict[str, float], wanted: dict[str, float]) -> bool:
    """Whether a node with `total` resources could ever hold the bundle `wanted`."""
    return all(total.get(name, 0.0) >= amount for name, amount in wanted.items())


def _shown(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def node_env(spec: JobSpec) -> dict[str, str]:
    return {**worker_env(threads_per_process(spec)), **spec.environment_variables}


def node_command(
    spec: JobSpec, node: int, *, python: str, node_ip: str, rdzv_endpoint: str, run_id: str, head: NodePlace
) -> list[str]:
    """The agent command for node `node`: node 0 hosts the rendezvous store; every node announces its Ray IP.
    An mpi job's node 0 (`head`) runs mpirun over the nodes instead, whose daemons the other nodes wait for."""
    if launched_by_mpirun(spec):
        launches = _mpi_launches(spec, run_id)
        return ray_node_command(
            spec, node, python=python, mpirun=head.mpirun or "mpirun", head_host=head.host, launches=launches
        )
    return torchrun_command(
        spec,
        python=python,
        rdzv_endpoint=rdzv_endpoint,
        run_id=run_id,
        rdzv_is_host=node == 0,
        local_addr=node_ip,
    )


def _mpi_launches(spec: JobSpec, run_id: str) -> Path:
    """Where an mpi job's mpirun and the other nodes meet: in the outputs folder every node sees, by the path
    the launcher sees (an account's agent starts in that folder, where a relative path would mean another)."""
    return JobOutputs.at(Path(spec.outputs.dir).resolve()).mpi_launches(run_id)


# The Ray cluster's own key, which the node's raylet hands every worker process: a job holding it could submit
# anything to the cluster. NOTE: this only keeps the key out of what the job is given; a job running as the same
# OS user as Ray's daemons can still read it from their /proc/PID/environ or Ray's token file.
_RAY_SECRETS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def job_environ(actor_environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a job's agent starts from on a Ray node: the actor's, without the cluster's secrets."""
    return {key: value for key, value in actor_environ.items() if key not in _RAY_SECRETS}


def check_shared_outputs(outputs: JobOutputs, launcher_claim: str | None, node_ip: str) -> None:
    """EngineError unless this node sees the launcher's outputs folder itself (its lock, as the launcher wrote
    it): a folder of the same name on the node's own disk would split the job's logs and checkpoints."""
    if launcher_claim is None or read_text_or_none(outputs.lock) == launcher_claim:
        return
    raise EngineError(
        f"outputs.dir {outputs.root} on Ray node {node_ip} is not the launcher's folder (its lock is missing or "
        "another job's): put outputs.dir on a filesystem every node sees, or give it a URL (az://, s3://)",
        retryable=False,
    )


class RayBackend:
    name = "ray"

    def dry_run(self, spec: JobSpec) -> Rendered:
        spec, url = as_launched(spec)
        nodes = spec.resources.instance_count
        lines = [
            f"# Ray cluster: {cluster_address(spec)}; namespace {NAMESPACE}",
            f"# placement group {spec.name}-<id>: {nodes} bundle(s) of {_shown(bundle(spec))}, strategy "
            f"{PLACEMENT_STRATEGY} (one node each)",
            "# one detached actor per bundle runs this command with its node's python, in a new process group;",
            "# node 0 hosts the c10d rendezvous on a free port it picks, other nodes pass --rdzv-conf=is_host=0",
        ]
        node_spec = spec
        if url is not None:  # each node in a folder of its own, which its actor fills from the store and copies back
            out = spec.outputs
            folder = NodeStore(url, Credentials(), out.cache_dir, out.upload_every_s).folder(f"{spec.name}-<id>", 0)
            node_spec = spec.model_copy(update={"outputs": out.model_copy(update={"dir": str(folder)})})
            lines.append(f"# outputs at {public(url)}: node N works in {str(folder)[:-1]}N, copied to the store")
        refuse_outputs_at_url(spec, url)
        if launched_by_mpirun(spec):  # no rendezvous: mpirun reaches the other nodes through their actors
            launches = _mpi_launches(spec, f"{spec.name}-<id>")
            receiver = ray_node_command(spec, 1, python="python", mpirun="", head_host="", launches=launches)[:-1]
            lines[-1] = f"# mpi: node 0 runs this mpirun; node N `{shlex.join(receiver)} N`, which starts its daemon"
        placement = "\n".join(lines)
        command = node_command(
            node_spec,
            0,
            python="python",
            node_ip="<node 0 IP>",
            rdzv_endpoint=_NODE0_RDZV,
            run_id=f"{spec.name}-<id>",
            head=NodePlace("<node 0 IP>", "python", "~", "<node 0 host>", "mpirun"),
        )
        return Rendered(
            backend=self.name,
            command=command,
            env=node_env(spec),
            files=resolved_spec_file(spec),
            secret_env=storage_secret_env(spec),
            placement=placement,
        )

    def submit(
        self,
        spec: JobSpec,
        outputs_store: str | None = None,
        *,
        confined: bool = False,
        account: JobAccount | None = None,
    ) -> RayRun:
        """`outputs_store`: the URL of the job's outputs, whose local copy `spec.outputs.dir` is; each node then
        works in a folder of its own, and the store is what they share. `account`: the unprivileged account a
        root job service runs the job as, whose outputs folder (which every node sees) it already is: on each
        node whose Ray daemons run as root, the agent starts as the account of that name; `confined` is implied
        by it (the nodes' agents start from Ray's environment either way, without the cluster's secrets)."""
        if account is not None and outputs_store is not None:
            # NOTE: each node's folder would be filled from the store and read back by root, in a folder the job's
            # account writes: a link the job made there would take those reads and writes anywhere.
            raise SpecError(
                f"outputs.dir = {public(outputs_store)!r}: this job service runs Ray jobs with outputs at a URL only "
                f"as Ray's own user, not as {account.name}; give outputs.dir a folder every Ray node sees"
            )
        refuse_outputs_at_url(spec, outputs_store)
        rendered = self.dry_run(spec)
        ray = _connect(cluster_address(spec))
        if account is not None:  # code, job file and logs folder written by a process of the account's
            put_job_files(Path(spec.outputs.dir).resolve(), spec.code, rendered.files, account)
        else:
            ship_code(spec)  # into outputs.dir, which every node sees, or which goes to the store for them:
        store = None
        if outputs_store is not None:
            out = spec.outputs
            store = NodeStore(outputs_store, job_credentials(spec), out.cache_dir, out.upload_every_s)
            for path, content in rendered.files.items():  # the job.yaml by which this run is known here and there
                write_atomically(Path(path), content)
            launcher_copy = JobOutputs.at(Path(out.dir).resolve())
            # Before any node starts: it fills its folder from the store (the supervisor reads the nodes back).
            OutputsMirror(launcher_copy, outputs_store, store.creds, role=MirrorRole.LAUNCHER).push(read_back=False)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
        nodes = spec.resources.min_nodes  # an elastic job starts once MIN are placed; more join as they come
        group = placement_group([bundle(spec)] * nodes, strategy=PLACEMENT_STRATEGY, name=job_id, lifetime="detached")
        ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            alive = [node for node in ray.nodes() if node.get("Alive")]
            big_enough = [node for node in alive if _holds(node.get("Resources", {}), bundle(spec))]
            raise EngineError(
                f"resources.instance_count = {nodes}: the Ray cluster at {cluster_address(spec)} did not offer "
                f"{nodes} separate nodes with {_shown(bundle(spec))} free within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s ({len(alive)} node(s) alive, {len(big_enough)} that large); "
                "lower instance_count or process_count_per_instance, or add nodes",
                # Enough nodes that large exist: they are busy, and may be free later. Too few never will be.
                retryable=len(big_enough) >= nodes,
            )
        actors = [
            _new_agent(
                ray, spec, job_id, node, PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=node)
            )
            for node in range(nodes)
        ]
        extra = {"address": cluster_address(spec), "nodes": str(spec.resources.max_nodes)}
        ref = EngineRef(self.name, job_id, {**extra, "elastic": "1"} if spec.resources.elastic else extra)
        run = RayRun(ref, dict(enumerate(actors)), ray)
        try:
            places = ray.get([actor.where.remote() for actor in actors])
            if launched_by_mpirun(spec):
                check_own_host_names(places)
            launch = AgentLaunch(
                spec=spec,
                job_id=job_id,
                rdzv_endpoint=f"{places[0].ip}:{ray.get(actors[0].free_port.remote())}",
                env={**rendered.env, **rendered.secret_env},
                files=rendered.files,
                log_dir=str(JobOutputs.at(Path(spec.outputs.dir).resolve()).logs),
                cwd=os.getcwd(),
                outputs_claim=read_text_or_none(JobOutputs.at(Path(spec.outputs.dir).resolve()).lock),
                store=store,
                account=account.name if account is not None else None,
                head=places[0],
            )
            ray.get(
                [
                    launch.start(actor, node, place)
                    for node, (actor, place) in enumerate(zip(actors, places, strict=True))
                ]
            )
            if spec.resources.elastic:
                run.grow_with(launch)
        except Exception as exc:
            run.cancel()
            cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the actor's own exception
            if isinstance(cause, (ClusterfitError, OSError)):
                raise cause from None
            raise
        return run

    def status(self, ref: EngineRef) -> EngineStatus:
        ray = _connect(ref.extra.get("address", "auto"))
        actors = _find_actors(ray, ref)
        if not actors:
            return EngineStatus("gone")
        if _is_elastic(ref) and 0 not in actors:
            return EngineStatus("exited", _LOST_NODE_EXIT)  # node 0 hosted the rendezvous: the others cannot go on
        code = job_exit_code(_agent_states(ray, list(actors.values())), elastic=_is_elastic(ref))
        return EngineStatus("running") if code is None else EngineStatus("exited", code)

    def cancel(self, ref: EngineRef) -> None:
        ray = _connect(ref.extra.get("address", "auto"))
        _tear_down(ray, ref.id, list(_find_actors(ray, ref).values()))


@dataclass(frozen=True)
class AgentLaunch:
    """Everything needed to start one node's agent of a job, at submission or when an elastic job grows."""

    spec: JobSpec
    job_id: str
    rdzv_endpoint: str
    env: dict[str, str]
    files: dict[str, str]
    log_dir: str
    cwd: str
    outputs_claim: str | None = None  # the launcher's lock in outputs.dir, which every node must see as it is
    store: NodeStore | None = None  # outputs at a URL: each node works in a folder of its own
    # The job service's account for this job: where Ray's daemons run as root, the agent runs as the account
    # of this name on the node, and what the job needs in its folder is there already.
    account: str | None = None
    head: NodePlace | None = None  # node 0: an mpi job's mpirun runs there, and knows its host name as its own

    def start(self, actor: Any, node: int, place: NodePlace) -> Any:
        if self.store is None:
            spec, files, log_dir, claim = self.spec, self.files, self.log_dir, self.outputs_claim
        else:
            folder = place.home_folder(self.store.folder(self.job_id, node))
            out = self.spec.outputs.model_copy(update={"dir": str(folder)})
            spec = self.spec.model_copy(update={"outputs": out})
            files, log_dir, claim = resolved_spec_file(spec), str(JobOutputs.at(folder).logs), None
        command = node_command(
            spec,
            node,
            python=place.python,
            node_ip=place.ip,
            rdzv_endpoint=self.rdzv_endpoint,
            run_id=self.job_id,
            head=self.head or place,
        )
        env = self.env
        if launched_by_mpirun(spec):
            env = {**env, **ray_launch_env(self.rdzv_endpoint, _mpi_launches(spec, self.job_id))}
        if self.account is not None:
            files = {}  # the launcher's account wrote them into the folder every node sees
        return actor.start.remote(command, env, files, log_dir, self.cwd, claim, self.store, node, self.account)


@dataclass
class _Joining:
    """An agent actor pinned to a node that had room when it was asked for; it joins once Ray places it."""

    actor: Any
    place: Any  # the ObjectRef of actor.where()
    node_id: str
    since: float


class RayRun:
    """The submitting process's view of a Ray job: polls the node actors, tears everything down at the end.
    For an elastic job it also fills the free node slots (up to MAX) with agents on Ray nodes that have room,
    and forgets the agents of lost nodes; the agents re-rendezvous by themselves."""

    def __init__(self, ref: EngineRef, actors: dict[int, Any], ray: Any) -> None:
        self.ref = ref
        self._actors = actors  # node slot -> its agent's actor
        self._ray = ray
        self._exit_code: int | None = None
        self._launch: AgentLaunch | None = None
        self._joining: dict[int, _Joining] = {}
        self._used_nodes: set[str] = set()  # Ray node ids that host (or hosted) one of this job's agents
        self._next_look = 0.0

    def grow_with(self, launch: AgentLaunch) -> None:
        self._launch = launch
        self._used_nodes |= set(self._ray.get([actor.node_id.remote() for actor in self._actors.values()]))
        self._grow()

    def poll(self) -> int | None:
        if self._exit_code is None:
            states = _agent_states(self._ray, list(self._actors.values()))
            code = job_exit_code(states, elastic=self._launch is not None)
            if code is not None:
                _tear_down(self._ray, self.ref.id, self._all_actors())  # stops the other nodes after a failure
                self._exit_code = code
            elif self._launch is not None:
                self._forget_lost(states)
                self._grow()
        return self._exit_code

    def _all_actors(self) -> list[Any]:
        return [*self._actors.values(), *(joining.actor for joining in self._joining.values())]

    def _forget_lost(self, states: list[AgentState]) -> None:
        """Frees the slot of every node whose agent ended while node 0 trains on: the node died, or its agent
        gave up. Its node is never used again by this job."""
        for (node, actor), state in zip(list(self._actors.items()), states, strict=True):
            if node != 0 and state.exit_code not in (None, 0):
                with contextlib.suppress(Exception):  # an actor still alive: stop what is left of its agent
                    self._ray.get(actor.stop.remote(), timeout=_STOP_GRACE_S + 10)
                with contextlib.suppress(Exception):  # frees its room and its name for a new agent
                    self._ray.kill(actor, no_restart=True)
                del self._actors[node]

    def _grow(self) -> None:
        """Starts the agents whose actors Ray has placed; asks for new ones on nodes with room, every few seconds."""
        assert self._launch is not None
        for node, joining in list(self._joining.items()):
            ready, _ = self._ray.wait([joining.place], timeout=0)
            if ready:
                with contextlib.suppress(Exception):  # a node that died as it joined: its slot stays free
                    self._ray.get(self._launch.start(joining.actor, node, self._ray.get(joining.place)))
                    self._actors[node] = joining.actor
                del self._joining[node]
            elif time.monotonic() - joining.since > _JOIN_TIMEOUT_S:  # its room was taken meanwhile
                self._ray.kill(joining.actor, no_restart=True)
                self._used_nodes.discard(joining.node_id)
                del self._joining[node]
        if time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + _GROW_EVERY_S
        free = [
            n for n in range(self._launch.spec.resources.max_nodes) if n not in self._actors and n not in self._joining
        ]
        wanted = bundle(self._launch.spec)
        for ray_node in self._ray.nodes():
            if not free:
                return
            if (
                ray_node.get("Alive")
                and ray_node["NodeID"] not in self._used_nodes
                and _holds(ray_node.get("Resources", {}), wanted)
            ):
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                try:
                    actor = _new_agent(
                        self._ray,
                        self._launch.spec,
                        self.ref.id,
                        free[0],
                        NodeAffinitySchedulingStrategy(ray_node["NodeID"], soft=False),
                    )
                except ValueError:  # the slot's name is still held by the agent it lost: next time
                    return
                self._joining[free.pop(0)] = _Joining(actor, actor.where.remote(), ray_node["NodeID"], time.monotonic())
                self._used_nodes.add(ray_node["NodeID"])

    def wait(self, timeout: float | None = None) -> int:
        return wait_for_exit(self.poll, timeout, f"Ray job {self.ref.id}", every_s=0.5)

    def cancel(self) -> None:
        if self._exit_code is None:
            _tear_down(self._ray, self.ref.id, self._all_actors())
            self._exit_code = -signal.SIGTERM  # what a cancelled agent reports on every other engine


@dataclass(frozen=True)
class NodePlace:
    ip: str
    python: str
    home: str  # the node's home folder: what `~` in outputs.cache_dir means there
    host: str  # its host name
    mpirun: str | None  # the mpirun beside its Python (the mpi extra), else the first on its PATH

    def home_folder(self, path: Path) -> Path:
        """`path`, whose `~` the launcher expanded to its own home, with the node's instead."""
        launcher_home = Path("~").expanduser()
        return Path(self.home) / path.relative_to(launcher_home) if path.is_relative_to(launcher_home) else path


def check_own_host_names(places: list[NodePlace]) -> None:
    """EngineError unless every node of an mpi job has a host name of its own: Open MPI tells its daemons apart
    by host name, and two on one name never finish the job (mpirun waits for ever)."""
    seen: dict[str, str] = {}
    for place in places:
        if place.host in seen:
            raise EngineError(
                f"Ray nodes {seen[place.host]} and {place.ip} share the host name {place.host!r}, and Open MPI tells "
                "the nodes of an mpi job apart by host name; give each Ray node a host name of its own",
                retryable=False,
            )
        seen[place.host] = place.ip


def node_account(name: str | None, node_ip: str) -> JobAccount | None:
    """The account a node's agent switches to before it starts the job: `name`'s when Ray's daemons run as
    root, None when they run as `name` itself (or the job has no account). Daemons of any other user cannot
    switch, and the job must not run as them (they hold the cluster's token; the account's folder is closed to
    them): EngineError in one line (docs/security.md)."""
    if name is None:
        return None
    try:
        account = JobAccount.named(name)
    except KeyError:
        raise EngineError(
            f"Ray node {node_ip} has no account {name}, which this job service runs the job as; make the account "
            "on every Ray node, or name another with --job-user",
            retryable=False,
        ) from None
    if os.geteuid() == 0:
        return account
    if os.geteuid() == account.uid:
        return None
    raise EngineError(
        f"Ray node {node_ip}: Ray's processes run as {account_name(os.geteuid())}, who cannot start the job as "
        f"{name}, the account this job service runs it as; start Ray's nodes as root (or as {name})",
        retryable=False,
    )


class NodeAgent:
    """Lives in one bundle of the job's placement group, on its node: starts torchrun's agent in a process
    group of its own and, when asked, stops it with every process it started."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | WarmAgent | None = None
        self._finished_at: float | None = None  # once the agent exited and (outputs at a URL) its node's copy is up
        self._ended: threading.Thread | None = None
        self._tree: dict[int, str] = {}  # pid -> start time of the agent and every descendant seen so far
        self._node_copy: NodeCopy | None = None  # outputs at a URL: this node's own folder of them

    def where(self) -> NodePlace:
        import ray

        return NodePlace(
            ray.util.get_node_ip_address(),
            sys.executable,
            str(Path("~").expanduser()),
            socket.gethostname(),
            find_mpirun(),
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        return free_port()

    def start(
        self,
        command: list[str],
        env: dict[str, str],
        files: dict[str, str],
        log_dir: str,
        cwd: str,
        outputs_claim: str | None = None,
        store: NodeStore | None = None,
        node: int = 0,
        account: str | None = None,
    ) -> int:
        runs_as = node_account(account, self.where().ip)
        outputs = JobOutputs.at(Path(log_dir).parent)
        if store is None and not os.path.isdir(cwd):
            raise EngineError(
                f"the launcher's working directory {cwd} does not exist on Ray node {self.where().ip}; run from a "
                "folder every node sees (outputs.dir and data paths must be on a shared filesystem)",
                retryable=False,
            )
        check_shared_outputs(outputs, outputs_claim, self.where().ip)
        agent_log_path = outputs.agent_log
        if store is not None:
            cwd = cwd if os.path.isdir(cwd) else str(outputs.root)
            agent_log_path = outputs.node_agent_log(node)
            self._node_copy = NodeCopy(
                outputs.root, store.url, store.creds, store.upload_every_s, lambda line: _say(agent_log_path, line)
            )
            self._node_copy.fill()
        for path, content in files.items():
            write_atomically(Path(cwd, path), content)
        if runs_as is None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            agent_log = os.open(agent_log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            options: dict[str, Any] = {"cwd": cwd, "env": {**job_environ(os.environ), **env}}
        else:  # root opens nothing in the account's folder that a link could steer, and the job gets no root env
            agent_log = open_agent_log(outputs.root, agent_log_path, runs_as)
            job_environment = job_env(outputs.root, env, server_env=job_environ(os.environ))
            options = {"cwd": str(outputs.root), "env": job_environment, **runs_as.process_options()}
        with open(agent_log, "a") as agent_log_file:
            # NOTE: a job of another account always starts cold: it must not share a process of Ray's user.
            warm = None if runs_as is not None else warm_started_agent(command, options["env"], cwd, agent_log_file)
            self._process = warm or self._start_cold(command, agent_log_file, runs_as, options)
        self._ended = threading.Thread(target=self._record_exit, daemon=True)
        self._ended.start()
        return self._process.pid

    def _start_cold(
        self, command: list[str], agent_log: IO[str], runs_as: JobAccount | None, options: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                command,
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=stop_with_parent,  # a killed actor leaves no training processes behind
                **options,
            )
        except PermissionError as exc:
            who = f"the account {runs_as.name}" if runs_as else "Ray's user"
            raise EngineError(
                f"Ray node {self.where().ip}: {who} cannot run {command[0]} ({exc.strerror}); install the "
                "Python that Ray's nodes run where every job account may run it (not under /root)",
                retryable=False,
            ) from None
        except FileNotFoundError:
            raise EngineError(
                f"Ray node {self.where().ip} has no {command[0]}; "
                + (INSTALL_HINT if command[0].endswith("mpirun") else "install it on every Ray node"),
                retryable=False,
            ) from None

    def state(self) -> AgentState:
        if self._process is None or self._finished_at is None:
            return AgentState(None)
        return AgentState(self._process.poll(), self._finished_at)

    def processes(self) -> list[int]:
        """Pids of the agent and every live descendant (workers, their data loaders)."""
        self._remember_tree()
        return [pid for pid, start in self._tree.items() if is_running(pid, start)]

    def stop(self) -> list[int]:
        """SIGTERM to the agent's group (torchrun stops its workers), then SIGKILL to whatever of the process
        tree remains; returns the pids still alive after that, which should be none."""
        if self._process is None:
            return []
        self._remember_tree()
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGTERM)
        self._wait_tree_gone(_STOP_GRACE_S)
        self._remember_tree()
        for pid, start in self._tree.items():
            kill_if_same(pid, start)
        self._wait_tree_gone(5.0)
        if self._ended is not None:
            self._ended.join(_LAST_UPLOAD_S)  # the node's last copy to the store, before the actor is killed
        return [pid for pid, start in self._tree.items() if is_running(pid, start)]

    def _record_exit(self) -> None:
        """Waits for the agent; with outputs at a URL, copies this node's folder to the store a last time (then
        removes it: the store holds it all) before the agent counts as ended, so the launcher reads it all."""
        assert self._process is not None
        self._process.wait()
        try:
            if self._node_copy is not None:
                self._node_copy.close()
        finally:
            self._finished_at = time.time()  # whatever became of the upload: the job must not wait forever

    def _remember_tree(self) -> None:
        if self._process is None:
            return
        start = process_start_time(self._process.pid)
        if start is not None:
            self._tree.setdefault(self._process.pid, start)
        # Workers whose agent died are no longer its children; their own children still count.
        alive = [pid for pid, start in self._tree.items() if is_running(pid, start)]
        for pid, start in descendants(*alive).items():
            self._tree.setdefault(pid, start)

    def _wait_tree_gone(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(is_running(pid, start) for pid, start in self._tree.items()) and time.monotonic() < deadline:
            time.sleep(0.1)


def _say(log: Path, line: str) -> None:
    with open(log, "a") as f:
        f.write(f"[clusterfit] {line}\n")


def _actor_name(job_id: str, node: int) -> str:
    return f"{job_id}-node-{node}"


def _new_agent(ray: Any, spec: JobSpec, job_id: str, node: int, strategy: Any) -> Any:
    """The detached actor of node slot `node`, reserving the job's bundle where `strategy` places it."""
    return (
        ray.remote(NodeAgent)
        .options(
            name=_actor_name(job_id, node),
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=0,
            num_cpus=bundle(spec)["CPU"],
            num_gpus=bundle(spec).get("GPU", 0),
            scheduling_strategy=strategy,
        )
        .remote()
    )


def _is_elastic(ref: EngineRef) -> bool:
    return ref.extra.get("elastic") == "1"


def _connect(address: str) -> Any:
    """The `ray` module, connected to the cluster at `address` (once per process)."""
    try:
        import ray
    except ImportError:
        raise EngineError(
            "resources.backend = 'ray' needs Ray on the launching machine: pip install 'clusterfit[ray]'",
            retryable=False,
        ) from None
    if not ray.is_initialized():
        _check_reachable(address)
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError or its own types here
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            # Retryable: a cluster that does not answer now (starting, restarting) may answer later.
            raise EngineError(
                f"resources.ray_address = {address!r}: cannot join a Ray cluster there ({reason}); start one with "
                "`ray start --head`, set resources.ray_address or RAY_ADDRESS, and RAY_AUTH_TOKEN if it uses tokens",
                retryable=True,
            ) from None
    return ray


def _check_reachable(address: str) -> None:
    # NOTE: Ray retries an unreachable cluster for minutes with nothing but warnings; a plain TCP connection
    # turns a wrong address or a stopped cluster into an error at once.
    if address == "auto":
        return  # Ray finds a local cluster itself, and says so at once when there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10):
            return
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
    raise EngineError(
        f"resources.ray_address = {address!r}: no Ray cluster answers there ({reason}); start one with "
        "`ray start --head`, or set resources.ray_address or RAY_ADDRESS to its host:port",
        retryable=True,
    )


def _find_actors(ray: Any, ref: EngineRef) -> dict[int, Any]:
    """Node slot -> actor, of the job's agents that Ray still knows."""
    actors = {}
    for node in range(int(ref.extra.get("nodes", "0"))):
        with contextlib.suppress(ValueError):
            actors[node] = ray.get_actor(_actor_name(ref.id, node), namespace=NAMESPACE)
    return actors


def _agent_states(ray: Any, actors: list[Any]) -> list[AgentState]:
    states = []
    for pending in [actor.state.remote() for actor in actors]:
        try:
            states.append(ray.get(pending))
        except ray.exceptions.RayActorError:  # its node died or someone killed it: that node's agent is gone
            states.append(AgentState(_LOST_NODE_EXIT, time.time()))
    return states


def _tear_down(ray: Any, job_id: str, actors: list[Any]) -> None:
    """Stop every agent and its workers, then the actors, then free the placement group."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    leftovers = []
    for actor, stopped in zip(actors, [actor.stop.remote() for actor in actors], strict=True):
        with contextlib.suppress(Exception):  # an actor that already died has no processes left to stop
            leftovers += ray.get(stopped)
        ray.kill(actor, no_restart=True)
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(job_id))
    if leftovers:
        raise RuntimeError(f"Ray job {job_id}: processes {leftovers} survived SIGKILL")

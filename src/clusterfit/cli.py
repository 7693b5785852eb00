"""`clusterfit` command line. Thin: parse, call named functions, turn user mistakes into one line."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from clusterfit.bench.cli import bench_app
from clusterfit.console import HELP_MARKUP, console, errors, print_json, print_table
from clusterfit.console import fail as _fail
from clusterfit.errors import ClusterfitError, SpecError
from clusterfit.outputs import JobOutputs
from clusterfit.processes import long_lived_imports
from clusterfit.service.jobs import JobService, ServiceError
from clusterfit.spec import JobSpec, load_spec

app = typer.Typer(
    help="Distributed training of image classifiers from one job spec.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=HELP_MARKUP,
)

BackendOption = Annotated[
    Optional[str],  # noqa: UP045 - typer needs Optional here
    typer.Option("--backend", help="The engine: local, ray, slurm, kubernetes (overrides resources.backend)."),
]
SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--set", help="Override a spec field, e.g. --set trainer.epochs=2 (repeatable)."),
]


STOPPED_EARLY = 75  # EX_TEMPFAIL: not finished, running it again continues

ServerOption = Annotated[
    Optional[str],  # noqa: UP045 - typer needs Optional here
    typer.Option(
        "--server", envvar="CLUSTERFIT_SERVER", help="Talk to this clusterfit server (URL) instead of the local store."
    ),
]
TokenOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--token", envvar="CLUSTERFIT_TOKEN", help="API token for --server.", show_default=False),
]


def _with_backend(overrides: list[str] | None, backend: str | None) -> list[str]:
    return [*(overrides or []), *([f"resources.backend={backend}"] if backend else [])]


def _load(spec_file: Path, overrides: list[str] | None, backend: str | None = None) -> JobSpec:
    from clusterfit.service.local_jobs import checked_spec

    with _one_line_errors():
        return checked_spec(lambda: load_spec(spec_file, _with_backend(overrides, backend)))


@app.command()
def run(
    spec_file: Annotated[Path, typer.Argument(metavar="JOB.yaml", help="The job spec.")],
    overrides: SetOption = None,
    backend_name: BackendOption = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print what the engine would be given (spec, command, script, manifests); start nothing."
        ),
    ] = False,
) -> None:
    """Run a training job in the foreground: stream every rank's log, show progress, export the model.

    The job is recorded like a submitted one (`clusterfit status/logs/show` work on it); Ctrl-C cancels it."""
    from clusterfit.backends import get_backend

    spec = _load(spec_file, overrides, backend_name)
    backend = get_backend(spec.resources.backend)
    if dry_run:
        try:
            rendered = backend.dry_run(spec)
        except ClusterfitError as exc:  # what only the engine checks (Ray: CPUs to reserve per process)
            raise _fail(str(exc)) from None
        for path, content in rendered.files.items():
            console.print(f"# {path}", markup=False)
            console.print(content, markup=False, end="", soft_wrap=True)
        console.print(f"# {rendered.backend} backend command", markup=False)
        console.print(rendered.as_text(), markup=False, soft_wrap=True)
        return
    _run_in_foreground(spec)


def _run_in_foreground(spec: JobSpec) -> None:
    """Record the job, supervise it here with a live view, print its result; `run` and `score` both end here."""
    from clusterfit.backends.mpi import launched_by_mpirun
    from clusterfit.monitoring.progress import LiveView
    from clusterfit.service.local_jobs import local_user
    from clusterfit.service.records import record_job
    from clusterfit.service.scheduler import schedule
    from clusterfit.service.states import JobState
    from clusterfit.service.store import dump_json
    from clusterfit.service.supervisor import Supervisor, this_supervisor
    from clusterfit.worker.stop_signal import StopRequest

    store = _store()
    job = record_job(store, spec, owner=local_user(), supervisor=dump_json(this_supervisor()))  # its scheduler too
    out = JobOutputs.at(job.outputs_dir)
    console.print(f"job {job.id} ({spec.name}) on the {spec.resources.backend} engine", markup=False)
    # Ctrl-C or `kill` of the launcher cancels the job at the supervisor's next tick; a second leaves at once.
    # NOTE: SIGINT is set too: a process started in the background by a non-interactive shell inherits it ignored.
    interrupt = StopRequest((signal.SIGINT, signal.SIGTERM), second_interrupts=True)
    with LiveView(out, spec.world_size, console) as view:
        say = partial(view.bar.console.print, markup=False, highlight=False, soft_wrap=True)
        supervisor = Supervisor(
            store, job.id, poll_s=0.2, on_tick=view.tick, log=say, interrupted=lambda: interrupt.received
        )
        try:
            final = supervisor.run()
        except KeyboardInterrupt:  # the second Ctrl-C
            errors.print(f"job {job.id}: left without waiting for its workers; `clusterfit status {job.id}` stops them")
            raise typer.Exit(130) from None
    schedule(store)  # the machine is free again for queued jobs
    if final.job_state is JobState.SUCCEEDED:
        view.release_tracebacks()  # the job survived them: show them
        _print_result(spec, out)
        return
    if final.job_state is JobState.CANCELLED:
        errors.print(f"job {job.id} cancelled; every worker stopped")
        raise typer.Exit(130)
    # The cause and the failing rank's own traceback tail lead; the peers' tracebacks that followed it and
    # the launcher's report stay in the logs.
    cause = final.failure_cause
    where = []
    if not (cause and cause.before_any_worker):
        held = view.held_tracebacks()
        not_shown = f" (not shown here: the tracebacks of {', '.join(held)})" if held else ""
        launcher = "mpirun" if launched_by_mpirun(spec) else "torchrun"
        where = [f"every rank's log is in {out.logs}, {launcher}'s report in {out.agent_log.name}{not_shown}"]
    detail = (final.cause_detail or "").splitlines()
    headline = f"job {spec.name} ({job.id}) failed: {cause.words if cause else 'unknown'}"
    raise _fail("\n".join([headline, *detail, *where]), 1)


def _print_result(spec: JobSpec, out: JobOutputs) -> None:
    from clusterfit.outputs import finished_this_run

    if spec.scorer is not None:
        _print_scoring_summary(out)
        return
    if spec.trainer is None or spec.resources.backend == "kubernetes":  # no summary, or it is in the claim
        console.print(f"job {spec.name} finished; every rank's log is in {out.logs}", markup=False)
        return
    if not finished_this_run(out):
        # The workers stopped at a checkpoint on request (SIGUSR1) before the last step.
        errors.print(f"job {spec.name} stopped at a checkpoint before its end; run it again to resume", markup=False)
        raise typer.Exit(STOPPED_EARLY)
    _print_summary(out)


def _store():  # noqa: ANN202 - the type lives in a module imported on demand
    from clusterfit.service.migrate import StoreUnavailable, open_store

    try:
        return open_store()
    except StoreUnavailable as exc:
        raise _fail(str(exc), 1) from None


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """A refusal of the job service (or an unreachable server) becomes its line and its exit code."""
    try:
        yield
    except ServiceError as exc:
        raise _fail(str(exc), exc.exit_code) from None


@contextlib.contextmanager
def _jobs(server: str | None, token: str | None) -> Iterator[JobService]:
    """The job service this command talks to: the server at --server, else this machine's store."""
    with _one_line_errors():
        if server:
            from clusterfit.service.client import ServiceClient

            with ServiceClient(server, token) as client:
                yield client
        else:
            from clusterfit.service.local_jobs import LocalJobs

            yield LocalJobs(_store())


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(metavar="JOB.yaml", help="The job spec.")],
    overrides: SetOption = None,
    backend_name: BackendOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Check a job on this machine, queue it, and print its id at once; it starts when there is room.

    With --server the server checks the spec (paths in it are the server's) and queues it."""
    with _jobs(server, token) as jobs:
        console.print(jobs.submit(spec_file, _with_backend(overrides, backend_name))["id"], markup=False)


JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the HTTP API's JSON for this request instead, for scripts.")
]


@app.command("list")
def list_jobs(
    state: Annotated[Optional[str], typer.Option(help="Only jobs in this state, e.g. running.")] = None,  # noqa: UP045
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
    as_json: JsonOption = False,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """The jobs, newest first: id, name, state, engine, ranks, progress, age."""
    from clusterfit.service.jobs import parse_state
    from clusterfit.service.render import jobs_table

    with _one_line_errors():
        wanted = parse_state(state, "--state")
    with _jobs(server, token) as jobs:
        found = jobs.list_jobs(wanted, limit)
    if as_json:
        print_json(found)
    else:
        print_table(jobs_table(found))


JobArgument = Annotated[str, typer.Argument(metavar="JOB", help="A job id (or a unique prefix of one).")]


@app.command()
def status(
    job_id: JobArgument, as_json: JsonOption = False, server: ServerOption = None, token: TokenOption = None
) -> None:
    """A job's state, progress, per-rank health and, if it failed, why."""
    from clusterfit.service.render import status_lines

    with _jobs(server, token) as jobs:
        found = jobs.status(job_id)
    if as_json:
        print_json(found)
        return
    for line in status_lines(found):
        console.print(line, markup=False, soft_wrap=True)


@app.command()
def show(
    job_id: JobArgument, as_json: JsonOption = False, server: ServerOption = None, token: TokenOption = None
) -> None:
    """Everything about a job: resolved spec, history, outputs, metrics, checkpoints."""
    from clusterfit.service.render import details_lines

    with _jobs(server, token) as jobs:
        details = jobs.details(job_id)
    if as_json:
        print_json(details)
        return
    for line in details_lines(details):
        console.print(line, markup=False, soft_wrap=True)


@app.command()
def logs(
    job_id: JobArgument,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    rank: Annotated[Optional[int], typer.Option(min=0, help="Only this rank's log.")] = None,  # noqa: UP045
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Every rank's log merged, each line labelled with its rank and node; -f follows it live."""
    from clusterfit.service.jobs import follow_logs

    emit = partial(console.print, markup=False, highlight=False, soft_wrap=True)
    with _jobs(server, token) as jobs:
        follow_logs(jobs, job_id, emit, rank=rank, follow=follow)


@app.command()
def cancel(
    job_id: JobArgument,
    wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for every process to stop.")] = 60.0,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Stop every process of a job and mark it CANCELLED; a queued job never starts."""
    from clusterfit.service.jobs import cancel_and_wait

    with _jobs(server, token) as jobs:
        found = cancel_and_wait(jobs, job_id, wait)
    console.print(f"job {found['id']} {found['state']}", markup=False)


@app.command()
def server(
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 for every interface.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port; 0 picks a free one (printed).")] = 8080,
    tls_cert: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--tls-cert", help="PEM certificate: serve HTTPS (with --tls-key)."),
    ] = None,
    tls_key: Annotated[Optional[Path], typer.Option("--tls-key", help="PEM private key of --tls-cert.")] = None,  # noqa: UP045
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Accept requests without a token (loopback addresses only).")
    ] = False,
    tls_terminated_elsewhere: Annotated[
        bool,
        typer.Option(
            "--tls-terminated-elsewhere", help="A proxy in front serves HTTPS: allow a non-loopback --host without TLS."
        ),
    ] = False,
    paused: Annotated[bool, typer.Option("--paused", help="Queue submissions but start none (maintenance).")] = False,
    max_body_bytes: Annotated[
        int, typer.Option(min=1024, help="Largest request body; larger ones get 413 before anything reads them.")
    ] = 1024 * 1024,
    job_user: Annotated[
        str,
        typer.Option(help="When the server runs as root: the unprivileged account its jobs run as."),
    ] = "nobody",
    job_user_of: Annotated[
        list[str] | None,
        typer.Option(
            help="OWNER=ACCOUNT: run OWNER's jobs as ACCOUNT instead of --job-user (repeat per owner; root server).",
        ),
    ] = None,
    allow_command_jobs: Annotated[
        bool,
        typer.Option(
            "--allow-command-jobs", help="Let submit tokens run command: jobs (their own programs); admin tokens may."
        ),
    ] = False,
    check_timeout: Annotated[
        float,
        typer.Option(
            min=1, help="Seconds a submitted job's data check may take (a store that does not answer); then 503."
        ),
    ] = 30.0,
    max_queued_per_owner: Annotated[
        int, typer.Option(min=1, help="Jobs one owner may have waiting in the queue; more are answered 429.")
    ] = 1000,
    warm_start: Annotated[
        bool,
        typer.Option(
            "--warm-start",
            help="Run `clusterfit warm-start` beside the server and fork its local jobs' agents from it "
            "(those of this account; other accounts' start cold).",
        ),
    ] = False,
) -> None:
    """Serve the job service's HTTP API and web dashboard over the local store.

    Every request needs a token (`clusterfit token create --scope admin` on this machine makes the first)."""
    from clusterfit.service.accounts import accounts_env
    from clusterfit.service.api import ServerSettings, bind, exposure_refusal, serve

    if (tls_cert is None) != (tls_key is None):
        raise _fail("--tls-cert and --tls-key go together; give both for HTTPS, or neither")
    for path in (tls_cert, tls_key):
        if path is not None and not path.is_file():
            raise _fail(f"{path}: no such file (a PEM certificate or key)")
    refusal = exposure_refusal(host, auth=not no_auth, tls=tls_cert is not None, tls_elsewhere=tls_terminated_elsewhere)
    if refusal:
        raise _fail(refusal)
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise _fail(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port or --host") from None
    settings = ServerSettings(
        auth=not no_auth,
        paused=paused,
        max_body_bytes=max_body_bytes,
        behind_proxy=tls_terminated_elsewhere,
        allow_command_jobs=allow_command_jobs,
        check_timeout_s=check_timeout,
        max_queued_per_owner=max_queued_per_owner,
    )
    by_owner = _owner_accounts(job_user_of or [])
    if os.geteuid() == 0:  # as anyone else, there are no root rights to drop
        default = job_user if _job_account_differs(f"--job-user {job_user!r}", job_user) else ""
        os.environ.update(accounts_env(default, by_owner))  # the supervisors this server starts inherit it
    say = partial(console.print, markup=False, highlight=False, soft_wrap=True)
    # Failed authentications and maintenance errors go to stderr with their time, for the operator.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.ExitStack() as stack:
        if warm_start:
            stack.enter_context(_server_warm_start(say))
        serve(_store(), sock, settings, tls_cert=tls_cert, tls_key=tls_key, announce=say)


@contextlib.contextmanager
def _server_warm_start(say: Callable[[str], object]) -> Iterator[None]:
    """The server's own `clusterfit warm-start`, named in its environment, which its supervisors inherit. Its
    socket is in a private folder of the server's own (mkdtemp's is 0700): a user's warm start at the default
    path goes on undisturbed."""
    from clusterfit.backends.warm_start import WARM_START_ENV, WarmStartUnavailable, running_warm_start

    with tempfile.TemporaryDirectory(prefix="clusterfit-server-") as folder, contextlib.ExitStack() as stack:
        socket_path = Path(folder) / "warm-start.sock"
        try:
            stack.enter_context(running_warm_start(socket_path))
        except WarmStartUnavailable as exc:
            raise _fail(f"--warm-start: {exc}; or leave --warm-start out") from None
        os.environ[WARM_START_ENV] = str(socket_path)
        say(f"local jobs' agents fork from the warm start at {socket_path}")
        yield


def _owner_accounts(pairs: list[str]) -> dict[str, str]:
    """--job-user-of OWNER=ACCOUNT pairs; each ACCOUNT exists, is not root and can run clusterfit."""
    if pairs and os.geteuid() != 0:
        raise _fail("--job-user-of: only a server run as root runs jobs as other accounts; run it as root, or drop it")
    by_owner: dict[str, str] = {}
    for pair in pairs:
        owner, _, account = pair.partition("=")
        if not owner or not account:
            raise _fail(f"--job-user-of {pair!r}: give OWNER=ACCOUNT, e.g. --job-user-of alice=alice")
        if not _job_account_differs(f"--job-user-of {pair!r}", account):
            raise _fail(f"--job-user-of {pair!r}: {account} is the server's own account; name an unprivileged one")
        by_owner[owner] = account
    return by_owner


def _job_account_differs(named_by: str, job_user: str) -> bool:
    """Whether a root server's jobs run as another account than the server's: `job_user` must then exist
    and be able to start this Python with clusterfit (checked now, not at each job's start)."""
    import subprocess

    from clusterfit.backends.job_env import job_base_env
    from clusterfit.backends.job_folder import JobAccount

    try:
        account = JobAccount.named(job_user)
    except KeyError:
        raise _fail(f"{named_by}: no such account on this machine; create it or name another") from None
    if account.uid == os.geteuid():
        return False
    try:
        subprocess.run(
            [sys.executable, "-c", "import clusterfit"],
            capture_output=True,
            check=True,
            timeout=60,
            **account.helper_options(job_base_env("/")),
        )
    except (OSError, subprocess.SubprocessError):
        raise _fail(
            f"{named_by}: {job_user} cannot run {sys.executable} with clusterfit: install them where that "
            "account can read them, or name another account"
        ) from None
    return True


token_app = typer.Typer(
    help="API tokens of this machine's job service (for `clusterfit server`).",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    scope: Annotated[str, typer.Option(help="read | submit (includes read) | admin (includes both).")] = "read",
    ttl: Annotated[str, typer.Option(help="Lifetime: 90s, 15m, 1h, 7d, 2w, or never.")] = "1h",
    name: Annotated[str, typer.Option(help="A name to recognise it by (shown in lists).")] = "",
    owner: Annotated[
        str,
        typer.Option(help="Whose jobs it submits; a submit token cancels only its owner's jobs. Default: the name."),
    ] = "",
) -> None:
    """Create a token in the local store and print it once: only its sha256 is kept."""
    from clusterfit.service.auth import TokenError, issue_token, parse_ttl

    try:
        issued = issue_token(_store(), scope, parse_ttl(ttl), name, owner)
    except TokenError as exc:
        raise _fail(str(exc)) from None
    expiry = f"expires {issued.expires_at:%Y-%m-%d %H:%M} UTC" if issued.expires_at else "never expires"
    errors.print(
        f"token {issued.id} ({issued.name} of {issued.owner}, scope {issued.scope}, {expiry}); it is shown only now:",
        markup=False,
        soft_wrap=True,
    )
    console.print(issued.secret, markup=False)


@token_app.command("list")
def token_list() -> None:
    """Every token of the local store: id, name, owner, scopes, expiry, revocation (never the token itself)."""
    from clusterfit.service.store import utcnow

    table = Table(box=None, header_style="bold")
    for column in ("id", "name", "owner", "scopes", "expires", "state"):
        table.add_column(column)
    now = utcnow()
    for token in _store().list_tokens():
        expired = token.expires_at is not None and token.expires_at <= now
        state = "revoked" if token.revoked_at else "expired" if expired else "valid"
        expires = f"{token.expires_at:%Y-%m-%d %H:%M}" if token.expires_at else "never"
        table.add_row(str(token.id), escape(token.name), escape(token.owner), token.scopes, expires, state)
    print_table(table)


@token_app.command("revoke")
def token_revoke(token_id: Annotated[int, typer.Argument(metavar="ID", help="The id from `token list`.")]) -> None:
    """Revoke a token at once: every request with it is refused from now on."""
    token = _store().revoke_token(token_id)
    if token is None:
        raise _fail(f"no token {token_id}; `clusterfit token list` shows them")
    console.print(f"token {token.id} ({token.name}) revoked", markup=False)


@app.command()
def validate(
    spec_file: Annotated[Path, typer.Argument(metavar="JOB.yaml")],
    overrides: SetOption = None,
    backend_name: BackendOption = None,
) -> None:
    """Check a job spec and its data without running anything."""
    spec = _load(spec_file, overrides, backend_name)
    what = spec.trainer.model if spec.trainer else f"command, {spec.distribution.type}"
    console.print(
        f"{spec_file}: ok ({what}, {spec.world_size} worker(s), backend {spec.resources.backend})", markup=False
    )


@app.command()
def plan(
    spec_file: Annotated[Path, typer.Argument(metavar="JOB.yaml")],
    nodes: Annotated[int, typer.Option(min=1, help="Nodes to plan for (the table doubles up to it).")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="Devices (GPUs, or CPU ranks) per node.")] = 8,
    device: Annotated[str, typer.Option(help="p100 | v100 | a100 | h100 | cpu (this machine's CPU).")] = "a100",
    interconnect: Annotated[str, typer.Option(help="The network between nodes, e.g. infiniband-hdr.")] = "ethernet-25g",
    nics_per_node: Annotated[int, typer.Option(min=1, help="Network adapters per node (rail-optimised).")] = 1,
    images_per_s: Annotated[
        Optional[float],  # noqa: UP045 - typer needs Optional here
        typer.Option(min=0.001, help="One device's measured training rate; replaces the FLOP estimate."),
    ] = None,
    host_cores: Annotated[
        Optional[int],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            min=1,
            help="Physical CPU cores per node that decode the images, two hardware threads each (default: the "
            "device's DGX host).",
        ),
    ] = None,
    decode_per_core: Annotated[
        Optional[float],  # noqa: UP045 - typer needs Optional here
        typer.Option(min=0.001, help="Images/s one host core prepares (`clusterfit bench data` measures it)."),
    ] = None,
    overrides: SetOption = None,
) -> None:
    """Predict how a trainer job scales before the hardware exists: images/s, the step split into compute,
    exposed all-reduce and input pipeline, and the scaling efficiency from 1 device to NODES x GPUS_PER_NODE,
    with what would help."""
    from clusterfit.plan.planner import markdown, plan_job

    try:
        spec = load_spec(spec_file, overrides)  # not preflighted: the plan needs neither the data nor the outputs
        result = plan_job(
            spec,
            device=device,
            nodes=nodes,
            devices_per_node=gpus_per_node,
            interconnect=interconnect,
            nics_per_node=nics_per_node,
            images_per_s=images_per_s,
            host_cores=host_cores,
            decode_per_core=decode_per_core,
        )
    except ClusterfitError as exc:
        raise _fail(str(exc)) from None
    console.print(markdown(result), markup=False, soft_wrap=True)


@app.command()
def export(
    model_dir: Annotated[Path, typer.Argument(metavar="MODEL_DIR", help="An exported model folder (a job's model/).")],
    images: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="A folder of images to compare PyTorch and ONNX Runtime on (default: random inputs)."),
    ] = None,
    tolerance: Annotated[float, typer.Option(min=0, help="Largest difference of any class probability.")] = 1e-4,
) -> None:
    """Add an ONNX model (dynamic batch) to MODEL_DIR, kept only if ONNX Runtime agrees with PyTorch on the same
    inputs; the check goes into the model card (needs the onnx extra)."""
    from clusterfit.outputs.layout import model_card_file

    if not model_card_file(model_dir).is_file():
        raise _fail(f"{model_dir}: no model_card.json; pass the model/ folder of a finished job")
    with long_lived_imports():  # torch, torchvision and ONNX: after the cheap check
        from clusterfit.scoring.onnx_export import export_onnx

    try:
        check = export_onnx(model_dir, images, tolerance)
    except ClusterfitError as exc:
        raise _fail(str(exc)) from None
    console.print(
        f"{check.path}: ONNX Runtime matches PyTorch on {check.inputs} (probabilities within "
        f"{check.max_abs_diff:.1g} of each other, tolerance {check.tolerance:g}; same top-1)",
        markup=False,
        soft_wrap=True,
    )


@app.command("serve")
def serve_model(
    model_dir: Annotated[Path, typer.Argument(metavar="MODEL_DIR", help="A job's model/ folder (model card inside).")],
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 for every interface.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port; 0 picks a free one (printed).")] = 8000,
    runtime: Annotated[str, typer.Option(help="auto (ONNX Runtime if model.onnx is there) | onnx | torch.")] = "auto",
    max_batch: Annotated[
        int, typer.Option(min=1, max=1024, help="Images the model runs at once; 1 = no batching.")
    ] = 32,
    max_wait_ms: Annotated[float, typer.Option(min=0, max=1000, help="Longest wait for a batch to fill.")] = 5.0,
    top_k: Annotated[int, typer.Option(min=1, help="Classes returned per image.")] = 5,
    key_file: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Keys clients must send (one per line); created with a new key if missing."),
    ] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="No keys (loopback addresses only).")] = False,
    tls_cert: Annotated[Optional[Path], typer.Option("--tls-cert", help="PEM certificate: serve HTTPS.")] = None,  # noqa: UP045
    tls_key: Annotated[Optional[Path], typer.Option("--tls-key", help="PEM private key of --tls-cert.")] = None,  # noqa: UP045
    tls_terminated_elsewhere: Annotated[
        bool, typer.Option("--tls-terminated-elsewhere", help="A proxy in front serves HTTPS.")
    ] = False,
    max_body_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body (413 above).")] = 16 << 20,
    backend: Annotated[
        str, typer.Option(help="local (this process) | ray (a Ray Serve app on RAY_ADDRESS).")
    ] = "local",
    replicas: Annotated[
        str, typer.Option(help="--backend ray: copies of the model, or MIN:MAX to autoscale between them.")
    ] = "2",
    cpus_per_replica: Annotated[float, typer.Option(min=0, help="--backend ray: CPUs each replica reserves.")] = 1.0,
) -> None:
    """Serve an exported model over HTTP: POST /predict with an image's bytes (or a JSON batch) returns the top
    classes; requests are batched dynamically. /health, /ready, /metadata (the model card), /stats.

    With --backend ray the model is deployed as a Ray Serve application of --replicas replicas on the cluster at
    RAY_ADDRESS and the command returns; `clusterfit serve-stop` removes it."""
    from clusterfit.outputs.layout import model_card_file, model_onnx
    from clusterfit.service.api import bind, exposure_refusal

    if not model_card_file(model_dir).is_file():
        raise _fail(f"{model_dir}: no model_card.json; give a job's model/ folder (outputs.dir/model)")
    if runtime not in ("auto", "onnx", "torch"):
        raise _fail(f"--runtime {runtime!r}: choose auto, onnx or torch")
    if runtime == "onnx" and not model_onnx(model_dir).is_file():
        raise _fail(f"--runtime onnx: {model_dir} has no model.onnx; run `clusterfit export {model_dir}` first")
    if (tls_cert is None) != (tls_key is None):
        raise _fail("--tls-cert and --tls-key go together; give both for HTTPS, or neither")
    if backend not in ("local", "ray"):
        raise _fail(f"--backend {backend!r}: choose local or ray")
    if backend == "ray" and tls_cert is not None:
        raise _fail("--backend ray serves through Ray Serve's proxy, which has no TLS; use a TLS proxy in front")
    if backend == "ray":
        from clusterfit.spec.serving import ReplicaCount

        try:
            replica_count = ReplicaCount.parse(replicas)
        except SpecError as exc:
            raise _fail(str(exc)) from None
    if no_auth == (key_file is not None):
        raise _fail("give --key-file (clients send one of its keys), or --no-auth on a loopback address")
    refusal = exposure_refusal(host, auth=not no_auth, tls=tls_cert is not None, tls_elsewhere=tls_terminated_elsewhere)
    if refusal:
        raise _fail(refusal.replace("run jobs", "use the model"))
    with long_lived_imports():  # torch and torchvision: the endpoint's first answer comes sooner
        from clusterfit.scoring.serve import (
            ServeSettings,
            create_serving_app,
            load_predictor,
            read_or_create_keys,
            run_endpoint,
        )

    say = partial(console.print, markup=False, highlight=False, soft_wrap=True)
    try:
        keys = read_or_create_keys(key_file, say) if key_file is not None else ()
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    settings = ServeSettings(
        keys=keys, max_batch=max_batch, max_wait_ms=max_wait_ms, top_k=top_k, max_body_bytes=max_body_bytes
    )
    if backend == "ray":
        from clusterfit.scoring.ray_serve import deploy

        url = deploy(
            model_dir,
            settings,
            runtime=runtime,
            replicas=replica_count,
            cpus_per_replica=cpus_per_replica,
            host=host,
            port=port or 8000,
        )
        say(
            f"clusterfit serve on Ray Serve: {replica_count} replica(s) at {url} (POST /predict); serve-stop removes it"
        )
        return
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise _fail(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port or --host") from None
    predictor = load_predictor(model_dir, runtime)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    say(f"model {model_dir} on {predictor.runtime}, batches of up to {max_batch} within {max_wait_ms:g} ms")
    app = create_serving_app(model_dir, predictor, settings)
    run_endpoint(app, sock, tls_cert=tls_cert, tls_key=tls_key, announce=say)


@app.command("serve-stop")
def serve_stop() -> None:
    """Remove the model endpoint `clusterfit serve --backend ray` deployed on the Ray cluster at RAY_ADDRESS."""
    from clusterfit.scoring.ray_serve import stop

    stop()
    console.print("the Ray Serve application is removed", markup=False)


@app.command("warm-start")
def warm_start(
    socket_path: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--socket", help="Where to listen; default: a private folder of this account's runtime folder."),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", help="No `export` line for a shell: the program that started it sets it.")
    ] = False,
) -> None:
    """Keep torch, torchvision and the trainer imported, and fork every local job's agent from here.

    While `CLUSTERFIT_WARM_START` names its socket in the environment of `clusterfit run`, `sweep run` or
    `server`, a job's agent starts without importing them again: about 2 s less CPU and wall time per job.
    Runs until Ctrl-C or SIGTERM, then ends once the agents it started have ended."""
    from clusterfit.backends.warm_start import WARM_START_ENV, default_socket_path, serve

    path = (socket_path or default_socket_path()).absolute()
    if not quiet:
        errors.print(f"export {WARM_START_ENV}={path}", markup=False, highlight=False)
    try:
        serve(path)
    except ClusterfitError as exc:  # a socket path it cannot use
        raise _fail(str(exc)) from None


@app.command()
def score(
    model_dir: Annotated[Path, typer.Argument(metavar="MODEL_DIR", help="An exported model folder (a job's model/).")],
    input_path: Annotated[
        str,
        typer.Argument(
            metavar="INPUT", help="Images: a folder of class folders, a flat folder, a packed dataset, or a URL."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="The job's outputs folder (predictions.parquet, summary.json).")],
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks on this machine; each image is scored by one.")] = 1,
    top_k: Annotated[int, typer.Option("--top-k", help="Classes per image (capped at the model's classes).")] = 5,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per forward pass.")] = 64,
    chunk_images: Annotated[
        int, typer.Option("--chunk-images", min=1, help="At most this many images per chunk file (a rerun redoes one).")
    ] = 1024,
    csv: Annotated[bool, typer.Option("--csv", help="Also write predictions.csv.")] = False,
) -> None:
    """Score every image in INPUT with MODEL_DIR's model on --nproc ranks: top-k classes and probabilities per
    image in OUT/predictions.parquet. Killed and run again, it scores only what is not done yet (needs pyarrow)."""
    from clusterfit.service.local_jobs import checked_spec
    from clusterfit.spec.scoring import scoring_spec

    def load() -> JobSpec:
        return scoring_spec(
            str(model_dir),
            input_path,
            str(out),
            nproc=nproc,
            top_k=top_k,
            batch_size=batch_size,
            chunk_images=chunk_images,
            csv=csv,
        )

    with _one_line_errors():
        spec = checked_spec(load)
    _run_in_foreground(spec)


data_app = typer.Typer(
    help="Prepare training data: pack folders into shards, stage from object storage.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(data_app, name="data")


@data_app.command("pack")
def data_pack(
    src: Annotated[str, typer.Argument(help="An ImageNet-layout folder: `SRC/<class>/<image>`.")],
    dst: Annotated[str, typer.Argument(help="A new folder for shard-*.tar and index.json.")],
    shard_size: Annotated[str, typer.Option("--shard-size", help="Bytes per shard, e.g. 256MB or 1GiB.")] = "256MB",
    max_side: Annotated[int, typer.Option("--max-side", min=16, help="Longer image side after re-encoding.")] = 320,
) -> None:
    """Pack a folder into WebDataset-style tar shards (KEY.jpg + KEY.cls) with an index; bad images are skipped."""
    from clusterfit.data.shards import pack_folder, parse_size

    try:
        size = parse_size(shard_size)
        report = pack_folder(src, dst, shard_size=size, max_side=max_side)
    except (ClusterfitError, ValueError) as exc:
        raise _fail(str(exc)) from None
    for file, reason in report.skipped:
        errors.print(f"skipped {file}: {reason}", markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"packed {report.samples} images into {report.shards} shard(s), {report.bytes / 1e6:.1f} MB, in "
        f"{report.seconds:.1f} s ({report.samples / max(report.seconds, 1e-9):.0f} images/s); "
        f"skipped {len(report.skipped)}; index: {Path(dst) / 'index.json'}",
        markup=False,
    )


@data_app.command("stage")
def data_stage(
    url: Annotated[str, typer.Argument(help="Where the data is: az://container/path, s3://bucket/path, file://...")],
    cache_dir: Annotated[str, typer.Argument(metavar="DIR", help="The node-local cache folder.")],
    account_name: Annotated[Optional[str], typer.Option(help="Storage account (az://).")] = None,  # noqa: UP045
    endpoint: Annotated[Optional[str], typer.Option(help="Service endpoint URL (emulators).")] = None,  # noqa: UP045
    workers: Annotated[int, typer.Option(min=1, max=128, help="Parallel transfers.")] = 32,
) -> None:
    """Copy a dataset from object storage into DIR, verified and resumable, as a job's workers would.

    Credentials come from the environment: AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY,
    AZURE_STORAGE_SAS_TOKEN (or CLUSTERFIT_STORAGE_SAS_TOKEN), AWS_* for s3://."""
    from clusterfit.data.staging import Credentials, describe, stage
    from clusterfit.outputs import STORAGE_SAS_TOKEN_ENV

    token = os.environ.get(STORAGE_SAS_TOKEN_ENV) or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    creds = Credentials(account_name=account_name, endpoint=endpoint, sas_token=token or None)
    try:
        report = stage(url, cache_dir, creds, workers=workers)
    except ClusterfitError as exc:
        raise _fail(str(exc), 1) from None
    console.print(describe(report), markup=False, soft_wrap=True)


app.add_typer(bench_app, name="bench")

sweep_app = typer.Typer(
    help="Hyperparameter sweeps: trials of one job side by side in the queue, the losers stopped early.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(sweep_app, name="sweep")
SweepName = Annotated[str, typer.Argument(metavar="NAME", help="The sweep's name (sweep.yaml's `name`).")]


@sweep_app.command("run")
def sweep_run(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="The sweep spec.")],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Change a sweep field (max_trials=4) or, for any other key, the base job of every trial "
            "(trainer.epochs=2). Repeatable.",
        ),
    ] = None,
    poll: Annotated[float, typer.Option(min=0.1, help="Seconds between looks at the running trials.")] = 2.0,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Run a sweep until its trial budget is spent: each trial is a job of the queue; running it again after an
    interruption continues where it was. Needs the sweep extra (Optuna)."""
    from clusterfit.sweep.driver import SweepDriver
    from clusterfit.sweep.spec import load_sweep

    try:
        require_sweep_extra()
        sweep, job_file = load_sweep(sweep_file, overrides)
    except ClusterfitError as exc:
        raise _fail(str(exc), 2) from None
    with _jobs(server, token) as jobs:
        SweepDriver(sweep, job_file, jobs, poll_s=poll, say=lambda line: console.print(line, markup=False)).run()
        _print_sweep(sweep.name, jobs)


@sweep_app.command("status")
def sweep_status(
    name: SweepName,
    plot: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional here
        typer.Option(help="Also draw every trial's metric against its step into this PNG (matplotlib)."),
    ] = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """The sweep's trials, best first: parameters, state, metric, reports, wall time, job and outputs."""
    with _jobs(server, token) as jobs:
        _print_sweep(name, jobs)
    if plot is not None:
        from clusterfit.sweep.driver import sweep_curves
        from clusterfit.sweep.render import plot_trials

        try:
            console.print(f"plot: {plot_trials(name, *sweep_curves(name), plot)}", markup=False)
        except ClusterfitError as exc:
            raise _fail(str(exc), 2) from None


@sweep_app.command("cancel")
def sweep_cancel(name: SweepName, server: ServerOption = None, token: TokenOption = None) -> None:
    """Stop every running trial (a cancel of its job) and the sweep's driver."""
    from clusterfit.sweep.driver import cancel_sweep

    with _jobs(server, token) as jobs:
        cancelled = cancel_sweep(_known_sweep(name), jobs)
    console.print(f"sweep {name} cancelled; jobs stopped: {', '.join(cancelled) or 'none'}", markup=False)


def require_sweep_extra() -> None:
    from clusterfit.sweep.study import require_optuna

    try:
        require_optuna()
    except ClusterfitError as exc:
        raise _fail(str(exc), 2) from None


def _known_sweep(name: str) -> str:
    from clusterfit.sweep.study import sweep_names

    require_sweep_extra()
    if name not in sweep_names():
        raise _fail(f"no sweep named {name!r}; known: {', '.join(sweep_names()) or 'none'}", 2)
    return name


def _print_sweep(name: str, jobs: JobService) -> None:
    from clusterfit.sweep.driver import sweep_rows
    from clusterfit.sweep.render import sweep_table

    rows, direction = sweep_rows(_known_sweep(name), jobs)
    print_table(sweep_table(name, rows, direction))
    best = next((row for row in rows if row["state"] == "COMPLETE"), None)
    if best is not None:
        console.print(f"best: trial {best['trial']} {best['params']} -> {best['outputs']}", markup=False)


def _print_summary(out: JobOutputs) -> None:
    from clusterfit.outputs import read_summary

    summary = read_summary(out)
    assert summary is not None, "checked by finished_this_run"
    table = Table(title=f"{summary['name']}: {summary['world_size']} worker(s), {summary['precision']}")
    table.add_column("epoch", justify="right")
    table.add_column("images/s", justify="right")
    table.add_column("train loss", justify="right")
    table.add_column("val top-1", justify="right")
    for epoch in summary["epochs"]:
        top1 = epoch.get("val_top1")
        table.add_row(
            str(epoch["epoch"]),
            f"{epoch['images_per_s']:.1f}",
            f"{epoch.get('train_loss', float('nan')):.4f}",
            "-" if top1 is None else f"{top1:.3f}",
        )
    print_table(table)
    inputs = summary.get("inputs") or {}
    if inputs.get("skipped_files"):
        reasons = ", ".join(f"{count} {reason}" for reason, count in inputs["by_reason"].items())
        worst = ", ".join(entry["file"] for entry in inputs["files"][:3])
        console.print(f"skipped {inputs['skipped_files']} unreadable input files ({reasons}): {worst}", markup=False)
    # Paths as they are (brackets and all), each line whole for a script to cut.
    console.print(f"model: {', '.join(summary['exported'])}", markup=False, soft_wrap=True)
    console.print(
        f"summary: {out.summary}  metrics: {out.metrics}  tensorboard: {out.tensorboard}", markup=False, soft_wrap=True
    )


def _print_scoring_summary(out: JobOutputs) -> None:
    from clusterfit.outputs import read_summary
    from clusterfit.outputs.summary import scoring_line

    summary = read_summary(out)
    assert summary is not None, "written by rank 0 before the job succeeded"
    console.print(scoring_line(summary), markup=False, soft_wrap=True)
    for entry in summary["inputs"]["files"][:3]:
        errors.print(f"skipped {entry['file']}: {entry['reason']}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"predictions: {', '.join(summary['exported'])}  summary: {out.summary}", markup=False)


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    main()

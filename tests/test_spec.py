"""The job spec: examples load, every user mistake becomes one line naming the field and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, tiny_job, write_job

from clusterfit.errors import DataError
from clusterfit.launch import preflight
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.spec import SpecError, apply_override, load_spec, validate_spec

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    spec = load_spec(path)
    assert spec.trainer.model.startswith("resnet")
    assert spec.world_size == 2


def test_overrides_keep_yaml_types() -> None:
    spec = load_spec(EXAMPLES[0], ["trainer.epochs=3", "trainer.steps_per_epoch=null", "trainer.channels_last=false"])
    assert spec.trainer.epochs == 3
    assert spec.trainer.steps_per_epoch is None
    assert spec.trainer.channels_last is False


def _set(raw: dict, dotted: str, value: object) -> dict:
    raw = copy.deepcopy(raw)
    *parents, last = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return raw


BAD_SPECS = [
    ("trainer.modle", "resnet18", "trainer.modle: unknown key (did you mean model?); allowed keys here: model, norm"),
    ("trainer.data.imagesize", 32, "trainer.data.imagesize: unknown key (did you mean image_size?); allowed keys"),
    ("trainer.batch_size", 0, "trainer.batch_size = 0: Input should be greater than or equal to 1"),
    ("trainer.batch_size", "big", "trainer.batch_size = 'big': Input should be a valid integer"),
    ("trainer.model", "lenet5", "trainer.model: 'lenet5' is unknown; use a torchvision classification model such as"),
    ("trainer.model", "resnt18", "trainer.model: 'resnt18' is unknown (did you mean resnet18?); use a torchvision"),
    ("trainer.precision", "fp8", "trainer.precision = 'fp8': Input should be 'auto', 'fp32', 'bf16' or 'fp16'"),
    ("trainer.optimizer.lr", -1, "trainer.optimizer.lr = -1: Input should be greater than 0"),
    (
        "trainer.data.loader_workers",
        100_000,
        "trainer.data.loader_workers = 100000: Input should be less than or equal to 128",
    ),
    ("trainer.data.val", "synthetic", "trainer.data: val cannot be 'synthetic'"),
    ("trainer.data.num_classes", None, "trainer.data: synthetic data needs num_classes"),
    ("distribution.process_count_per_instance", 0, "distribution.process_count_per_instance = 0: Input should be"),
    ("resources.backend", "yarn", "resources.backend = 'yarn': Input should be 'local'"),
    ("resources.instance_count", 2, "resources.instance_count is 2 but the local backend runs on one machine"),
    ("name", "has space", "name = 'has space': String should match pattern"),
    (
        "trainer.strategy",
        "zero3",
        "trainer.strategy = 'zero3': Input should be 'ddp', 'fsdp', 'pipeline' or 'localsgd'",
    ),
    (
        "trainer.strategy_options",
        {"stages": 2},
        "trainer.strategy_options.stages: unknown key; this section takes no keys here",
    ),
    ("trainer.grad_compression", "powersgd", None),  # valid with the default ddp
    ("trainer.powersgd_rank", 0, "trainer.powersgd_rank = 0: Input should be greater than or equal to 1"),
    ("trainer.data.train_crop_size", 8, "trainer.data.train_crop_size = 8: Input should be greater than or equal"),
    (
        "trainer.data.val_resize_size",
        24,
        "trainer.data: val_resize_size = 24 is smaller than val_crop_size (null: image_size) = 32: the centre crop "
        "must fit inside the resized image; give val_resize_size >= 32 or a smaller crop",
    ),
    ("trainer.data.val_resize_size", 32, None),  # the whole image: a crop as large as the resize
    ("outputs", None, "outputs = None: Input should be a valid dictionary"),
]

STRATEGY_MISTAKES = [
    (
        {"strategy": "pipeline", "strategy_options": {"stages": 4}},
        "trainer.strategy_options.stages = 4 does not divide the 2 workers",
    ),
    (
        {"strategy": "pipeline", "strategy_options": {"stages": 2, "microbatches": 1}},
        "strategy_options.microbatches = 1 is fewer than the 2 stages",
    ),
    (
        {"strategy": "pipeline", "batch_size": 6, "strategy_options": {"microbatches": 4}},
        "batch_size 6 cannot be split into 4 equal microbatches",
    ),
    (
        {"strategy": "pipeline", "precision": "fp16"},
        "precision fp16 (loss scaling) is not supported with strategy pipeline",
    ),
    (
        {"strategy": "localsgd", "strategy_options": {"sync_every": 0}},
        "trainer.strategy_options.sync_every = 0: Input should be greater than or equal to 1",
    ),
    ({"strategy": "fsdp", "grad_compression": "fp16"}, "grad_compression 'fp16' works with strategy ddp only"),
    (
        {"grad_compression": "fp16", "powersgd_rank": 2},
        "powersgd_rank 2 applies to grad_compression powersgd only, not 'fp16'; remove powersgd_rank or set",
    ),
    (
        {"strategy": "fsdp", "strategy_options": {"sync_every": 2}},
        "trainer.strategy_options.sync_every: unknown key; allowed keys here: reshard_after_forward",
    ),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_SPECS, ids=[f"{f}={v}" for f, v, _ in BAD_SPECS])
def test_bad_spec_gives_one_line(tmp_path: Path, field: str, value: object, message: str | None) -> None:
    raw = _set(tiny_job(tmp_path / "out"), field, value)
    if message is None:
        validate_spec(raw)
        return
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, source="job.yaml")
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith("job.yaml: ")
    assert message in text


@pytest.mark.parametrize(("trainer", "message"), STRATEGY_MISTAKES, ids=[m[:30] for _, m in STRATEGY_MISTAKES])
def test_impossible_strategy_combinations_are_refused(tmp_path: Path, trainer: dict, message: str) -> None:
    raw = tiny_job(tmp_path / "out", **trainer)
    with pytest.raises(SpecError) as caught:
        validate_spec(raw)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_strategy_options_round_trip_through_the_resolved_spec(tmp_path: Path) -> None:
    raw = tiny_job(tmp_path / "out", strategy="pipeline", strategy_options={"schedule": "1f1b"})
    dumped = validate_spec(raw).model_dump(mode="json")
    assert dumped["trainer"]["strategy_options"] == {"stages": 2, "microbatches": 4, "schedule": "1f1b"}
    assert validate_spec(dumped).trainer.strategy_options.schedule == "1f1b"


@pytest.mark.parametrize("compression", [{"grad_compression": "fp16"}, {"grad_compression": "powersgd"}])
def test_gradient_compression_round_trips_through_the_resolved_spec(tmp_path: Path, compression: dict) -> None:
    # The launcher writes the resolved spec, defaults included, and every rank reads it back.
    dumped = validate_spec(tiny_job(tmp_path / "out", **compression)).model_dump(mode="json")
    trainer = validate_spec(dumped).trainer
    assert trainer.grad_compression == compression["grad_compression"] and trainer.resolved_powersgd_rank() == 4


def test_val_equal_to_train_is_refused(tmp_path: Path, tiny_imagefolder: Path) -> None:
    train = str(tiny_imagefolder / "train")
    raw = tiny_job(tmp_path / "out", data={"train": train, "val": train + "/", "image_size": 32, "num_classes": None})
    with pytest.raises(SpecError, match="val is the train folder"):
        validate_spec(raw)


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        ("missing", DataError, "trainer.data.train = '{root}': no such folder"),
        ("empty", DataError, "trainer.data.train = '{root}': has no class subfolders"),
        ("no_images", DataError, "trainer.data.train = '{root}': its class folders hold no images"),
        ("parent", SpecError, "holds a train/ folder; point trainer.data.train at {root}/train"),
        ("file", DataError, "trainer.data.train = '{root}': is a file"),
    ],
)
def test_bad_data_folder_is_refused_before_launch(
    tmp_path: Path, tiny_imagefolder: Path, layout: str, error: type[Exception], message: str
) -> None:
    root = {
        "missing": tmp_path / "nope",
        "empty": tmp_path / "empty",
        "no_images": tmp_path / "noimg",
        "parent": tiny_imagefolder,
        "file": tmp_path / "afile",
    }[layout]
    if layout == "empty":
        root.mkdir()
    if layout == "no_images":
        (root / "cat").mkdir(parents=True)
        (root / "cat" / "notes.txt").write_text("not an image")
    if layout == "file":
        root.write_text("x")
    raw = tiny_job(tmp_path / "out", data={"train": str(root), "image_size": 32, "num_classes": None})
    with pytest.raises(error) as caught:
        preflight(validate_spec(raw))
    assert message.format(root=root) in str(caught.value)
    assert not caught.value.retryable  # the same data fails the same way on every attempt


def test_too_little_data_for_one_global_batch(tmp_path: Path, tiny_imagefolder: Path) -> None:
    raw = tiny_job(
        tmp_path / "out",
        batch_size=40,
        data={"train": str(tiny_imagefolder / "train"), "image_size": 32, "num_classes": None},
    )
    with pytest.raises(SpecError, match="2 workers need 80 images per step but the training data has 48"):
        preflight(validate_spec(raw))


def test_num_classes_must_match_folders(tmp_path: Path, tiny_imagefolder: Path) -> None:
    raw = tiny_job(
        tmp_path / "out", data={"train": str(tiny_imagefolder / "train"), "image_size": 32, "num_classes": 5}
    )
    with pytest.raises(SpecError, match="num_classes = 5: .* has 3 class folders"):
        preflight(validate_spec(raw))


def test_override_into_a_value_is_refused() -> None:
    with pytest.raises(SpecError, match="trainer.model is 'resnet18', not a section"):
        apply_override({"trainer": {"model": "resnet18"}}, "trainer.model.depth=3")
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        apply_override({}, "trainer.epochs")


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntrainer: {model: [\n")
    with pytest.raises(SpecError, match=r"job.yaml: .* at line \d+"):
        load_spec(path)


def test_cli_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out"))
    result = run_cli("run", str(job), "--set", "trainer.batch_size=0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines() == [
        f"error: {job}: trainer.batch_size = 0: Input should be greater than or equal to 1"
    ]
    assert not (tmp_path / "out").exists(), "nothing may be written for a refused spec"


def test_dry_run_prints_spec_and_command_and_starts_nothing(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path / "out"))
    result = run_cli("run", str(job), "--dry-run", "--set", "trainer.epochs=3")
    assert result.returncode == 0, result.stderr
    resolved, command = result.stdout.split("# local backend command")
    assert resolved.startswith(f"# {tmp_path / 'out' / 'job.yaml'}")
    assert yaml.safe_load(resolved)["trainer"]["epochs"] == 3
    assert "-m clusterfit.backends.agent --standalone --nnodes=1 --nproc-per-node=2" in command
    assert f"-m clusterfit.worker --spec {tmp_path / 'out' / 'job.yaml'}" in command
    assert not (tmp_path / "out").exists()


def test_sas_token_is_never_printed_or_written_by_the_launcher(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["storage"] = {"account_name": "acct", "sas_token": "sv=2024&sig=SECRETSIGNATURE"}
    result = run_cli("run", str(write_job(tmp_path / "job.yaml", job)), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "SECRETSIGNATURE" not in result.stdout + result.stderr
    assert yaml.safe_load(result.stdout.split("# local backend command")[0])["storage"]["sas_token"] is None


def _validate(job: dict, tmp_path: Path, *args: str) -> list[str]:
    """`clusterfit validate` of the job: its stdout lines when valid, else its stderr lines."""
    path = write_job(tmp_path / "job.yaml", job)
    result = run_cli("validate", str(path), *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == (0 if not result.stderr.strip() else 2), result.stderr
    return (result.stderr or result.stdout).strip().splitlines()


# What a launcher can know of the workers' devices: the local engine's are this machine's (made GPU-less here by
# CUDA_VISIBLE_DEVICES, whatever the machine has); another engine's nodes have the GPUs the spec asks for.
DEVICE_MISTAKES = [
    pytest.param(
        {"trainer": {"precision": "fp16"}},
        (),
        "error: trainer.precision = 'fp16': the workers will run on CPUs (this machine has no GPU) and fp16 needs a "
        "CUDA GPU; use bf16, fp32 or auto",
        id="fp16-on-this-cpu",
    ),
    pytest.param(
        {"trainer": {"precision": "fp16"}},
        ("--backend", "slurm"),
        "error: trainer.precision = 'fp16': the workers will run on CPUs (resources.gpus_per_instance is 0) and fp16 "
        "needs a CUDA GPU; use bf16, fp32 or auto, or give the workers GPUs with resources.gpus_per_instance",
        id="fp16-on-cpu-nodes",
    ),
    pytest.param(
        {"resources": {"gpus_per_instance": 4}},
        (),
        "error: resources.gpus_per_instance = 4: the local engine runs on this machine, which has 0 GPU(s); set it "
        "to 0, or choose an engine whose nodes have GPUs (resources.backend)",
        id="gpus-this-machine-lacks",
    ),
]


@pytest.mark.parametrize(("changes", "args", "line"), DEVICE_MISTAKES)
def test_devices_the_workers_will_not_have_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes: dict, args: tuple[str, ...], line: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    job = tiny_job(tmp_path / "out", **changes.get("trainer", {}))
    job["resources"].update(changes.get("resources", {}))
    assert _validate(job, tmp_path, *args) == [line]


def test_gpus_of_a_remote_engines_nodes_are_not_judged_by_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    job = tiny_job(tmp_path / "out", precision="fp16")
    job["resources"].update({"backend": "slurm", "gpus_per_instance": 4})
    assert _validate(job, tmp_path) == [f"{tmp_path / 'job.yaml'}: ok (resnet_tiny, 2 worker(s), backend slurm)"]


def test_an_outputs_url_never_carries_a_token(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    job["resources"]["backend"] = "slurm"
    job["outputs"]["dir"] = "az://c/x?sv=2025&sig=SECRETSIGNATURE"
    refused = _validate(job, tmp_path)
    assert refused == [
        f"error: {tmp_path / 'job.yaml'}: outputs.dir: a URL with a query string (a SAS token?) would be stored with "
        "the job; give the URL alone and the token in storage.sas_token or the environment"
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"resources": {"backend": "slurm", "slurm": {"partition": "debug\n#SBATCH --uid=0"}}},
            "job: resources.slurm.partition holds a control character ('\\n'); write it on one line of printable text",
        ),
        (
            {"resources": {"backend": "slurm", "slurm": {"extra_sbatch_args": ["--account=x\r"]}}},
            "job: resources.slurm.extra_sbatch_args.0 holds a control character ('\\r');",
        ),
        ({"environment_variables": {"A": "x\x00y"}}, "job: environment_variables.A holds a control character"),
        ({"name": "a\x1bb"}, "job: name holds a control character ('\\x1b');"),
    ],
)
def test_control_characters_never_reach_a_script_or_a_manifest(tmp_path: Path, change: dict, message: str) -> None:
    job = {**tiny_job(tmp_path / "out"), **change}
    with pytest.raises(SpecError) as error:
        validate_spec(job)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    command = {key: value for key, value in tiny_job(tmp_path / "out").items() if key != "trainer"}
    assert (
        validate_spec({**command, "command": "echo a\necho b", "description": "two\nlines"}).command == "echo a\necho b"
    )


ELASTIC_MISTAKES = [
    ({"instance_count": "2:1"}, {}, "resources.instance_count: '2:1' is neither a node count nor MIN:MAX"),
    ({"instance_count": 0}, {}, "give a whole number of at least 1, or MIN:MAX with 1 <= MIN <= MAX"),
    (
        {"instance_count": "1:2"},
        {},
        "resources.instance_count = '1:2' is elastic but distribution.max_restarts = 0, so the first lost node ends "
        "the job; set max_restarts to the node losses it should survive",
    ),
    (
        {"instance_count": "1:2", "backend": "slurm"},
        {"max_restarts": 3},
        "resources.instance_count = '1:2': Slurm gives a job a fixed set of nodes and ends it when one fails",
    ),
    (
        {"instance_count": "1:2", "backend": "local"},
        {"max_restarts": 3},
        "resources.instance_count is 1:2 but the local backend runs on one machine",
    ),
    # A range of 10^8 nodes took 7.7 s of the server's CPU to check (and 10^12 would have taken a day).
    (
        {"instance_count": "1:100000000"},
        {"max_restarts": 3},
        "resources.instance_count: '1:100000000' is more than 65,536 nodes; give at most 65,536",
    ),
    ({"instance_count": "1:" + "9" * 5000}, {"max_restarts": 3}, "is more than 65,536 nodes"),
    (
        {"instance_count": 1024},
        {"process_count_per_instance": 128},
        "resources.instance_count = 1024 with distribution.process_count_per_instance = 128 is 131,072 ranks; a job "
        "has at most 65,536",
    ),
]


@pytest.mark.parametrize(("resources", "distribution", "message"), ELASTIC_MISTAKES)
def test_elastic_node_ranges_are_checked_in_one_line(
    tmp_path: Path, resources: dict, distribution: dict, message: str
) -> None:
    raw = tiny_job(tmp_path / "out")
    raw["resources"] = {"backend": "ray", **resources}
    raw["distribution"].update(distribution)
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, source="job.yaml")
    assert "\n" not in str(caught.value) and message in str(caught.value)


def test_an_elastic_range_is_read_from_yaml_as_written_not_as_a_base_60_number(tmp_path: Path) -> None:
    raw = tiny_job(tmp_path / "out")
    raw["resources"] = {"backend": "ray"}
    raw["distribution"]["max_restarts"] = 3
    text = yaml.safe_dump(raw).replace("backend: ray", "backend: ray\n  instance_count: 1:2")
    assert "instance_count: 1:2\n" in text  # unquoted, as people write it (YAML 1.1 would read 62)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert (spec.resources.min_nodes, spec.resources.max_nodes, spec.resources.elastic) == (1, 2, True)
    assert spec.world_size == 4  # of MAX nodes x 2 processes
    assert load_spec(path, ["resources.instance_count=2:4"]).resources.instance_count == "2:4"
    assert load_spec(path, ["resources.instance_count=3:3"]).resources.instance_count == 3  # not elastic
    assert validate_spec(yaml.safe_load(resolved_spec_text(spec))) == spec  # the resolved spec keeps the range


def test_an_elastic_pipeline_must_divide_every_world_size_of_the_range(tmp_path: Path) -> None:
    raw = tiny_job(tmp_path / "out", strategy="pipeline", strategy_options={"stages": 2})
    raw["resources"] = {"backend": "ray", "instance_count": "1:3"}
    raw["distribution"].update(process_count_per_instance=1, max_restarts=3)
    with pytest.raises(SpecError, match="stages = 2 does not divide the 1 workers; .* for every node count of the"):
        validate_spec(raw)


def test_a_submitted_jobs_relative_paths_are_anchored_where_it_was_submitted(tmp_path: Path) -> None:
    """A job of the service runs in its own outputs folder: a relative path must mean what it meant to `submit`."""
    from clusterfit.spec.model import anchored

    raw = tiny_job(Path("runs/tiny"), data={"train": "data/train", "val": "az://c/val", "num_classes": None})
    raw["trainer"]["init"] = {"weights": "old/model/model.safetensors"}
    spec = anchored(validate_spec(raw), tmp_path)
    assert spec.outputs.dir == str(tmp_path / "runs/tiny")
    assert (spec.trainer.data.train, spec.trainer.data.val) == (str(tmp_path / "data/train"), "az://c/val")
    assert spec.trainer.init.weights == str(tmp_path / "old/model/model.safetensors")
    synthetic = anchored(validate_spec(tiny_job(tmp_path / "out")), tmp_path)
    assert synthetic.trainer.data.train == "synthetic" and synthetic.outputs.dir == str(tmp_path / "out")
    raw["resources"] = {"backend": "kubernetes", "instance_count": 2}
    in_pods = validate_spec(raw)
    assert anchored(in_pods, tmp_path) == in_pods  # places inside the pods, relative to the image's folder


@pytest.mark.parametrize("backend", ["local", "ray", "slurm", "kubernetes"])
def test_a_dry_run_with_outputs_at_a_url_shows_where_the_job_works(backend: str, tmp_path: Path) -> None:
    """`--dry-run` renders what the launcher runs: the job in its copy of the outputs (outputs.cache_dir), and the
    nodes that share no folder in their own; never the URL taken as a path (`file:/...`, `az:/...`)."""
    from clusterfit.backends import get_backend
    from clusterfit.storage.filesystems import cache_folder

    job = tiny_job(tmp_path / "unused")
    job["resources"]["backend"] = backend
    job["outputs"] = {"dir": "az://outputs/runs/tiny", "cache_dir": str(tmp_path / "cache")}
    rendered = get_backend(backend).dry_run(validate_spec(job))
    shown = "\n".join([*rendered.files, *rendered.files.values(), rendered.as_text(), rendered.placement or ""])
    assert "az:/outputs" not in shown.replace("az://outputs", "")
    if backend != "kubernetes":  # a pod's folder is its emptyDir, and its job.yaml a ConfigMap
        assert str(cache_folder("az://outputs/runs/tiny", tmp_path / "cache") / "job.yaml") in rendered.files

"""The user-facing job spec: what a `job.yaml` may say, validated once at the boundary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from clusterfit.spec.model_names import (
    MODEL_NAMES,
    has_residual_stages,
    image_size_problem,
    input_size_is_fixed,
    unknown_model,
)

__all__ = ["MODEL_NAMES"]  # re-exported: the bench commands check their --model flags against it

SYNTHETIC = "synthetic"
# Loader workers per rank when trainer.data.loader_workers is null: the rank's share of the CPUs, at most this
# many, the default of torchvision's reference scripts (-j 16) and the per-GPU count of NVIDIA's ResNet-50 recipe
# on a DGX A100 (16 of its 256 CPUs per GPU). At 8 a DGX A100's ranks left half its cores idle.
AUTO_LOADER_WORKERS_MAX = 16
# A job of the job service sets trainer.data.loader_workers: processes per rank, bounded as stage_workers is.
LOADER_WORKERS_MAX = 128


def is_url(path: str) -> bool:
    """`scheme://...` (az://, s3://, file://, ...), as opposed to a path on a filesystem."""
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


class _Strict(BaseModel):
    # NOTE: a misspelt key must be an error, never silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSpec(_Strict):
    train: str = SYNTHETIC  # "synthetic", a folder, a packed dataset, or a URL (az://, s3://, file://) of either
    val: str | None = None
    mode: Literal["download", "direct"] = Field(
        "download",
        description="URLs: download = copied once per node into cache_dir; direct = packed shards streamed, no copy",
    )
    cache_dir: str = Field("~/.cache/clusterfit/data", description="node-local folder for staged URLs")
    stage_workers: int = Field(32, ge=1, le=128, description="parallel transfers when staging")
    image_size: int = Field(
        224, ge=16, le=1024, description="the network's input side; the default of train_crop_size and val_crop_size"
    )
    train_crop_size: int | None = Field(
        None,
        ge=16,
        le=1024,
        description="side of the random training crop (torchvision's --train-crop-size); null = image_size",
    )
    val_resize_size: int | None = Field(
        None,
        ge=16,
        le=2048,
        description="validation resizes the shorter side to this, then takes the centre crop (torchvision's "
        "--val-resize-size); null = the crop / 0.875, ImageNet's proportion (256 for 224)",
    )
    val_crop_size: int | None = Field(
        None,
        ge=16,
        le=1024,
        description="side of the validation centre crop (torchvision's --val-crop-size); null = image_size",
    )
    num_classes: int | None = Field(None, ge=2)
    synthetic_images: int = Field(12_800, ge=1, description="images in one synthetic epoch")
    loader_workers: int | None = Field(
        None,
        ge=0,
        le=LOADER_WORKERS_MAX,
        description=f"DataLoader processes per rank; null = the rank's share of the CPUs, at most "
        f"{AUTO_LOADER_WORKERS_MAX}",
    )
    shuffle_buffer: int = Field(2048, ge=1, description="packed datasets: samples shuffled together in a block")
    max_bad_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        description="the job fails once more unreadable files were skipped than this share of an epoch",
    )

    @model_validator(mode="after")
    def _val_is_not_train(self) -> DataSpec:
        if self.val == SYNTHETIC:
            raise ValueError("val cannot be 'synthetic'; use null to skip validation")
        if self.val is not None and self.val.rstrip("/") == self.train.rstrip("/"):
            raise ValueError(f"val is the train folder {self.train!r}; give a separate validation folder or null")
        if self.train == SYNTHETIC and self.num_classes is None:
            raise ValueError("synthetic data needs num_classes (e.g. 1000)")
        return self

    @model_validator(mode="after")
    def _val_crop_fits_the_resize(self) -> DataSpec:
        if self.val_resize_size is not None and self.val_crop > self.val_resize_size:
            named = "val_crop_size" if self.val_crop_size is not None else "val_crop_size (null: image_size)"
            raise ValueError(
                f"val_resize_size = {self.val_resize_size} is smaller than {named} = {self.val_crop}: the centre "
                f"crop must fit inside the resized image; give val_resize_size >= {self.val_crop} or a smaller crop"
            )
        return self

    @property
    def is_synthetic(self) -> bool:
        return self.train == SYNTHETIC

    @property
    def train_crop(self) -> int:
        """The side of the training images: train_crop_size, else image_size."""
        return self.train_crop_size or self.image_size

    @property
    def val_crop(self) -> int:
        """The side of the validation images (and of what a scorer feeds the model): val_crop_size, else image_size."""
        return self.val_crop_size or self.image_size

    def workers_per_rank(self, cpus: int, ranks_on_node: int) -> int:
        """The DataLoader processes of each rank: loader_workers, or the rank's share of the node's `cpus`."""
        if self.loader_workers is not None:
            return self.loader_workers
        return max(1, min(AUTO_LOADER_WORKERS_MAX, cpus // max(1, ranks_on_node)))


class OptimizerSpec(_Strict):
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0, description="learning rate per 256 images; scaled by global batch / 256")
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(1e-4, ge=0)


class ScheduleSpec(_Strict):
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_epochs: float = Field(0.0, ge=0)


class CheckpointSpec(_Strict):
    every_steps: int | None = Field(200, ge=1, description="null = only at epochs' ends")
    min_interval_s: float = Field(
        60.0,
        ge=0,
        description="an epoch's end is checkpointed once this long has passed since the last checkpoint (0: every "
        "epoch's end); the last epoch, an early stop, a new best (export_weights: best) and every_steps always are",
    )
    keep: int = Field(3, ge=1)
    async_save: bool = Field(
        False,
        description="copy the state in memory and write it in a background thread while training goes on; "
        "rank 0 writes and publishes it, one save in flight, the last one finished before export",
    )


class DdpOptions(_Strict):
    strategy: Literal["ddp"] = Field("ddp", exclude=True)


class FsdpOptions(_Strict):
    strategy: Literal["fsdp"] = Field("fsdp", exclude=True)
    reshard_after_forward: bool = True


class PipelineOptions(_Strict):
    strategy: Literal["pipeline"] = Field("pipeline", exclude=True)
    stages: int = Field(2, ge=2, le=4, description="the ResNet is cut at its residual stages")
    microbatches: int = Field(4, ge=1)
    schedule: Literal["gpipe", "1f1b"] = "gpipe"


class LocalSgdOptions(_Strict):
    strategy: Literal["localsgd"] = Field("localsgd", exclude=True)
    sync_every: int = Field(8, ge=1, description="average parameters every k steps")
    warmup_steps: int = Field(100, ge=0, description="steps of plain DDP before workers step independently")


StrategyOptions = Annotated[
    DdpOptions | FsdpOptions | PipelineOptions | LocalSgdOptions, Field(discriminator="strategy")
]


SMALL_IMAGE_PX = 64  # at or below: the `auto` augmentation preset is `small`
# Rank 1 (PyTorch's example) lost about 30 points of val top-1 in an 8-epoch job where rank 4 lost about 1
# (benchmarks/RESULTS.md, accuracy with gradient compression).
DEFAULT_POWERSGD_RANK = 4


class AugmentSpec(_Strict):
    """Training-time augmentation. A preset sets every field; fields given here override it. `auto` picks
    `small` for images of at most 64 px (or non-photographic ones, choose it yourself) and `imagenet` above."""

    preset: Literal["auto", "imagenet", "small"] = "auto"
    crop_scale: tuple[float, float] | None = Field(
        None, description="RandomResizedCrop's area range; imagenet (0.08, 1), small (0.64, 1)"
    )
    crop_ratio: tuple[float, float] | None = Field(None, description="aspect-ratio range; both presets (3/4, 4/3)")
    flip: bool | None = Field(None, description="random horizontal flip; imagenet yes, small no")
    policy: Literal["none", "randaugment", "trivialaugment", "autoaugment"] = "none"
    random_erasing: float = Field(0.0, ge=0, le=1, description="probability of erasing a random rectangle")
    mixup_alpha: float = Field(
        0.0, ge=0, description="MixUp on each batch, on the device, with Beta(alpha, alpha) weights; 0 = off"
    )
    cutmix_alpha: float = Field(
        0.0, ge=0, description="CutMix on each batch; with mixup_alpha too, each batch gets one of the two"
    )

    @model_validator(mode="after")
    def _ranges(self) -> AugmentSpec:
        for name in ("crop_scale", "crop_ratio"):
            low_high = getattr(self, name)
            if low_high is not None and not 0 < low_high[0] <= low_high[1]:
                raise ValueError(f"{name} = {list(low_high)}: give [low, high] with 0 < low <= high")
        if self.crop_scale is not None and self.crop_scale[1] > 1:
            raise ValueError(f"crop_scale = {list(self.crop_scale)}: the area share is at most 1")
        return self

    def resolved(self, train_crop: int) -> ResolvedAugment:
        """Every field decided; `auto` by the side of the training crops."""
        preset = self.preset
        why = "as set"
        if preset == "auto":
            preset = "small" if train_crop <= SMALL_IMAGE_PX else "imagenet"
            why = f"auto: train crop {train_crop} px {'<=' if preset == 'small' else '>'} {SMALL_IMAGE_PX}"
        small = preset == "small"
        return ResolvedAugment(
            preset=preset,
            why=why,
            crop_scale=self.crop_scale or ((0.64, 1.0) if small else (0.08, 1.0)),
            crop_ratio=self.crop_ratio or (3 / 4, 4 / 3),
            flip=self.flip if self.flip is not None else not small,
            policy=self.policy,
            random_erasing=self.random_erasing,
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
        )


class ResolvedAugment(BaseModel):
    """What a job's training transform does, every field decided."""

    model_config = ConfigDict(frozen=True)
    preset: str
    why: str
    crop_scale: tuple[float, float]
    crop_ratio: tuple[float, float]
    flip: bool
    policy: str
    random_erasing: float
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def describe(self) -> str:
        parts = [
            f"preset {self.preset} ({self.why})",
            f"crop scale {self.crop_scale[0]:g}-{self.crop_scale[1]:g}",
            "flip" if self.flip else "no flip",
        ]
        if self.policy != "none":
            parts.append(self.policy)
        if self.random_erasing:
            parts.append(f"random erasing p={self.random_erasing:g}")
        if self.mixup_alpha:
            parts.append(f"mixup alpha={self.mixup_alpha:g}")
        if self.cutmix_alpha:
            parts.append(f"cutmix alpha={self.cutmix_alpha:g}")
        return "augmentation: " + ", ".join(parts)


ValMetric = Literal["val_top1", "val_top5", "val_loss"]  # val_loss is better lower, the others higher


class EarlyStoppingSpec(_Strict):
    metric: ValMetric = "val_top1"
    patience: int = Field(3, ge=1, description="validations without improvement before the job ends")
    min_delta: float = Field(0.0, ge=0, description="a smaller change does not count as an improvement")


class EmaSpec(_Strict):
    decay: float = Field(0.999, gt=0, lt=1, description="weight of the average's past at each update")
    every_steps: int = Field(1, ge=1, description="update the average every k optimizer steps")


class InitSpec(_Strict):
    weights: str = Field(
        description="a .safetensors file (e.g. an earlier job's model/model.safetensors) or a torch state dict, "
        "read weights-only, or a URL of one (az://, s3://, file://; staged like data); the classifier head is "
        "replaced when the class count differs"
    )
    freeze_backbone_epochs: int = Field(0, ge=0, description="train only the classifier head for this many epochs")


class TrainerSpec(_Strict):
    model: str = Field("resnet50", description="a torchvision classification model by name, or resnet_tiny")
    norm_layer: Literal["batch", "group"] = "batch"
    data: DataSpec = DataSpec(num_classes=1000)
    epochs: int = Field(1, ge=1)
    steps_per_epoch: int | None = Field(None, ge=1, description="optional cap on steps per epoch")
    batch_size: int = Field(64, ge=1, description="images per worker per step")
    accumulate_steps: int = Field(
        1,
        ge=1,
        description="batches whose gradients add up to one optimizer step: the global batch is "
        "batch_size x workers x accumulate_steps, for a global batch larger than memory",
    )
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    augment: AugmentSpec = AugmentSpec()
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    channels_last: bool = False
    checkpoint: CheckpointSpec = CheckpointSpec()
    log_every_steps: int = Field(10, ge=1)
    seed: int = Field(0, ge=0)
    strategy: Literal["ddp", "fsdp", "pipeline", "localsgd"] = "ddp"
    strategy_options: StrategyOptions = DdpOptions()
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    powersgd_rank: int | None = Field(
        None,
        ge=1,
        le=64,
        description=f"grad_compression: powersgd: the rank of each gradient's approximation (null: "
        f"{DEFAULT_POWERSGD_RANK}); lower sends less and loses more accuracy (benchmarks/RESULTS.md)",
    )
    export_weights: Literal["last", "best"] = Field(
        "last", description="export the weights of the last step, or those of the best validation (best_metric)"
    )
    best_metric: ValMetric = Field("val_top1", description="what `export_weights: best` compares")
    init: InitSpec | None = Field(None, description="starting weights for fine-tuning; null = from scratch")
    ema: EmaSpec | None = Field(
        None, description="validate and export an exponential moving average of the weights; null = off"
    )
    clip_grad_norm: float | None = Field(
        None, gt=0, description="clip the gradients' global L2 norm to this value before each step; null = off"
    )
    validate_every_epochs: int = Field(1, ge=1, description="validate after every Nth epoch and after the last")
    stop_at: dict[ValMetric, float] = Field(
        default_factory=dict,
        description="end the job once a validation metric reaches this value, e.g. {val_top1: 0.95}; the time "
        "it took is in summary.json",
    )
    early_stopping: EarlyStoppingSpec | None = Field(
        None, description="end the job when the metric has not improved for `patience` validations"
    )
    ddp_bucket_cap_mb: float | None = Field(
        None,
        gt=0,
        description="DDP gradient bucket size in MB (null = PyTorch's 25): smaller buckets start communicating "
        "earlier in backward, larger ones make fewer, bigger messages",
    )

    @model_validator(mode="before")
    @classmethod
    def _options_follow_strategy(cls, data: Any) -> Any:
        # NOTE: users write `strategy_options` without a tag; the strategy field says which kind it is.
        if isinstance(data, dict):
            options = data.get("strategy_options")
            strategy = data.get("strategy", "ddp")
            if options is None or isinstance(options, dict):
                data = {**data, "strategy_options": {**(options or {}), "strategy": strategy}}
        return data

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        problem = unknown_model(name)
        if problem:
            raise ValueError(problem)
        return name

    def resolved_powersgd_rank(self) -> int:
        return self.powersgd_rank or DEFAULT_POWERSGD_RANK

    def resolved_augment(self) -> ResolvedAugment:
        """The training transform's settings, `auto` decided by the training crop's side."""
        return self.augment.resolved(self.data.train_crop)

    @model_validator(mode="after")
    def _model_fits(self) -> TrainerSpec:
        data = self.data
        for field in ("image_size", "train_crop_size", "val_crop_size"):
            size = getattr(data, field)
            problem = size is not None and image_size_problem(self.model, size)
            if problem:
                raise ValueError(f"data.{field} = {size}: {problem}")
            if size is not None and size != data.image_size and input_size_is_fixed(self.model):
                raise ValueError(
                    f"data.{field} = {size}: {self.model} is built for data.image_size = {data.image_size} and "
                    f"takes only that size; set {field} to {data.image_size} or null"
                )
        if not has_residual_stages(self.model):
            if self.norm_layer == "group":
                raise ValueError(
                    f"norm_layer: group applies to ResNet-style models, not {self.model}; use norm_layer: batch"
                )
            if self.strategy == "pipeline":
                raise ValueError(
                    f"strategy pipeline cuts ResNet-style models at their residual stages, not {self.model}; "
                    "use strategy ddp or fsdp"
                )
        return self

    @model_validator(mode="after")
    def _stopping_needs_validation(self) -> TrainerSpec:
        wants = "stop_at" if self.stop_at else "early_stopping" if self.early_stopping else None
        if self.export_weights == "best":
            wants = "export_weights: best"
        if wants and self.data.val is None:
            raise ValueError(f"{wants} decides on validation metrics, but data.val is null; give a validation folder")
        return self

    @model_validator(mode="after")
    def _strategy_combinations(self) -> TrainerSpec:
        if self.init is not None and self.init.freeze_backbone_epochs and self.strategy == "pipeline":
            raise ValueError(
                "init.freeze_backbone_epochs needs the whole model on each rank, which strategy pipeline splits; "
                "use strategy ddp or fsdp, or set freeze_backbone_epochs: 0"
            )
        if self.accumulate_steps > 1 and self.strategy not in ("ddp", "fsdp"):
            raise ValueError(
                f"accumulate_steps = {self.accumulate_steps} works with strategy ddp or fsdp, not {self.strategy}"
                f"{' (whose microbatches already split each batch)' if self.strategy == 'pipeline' else ''}; "
                "set accumulate_steps: 1"
            )
        if self.ema is not None and self.strategy != "ddp":
            raise ValueError(
                f"ema averages the whole model on every rank, which strategy {self.strategy} does not hold "
                "(sharded, split or diverging between syncs); use strategy ddp, or set ema: null"
            )
        if self.clip_grad_norm is not None and self.strategy == "pipeline":
            raise ValueError(
                "clip_grad_norm needs the norm over all parameters, which strategy pipeline splits across stages; "
                "use strategy ddp or fsdp, or set clip_grad_norm: null"
            )
        if self.grad_compression != "none" and self.strategy != "ddp":
            raise ValueError(
                f"grad_compression {self.grad_compression!r} works with strategy ddp only, not {self.strategy!r}; "
                "set grad_compression: none"
            )
        if self.powersgd_rank is not None and self.grad_compression != "powersgd":
            raise ValueError(
                f"powersgd_rank {self.powersgd_rank} applies to grad_compression powersgd only, not "
                f"{self.grad_compression!r}; remove powersgd_rank or set grad_compression: powersgd"
            )
        options = self.strategy_options
        if isinstance(options, PipelineOptions):
            if options.microbatches < options.stages:
                raise ValueError(
                    f"strategy_options.microbatches = {options.microbatches} is fewer than the {options.stages} "
                    "stages, which would leave stages idle; use at least as many microbatches as stages"
                )
            if self.batch_size % options.microbatches:
                raise ValueError(
                    f"batch_size {self.batch_size} cannot be split into {options.microbatches} equal microbatches; "
                    "make batch_size a multiple of strategy_options.microbatches"
                )
            if self.precision == "fp16":
                raise ValueError("precision fp16 (loss scaling) is not supported with strategy pipeline; use bf16")
        return self


class StorageSpec(_Strict):
    """Credentials for URL inputs, when the environment (AZURE_STORAGE_*, AWS_*) does not provide them."""

    account_name: str | None = None
    endpoint: str | None = Field(None, description="blob/S3 endpoint URL, for emulators and other clouds")
    sas_token: SecretStr | None = None

    @field_serializer("sas_token")
    def _never_written(self, value: SecretStr | None) -> None:
        # NOTE: the token is never written anywhere (job.yaml, checkpoints, summary.json); the launcher hands it
        # to the workers in their environment.
        return None


class DistributionSpec(_Strict):
    type: Literal["pytorch", "mpi", "tensorflow"] = Field(
        "pytorch",
        description="the environment a command job's processes see: torchrun's (pytorch), OMPI_*/PMI_* (mpi), "
        "TF_CONFIG (tensorflow); the built-in trainer needs pytorch",
    )
    process_count_per_instance: int = Field(1, ge=1, le=1024)
    max_restarts: int = Field(0, ge=0, description="times torchrun restarts all workers after a failure")
    parameter_server_count: int = Field(
        0, ge=0, description="tensorflow: parameter-server tasks; only 0 (every process is a worker) is supported"
    )

    @field_validator("parameter_server_count")
    @classmethod
    def _no_parameter_servers(cls, count: int) -> int:
        # NOTE: TF_CONFIG names every process a worker, for MultiWorkerMirroredStrategy; parameter-server
        # training also needs a coordinator that places ps tasks, which no engine here starts.
        if count:
            raise ValueError(
                f"{count}: parameter-server training is not supported; set 0 and use "
                "tf.distribute.MultiWorkerMirroredStrategy (every process is a worker)"
            )
        return count


class SlurmSpec(_Strict):
    partition: str | None = Field(None, description="sbatch --partition; null = the cluster's default")
    time_limit_minutes: int | None = Field(None, ge=1, description="sbatch --time; null = the partition's limit")
    checkpoint_signal_seconds: int = Field(
        120, ge=10, description="SIGUSR1 this long before the time limit: the trainer checkpoints and the job requeues"
    )
    extra_sbatch_args: list[str] = Field(default_factory=list, description="more #SBATCH lines, e.g. --account=x")


class KubernetesSpec(_Strict):
    image: str = Field("clusterfit:cpu", description="the worker image (see the Dockerfile)")
    namespace: str = "default"
    outputs_claim: str = Field(
        "clusterfit-outputs", description="a ReadWriteMany PersistentVolumeClaim mounted at outputs.dir on every pod"
    )
    data_claim: str | None = Field(None, description="a PersistentVolumeClaim mounted read-only at /data")
    cpu: str = Field("2", description="CPU request and limit per pod")
    memory: str = Field("8Gi", description="memory request and limit per pod")
    service_account: str | None = Field(
        None,
        description="the pods' service account, whose token is then mounted (a workload identity for storage); "
        "without one no token is mounted, so a job's code cannot call the cluster's API",
    )
    run_as_user: int = Field(
        1000, ge=1, description="the user and group id the pods run as, never root (restricted Pod Security Standard)"
    )


# The most ranks (and so nodes) a job may have: what reads a job's files goes through its ranks one by one, and
# the spec's own checks through its node counts. Far above the largest jobs torchrun's rendezvous serves.
MAX_RANKS = 65_536


def node_range(value: object) -> tuple[int, int]:
    """`instance_count` as (fewest, most) nodes: 4 is (4, 4), "2:4" an elastic job of 2 to 4 nodes."""
    text = "" if isinstance(value, bool) else str(value).strip()
    low, colon, high = text.partition(":")
    high = high if colon else low
    if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
        raise ValueError(
            f"{value!r} is neither a node count nor MIN:MAX; give a whole number of at least 1, or MIN:MAX with "
            "1 <= MIN <= MAX for an elastic job (for example 1:4)"
        )
    if max(len(low.lstrip("0")), len(high.lstrip("0"))) > len(str(MAX_RANKS)) or int(high) > MAX_RANKS:
        raise ValueError(f"{str(value)[:40]!r} is more than {MAX_RANKS:,} nodes; give at most {MAX_RANKS:,}")
    if not 1 <= int(low) <= int(high):
        raise ValueError(
            f"{value!r} is neither a node count nor MIN:MAX; give a whole number of at least 1, or MIN:MAX with "
            "1 <= MIN <= MAX for an elastic job (for example 1:4)"
        )
    return int(low), int(high)


def _node_count_or_range(value: object) -> int | str:
    low, high = node_range(value)
    return low if low == high else f"{low}:{high}"  # "4:4" is the plain 4, so rendering never sees a range of one


class ResourcesSpec(_Strict):
    instance_count: Annotated[int | str, BeforeValidator(_node_count_or_range)] = Field(
        1,
        description="nodes; torchrun's agent runs once on each. MIN:MAX (e.g. 1:4) for an elastic job that starts "
        "with MIN and takes up to MAX, losing and gaining nodes while it runs (see docs/engines.md#elastic-jobs)",
    )
    backend: Literal["local", "ray", "slurm", "kubernetes"] = "local"
    gpus_per_instance: int = Field(0, ge=0, description="GPUs per node (Slurm --gpus-per-node, nvidia.com/gpu)")
    ray_address: str | None = Field(
        None,
        description="ray backend: the cluster (host:port, ray://host:port or auto); null = $RAY_ADDRESS, else auto",
    )
    slurm: SlurmSpec = SlurmSpec()
    kubernetes: KubernetesSpec = KubernetesSpec()

    @property
    def min_nodes(self) -> int:
        return node_range(self.instance_count)[0]

    @property
    def max_nodes(self) -> int:
        return node_range(self.instance_count)[1]

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes


class OutputsSpec(_Strict):
    dir: str = Field(
        description="the job's folder (checkpoints, logs, metrics, model), or a URL (az://, s3://, file://) of a "
        "store it is copied to while the job runs"
    )
    cache_dir: str = Field(
        "~/.cache/clusterfit/outputs",
        description="with a URL dir: where on the node the job works, each URL in its own folder",
    )
    upload_every_s: float = Field(
        10.0, gt=0, le=3600, description="with a URL dir: seconds between uploads of what changed"
    )


class LimitsSpec(_Strict):
    max_retries: int = Field(
        0, ge=0, le=100, description="times the job service re-runs a failed job from its last checkpoint"
    )
    hang_timeout: int = Field(
        1800, ge=5, description="seconds without a training step on any rank before the job counts as hung"
    )
    collective_timeout: int = Field(
        600, ge=5, description="seconds a rank waits in one collective (all-reduce, barrier) before it fails"
    )


class QueueSettingsSpec(_Strict):
    priority: int = Field(0, ge=-1000, le=1000, description="queued jobs with a higher priority start first")


class ScorerSpec(_Strict):
    """Batch scoring with an exported model: every image of `input` scored once, across every rank."""

    model_dir: str = Field(description="an exported model folder (a job's model/, with model_card.json)")
    input: str = Field(
        description="images to score: an ImageNet-layout folder, a flat folder, a packed dataset, or a URL of a folder"
    )
    top_k: int = Field(5, ge=1, description="classes kept per image, at most the model's class count")
    batch_size: int = Field(64, ge=1, description="images per forward pass")
    chunk_images: int = Field(
        1024,
        ge=1,
        description="at most this many images per published chunk file (fewer, to give each rank a few); a rerun "
        "after a crash redoes at most one per rank",
    )
    csv: bool = Field(False, description="also write predictions.csv")
    cache_dir: str = Field("~/.cache/clusterfit/data", description="node-local folder for a staged URL input")
    stage_workers: int = Field(32, ge=1, le=128, description="parallel transfers when staging")


# Variables that change how a program is loaded or which program runs: a job setting them would run code of its
# choosing inside clusterfit's own processes (the agent, the workers, the supervisor's tools), not only its own.
_LOADER_PREFIXES = ("PYTHON", "LD_", "DYLD_", "BASH_FUNC_", "PERL5", "RUBY", "NODE_", "JAVA_TOOL_", "_JAVA_")
_LOADER_NAMES = frozenset({"BASH_ENV", "ENV", "PATH", "IFS", "PERLLIB", "GCONV_PATH", "LOCPATH", "NLSPATH"})
# Set by torchrun and clusterfit for every worker; a job's own value would break the contract they rely on.
_CONTRACT_NAMES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TF_CONFIG",
    }
)
# Fault injection (a documented testing aid), and the attempt number the job service writes into the resolved
# spec of each attempt (how it reaches the workers on every engine).
_OWN_VARIABLES_ALLOWED = frozenset({"CLUSTERFIT_FAULT", "CLUSTERFIT_ATTEMPT"})


def reserved_variable(name: str) -> str | None:
    """Why a job may not set environment variable `name`, or None if it may."""
    upper = name.upper()
    if upper in _LOADER_NAMES or upper.startswith(_LOADER_PREFIXES):
        return (
            "changes how programs are loaded, so it would run code inside clusterfit's own processes; "
            "install packages into the image or pass paths as your script's arguments"
        )
    if upper in _CONTRACT_NAMES or upper.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_")):
        return "is set for every worker by torchrun and clusterfit; remove it (distribution: sets the world)"
    if upper.startswith("CLUSTERFIT_") and upper not in _OWN_VARIABLES_ALLOWED:
        return "belongs to clusterfit (its service and workers); remove it"
    return None


class JobSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    description: str | None = None
    trainer: TrainerSpec | None = None
    command: str | None = Field(None, min_length=1, description="a user program instead of the built-in trainer")
    scorer: ScorerSpec | None = Field(None, description="batch scoring with an exported model (clusterfit score)")
    code: str | None = Field(None, description="a command job's folder, copied to outputs.dir/code; its cwd")
    distribution: DistributionSpec = DistributionSpec()
    resources: ResourcesSpec = ResourcesSpec()
    outputs: OutputsSpec
    storage: StorageSpec = StorageSpec()
    environment_variables: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(
        default_factory=dict, description="set in every worker process"
    )
    limits: LimitsSpec = LimitsSpec()
    queue_settings: QueueSettingsSpec = QueueSettingsSpec()

    @model_validator(mode="before")
    @classmethod
    def _printable(cls, data: Any) -> Any:
        # NOTE: spec values reach sbatch scripts, Kubernetes manifests and command lines; a newline in a
        # partition name would become a line of its own there. Only `command` and `description` span lines.
        problem = _control_character(data, ())
        if problem:
            raise ValueError(problem)
        return data

    @field_validator("environment_variables")
    @classmethod
    def _no_loader_or_contract_variables(cls, variables: dict[str, str]) -> dict[str, str]:
        for name in variables:
            problem = reserved_variable(name)
            if problem:
                raise ValueError(f"{name} {problem}")
        return variables

    @model_validator(mode="after")
    def _trainer_or_command(self) -> JobSpec:
        given = [name for name in ("trainer", "command", "scorer") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "a job has one of trainer: (the built-in trainer), command: (your own program) or scorer: "
                "(batch scoring), "
                + (f"not {' and '.join(given)}; keep one" if given else "and this one has none; add one")
            )
        if self.command is None and self.code is not None:
            raise ValueError(f"code is only for command jobs; remove it, or replace {given[0]}: with command:")
        if self.command is None and self.distribution.type != "pytorch":
            raise ValueError(
                f"distribution.type = {self.distribution.type!r}: the built-in {given[0]} runs as pytorch; "
                "set distribution.type: pytorch"
            )
        return self

    @model_validator(mode="after")
    def _ranks_within_bounds(self) -> JobSpec:
        if self.world_size > MAX_RANKS:
            raise ValueError(
                f"resources.instance_count = {self.resources.instance_count!r} with "
                f"distribution.process_count_per_instance = {self.distribution.process_count_per_instance} is "
                f"{self.world_size:,} ranks; a job has at most {MAX_RANKS:,}"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_fits_the_workers(self) -> JobSpec:
        options = self.trainer.strategy_options if self.trainer else None
        per_node, res = self.distribution.process_count_per_instance, self.resources
        for workers in (nodes * per_node for nodes in range(res.min_nodes, res.max_nodes + 1)):
            if isinstance(options, PipelineOptions) and workers % options.stages:
                raise ValueError(
                    f"trainer.strategy_options.stages = {options.stages} does not divide the {workers} workers; "
                    "choose stages that divide instance_count x process_count_per_instance"
                    + (" for every node count of the elastic range" if res.elastic else "")
                )
        return self

    @model_validator(mode="after")
    def _outputs_url_where_the_supervisor_sees_it(self) -> JobSpec:
        # NOTE: on Slurm the job's supervisor uploads the outputs, so outputs.cache_dir must be on a filesystem
        # every node sees, as outputs.dir must without a URL (on Ray and Kubernetes each node uploads its own).
        if is_url(self.outputs.dir) and "?" in self.outputs.dir:
            raise ValueError(
                "outputs.dir: a URL with a query string (a SAS token?) would be stored with the job; give the URL "
                "alone and the token in storage.sas_token or the environment"
            )
        return self

    @model_validator(mode="after")
    def _local_is_one_machine(self) -> JobSpec:
        if self.resources.backend == "local" and self.resources.instance_count != 1:
            raise ValueError(
                f"resources.instance_count is {self.resources.instance_count} but the local backend runs on one "
                "machine; set it to 1"
            )
        return self

    @model_validator(mode="after")
    def _elastic_can_regroup(self) -> JobSpec:
        res, dist = self.resources, self.distribution
        if not res.elastic:
            return self
        shown = f"resources.instance_count = {res.instance_count!r}"
        if res.backend == "slurm":
            raise ValueError(
                f"{shown}: Slurm gives a job a fixed set of nodes and ends it when one fails; give a node count "
                "(a requeued job resumes from its checkpoint, see docs/engines.md#elastic-jobs)"
            )
        if self.command is not None and dist.type != "pytorch":
            raise ValueError(
                f"{shown}: a {dist.type} job's ranks are fixed when it starts ({_FIXED_WORLD[dist.type]}); give a "
                "node count, or distribution.type: pytorch"
            )
        if dist.max_restarts == 0:
            raise ValueError(
                f"{shown} is elastic but distribution.max_restarts = 0, so the first lost node ends the job; set "
                "max_restarts to the node losses it should survive (for example 3)"
            )
        return self

    @property
    def world_size(self) -> int:
        """The ranks of a full job: of MAX nodes, for an elastic one."""
        return self.resources.max_nodes * self.distribution.process_count_per_instance


def anchored(spec: JobSpec, base: Path) -> JobSpec:
    """The spec with its relative local paths (data folders, starting weights, a command job's code, a scorer's
    model and input, outputs.dir) made absolute from `base`: a submitted job runs in its own outputs folder, so
    a path relative to where it was submitted would lead nowhere."""
    for field, path in submission_relative_paths(spec).items():
        spec = _replaced(spec, field, str(base / path))
    return spec


def named_places(spec: JobSpec) -> dict[str, str]:
    """Every folder, file or URL the spec names, by field name."""
    fields: dict[str, str | None] = {"outputs.dir": spec.outputs.dir, "code": spec.code}
    if spec.trainer is not None:
        init = spec.trainer.init
        fields |= {
            "trainer.data.train": spec.trainer.data.train,
            "trainer.data.val": spec.trainer.data.val,
            "trainer.init.weights": init and init.weights,
        }
    if spec.scorer is not None:
        fields |= {"scorer.model_dir": spec.scorer.model_dir, "scorer.input": spec.scorer.input}
    return {field: place for field, place in fields.items() if place and place != SYNTHETIC}


def submission_relative_paths(spec: JobSpec) -> dict[str, str]:
    """The spec's local paths that are relative to the folder it was submitted from, by field name. A Kubernetes
    job's paths are places inside its pods (relative to the image's working folder), so it has none."""
    if spec.resources.backend == "kubernetes":
        return {}
    return {
        field: path
        for field, path in named_places(spec).items()
        if not is_url(path) and not path.startswith("~") and not Path(path).is_absolute()
    }


def _replaced(model: BaseModel, field: str, value: str) -> Any:
    """`model` with the dotted `field` set to `value`, every model on the way copied."""
    name, _, rest = field.partition(".")
    return model.model_copy(update={name: _replaced(getattr(model, name), rest, value) if rest else value})


_FIXED_WORLD = {"mpi": "mpirun starts them all at once", "tensorflow": "TF_CONFIG lists every worker"}
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but tab
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_NEWLINE_ALLOWED = {("command",), ("description",)}  # a shell script; prose that reaches no script


def _control_character(value: Any, path: tuple[str, ...]) -> str | None:
    """The first string in a raw spec (keys included) holding a control character, as a one-line refusal."""
    if isinstance(value, dict):
        for key, child in value.items():
            where = (*path, str(key))
            problem = _control_character(str(key), where) or _control_character(child, where)
            if problem:
                return problem
    elif isinstance(value, list):
        for index, child in enumerate(value):
            problem = _control_character(child, (*path, str(index)))
            if problem:
                return problem
    elif isinstance(value, str):
        found = (_CONTROL_BUT_NEWLINE if path in _NEWLINE_ALLOWED else _CONTROL).search(value)
        if found:
            return (
                f"{'.'.join(path) or 'a key'} holds a control character ({found.group()!r}); "
                "write it on one line of printable text"
            )
    return None

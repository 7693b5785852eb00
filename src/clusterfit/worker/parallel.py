"""The `parallelize` step: how the model is spread over the ranks (ddp, fsdp, pipeline, localsgd).

The model and the training loop stay unaware of the strategy: they talk to the `Strategy` protocol.
Checkpoints hold full (unsharded) state dicts keyed by parameter name, so a job can resume under
another strategy or world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from clusterfit.models import load_weights
from clusterfit.spec.model import FsdpOptions, LocalSgdOptions, PipelineOptions, TrainerSpec
from clusterfit.worker.dist import DistEnv
from clusterfit.worker.pipeline import ResNetStage, stage_parts
from clusterfit.worker.precision import Precision

ModelFactory = Callable[[], nn.Module]
_ONE_BUCKET_MB = 1 << 20  # larger than any model: DDP then puts every gradient in one bucket
StateDict = dict[str, Any]


@dataclass(frozen=True)
class Accumulation:
    batches: int = 1  # batches per optimizer step: each loss is divided by this
    last: bool = True  # the step's last batch, whose backward synchronises the gradients


NO_ACCUMULATION = Accumulation()


class Strategy(Protocol):
    name: str
    module: nn.Module  # holds the parameters this rank's optimizer updates
    data_rank: int  # which slice of each global batch this rank reads
    data_world: int  # how many distinct slices there are (the data-parallel degree)

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        precision: Precision,
        scaler: torch.amp.GradScaler,
        accumulation: Accumulation = NO_ACCUMULATION,
    ) -> torch.Tensor | None:
        """Forward and backward; the mean loss where this rank computes one (None on inner pipeline stages).
        Gradients add up over `accumulation.batches` calls and are synchronised on the last one."""
        ...

    def after_optimizer_step(self) -> None: ...

    def eval_module(self) -> nn.Module:
        """Collective: a plain module with the job's current weights, on every rank."""
        ...

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[StateDict, StateDict] | None:
        """Collective: (model, optimizer) state dicts, unsharded and keyed by parameter name, on the main rank."""
        ...

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: StateDict, optim_state: StateDict, global_step: int
    ) -> None: ...


def parallelize(
    model: nn.Module,
    spec: TrainerSpec,
    env: DistEnv,
    device: torch.device,
    loss_fn: nn.Module,
    model_factory: ModelFactory,
) -> Strategy:
    options = spec.strategy_options
    if isinstance(options, FsdpOptions) and env.is_distributed:
        return ShardedDataParallel(model, env, device, options, loss_fn, model_factory)
    if isinstance(options, PipelineOptions):
        return PipelineParallel(model, env, device, options, loss_fn, model_factory)
    return DataParallel(model, env, device, spec, loss_fn)


class DataParallel:
    """DDP: every rank holds the whole model; gradients are averaged in buckets during backward.
    With `localsgd`, ranks step on their own after a warm-up and average parameters every k steps."""

    def __init__(
        self, model: nn.Module, env: DistEnv, device: torch.device, spec: TrainerSpec, loss_fn: nn.Module
    ) -> None:
        self.name = spec.strategy
        self.module, self.env, self.loss_fn = model, env, loss_fn
        self.data_rank, self.data_world = env.rank, env.world_size
        self.forward_module: nn.Module = model
        self.averager = self.local_sgd_state = None
        if not env.is_distributed:
            return
        device_ids = [device.index] if device.type == "cuda" else None
        bucket_cap_mb = spec.ddp_bucket_cap_mb
        if spec.grad_compression == "powersgd" and device.type != "cuda":
            # NOTE: PowerSGD chains collectives in future callbacks. Under gloo (no stream ordering), callbacks
            # of different buckets interleave in different orders on different ranks and the collectives
            # mismatch ("Connection reset by peer"); one bucket for the whole model keeps them ordered.
            bucket_cap_mb = _ONE_BUCKET_MB
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
        self.forward_module = ddp
        if spec.grad_compression != "none":
            _register_compression(ddp, spec.grad_compression, spec.resolved_powersgd_rank())
        options = spec.strategy_options
        if isinstance(options, LocalSgdOptions):
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
                PostLocalSGDState,
                post_localSGD_hook,
            )
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            # NOTE: after the warm-up each rank is its own gradient group (no all-reduce at all), so workers
            # truly step independently; on one machine the default intra-node subgroup would be all ranks.
            own_group, _ = dist.new_subgroups(group_size=1)
            self.local_sgd_state = PostLocalSGDState(
                process_group=None, subgroup=own_group, start_localSGD_iter=options.warmup_steps
            )
            ddp.register_comm_hook(self.local_sgd_state, post_localSGD_hook)
            self.averager = PeriodicModelAverager(period=options.sync_every, warmup_steps=options.warmup_steps)

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        precision: Precision,
        scaler: torch.amp.GradScaler,
        accumulation: Accumulation = NO_ACCUMULATION,
    ) -> torch.Tensor:
        module = self.forward_module
        hold = isinstance(module, DistributedDataParallel) and not accumulation.last
        with module.no_sync() if hold else nullcontext():
            return _forward_backward(module, self.loss_fn, inputs, targets, precision, scaler, accumulation.batches)

    def after_optimizer_step(self) -> None:
        if self.averager is not None:
            self.averager.average_parameters(self.module.parameters())

    def eval_module(self) -> nn.Module:
        if self.averager is None:
            return self.module  # identical on every rank
        # Between averaging steps ranks differ: score rank 0's weights everywhere, as checkpoints do.
        reference = copy.deepcopy(self.module)
        for tensor in [*reference.parameters(), *reference.buffers()]:
            dist.broadcast(tensor.data, src=0)
        return reference

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[StateDict, StateDict] | None:
        if not self.env.is_main:
            return None
        return _cpu(self.module.state_dict()), get_optimizer_state_dict(self.module, optimizer)

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: StateDict, optim_state: StateDict, global_step: int
    ) -> None:
        set_state_dict(self.module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        if self.averager is not None and self.local_sgd_state is not None:
            self.averager.step = global_step
            self.local_sgd_state.iter = global_step


class ShardedDataParallel:
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks; each
    residual block is its own unit, gathered just before it runs."""

    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        device: torch.device,
        options: FsdpOptions,
        loss_fn: nn.Module,
        model_factory: ModelFactory,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.name = "fsdp"
        self.env, self.loss_fn, self.model_factory = env, loss_fn, model_factory
        self.data_rank, self.data_world = env.rank, env.world_size
        mesh = init_device_mesh(device.type, (env.world_size,))
        # NOTE: FSDP2 shards only contiguous parameters; channels_last inputs still give channels_last convs.
        model = model.to(memory_format=torch.contiguous_format)
        for block in _residual_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
        self.module = fully_shard(model, mesh=mesh, reshard_after_forward=options.reshard_after_forward)

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        precision: Precision,
        scaler: torch.amp.GradScaler,
        accumulation: Accumulation = NO_ACCUMULATION,
    ) -> torch.Tensor:
        # Without sync, FSDP keeps each rank's unsharded gradients and reduce-scatters their sum on the last batch.
        self.module.set_requires_gradient_sync(accumulation.last)
        return _forward_backward(self.module, self.loss_fn, inputs, targets, precision, scaler, accumulation.batches)

    def after_optimizer_step(self) -> None:
        pass

    def eval_module(self) -> nn.Module:
        # Ranks may hold different numbers of validation batches, so evaluation cannot run collectives
        # inside forward: score an unsharded copy.
        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return _plain_model(self.model_factory, full, next(iter(full.values())).device)

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[StateDict, StateDict] | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.module, options=options)
        optim_state = get_optimizer_state_dict(self.module, optimizer, options=options)
        return (model_state, optim_state) if self.env.is_main else None

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: StateDict, optim_state: StateDict, global_step: int
    ) -> None:
        set_state_dict(
            self.module,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=StateDictOptions(full_state_dict=True),
        )


class PipelineParallel:
    """`torch.distributed.pipelining`: each rank runs one stage of the model on microbatches (GPipe or
    1F1B); with more ranks than stages, stage replicas are data-parallel (DDP over the `dp` mesh axis)."""

    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        device: torch.device,
        options: PipelineOptions,
        loss_fn: nn.Module,
        model_factory: ModelFactory,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.name = "pipeline"
        self.env, self.model_factory = env, model_factory
        stages = options.stages
        mesh = init_device_mesh(device.type, (env.world_size // stages, stages), mesh_dim_names=("dp", "pp"))
        stage_index = mesh["pp"].get_local_rank()
        self.data_rank, self.data_world = mesh["dp"].get_local_rank(), mesh["dp"].size()
        self.is_first, self.is_last = stage_index == 0, stage_index == stages - 1
        self.module = ResNetStage(model, stage_parts(stages)[stage_index])
        submodule: nn.Module = self.module
        if self.data_world > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            submodule = DistributedDataParallel(
                self.module, device_ids=device_ids, process_group=mesh["dp"].get_group()
            )
        stage = PipelineStage(submodule, stage_index, stages, device, group=mesh["pp"].get_group())
        schedule_class = ScheduleGPipe if options.schedule == "gpipe" else Schedule1F1B
        # scale_grads: gradients are the mean over microbatches, as for one pass over the whole batch.
        self.schedule = schedule_class(stage, options.microbatches, loss_fn=loss_fn, scale_grads=True)

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        precision: Precision,
        scaler: torch.amp.GradScaler,
        accumulation: Accumulation = NO_ACCUMULATION,
    ) -> torch.Tensor | None:
        # accumulation is refused with this strategy by the spec: its microbatches already split each batch.
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        target = targets if self.is_last else None
        with precision.autocast(inputs.device):
            if self.is_first:
                self.schedule.step(inputs, target=target, losses=losses)
            else:
                self.schedule.step(target=target, losses=losses)
        return torch.stack(losses).mean().detach() if losses else None

    def after_optimizer_step(self) -> None:
        pass

    def eval_module(self) -> nn.Module:
        full = self._gather_stages(lambda: _cpu(self.module.state_dict()), everywhere=True)
        device = next(self.module.parameters()).device
        return _plain_model(self.model_factory, _merge_dicts(full), device)

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[StateDict, StateDict] | None:
        parts = self._gather_stages(
            lambda: (_cpu(self.module.state_dict()), get_optimizer_state_dict(self.module, optimizer)),
            everywhere=False,
        )
        if parts is None:
            return None
        return _merge_dicts([model for model, _ in parts]), _merge_optimizer_states([optim for _, optim in parts])

    def load_full_state(
        self, optimizer: torch.optim.Optimizer, model_state: StateDict, optim_state: StateDict, global_step: int
    ) -> None:
        names = set(self.module.state_dict())
        mine = {key: value for key, value in model_state.items() if key in names}
        set_state_dict(
            self.module,
            optimizer,
            model_state_dict=mine,
            optim_state_dict=_restrict_optimizer_state(optim_state, names),
        )

    def _gather_stages(self, local: Callable[[], Any], everywhere: bool) -> list[Any] | None:
        """Every stage's `local()`; only the data-parallel replica 0 of each stage contributes."""
        mine = local() if self.data_rank == 0 else None
        gathered: list[Any] = [None] * self.env.world_size
        if everywhere:
            dist.all_gather_object(gathered, mine)
        else:
            dist.gather_object(mine, gathered if self.env.is_main else None, dst=0)
            if not self.env.is_main:
                return None
        return [part for part in gathered if part is not None]


def _forward_backward(
    module: nn.Module,
    loss_fn: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: Precision,
    scaler: torch.amp.GradScaler,
    batches_per_step: int = 1,
) -> torch.Tensor:
    with precision.autocast(inputs.device):
        loss = loss_fn(module(inputs), targets)
    scaler.scale(loss / batches_per_step).backward()  # DDP and FSDP communicate gradients during backward
    return loss.detach()


def _register_compression(ddp: DistributedDataParallel, kind: str, powersgd_rank: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        # Exact all-reduces for 10 steps, then each gradient's rank-k approximation, with error feedback.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=10
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _residual_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for name in ("layer1", "layer2", "layer3", "layer4") for block in getattr(model, name, [])]


def _plain_model(factory: ModelFactory, state: StateDict, device: torch.device) -> nn.Module:
    model = factory()
    load_weights(model, state)
    return model.to(device)


def _cpu(state: StateDict) -> StateDict:
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _merge_dicts(parts: list[StateDict]) -> StateDict:
    merged: StateDict = {}
    for part in parts:
        merged.update(part)
    return merged


def _merge_optimizer_states(parts: list[StateDict]) -> StateDict:
    """Name-keyed optimizer states of disjoint parameter sets -> one state with the groups concatenated."""
    groups = [dict(group, params=[]) for group in parts[0]["param_groups"]]
    state: StateDict = {}
    for part in parts:
        state.update(part["state"])
        for merged, group in zip(groups, part["param_groups"], strict=True):
            merged["params"] = merged["params"] + list(group["params"])
    return {"state": state, "param_groups": groups}


def _restrict_optimizer_state(full: StateDict, names: set[str]) -> StateDict:
    groups = [dict(group, params=[p for p in group["params"] if p in names]) for group in full["param_groups"]]
    return {"state": {k: v for k, v in full["state"].items() if k in names}, "param_groups": groups}

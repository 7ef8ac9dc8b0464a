"""`zerospeed.initialize`: validate the config, start the process group, build and wire the parts.

Order (DESIGN.md, "The data path"): config (validated before any process group or tensor) ->
process group -> model placement and broadcast -> mixed-precision cast -> ZeRO strategy (and the
optimizer over its fp32 masters) -> LR scheduler -> loss scaler -> engine. Each builder receives
only its own section of the config.
"""
from __future__ import annotations

import argparse
import logging
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.init import default_device, init_distributed, read_launch_env
from ..comm.logger import CommsLogger
from ..comm.ops import broadcast
from ..config import ConfigError, ZeroSpeedConfig, load_config
from ..config.optimizer import check_optimizer_for_stage
from ..optim import build_optimizer, build_scheduler
from ..parallel import ParallelMesh
from ..precision import MixedPrecisionPolicy, build_loss_scaler
from ..tensor_parallel import tensor_parallel_layers
from ..zero.factory import build_strategy
from ..zero.param_groups import check_optimizer_params
from .dataloader import RepeatingLoader, build_dataloader
from .engine import ZeroSpeedEngine
from .host_malloc import retain_freed_host_memory, retain_wanted
from .checkpoint_pipe import PipeTranslation
from .pipe_engine import PipelineEngine
from .pipe_setup import check_pipeline, is_pipeline, pipeline_schedule, split_backward
from .pipe_ties import TiedWeights
from .telemetry import Telemetry
from .tp_init import merge_tp_model_init, sharded_mesh
from .tp_setup import plan_tensor_parallel, remap_parameters, shard_model
from .moe_setup import (agree_across_stages, apply_autoep, attach_expert_groups, autoep_blocks, expert_comm_group,
                        expert_group, expert_param_ids, expert_parallel_size)

log = logging.getLogger(__name__)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` flags to `parser`."""
    group = parser.add_argument_group("zerospeed", "zerospeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the engine (compatibility flag)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="path to the ds_config JSON file")
    return parser


def _config_source(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ConfigError("a config was given both as config=... and as args.deepspeed_config; pass only one")
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError("no config: pass config=<path | dict | JSON string> or args.deepspeed_config")
    return source


def _dp_world_size(mpu, model=None) -> int:
    """The data-parallel world size the batch triple counts: the mpu's data-parallel size, the world over a
    PipelineModule's stages, else the world."""
    if is_pipeline(model):
        world = dist.get_world_size() if dist.is_initialized() else read_launch_env().world_size
        return max(1, world // model.num_stages)
    if mpu is not None:
        if not dist.is_initialized():
            raise RuntimeError("initialize(mpu=...) needs torch.distributed initialised first: the mpu's process "
                               "groups are built on it (zerospeed.comm.init_distributed() before building the mpu)")
        return ParallelMesh.from_mpu(mpu).size("data")
    return dist.get_world_size() if dist.is_initialized() else read_launch_env().world_size


def _select_parameters(model: nn.Module, model_parameters, optimizer) -> list | None:
    """What the optimizer is built over: `model_parameters` as given (tensors or param-group dicts, frozen
    tensors left out), or None for all trainable parameters. Trainable parameters that neither
    `model_parameters` nor a client optimizer object holds are frozen (requires_grad=False): nothing
    would ever update them (DeepSpeed leaves them out of its optimizer too); a warning names them.
    Raises TypeError for a mix of tensors and dicts, ValueError for a tensor that is not a model parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    given, held = None, None
    if isinstance(optimizer, torch.optim.Optimizer):
        held = {id(t) for g in optimizer.param_groups for t in g["params"]}
    elif model_parameters is not None:
        given = [model_parameters] if isinstance(model_parameters, torch.Tensor) else list(model_parameters)
        if not given:
            raise ValueError("model_parameters is empty; pass the parameters to train (or leave it out for all)")
        if all(isinstance(x, dict) for x in given):
            given = [{**g, "params": [t for t in ([g["params"]] if isinstance(g["params"], torch.Tensor)
                                                  else list(g["params"])) if t.requires_grad]} for g in given]
            tensors = [t for g in given for t in g["params"]]
        elif all(isinstance(x, torch.Tensor) for x in given):
            given = tensors = [t for t in given if t.requires_grad]
        else:
            raise TypeError("model_parameters must be all tensors or all param-group dicts ({'params': [...], ...}), "
                            "not a mix")
        stray = [t for t in tensors if id(t) not in names]
        if stray:
            raise ValueError(f"model_parameters holds {len(stray)} tensor(s) that are not parameters of the model "
                             f"(e.g. shape {tuple(stray[0].shape)}); pass the model's own parameters")
        held = {id(t) for t in tensors}
    if held is not None:
        left = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        if left:
            log.warning("%d trainable parameter(s) are not in the optimizer (e.g. %s); they are frozen "
                        "(requires_grad=False), as nothing would update them", len(left),
                        ", ".join(n for n, _ in left[:3]))
            for _, p in left:
                p.requires_grad_(False)
    return given


def _build_optimizer(cfg: ZeroSpeedConfig, model: nn.Module, optimizer, params):
    """The optimizer over the model's own trainable parameters in the user's param groups (as plain PyTorch
    would build it); the ZeRO strategy then re-targets it to what this rank updates. optimizer: a client
    object (used as it is), a callable (called with `params`, DeepSpeed's `model_parameters`, or the
    trainable parameters) or None (the config's `optimizer` block, over `params` or all trainable ones)."""
    trainable = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if cfg.optimizer is None:
            return None
        opt = build_optimizer(trainable, cfg.optimizer.torch_class_name, cfg.optimizer.torch_kwargs(),
                              fused_cpu=cfg.optimizer.fused_kernel)
    elif isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(trainable)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
    else:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable(params), got {type(optimizer)}")
    check_optimizer_params(opt, model)
    from ..optim import Lamb

    if isinstance(opt, Lamb) and cfg.zero_optimization.stage >= 1:  # the config's Lamb: _check_supported
        raise NotImplementedError(f"a client Lamb optimizer cannot run at zero_optimization.stage="
                                  f"{cfg.zero_optimization.stage}: its trust ratio is a norm over each whole "
                                  "parameter, and ZeRO stages 1-3 step flat partition slices; use stage 0 with Lamb, "
                                  "or another optimizer (Lion, Adam, AdamW)")
    return opt


def _build_scheduler(cfg: ZeroSpeedConfig, lr_scheduler, optimizer):
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError(f"scheduler {cfg.scheduler.type!r} needs an optimizer: add an 'optimizer' block "
                          "or pass optimizer=...")
    return build_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.kwargs())


IMPLEMENTED_STAGES = {0, 1, 2, 3}


def _check_supported(cfg: ZeroSpeedConfig) -> None:
    stage = cfg.zero_optimization.stage
    if stage not in IMPLEMENTED_STAGES:
        raise NotImplementedError(f"zero_optimization.stage={stage} is not implemented yet in this version of "
                                  f"zerospeed (implemented: {sorted(IMPLEMENTED_STAGES)})")
    check_optimizer_for_stage(cfg.optimizer, stage)
    zero = cfg.zero_optimization
    opt = zero.offload_optimizer
    # ratio < 1 keeps that share of the optimizer on the accelerator; without one it is on the host either way
    if opt is not None and opt.enabled and opt.ratio < 1.0 and torch.accelerator.is_available():
        raise NotImplementedError(f"zero_optimization.offload_optimizer.ratio={opt.ratio}: partial optimizer offload is "
                                  "not implemented in zerospeed; remove the key (ratio 1.0 offloads everything)")
    if cfg.aio.use_gds:
        raise NotImplementedError("aio.use_gds=true (GPUDirect Storage) is not implemented in zerospeed; remove the key "
                                  "(swap files are read and written through host buffers)")
    for section, flag in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                          ("bf16", "bf16_optimizer_states")):
        if getattr(getattr(cfg, section), flag):
            raise NotImplementedError(f"{section}.{flag}=true is not implemented yet in this version of zerospeed: "
                                      "master weights, gradients and optimizer states are kept in fp32; remove the key")
    if cfg.torch_autocast.enabled:
        raise NotImplementedError("torch_autocast.enabled=true is not implemented yet in this version of zerospeed; "
                                  'use "bf16": {"enabled": true} (the model is cast, fp32 master weights are kept)')
    accum = cfg.data_types.grad_accum_dtype
    ours = cfg.precision if cfg.precision != "fp32" and stage == 1 else "fp32"
    if accum is not None and accum != ours:
        raise NotImplementedError(f"data_types.grad_accum_dtype={accum!r} is not supported with {cfg.precision} at "
                                  f"ZeRO stage {stage}: zerospeed accumulates gradients in {ours} there (stage 1 "
                                  "in the parameter dtype, the other stages in fp32); remove the key")
    if cfg.data_types.param_dtype not in (None, cfg.precision):
        raise NotImplementedError(f"data_types.param_dtype={cfg.data_types.param_dtype!r} differs from the precision "
                                  f"the fp16/bf16 sections select ({cfg.precision}); set it through fp16/bf16 instead")


def _build_offload(cfg: ZeroSpeedConfig, model: nn.Module, group, policy: MixedPrecisionPolicy, experts=None):
    """The rank's OffloadContext (pre-flight checks against the rank's predicted budget, swap spaces)
    when offload_* is on, else None. experts: the `ExpertGroup` of expert parallelism (its parameters are
    partitioned over its smaller group: they count ep times in the budget's Ψ / N), or None."""
    from ..offload import OffloadPolicy

    opol = OffloadPolicy.from_config(cfg.zero_optimization)
    if not opol.enabled:
        return None
    from ..offload import OffloadContext
    from ..offload.budget import rank_budget
    from ..zero.stage3_init import shape_of
    from ..zero.stage3_units import plan_units

    zero = cfg.zero_optimization
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(shape_of(p).numel() for p in params)
    world = dist.get_world_size(group)
    if experts is not None:  # this rank's experts over the expert-data group: their share is ep times larger
        mine = sum(shape_of(p).numel() for p in params if id(p) in experts.params)
        numel += mine * (world // dist.get_world_size(experts.group) - 1)
    largest = numel
    if zero.stage == 3:  # the gather units the strategy will build (pure: no tensor is touched)
        plans = plan_units(model, persistence_threshold=int(zero.param_persistence_threshold),
                           leaf_classes=zero.leaf_module.classes, leaf_names=zero.leaf_module.names,
                           leaf_name_suffixes=zero.leaf_module.name_suffixes,
                           numel_of=lambda p: shape_of(p).numel())
        largest = max((plan.numel for plan in plans), default=numel) or numel
    budget = rank_budget(opol, numel=max(numel, 1), largest_unit=max(largest, 1), world=world,
                         param_bytes=torch.empty(0, dtype=policy.param_dtype).element_size(), mixed=policy.mixed,
                         grad_accum=cfg.gradient_accumulation_steps, stage=zero.stage,
                         prefetch_bucket_size=int(zero.prefetch_bucket_size),
                         reduce_bucket_size=int(zero.reduce_bucket_elements))
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())  # ranks on this node share its RAM and disk
    mine = [r for r, h in enumerate(hosts) if h == hosts[dist.get_rank()]]
    from ..zero.stage3_init_spill import spilled_bytes

    # zero.Init(remote_device="nvme")'s slices are on disk now and freed as the strategy takes them over
    return OffloadContext.create(opol, cfg.aio, rank=dist.get_rank(), local_ranks=len(mine), budget=budget,
                                 clear_stale_files=dist.get_rank() == mine[0], disk_credit=spilled_bytes())


def _model_parallel_grads(model: nn.Module, mesh, pipeline: bool = False, ties=None):
    """How tensor parallelism splits the gradient (for the global norm), or None when nothing is sharded.
    Sharded: the parameters of zerospeed's tensor-parallel layers, and those Megatron-LM marks
    `tensor_model_parallel=True` (a user's mpu with Megatron layers, as DeepSpeed reads it)."""
    from ..zero.clipping import ModelParallelGrads

    if pipeline:  # every stage holds its own layers: squares summed over the pipe group, tied weights counted once
        return ModelParallelGrads(group=mesh.group("pipe"), size=mesh.size("pipe"), replicated=frozenset(),
                                  excluded=ties.owned_elsewhere() if ties else frozenset())
    if mesh.size("tensor") == 1:
        return None

    sharded = {id(getattr(layer, pn)) for _, layer in tensor_parallel_layers(model)
               for pn, spec in layer.shard_specs.items() if spec is not None}
    sharded |= {id(p) for p in model.parameters() if getattr(p, "tensor_model_parallel", False)}
    if not sharded:  # replicas only: the data-parallel norm is already the global one
        return None
    return ModelParallelGrads(group=mesh.group("tensor"), size=mesh.size("tensor"),
                              replicated=frozenset(id(p) for p in model.parameters() if id(p) not in sharded))


def _build_telemetry(cfg: ZeroSpeedConfig, model: nn.Module, device: torch.device) -> Telemetry:
    """Monitors (rank 0 writes), the flops profiler and wall-clock timers, from their config blocks."""
    from ..checkpointing import configure as configure_checkpointing

    configure_checkpointing(None, deepspeed_config=cfg)  # the activation_checkpointing block
    monitor = None
    if cfg.tensorboard.enabled or cfg.wandb.enabled or cfg.csv_monitor.enabled:
        from ..monitor import MonitorMaster

        monitor = MonitorMaster(rank=dist.get_rank(), tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                                csv_monitor=cfg.csv_monitor)
    profiler = None
    if cfg.flops_profiler.enabled:
        from ..profiling import FlopsProfiler

        profiler = FlopsProfiler(model, recompute_fwd_factor=cfg.flops_profiler.recompute_fwd_factor)
    return Telemetry(rank=dist.get_rank(), device=device, steps_per_print=cfg.effective_steps_per_print,
                     wall_clock_breakdown=cfg.effective_wall_clock_breakdown, monitor=monitor,
                     profiler=profiler, profiler_cfg=cfg.flops_profiler)


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, config_params: Any = None,
               distributed_port: int = 29500):
    """Build a training engine around `model` (DeepSpeed's `deepspeed.initialize`).

    config: a ds_config as a dict, a path to a JSON file, a JSON string or urlsafe-base64 JSON
    (or `args.deepspeed_config`). optimizer / lr_scheduler: an object, a callable building one
    (from the parameters / from the optimizer), or None to build from the config.
    model_parameters: what to optimize, as for a torch optimizer: tensors or param-group dicts
    ({"params": [...], "weight_decay": 0.0, "lr": ...}), default all trainable parameters of `model`;
    trainable parameters left out are frozen (requires_grad=False). The returned optimizer's
    `param_groups` are these groups, in this order, with their hyperparameters, at every ZeRO stage.
    training_data: a torch Dataset; a DataLoader with a DistributedSampler over the data-parallel
    ranks is built for it (micro-batch size from the config).
    mpu: a Megatron-style model-parallel unit (Megatron-LM's `parallel_state`, DeepSpeed's
    `PipelineParallelGrid`, or `zerospeed.parallel.ParallelMesh.build(tp=..., pp=...)`): ZeRO then runs
    over its data-parallel group only, the batch triple counts data-parallel ranks, and the overflow
    decision is taken over the whole world. torch.distributed must be initialised before it is built.

    Returns (engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed does.
    Raises ConfigError for a bad config (before any process group is created),
    NotImplementedError for a feature not implemented yet, TypeError for bad arguments
    (`parallel.MpuError` for an mpu that lacks the methods zerospeed calls).
    """
    if model is None:
        raise TypeError("initialize() needs model=<torch.nn.Module>")
    source = _config_source(args, config, config_params)
    tp_mesh = sharded_mesh(model)  # zerospeed.tp_model_init sharded the model: its mesh, its autotp_size
    if tp_mesh is not None:
        source, mpu = merge_tp_model_init(source, model, tp_mesh, mpu), None
    client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    cfg = load_config(source, dp_world_size=_dp_world_size(mpu, model), client_optimizer=client_opt, model=model,
                      dp_from_mpu=mpu is not None and not is_pipeline(model))
    _check_supported(cfg)
    pipeline = is_pipeline(model)
    if pipeline:
        check_pipeline(cfg, model, mpu)
    elif cfg.pipeline.schedule != "1f1b" or cfg.pipeline.stages not in ("auto", 1):
        raise ConfigError(f"the pipeline block sets schedule={cfg.pipeline.schedule!r}, stages="
                          f"{cfg.pipeline.stages!r}, but the model is a {type(model).__name__}, not a "
                          "zerospeed.pipe.PipelineModule: build the model as a PipelineModule or remove those keys")
    tp_plan = plan_tensor_parallel(cfg, model, mpu) if tp_mesh is None else None
    ep = expert_parallel_size(cfg, model)  # MoE layers' ep_size
    autoep = autoep_blocks(cfg, model)  # AutoEP: the HF model's MoE blocks (checked before any process group)
    if cfg.zero_optimization.stage < 3:
        from ..zero.stage3_init import partitioned_parameters

        if partitioned := partitioned_parameters(model):
            raise ConfigError(f"the model was built under zerospeed.zero.Init() (e.g. {partitioned[0]!r} is "
                              f"partitioned) but zero_optimization.stage={cfg.zero_optimization.stage}; "
                              "use stage 3, or build the model without zero.Init()")

    init_distributed(dist_init_required=dist_init_required)
    if pipeline:  # a stage holds only its own layers: the MoE layers' ep_size as the other stages found it
        ep = agree_across_stages(ep)
    # the named sub-groups (parallel/mesh.py): ZeRO runs over "data" only; None = the whole world
    if tp_mesh is not None:  # expert groups carved from its data groups (tp_model_init built it with ep 1)
        mesh = tp_mesh.with_expert_parallel(ep)
    elif pipeline:
        mesh = ParallelMesh.build(pp=model.num_stages, ep=ep)
    else:
        mesh = ParallelMesh.from_mpu(mpu, ep=ep) if mpu is not None else \
            ParallelMesh.build(tp=cfg.tensor_parallel.size, ep=ep)
    group = mesh.group("data")
    env = read_launch_env()
    device = default_device(env.local_rank)
    if retain_wanted(cfg, device):
        retain_freed_host_memory()
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    model.to(device)
    # every rank starts from global rank 0's (whole, unsharded) weights, as DeepSpeed does; a model tp_model_init
    # sharded (after the same broadcast) from its data-parallel rank 0's shards
    # (a pipeline stage holds only its layers: from the data-parallel rank 0 of the same stage, as DeepSpeed)
    source_group = None if tp_mesh is None and not pipeline else mesh.group("data")
    experts = expert_param_ids(model) if ep > 1 else frozenset()  # different on every rank of an "expert" group
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in experts:
                broadcast(t.data, 0, group=source_group)
                continue
            for name in ("expert_data", "tensor"):  # this rank's experts from its first replica (replicated over TP)
                if mesh.size(name) > 1:
                    broadcast(t.data, 0, group=mesh.group(name))
    if autoep and ep > 1:  # every rank now holds rank 0's full experts: keep this rank's rows
        model_parameters = remap_parameters(apply_autoep(autoep, ep, mesh.rank("expert")), model_parameters,
                                            optimizer)
    ties = TiedWeights(model, mesh.group("pipe"), None) if pipeline else None
    if ties:
        ties.synchronize()  # layers tied across stages start equal (before the strategy copies them)
    if tp_plan is not None:  # AutoTP: each rank keeps its shard of the planned layers
        model_parameters = remap_parameters(shard_model(model, tp_plan, mesh), model_parameters, optimizer)
    policy = MixedPrecisionPolicy.from_precision(cfg.precision, cfg.communication_data_type)
    # bf16/fp16: cast the model; the strategy builds its fp32 masters from the original values
    original_values = policy.cast_module(model)

    opt = _build_optimizer(cfg, model, optimizer, _select_parameters(model, model_parameters, optimizer))
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(t)] for t in g["params"]] for g in opt.param_groups] if opt is not None else None
    cl = cfg.comms_logger
    logger = CommsLogger(enabled=cl.enabled, verbose=cl.verbose, prof_all=cl.prof_all,
                         prof_ops=tuple(cl.prof_ops)) if cl.enabled else None
    ep_comm = expert_comm_group(mesh) if ep > 1 else None  # the MoE all-to-alls' own process group
    attach_expert_groups(model, ep_comm, logger)  # MoE layers: the "expert" group for their all-to-alls
    for _, layer in tensor_parallel_layers(model):  # their all-reduces are counted with the others
        layer.logger = logger
        if getattr(layer, "shared_input", None) is not None:
            layer.shared_input.logger = logger
    experts = expert_group(model, mesh)
    offload = _build_offload(cfg, model, group, policy, experts)
    strategy = build_strategy(cfg.zero_optimization.stage, module=model, optimizer=opt, group=group,
                              zero_cfg=cfg.zero_optimization, gradient_allreduce_op=cfg.gradient_allreduce_op,
                              predivide_factor=cfg.gradient_predivide_factor if cfg.prescale_gradients else 1.0,
                              logger=logger, policy=policy, master_values=original_values, offload=offload,
                              model_parallel=_model_parallel_grads(model, mesh, pipeline, ties),
                              experts=experts)
    del original_values  # the originals live on only where a strategy adopted them as masters
    sched = _build_scheduler(cfg, lr_scheduler, opt)
    telemetry = _build_telemetry(cfg, model, device)
    loader = None
    if training_data is not None:  # a pipeline reads its data in order, over and over (DeepSpeed's _build_data_iter)
        loader = build_dataloader(training_data, micro_batch_size=cfg.train_micro_batch_size_per_gpu,
                                  group=group, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
                                  seed=cfg.seed or 0, shuffle=not pipeline)
        if pipeline:
            loader = RepeatingLoader(loader)
    engine = (PipelineEngine if pipeline else ZeroSpeedEngine)(
        module=model, optimizer=opt, lr_scheduler=sched, strategy=strategy, group=group, device=device,
        train_batch_size=cfg.train_batch_size, micro_batch_size=cfg.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, gradient_clipping=cfg.gradient_clipping,
        zero_stage=cfg.zero_optimization.stage, steps_per_print=cfg.effective_steps_per_print,
        comms_logger=logger, telemetry=telemetry, training_dataloader=loader, local_rank=env.local_rank,
        policy=policy, loss_scaler=build_loss_scaler(cfg.fp16),
        check_overflow=cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow),
        auto_cast=cfg.fp16.enabled and cfg.fp16.auto_cast, mesh=mesh)
    _warn_super_offload(cfg, engine)
    if pipeline:
        engine._init_pipeline(mesh.group("pipe"), pipeline_schedule(cfg, model), ties,
                              split_backward=split_backward(cfg, model))
        if loader is not None:
            engine.set_dataloader(loader)
        engine.checkpoint_translation = engine.pipe_translation = PipeTranslation(model, ties)  # one for all stages
    engine.checkpoint_tag_validation = cfg.checkpoint.tag_validation
    engine.expert_parallel_size = ep
    engine.offload = offload
    engine.param_group_names = group_names  # checkpoints record which parameters each group holds
    if mesh.size("tensor") > 1 and any(True for _ in tensor_parallel_layers(model)):
        # checkpoints and save_16bit_model write full tensors, not shards
        from .checkpoint_tp import TPTranslation

        engine.checkpoint_translation = engine.tp_translation = TPTranslation(model, mesh)
    if ep > 1:  # each expert saved under its global id (after the pipeline's or tensor-parallel translation)
        from .checkpoint_moe import ChainedTranslation, ExpertTranslation

        engine.expert_translation = ExpertTranslation(model, mesh.rank("expert"), ep_comm)
        first = engine.checkpoint_translation
        engine.checkpoint_translation = engine.expert_translation if first is None else \
            ChainedTranslation(first, engine.expert_translation)
    if telemetry.profiler is not None:
        telemetry.profiler.ds_engine = engine
    return engine, opt, loader, sched


def _warn_super_offload(cfg, engine) -> None:
    """super_offload steps in the backward only with the optimizer on NVMe and when the step needs no global
    quantity: say why it cannot."""
    opt = cfg.zero_optimization.offload_optimizer
    if opt is None or not opt.super_offload:
        return
    if opt.device == "cpu":  # DeepSpeed's SuperOffload examples' config (GH200: the step on the Grace CPU)
        log.warning("offload_optimizer.super_offload with device \"cpu\": the optimizer step runs on the host at "
                    "engine.step(), after the backward - zerospeed overlaps the step with the backward for the NVMe "
                    "tier only (offload_optimizer.device \"nvme\"); the numbers are the same either way")
        return
    if engine._step_needs_no_global():
        return
    why = [w for w, on in (("gradient_clipping > 0", bool(cfg.gradient_clipping)), ("fp16", cfg.fp16.enabled),
                           ("bf16.check_grad_overflow", cfg.bf16.enabled and cfg.bf16.check_grad_overflow)) if on]
    log.warning("offload_optimizer.super_offload: the optimizer step runs at engine.step(), not during the backward, "
                "because the step needs the whole gradient (%s; zerospeed does not step speculatively and roll back "
                "as DeepSpeed does); the numbers are the same either way", ", ".join(why))


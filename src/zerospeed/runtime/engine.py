"""The training engine: orders forward, backward, reduction and the optimizer step.

It owns no algorithm: gradient reduction lives in the ZeRO strategy (`zero/`), the update in the
torch optimizer, the LR in the scheduler, the loss scale in the loss scaler (`precision/`). What it
adds is DeepSpeed's contract (`DeepSpeedEngine`): `backward` divides the loss by the gradient
accumulation steps and multiplies it by the fp16 loss scale, `step` acts only at the accumulation
boundary and skips the update on every rank when the gradients overflowed (fp16, and bf16 with
`check_grad_overflow`), counters and accessors have DeepSpeed's names.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ..comm.logger import CommsLogger
from ..comm.ops import all_reduce
from ..precision import LossScaler, MixedPrecisionPolicy, SkipLog
from ..zero.data_parallel import ReducePhase
from ..zero.strategy import ZeroStrategy
from .telemetry import Telemetry

log = logging.getLogger(__name__)


class ZeroSpeedEngine(nn.Module):
    """Wraps `module` for data-parallel training; built by `zerospeed.initialize`.

    Use: `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()` every micro-batch.
    Attributes: module, optimizer, lr_scheduler, global_steps (optimizer steps attempted, skipped
    ones included, as DeepSpeed counts), skipped_steps (steps skipped on gradient overflow),
    global_samples (samples consumed by those steps, all ranks), micro_steps, device,
    dp_world_size, global_rank, local_rank, policy (MixedPrecisionPolicy), loss_scaler
    (its `state_dict()` belongs in checkpoints).
    """

    def __init__(self, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler,
                 strategy: ZeroStrategy, group: dist.ProcessGroup | None, device: torch.device,
                 train_batch_size: int, micro_batch_size: int, gradient_accumulation_steps: int,
                 gradient_clipping: float, zero_stage: int, steps_per_print: int,
                 comms_logger: CommsLogger | None, telemetry: Telemetry, training_dataloader=None,
                 local_rank: int = 0, policy: MixedPrecisionPolicy | None = None,
                 loss_scaler: LossScaler | None = None, check_overflow: bool = False, auto_cast: bool = False,
                 mesh=None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.strategy = strategy
        self.group = group
        self.device = device
        self.comms_logger = comms_logger
        self.telemetry = telemetry
        self.training_dataloader = training_dataloader
        self.policy = policy or MixedPrecisionPolicy()
        self.loss_scaler = loss_scaler or LossScaler(1.0)
        self._check_overflow = check_overflow  # skip steps whose gradients hold inf/nan
        self._auto_cast = auto_cast  # fp16.auto_cast: floating-point inputs are cast to fp16
        self._train_batch_size = train_batch_size
        self._micro_batch_size = micro_batch_size
        self._gas = gradient_accumulation_steps
        self._clip = gradient_clipping
        self._zero_stage = zero_stage
        self._steps_per_print = steps_per_print
        self.global_rank = dist.get_rank()
        self.local_rank = local_rank
        self.dp_world_size = dist.get_world_size(group)
        self.world_size = dist.get_world_size()
        # the named sub-groups (parallel.ParallelMesh, also the `mpu`); group is its "data" group
        self.mesh = self.mpu = mesh
        self.mp_world_size = mesh.size("model") if mesh is not None else 1
        self.tp_translation = None  # runtime.checkpoint_tp.TPTranslation under AutoTP (set by initialize)
        # how this rank's parameters map onto a checkpoint's full tensors: the TPTranslation, a pipeline's
        # runtime.checkpoint_pipe.PipeTranslation, or None (set by initialize)
        self.checkpoint_translation = None
        self.expert_translation = None  # runtime.checkpoint_moe.ExpertTranslation with expert parallelism
        self.pipe_translation = None  # a pipeline's PipeTranslation (also under the expert one)
        self.expert_parallel_size = 1  # MoE layers' ep_size (set by initialize)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._in_no_sync = False
        self._step_applied = False
        self._last_print = time.perf_counter()
        self._skip_log = SkipLog(rank=self.global_rank)

    # -- forward / backward / step ----------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.telemetry.forward_begin(args, self.global_steps)
        if self._auto_cast:
            args, kwargs = _cast_floating((args, kwargs), self.policy.param_dtype)
        try:
            return self.module(*args, **kwargs)
        finally:
            self.telemetry.forward_end(self.global_steps)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the last micro-batch of a step: `(micro_steps + 1) % gradient_accumulation_steps == 0`."""
        return (self.micro_steps + 1) % self._gas == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagate `loss` / gradient_accumulation_steps, times the fp16 loss scale; at the
        boundary, reduce gradients in buckets while backward runs. Returns the loss divided by the
        accumulation steps (not multiplied by the loss scale), as DeepSpeed. Raises ValueError for a
        non-scalar loss without a gradient."""
        self.telemetry.record_loss(loss)
        if scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        reduce = (self.is_gradient_accumulation_boundary() or self.strategy.reduce_every_micro_step) and not self._in_no_sync
        if reduce:
            self.strategy.arm()
            if self.is_gradient_accumulation_boundary() and self._step_needs_no_global():
                self.strategy.step_in_backward()  # super_offload: the optimizer steps while backward runs
        timers = self.telemetry.timers
        timers.start("bwd_inner")
        try:
            self.loss_scaler.scale(loss).backward(retain_graph=retain_graph)
        except BaseException:
            if reduce:
                self.strategy.disarm()
            raise
        finally:
            timers.stop("bwd_inner")
        if reduce:
            timers.start("bwd_allreduce")
            self.strategy.finish()
            timers.stop("bwd_allreduce")
        return loss

    def _step_needs_no_global(self) -> bool:
        """The optimizer step depends on no quantity of the whole gradient: no clipping, no overflow vote,
        loss scale 1 (so each sub-group may step as soon as its own gradient is reduced)."""
        return not self._clip and not self._check_overflow and self.loss_scaler.loss_scale == 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current fp16 loss scale (unchanged in bf16 / fp32), for users who call
        `engine.scale(loss).backward()` themselves (DeepSpeed's `engine.scale`); no accumulation division."""
        return self.loss_scaler.scale(loss)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-batch; at the boundary unscale, clip, step the optimizer and the LR
        scheduler, zero grads. If the gradients overflowed (fp16, or bf16 with check_grad_overflow)
        every rank skips the optimizer and the LR scheduler (DeepSpeed's `_take_model_step`),
        `skipped_steps` grows, and the fp16 loss scale is updated.

        Raises RuntimeError inside `no_sync()` (DeepSpeed does the same); LossScaleAtMinimumError
        when the fp16 scale cannot go lower (naming the first parameters with inf/nan gradients).
        """
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the context before stepping, "
                               "so the accumulated gradients are reduced first")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self.telemetry.timers.start("step")
            if self.strategy.phase is not ReducePhase.FINISHED:
                # gradients came from a plain loss.backward(): reduce them now, all at once
                self.strategy.arm()
                self.strategy.finish()
            self._take_model_step(lr_kwargs)
            self.telemetry.timers.stop("step")
            self.telemetry.end_step(self)
            self._maybe_print()
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None = None) -> None:
        """At the boundary, with reduced gradients: unscale, norm, clip, the overflow vote, the optimizer and
        LR-scheduler step (skipped on overflow), zero grads, counters (DeepSpeed's `_take_model_step`)."""
        scale = self.loss_scaler.loss_scale
        self._global_grad_norm = self.strategy.clip_and_norm(self._clip, loss_scale=scale)
        # the norm was all-reduced over the data-parallel group; the other dimensions vote too
        overflow = self._check_overflow and self._overflow_anywhere(self._global_grad_norm)
        self.loss_scaler.update_scale(overflow, nonfinite_names=self.strategy.nonfinite_grad_names)
        if overflow:
            self.skipped_steps += 1
            self._skip_log.skipped(step=self.global_steps, total_skipped=self.skipped_steps, old_scale=scale,
                                   new_scale=self.loss_scaler.loss_scale, fp16=self.fp16_enabled())
        elif self.optimizer is not None:
            self.strategy.optimizer_step()
            self._step_applied = True
        self.zero_grad()
        if self.lr_scheduler is not None and not overflow:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        self.strategy.disarm()

    def _overflow_anywhere(self, norm: float) -> bool:
        """True on every rank if the gradient norm is non-finite on any rank of the world: the data-parallel
        ranks already agree (the norm was all-reduced over their group); with model-parallel dimensions the
        decision is an all-reduce (MAX of the flag) over the whole world, so every replica and every shard
        skips the same steps."""
        bad = not math.isfinite(norm)
        if self.mp_world_size == 1:
            return bad
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        all_reduce(flag, group=None, op=dist.ReduceOp.MAX, logger=self.comms_logger)
        return bool(flag.item())

    def zero_grad(self) -> None:
        """Clear the gradients (stage 0 keeps them as views into the buckets and zeroes them in place)."""
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction inside the context (accumulate locally); not re-entrant."""
        if self._zero_stage >= 2:
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {self._zero_stage}: gradients "
                               "are partitioned as they are produced; use gradient_accumulation_steps instead")
        if self._in_no_sync:
            raise RuntimeError("no_sync() is not re-entrant")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- accessors (DeepSpeed names) -------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def zero_optimization_stage(self) -> int:
        return self._zero_stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        if not self.optimizer:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient 2-norm before clipping, from the last optimizer step."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """True if the last `step()` updated the parameters (False off the boundary and on overflow)."""
        return self._step_applied

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def fp16_enabled(self) -> bool:
        return self.policy.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.policy.param_dtype == torch.bfloat16

    @property
    def loss_scale(self) -> float:
        """The current loss scale (fp16; 1.0 in bf16 and fp32)."""
        return self.loss_scaler.loss_scale

    # -- checkpoints: runtime/checkpoint.py (format: checkpoint_format.py) -------------------------
    checkpoint_tag_validation = "Warn"  # the config's checkpoint.tag_validation (set by initialize)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective sharded save to `save_dir/<tag>` (default `global_step<N>`), then `save_dir/latest`."""
        from .checkpoint import save_checkpoint
        return self._per_model_rank(lambda d: save_checkpoint(self, d, tag, client_state, save_latest,
                                                              exclude_frozen_parameters), save_dir, "save")

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Collective load at any world size / stage -> (load_path, client_state); (None, None) without `latest`."""
        from .checkpoint import load_checkpoint
        return self._per_model_rank(lambda d: load_checkpoint(self, d, tag, load_module_strict, load_optimizer_states,
                                                              load_lr_scheduler_states, load_module_only),
                                    load_dir, "load")

    def _per_model_rank(self, run, directory, what: str):
        """Run a collective checkpoint call over the data-parallel group. With model-parallel dimensions
        (mp_world_size > 1) each model-parallel rank's data-parallel group uses its own sub-directory
        `mp_rank_XX` (as DeepSpeed's mp_rank files: correct whether the model ranks hold replicas or
        different shards, but loadable only at the same model-parallel size), and the outcome is agreed
        over the whole world: CheckpointError on every rank if any group failed. Loading a directory
        saved without that sub-directory raises CheckpointError naming the sizes."""
        if self.mp_world_size == 1 or self.checkpoint_translation is not None:  # AutoTP, pipelines: one directory
            return run(directory)
        from pathlib import Path

        from .checkpoint_format import CheckpointError

        sub = Path(directory) / f"mp_rank_{self.mesh.rank('model'):02d}"
        result, own = None, None
        try:
            if what == "load" and Path(directory).is_dir() and not sub.is_dir():
                raise CheckpointError(f"{directory} has no {sub.name}/: it was not saved at model-parallel size "
                                      f"{self.mp_world_size}; loading across model-parallel sizes is not supported yet")
            result = run(sub)
        except Exception as exc:  # noqa: BLE001 - agreed over the world below
            own = exc
        outcomes: list = [None] * self.world_size
        dist.all_gather_object(outcomes, None if own is None else f"{type(own).__name__}: {own}")
        if own is not None:
            raise own
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed:
            raise CheckpointError(f"checkpoint {what} failed on rank {failed[0][0]} ({failed[0][1]})")
        return result

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: rank 0 writes the full weights in the module's dtype (see runtime/consolidate.py; a
        pipeline's stages: runtime/consolidate_pipe.py)."""
        if self.mp_world_size > 1 and self.pipe_translation is not None:
            from .consolidate_pipe import save_16bit_model_pipeline  # every stage's layers, sent to rank 0
            return save_16bit_model_pipeline(self, save_dir, save_filename, exclude_frozen_parameters)
        if self.mp_world_size > 1 and self.tp_translation is None:  # rank 0 would write its own shards only
            raise NotImplementedError(f"save_16bit_model with model parallelism (model-parallel size "
                                      f"{self.mp_world_size}) is not supported yet: it would write one model "
                                      "rank's tensors; use engine.save_checkpoint")
        from .consolidate import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Remove hooks and release gradient buckets; the process group is left to the caller. At ZeRO
        stage 3 the parameters get their full values back, except with `offload_param` on NVMe (the
        model may be larger than RAM; its swap files are removed): they are left empty, as DeepSpeed
        leaves them partitioned, so save the model before."""
        self.strategy.remove()
        self.telemetry.close()
        if getattr(self, "offload", None) is not None:  # swap files are removed with the engine
            self.offload.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model states this rank holds: params, grads, optimizer_states, master_weights
        (the fp32 masters under bf16/fp16, counted apart from the 2-byte params)."""
        return self.strategy.memory_breakdown()

    def _maybe_print(self) -> None:
        if self._steps_per_print and self.global_steps % self._steps_per_print == 0 and self.global_rank == 0:
            now = time.perf_counter()
            rate = self._steps_per_print * self._train_batch_size / max(now - self._last_print, 1e-9)
            self._last_print = now
            scale = f", loss_scale={self.loss_scale:g}" if self.fp16_enabled() else ""
            log.info("step=%d, skipped=%d, lr=%s, grad_norm=%.4g%s, samples/s=%.1f", self.global_steps,
                     self.skipped_steps, self.get_lr(), self._global_grad_norm or 0.0, scale, rate)


DeepSpeedEngine = ZeroSpeedEngine  # DeepSpeed's name at its path, for `isinstance(engine, DeepSpeedEngine)`


def _cast_floating(obj, dtype: torch.dtype):
    """Cast every floating-point tensor inside (nested tuples / lists / dicts) to `dtype`."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        items = [_cast_floating(o, dtype) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj

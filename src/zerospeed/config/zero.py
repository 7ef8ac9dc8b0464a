"""``zero_optimization`` and its offload sub-sections (DeepSpeed 0.19.8's ``DeepSpeedZeroConfig``).

Sizes are counted in **elements** (parameters or gradient values), not bytes, unless the field
says otherwise. Field names, aliases and defaults are DeepSpeed's: the python name of a stage-3
knob drops the ``stage3_`` prefix (``prefetch_bucket_size``) and the prefixed spelling is its alias;
both are accepted, giving both is an error.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ._base import ConfigModel, is_auto
from .auto import STAGE_AUTO_MESSAGE, resolve_hidden_size_autos
from .errors import ConfigDeprecationWarning, ConfigIssue
from .keys import REMOVED_ZERO_KEYS, removed_message, unsupported_message

__all__ = ["ZeroConfig", "DEFAULT_REDUCE_BUCKET_SIZE", "OffloadParamConfig", "OffloadOptimizerConfig", "LeafModuleConfig",
           "OffloadDevice"]

OffloadDevice = Literal["none", "cpu", "nvme"]

# Elements per gradient bucket (stages 0-3) when the config leaves `reduce_bucket_size` unset: 25 MiB of
# fp32, PyTorch DDP's `bucket_cap_mb` default. DeepSpeed's 5e8 exceeds any model under 500M parameters,
# so its one all-reduce can start only after backward ends (profiled: 122 ms waited after backward,
# small GPT, 10.8M parameters); with 25 MiB buckets all but the last overlap backward, as in DDP.
DEFAULT_REDUCE_BUCKET_SIZE = 25 * 2**20 // 4


class OffloadParamConfig(ConfigModel):
    """``zero_optimization.offload_param``: keep partitioned parameters on CPU or NVMe (stage 3 only)."""

    device: OffloadDevice = "none"
    """Where parameters live between uses: "none" (accelerator), "cpu" or "nvme"."""
    nvme_path: Optional[Path] = None
    """Directory on the NVMe device (required when device is "nvme")."""
    buffer_count: int = Field(5, ge=0)
    """Number of buffers in the NVMe swap pool (default 5)."""
    buffer_size: int = Field(100_000_000, ge=0)
    """Size of each NVMe swap buffer, in elements (default 1e8)."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Elements of parameters kept in CPU memory when offloading to NVMe (default 1e9)."""
    pin_memory: bool = True
    """Use page-locked host memory (default true since DeepSpeed 0.19; false on hosts with a
    tight ``ulimit -l``)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class OffloadOptimizerConfig(ConfigModel):
    """``zero_optimization.offload_optimizer``: optimizer states on CPU/NVMe; the step runs on CPU."""

    device: OffloadDevice = "none"
    """Where optimizer states live: "none", "cpu" or "nvme". The optimizer always computes on CPU."""
    nvme_path: Optional[Path] = None
    """Directory on the NVMe device (required when device is "nvme")."""
    buffer_count: int = Field(4, ge=0)
    """Buffers in the NVMe swap pool; at least the number of per-parameter states (default 4)."""
    pin_memory: bool = True
    """Use page-locked host memory (default true since DeepSpeed 0.19)."""
    pipeline_read: bool = False
    """Overlap the read of the next sub-group with the step of the current one (NVMe)."""
    pipeline_write: bool = False
    """Overlap the write of the previous sub-group with the step of the current one (NVMe)."""
    fast_init: bool = False
    """Fast optimizer initialisation when offloading to NVMe."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer states offloaded (partial offload, < 1 needs stage 3). Default 1.0."""
    super_offload: bool = False
    """Step each sub-group during the boundary micro-step's backward, as soon as its gradient is reduced, so the
    step overlaps the backward (DeepSpeed's SuperOffload); zerospeed steps the last layers' sub-groups in the
    next forward instead (`offload/backward_steps.py`). zerospeed: stage 3 with device "nvme" only; the
    in-backward step runs when the step needs no global quantity (gradient_clipping 0, bf16/fp32 without
    check_grad_overflow), else the step runs at engine.step() as without it (DeepSpeed speculates and rolls back)."""
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores used by the CPU optimizer (default 0.8)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @property
    def pipeline(self) -> bool:
        """True when reads or writes are pipelined with the step."""
        return self.pipeline_read or self.pipeline_write


class LeafModuleConfig(ConfigModel):
    """``zero_optimization.leaf_module``: modules fetched as one unit by ZeRO-3 (no hooks inside)."""

    classes: list[str] = Field(default_factory=list)
    """Class names (qualified or bare) of leaf modules. A single string is accepted."""
    names: list[str] = Field(default_factory=list)
    """Module names (as in ``named_modules()``) of leaf modules."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Module-name suffixes marking leaf modules."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


_DEPRECATED = {
    # old key: (new key, how to convert the old value)
    "cpu_offload": ("offload_optimizer", lambda v: {"device": "cpu"} if v else None),
    "cpu_offload_param": ("offload_param", lambda v: {"device": "cpu"} if v else None),
    "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", bool),
}

# fields zerospeed accepts only at their default value (DeepSpeed features not implemented yet)
_UNSUPPORTED_UNLESS_DEFAULT = {
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zero_hpz_partition_size": 1,
    "zenflow": None,
    "legacy_stage1": False,
    "pipeline_loading_checkpoint": False,
}


class ZeroConfig(ConfigModel):
    """``zero_optimization``: the ZeRO stage and its communication / memory knobs.

    ``zero_optimization: true`` (an old boolean form) means stage 1 and ``false`` stage 0.
    Deprecated keys are remapped with a ConfigDeprecationWarning: ``cpu_offload`` ->
    ``offload_optimizer: {device: cpu}``, ``cpu_offload_param`` -> ``offload_param: {device: cpu}``,
    ``stage3_gather_fp16_weights_on_model_save`` -> ``gather_16bit_weights_on_model_save``;
    ``cpu_offload_use_pin_memory`` is dropped (``pin_memory`` lives in the offload sections).
    Giving a deprecated key together with its replacement is an error.
    """

    stage: int = Field(0, ge=0)
    """0 off (plain data parallel); 1 partitions optimizer states; 2 also gradients; 3 also
    parameters. Values above 3 are an error. ``"auto"`` is an error (DeepSpeed silently runs stage 0,
    and the Hugging Face Trainer does not fill it)."""
    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements reduced per gradient bucket (default 5e8 elements, not bytes: DeepSpeed's value, kept
    here so the section reads as DeepSpeed's; must be >= 1). zerospeed: when the key is absent, stages
    0-3 use PyTorch DDP's 25 MiB buckets instead (`DEFAULT_REDUCE_BUCKET_SIZE`, resolved once in
    `reduce_bucket_elements`, which is what `zero/` receives): 5e8 exceeds any model under 500M
    parameters, so it is a single bucket and no reduction overlaps backward; the sums are the same.
    Stage 3 puts the gradients of consecutive gather units in one bucket (DeepSpeed's stage-3 ipg bucket).
    ``"auto"`` = ``hidden_size**2`` as the Hugging Face Trainer fills it, with the hidden size read
    from the model by ``load_config(..., model=)`` (``config/auto.py``); an error without one."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the ranks' reduce buckets into one all-reduce."""
    allgather_partitions: bool = True
    """All-gather updated partitions after the step (stages 1-2) instead of broadcasts."""
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """Elements per all-gather bucket (default 5e8 elements)."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with the backward pass. Unset (None) resolves to true for
    stage 3 and false for stages 0-2, as in DeepSpeed; after validation it is always a bool."""
    compute_grad_norm: bool = True
    """Compute the global gradient norm at each step; false is only allowed with stage 1 or 2
    (then ``get_global_grad_norm()`` returns None)."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the fp32 copy in a checkpoint (no precision loss)."""
    elastic_checkpoint: bool = False
    """Legacy elastic checkpoint flag (zerospeed checkpoints are topology-independent anyway)."""
    offload_param: Optional[OffloadParamConfig] = None
    """Parameter offload (stage 3 only). None = no offload."""
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer-state offload (stages 1-3). None = no offload."""
    zenflow: Optional[dict[str, Any]] = None
    """ZenFlow (not supported by zerospeed yet; must be absent or null)."""
    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Elements per optimizer-step tile with ZeRO-3 offload / Infinity (default 1e9)."""
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: elements of parameters fetched ahead of use (default 5e7). ``"auto"`` at stage 3 =
    ``int(0.9 * hidden_size**2)`` (Hugging Face's fill, hidden size from the model; ``config/auto.py``)."""
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements than this stay unpartitioned (default 1e5). ``"auto"`` at
    stage 3 = ``10 * hidden_size`` (Hugging Face's fill, hidden size from the model; ``config/auto.py``)."""
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    """Stage 3: cap on the total elements kept unpartitioned (default sys.maxsize)."""
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    """Stage 3: max gathered elements resident per rank before releasing (default 1e9)."""
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: do not release a parameter reused within this many elements (default 1e9)."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: gather full 16-bit weights in ``save_16bit_model()`` (default false)."""
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    """Stage 3: modules with params/(1+descendants) below this are fetched as one unit (0 = off)."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Stage 3: fetch parameters with all-reduce instead of all-gather."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Stage 3: all-gather parameters one by one, without bucketing."""
    ignore_unused_parameters: bool = True
    """Stage 2: do not error on parameters that get no gradient."""
    legacy_stage1: bool = False
    """DeepSpeed's old stage-1 implementation (not supported; must be false)."""
    round_robin_gradients: bool = False
    """Stages 1-2 with offload: spread gradient copies over ranks."""
    parameter_alignment: bool = False
    """Pad flat buffers to 16-byte alignment."""
    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ hpZ secondary partition size (not supported yet; must be 1)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ quantized weight all-gather (not supported yet; must be false)."""
    zero_quantized_nontrainable_weights: bool = False
    """Keep frozen weights quantized (not supported yet; must be false)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ quantized gradient reduction (not supported yet; must be false)."""
    memory_efficient_linear: bool = True
    """Stage 3: memory-efficient linear autograd function."""
    pipeline_loading_checkpoint: bool = False
    """Force checkpoint loading in pipeline mode (not supported; must be false)."""
    override_module_apply: bool = True
    """Stage 3: gather parameters inside ``nn.Module.apply``."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log trace-cache invalidation warnings."""
    enable_sanity_checks: bool = False
    """Extra internal consistency checks (slow; for debugging)."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Muon with NVMe offload: keep the momentum buffer in memory."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3 leaf modules (fetched whole, no hooks on their children)."""

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        issues = [((k,), removed_message(k)) for k in data if k in REMOVED_ZERO_KEYS]
        if "cpu_offload_use_pin_memory" in data:
            data.pop("cpu_offload_use_pin_memory")
            warnings.warn("zero_optimization.cpu_offload_use_pin_memory is deprecated and ignored; set "
                          "pin_memory in offload_optimizer / offload_param", ConfigDeprecationWarning, stacklevel=2)
        for old, (new, convert) in _DEPRECATED.items():
            if old not in data:
                continue
            value = data.pop(old)
            new_keys = [k for k, name in cls.config_keys().items() if name == new]
            present = [k for k in new_keys if k in data]
            if present:
                issues.append(((old,), f"deprecated key given together with its replacement '{present[0]}'; "
                                       f"keep only '{present[0]}'"))
                continue
            if is_auto(value) or value is None:
                continue
            if not isinstance(value, bool):
                issues.append(((old,), f"expected true or false, got {value!r}"))
                continue
            warnings.warn(f"zero_optimization.{old} is deprecated; use zero_optimization.{new} "
                          f"(remapped to {new}={convert(value)!r})", ConfigDeprecationWarning, stacklevel=2)
            data[new] = convert(value)
        if is_auto(data.get("stage")):
            issues.append((("stage",), STAGE_AUTO_MESSAGE))
        issues += resolve_hidden_size_autos(data, cls.config_keys(), context.get("model_hints"))
        if issues:
            raise ConfigIssue(issues)
        return data

    @field_validator("stage", mode="before")
    @classmethod
    def _check_stage(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("stage must be an integer 0-3, not a boolean")
        if isinstance(v, (int, float)) and v > 3:
            raise ValueError(f"ZeRO stage {v:g} does not exist: the maximum stage is 3 (0 off, 1 optimizer "
                             "states, 2 + gradients, 3 + parameters)")
        return v

    @model_validator(mode="after")
    def _check(self) -> ZeroConfig:
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == 3
        issues: list[tuple[tuple, str]] = []
        for key, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
            if getattr(self, key) != default:
                issues.append(((key,), unsupported_message(key, default)))
        opt, par = self.offload_optimizer, self.offload_param
        if opt is not None and opt.super_offload and (self.stage != 3 or opt.device not in ("cpu", "nvme")):
            issues.append((("offload_optimizer", "super_offload"),
                           f"super_offload (each optimizer sub-group stepped during the backward, as its gradient "
                           f"is reduced) is supported with stage 3 and offload_optimizer.device \"cpu\" or \"nvme\", "
                           f"not stage {self.stage} with device {opt.device!r}; remove super_offload or offload the "
                           "optimizer at stage 3 (DeepSpeed's own super_offload needs CUDA)"))
        if opt is not None and opt.ratio < 1.0 and self.stage != 3:
            issues.append((("offload_optimizer", "ratio"),
                           f"partial offload (ratio={opt.ratio}) is only supported with stage 3, "
                           f"not stage {self.stage}"))
        if opt is not None and opt.enabled and self.stage == 0:
            issues.append((("offload_optimizer",), f"offloading the optimizer (device={opt.device!r}) needs "
                                                    "ZeRO stage 1, 2 or 3; set zero_optimization.stage"))
        if par is not None and par.enabled and self.stage != 3:
            issues.append((("offload_param",), f"offloading parameters (device={par.device!r}) needs ZeRO stage 3, "
                                                f"not stage {self.stage} (DeepSpeed silently ignores it there)"))
        for name, sec in (("offload_optimizer", opt), ("offload_param", par)):
            if sec is not None and sec.device == "nvme" and sec.nvme_path is None:
                issues.append(((name, "nvme_path"), 'device "nvme" needs nvme_path (a directory on the NVMe drive)'))
        if not self.compute_grad_norm and self.stage not in (1, 2):
            issues.append((("compute_grad_norm",),
                           f"false is only supported with stage 1 or 2, not stage {self.stage}"))
        if issues:
            raise ConfigIssue(issues)
        return self

    @property
    def enabled(self) -> bool:
        """True for stages 1-3."""
        return self.stage > 0

    @property
    def reduce_bucket_elements(self) -> int:
        """The gradient bucket size stages 0-3 use, in elements (stage 0's all-reduce buckets, stages
        1-2's reduce-scatter chunks, stage 3's reduce-scatter buckets of whole units):
        `reduce_bucket_size` when the config set it (DeepSpeed semantics, even its 5e8; ``"auto"``
        resolved), else `DEFAULT_REDUCE_BUCKET_SIZE` (the key was absent)."""
        return self.reduce_bucket_size if "reduce_bucket_size" in self.model_fields_set else DEFAULT_REDUCE_BUCKET_SIZE

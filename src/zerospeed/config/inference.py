"""The `zerospeed.init_inference` config: DeepSpeed 0.19.8's `DeepSpeedInferenceConfig` keys and defaults.

    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
    engine = zerospeed.init_inference(model, config="ds_inference.json")   # the same keys in a file

Every key DeepSpeed accepts is accepted here under its name and alias; an unknown key is an error naming
the closest valid one. What DeepSpeed's CUDA kernels do (Triton, CUDA graphs, the injected transformer
kernels' knobs) is either done the device-agnostic way (`replace_with_kernel_inject`) or an error on a
device that cannot do it (`enable_cuda_graph` off CUDA), never silently dropped. Differences from DeepSpeed,
each documented on its field: int8 is per-output-channel weight-only quantization (`dtype=torch.int8`); an
explicit `quant` block needs `dtype=torch.int8` (DeepSpeed ignores it otherwise); `num_beams > 1` is allowed.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
from pydantic import Field, ValidationError, field_validator

from ._base import ConfigModel, issues_from_validation_error
from .errors import ConfigDeprecationWarning, ConfigError, format_path
from .zero import ZeroConfig

__all__ = ["InferenceConfig", "InferenceTPConfig", "InferenceMoEConfig", "QuantizationConfig",
           "load_inference_config", "parse_dtype"]

# DeepSpeed's DtypeEnum: every spelling it accepts, mapped to the torch dtype
_DTYPES = {torch.float16: ("fp16", "float16", "half", "torch.float16"),
           torch.float32: ("fp32", "float32", "float", "torch.float32"),
           torch.bfloat16: ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
           torch.int8: ("int8", "torch.int8")}
_BY_NAME = {name: dtype for dtype, names in _DTYPES.items() for name in names}


def parse_dtype(value: Any) -> torch.dtype:
    """A torch dtype from a torch.dtype or one of DeepSpeed's names ("fp16", "bfloat16", "torch.int8", ...).
    Raises ValueError listing the accepted names."""
    if isinstance(value, torch.dtype) and value in _DTYPES:
        return value
    if isinstance(value, str) and value.strip().lower() in _BY_NAME:
        return _BY_NAME[value.strip().lower()]
    names = ", ".join(n for names in _DTYPES.values() for n in names[:2])
    raise ValueError(f"dtype {value!r} is not supported; use torch.float16, torch.bfloat16, torch.float32 or "
                     f"torch.int8 (or a name: {names})")


_DEPRECATED = {"mp_size": ("tensor_parallel", "tp_size"), "mpu": ("tensor_parallel", "mpu"),
               "ep_size": ("moe", "ep_size"), "moe_experts": ("moe", "moe_experts"), "moe_type": ("moe", "type"),
               "ep_group": ("moe", "ep_group"), "expert_group": ("moe", "ep_group"),
               "ep_mp_group": ("moe", "ep_mp_group"), "expert_mp_group": ("moe", "ep_mp_group")}


class InferenceTPConfig(ConfigModel):
    """``tensor_parallel`` (alias ``tp``): AutoTP sharding of the model's linear layers for serving."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    """Ranks per tensor-parallel group; must divide the world size, the attention heads and the MLP width."""
    tp_grain_size: int = Field(64, ge=1)
    """DeepSpeed's granularity of uneven splits; zerospeed splits only evenly (whole heads), so it has no effect."""
    mpu: Any = None
    """A Megatron-style mpu; its model-parallel group is the tensor-parallel group."""
    tp_group: Any = None
    """A process group to shard over (its size is the tp size); default: consecutive ranks of tp_size."""


class InferenceMoEConfig(ConfigModel):
    """``moe``: DeepSpeed's inference MoE block. ep_size > 1 spreads each MoE layer's experts over ep_size ranks
    (`inference/ep.py`); ep_group: the process group to use (default: consecutive ranks); moe_experts and type
    are accepted for DeepSpeed's injected kernels and have no effect; ep_mp_group (expert tensor parallelism)
    is refused by the engine."""

    enabled: bool = True
    ep_size: int = Field(1, ge=1)
    moe_experts: list = Field(default_factory=lambda: [1], alias="num_experts")
    type: str = "standard"
    ep_mp_group: Any = None
    ep_group: Any = Field(None, alias="expert_group")


class _BaseQuant(ConfigModel):
    enabled: bool = True
    num_bits: int = 8
    q_type: str = "symmetric"
    q_groups: int = Field(1, ge=1)


class WeightQuantConfig(_BaseQuant):
    quantized_initialization: dict = Field(default_factory=dict)
    post_init_quant: dict = Field(default_factory=dict)


class QuantizationConfig(ConfigModel):
    """``quant``: how `dtype=torch.int8` quantizes. Weight-only, symmetric, one scale per output channel
    (finer than any DeepSpeed q_groups, so q_groups has no effect); activations stay in the compute dtype."""

    enabled: bool = True
    activation: _BaseQuant = Field(default_factory=_BaseQuant)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: dict = Field(default_factory=dict)

    @field_validator("weight")
    @classmethod
    def _weight(cls, v):
        if v.num_bits != 8 or v.q_type not in ("symmetric", "sym"):
            raise ValueError(f"weight quantization num_bits={v.num_bits}, q_type={v.q_type!r}: only 8-bit "
                             "symmetric weights are implemented")
        return v


class InferenceConfig(ConfigModel):
    """DeepSpeed 0.19.8's `DeepSpeedInferenceConfig`, strict. Deprecated top-level keys are remapped with a
    ConfigDeprecationWarning: ``mp_size`` -> ``tensor_parallel.tp_size``, ``mpu`` -> ``tensor_parallel.mpu``,
    ``ep_size`` -> ``moe.ep_size``, ``moe_experts`` -> ``moe.moe_experts``, ``moe_type`` -> ``moe.type``,
    ``ep_group`` / ``ep_mp_group`` -> ``moe.*``; ``replace_method`` is dropped (DeepSpeed ignores it too)."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Swap the model's attention for a device-agnostic fused path (static KV cache, fused projections)."""
    dtype: Any = torch.float16
    """Weights' dtype. DeepSpeed's default is fp16: on a CPU without fp16 kernels that is an error (as in
    DeepSpeed), so pass torch.float32 or torch.bfloat16. torch.int8: int8 weights, see `quant`."""
    tensor_parallel: InferenceTPConfig = Field(default_factory=InferenceTPConfig, alias="tp")
    enable_cuda_graph: bool = False
    """CUDA graphs of the forward; an error on any other device."""
    use_triton: bool = False
    triton_autotune: bool = False
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO-Inference: stage 3 with offload_param streams the weights from host memory or NVMe."""
    triangular_masking: bool = Field(True, alias="tm")
    """DeepSpeed's injected kernels' causal mask flag; HF models mask themselves, so it has no effect."""
    moe: InferenceMoEConfig = Field(default_factory=InferenceMoEConfig)
    """true / false are {"enabled": true / false}, as DeepSpeed's bool form."""
    keep_module_on_host: bool = False
    """Leave the weights where they are instead of moving them to the accelerator."""
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: Optional[Union[str, dict]] = None
    """Weights to load: a safetensors file or directory, a zerospeed/DeepSpeed checkpoint directory, or
    DeepSpeed's checkpoint json dict; each rank reads only its shard."""
    base_dir: str = ""
    set_empty_params: bool = False
    """DeepSpeed: the injected kernel modules allocate no weights, they use the model's. Here kernel injection
    then compiles its decode step without inductor's freezing, so it keeps no packed copy of the weights
    (less memory, slower decode: bench/README); without injection nothing is copied and it has no effect."""
    save_mp_checkpoint_path: Optional[str] = None
    checkpoint_config: dict = Field(default_factory=dict, alias="ckpt_config")
    return_tuple: bool = True
    training_mp_size: int = Field(1, ge=1)
    injection_policy: Optional[dict] = Field(None, alias="injection_dict")
    """{module class: (names of its output linear layers...)}: DeepSpeed's hand-written TP policy; the named
    layers are row-parallel, every other linear layer in that class column-parallel."""
    injection_policy_tuple: Optional[tuple] = None
    config: Optional[dict] = Field(None, alias="args")
    max_out_tokens: int = Field(1024, alias="max_tokens", gt=0)
    """Longest prompt (tokens) `generate` accepts, and the length of the static KV cache of kernel injection."""
    min_out_tokens: int = Field(1, alias="min_tokens")
    transposed_mode: bool = False

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        data.pop("replace_method", None)
        for old, (section, key) in _DEPRECATED.items():
            if old not in data:
                continue
            value = data.pop(old)
            skey = "tp" if section == "tensor_parallel" and "tp" in data else section
            block = data.get(skey)
            block = dict(block) if isinstance(block, dict) else ({} if block in (None, True) else block)
            if not isinstance(block, dict):
                continue
            if key in block and block[key] != value:
                raise ValueError(f"{old}={value!r} (deprecated) conflicts with {section}.{key}={block[key]!r}; "
                                 f"keep only {section}.{key}")
            if old in ("mp_size", "ep_size") and value == 1:  # the default: nothing to remap
                continue
            warnings.warn(f"init_inference: {old} is deprecated; use {section}.{key} (remapped)",
                          ConfigDeprecationWarning, stacklevel=4)
            block[key] = value
            data[skey] = block
        return data

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v):
        return parse_dtype(v)

    @field_validator("moe", mode="before")
    @classmethod
    def _moe(cls, v):
        return {"enabled": v} if isinstance(v, bool) else v

    @field_validator("use_triton", "triton_autotune")
    @classmethod
    def _triton(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name}=true selects DeepSpeed's Triton kernels, which zerospeed does not "
                             "ship; remove it (replace_with_kernel_inject=true gives the device-agnostic fused path)")
        return v

    @field_validator("training_mp_size")
    @classmethod
    def _training_mp(cls, v):
        if v != 1:
            raise ValueError(f"training_mp_size={v}: loading DeepSpeed's per-rank Megatron checkpoints is not "
                             "implemented; give a safetensors or zerospeed checkpoint (each rank reads its shard)")
        return v

    @property
    def tp_size(self) -> int:
        """The tensor-parallel size (1 when disabled)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def int8(self) -> bool:
        return self.dtype is torch.int8


def load_inference_config(config: Any = None, kwargs: Optional[dict] = None) -> InferenceConfig:
    """DeepSpeed's `init_inference` merge: `config` (None, a dict, or a path to a JSON file) updated with
    `kwargs`; a key in both with different values is an error (as DeepSpeed). Raises ConfigError listing
    every problem with its dotted key path."""
    from .loader import parse_source

    if config is None:
        raw: dict = {}
    elif isinstance(config, dict):
        raw = dict(config)
    elif isinstance(config, str):
        raw = parse_source(config)
    else:
        raise ConfigError(f"init_inference(config=...) expects a dict or a path to a JSON file, got "
                          f"{type(config).__name__}")
    kwargs = dict(kwargs or {})
    clash = [k for k in sorted(set(raw) & set(kwargs)) if raw[k] != kwargs[k]]
    if clash:
        raise ConfigError([f"{k}: given as {raw[k]!r} in config and as {kwargs[k]!r} in the keyword arguments; "
                           "give it once" for k in clash])
    raw.update(kwargs)
    explicit_quant = "quant" in raw
    try:
        cfg = InferenceConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError([f"{format_path(p)}: {m}" if p else m
                           for p, m in issues_from_validation_error(exc, InferenceConfig)]) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if explicit_quant and not cfg.int8:
        raise ConfigError(f"quant is given but dtype is {cfg.dtype}: quantization applies only with "
                          "dtype=torch.int8 (DeepSpeed ignores quant otherwise); set dtype=torch.int8 or drop quant")
    return cfg

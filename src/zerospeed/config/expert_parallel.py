"""``expert_parallel``: AutoEP, expert parallelism for an unmodified Hugging Face MoE model (DeepSpeed 0.19.8's
`AutoEPConfig` keys and defaults, `deepspeed/module_inject/auto_ep_presets/base.py`).

``{"expert_parallel": {"enabled": true, "autoep_size": 2}}`` spreads the experts of every MoE block of a
transformers model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, ...) over groups of 2 data-parallel ranks
(`zerospeed.moe.autoep`). Differences from DeepSpeed, each an error rather than a silent change:

* Routing stays the model's own module (same top-k, normalisation, scaling, group-limited routing, router
  auxiliary loss): DeepSpeed re-implements it from the routing keys. So `top_k`, `score_func`, `route_norm`,
  `route_scale`, `routed_scaling_factor`, `num_expert_groups`, `num_limited_groups` are accepted only at
  their defaults ("auto" / null / 1.0) or, for `top_k`, equal to the model's; anything else is an error
  naming the model's value.
* Kernel and transport choices for CUDA (`use_grouped_mm`, `disable_triton_grouped_mm`, `combine_impl`,
  `row_weighting_impl`, `gate_up_impl`, `score_apply`, `comm_backend`, `comm_num_sm`, `comm_qp_margin`,
  `comm_max_tokens_per_rank`, `async_split_plan`, `validate_folding_routing`) are accepted with DeepSpeed's
  allowed values and change nothing here: the experts are dropless and exchanged with gloo/NCCL
  all-to-all (`comm_backend: "deepep"` is refused: no DeepEP).
* `expert_tensor_parallel_size` > 1 is not implemented; the custom-model keys (`expert_w1/w2/w3`,
  `num_experts_attr`, `top_k_attr`, `has_shared_experts`, `shared_experts_pattern`,
  `shared_experts_gate_pattern`, `expert_activation`) are not needed for transformers' fused experts and are
  accepted only unset.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from ._base import ConfigModel

__all__ = ["ExpertParallelConfig", "PRESET_MODELS"]

#: DeepSpeed 0.19.8's AutoEP presets -> the Hugging Face model types each covers.
PRESET_MODELS = {"mixtral": ("mixtral",), "qwen3_moe": ("qwen3_moe",), "qwen3_5_moe": ("qwen3_5_moe",),
                 "deepseek_v2": ("deepseek_v2",), "deepseek_v3": ("deepseek_v3",), "minimax_m3": ("minimax_m3",)}


class ExpertParallelConfig(ConfigModel):
    """``expert_parallel``: AutoEP over the model's MoE blocks."""

    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    """Ranks per expert-parallel group (each holds num_experts / autoep_size experts of every MoE block); must
    divide the data-parallel size and the number of experts."""
    expert_tensor_parallel_size: int = Field(1, ge=1)
    """Tensor parallelism inside each expert; only 1 is implemented."""
    preset_model: Optional[str] = None
    """One of DeepSpeed's presets (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3, minimax_m3); it
    must match the model's `config.model_type`. Default: detected from the model."""
    moe_layer_pattern: Optional[str] = None
    """Regex (full match) over module names selecting the MoE blocks (default: every module with an experts
    child of transformers' fused-expert layout)."""
    expert_pattern: Optional[str] = None
    """Name of the experts child of an MoE block (default "experts")."""
    router_pattern: Optional[str] = None
    """Name of the router child of an MoE block (default "gate"); the router itself is kept as it is."""
    top_k: Union[int, Literal["auto"]] = "auto"
    load_balance_coeff: Optional[float] = None
    route_norm: Optional[bool] = None
    route_scale: float = 1.0
    routed_scaling_factor: Union[float, Literal["auto"]] = "auto"
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    # CUDA kernel / transport choices: accepted (DeepSpeed's values), no effect here
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    row_weighting_impl: Literal["auto", "eager", "fused"] = "auto"
    gate_up_impl: Literal["separate", "fused"] = "separate"
    comm_backend: Literal["comm", "deepep"] = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    async_split_plan: bool = False
    validate_folding_routing: bool = False
    # custom (non-preset) model description: not needed for transformers' fused experts
    expert_w1: Optional[str] = None
    expert_w2: Optional[str] = None
    expert_w3: Optional[Any] = None
    num_experts_attr: Optional[str] = None
    top_k_attr: Optional[str] = None
    has_shared_experts: Optional[bool] = None
    shared_experts_pattern: Optional[str] = None
    shared_experts_gate_pattern: Optional[str] = None
    expert_activation: Optional[str] = None

    @field_validator("preset_model")
    @classmethod
    def _preset(cls, v):
        if v is not None and v not in PRESET_MODELS:
            raise ValueError(f"unknown preset_model {v!r}; DeepSpeed's presets are {sorted(PRESET_MODELS)} (or "
                             "remove the key: the MoE blocks are detected from the model)")
        return v

    @field_validator("expert_tensor_parallel_size")
    @classmethod
    def _etp(cls, v):
        if v != 1:
            raise ValueError(f"expert_tensor_parallel_size={v} is not implemented yet: each expert is whole on one "
                             "rank; remove the key or set it to 1")
        return v

    @field_validator("load_balance_coeff")
    @classmethod
    def _lbc(cls, v):
        if v is not None:  # DeepSpeed 0.19.8 refuses it too (_raise_unsupported_load_balance_coeff)
            raise ValueError(f"load_balance_coeff={v} is not supported (DeepSpeed 0.19.8 rejects it as well): the "
                             "router auxiliary loss is the model's own (config.router_aux_loss_coef); remove the key")
        return v

    @field_validator("comm_backend")
    @classmethod
    def _deepep(cls, v):
        if v == "deepep":
            raise ValueError('comm_backend="deepep" needs DeepEP (CUDA); zerospeed exchanges tokens with the process '
                             'group\'s all-to-all: use "comm" or remove the key')
        return v

    @field_validator("route_norm", "num_expert_groups", "num_limited_groups", "expert_w1", "expert_w2", "expert_w3",
                     "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
                     "shared_experts_gate_pattern", "expert_activation")
    @classmethod
    def _model_own(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name}={v!r}: zerospeed's AutoEP keeps the model's own router and expert "
                             "layout (transformers' fused experts), so this override is not supported; remove the key")
        return v

    @field_validator("route_scale")
    @classmethod
    def _scale(cls, v):
        if v != 1.0:
            raise ValueError(f"route_scale={v}: zerospeed's AutoEP keeps the model's own routing (its scaling "
                             "factor); remove the key")
        return v

    @field_validator("score_func", "routed_scaling_factor")
    @classmethod
    def _auto(cls, v, info):
        if v != "auto":
            raise ValueError(f"{info.field_name}={v!r}: zerospeed's AutoEP keeps the model's own routing; remove "
                             "the key (or set it to \"auto\")")
        return v

    @property
    def size(self) -> int:
        """The expert-parallel size AutoEP asks for (1 when disabled)."""
        return self.autoep_size if self.enabled else 1

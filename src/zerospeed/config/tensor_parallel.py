"""``tensor_parallel``: AutoTP training (DeepSpeed 0.19.8's `TPTrainingConfig` keys and defaults).

``{"tensor_parallel": {"autotp_size": 2}}`` shards the model's linear layers over groups of 2 ranks
(`zerospeed.tensor_parallel`); ZeRO then runs over the remaining world / 2 data-parallel ranks, and the
batch triple counts those only (DeepSpeed's AutoTP counts every rank: see `tp_batch_problems`).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from ._base import ConfigModel

__all__ = ["TensorParallelConfig", "TPInnerConfig", "tp_batch_problems"]


class TPInnerConfig(ConfigModel):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): DeepSpeed's inference-side TP block."""

    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size for inference; training uses autotp_size."""
    tp_grain_size: int = Field(1, ge=1)
    """Granularity of uneven splits (DeepSpeed inference); only 1 is supported."""
    mpu: Any = None
    tp_group: Any = None


class TensorParallelConfig(ConfigModel):
    """``tensor_parallel``: tensor-parallel training of an unmodified model (AutoTP)."""

    autotp_size: int = Field(0, ge=0)
    """Ranks per tensor-parallel group (0 or 1: off). Must divide the world size."""
    tp_overlap_comm: bool = False
    """Overlap the tensor-parallel all-reduces with compute (DeepSpeed); accepted, the all-reduces run in order."""
    vocab_parallel_lm_head: Optional[bool] = None
    """Shard the lm_head over the vocabulary with a vocab-parallel cross-entropy; only false/null (replicated
    lm_head) is implemented."""
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    dtype: Optional[str] = None
    """Parameter dtype for tp_model_init (DeepSpeed's default fp16); the fp16/bf16 sections decide here."""
    tensor_parallel: TPInnerConfig = Field(default_factory=TPInnerConfig, alias="tp")
    injection_policy_tuple: Optional[Any] = None
    partition_config: Optional[dict[str, Any]] = None
    """{"use_default_specs": bool, "layer_specs": [{"patterns": [regex over parameter names], "partition_type":
    "row" | "column" | "skip", "shape": [blocks, -1]}]}: which linear layers are sharded and how (first match
    wins; with use_default_specs, the preset's rules follow)."""
    preset_model: Optional[str] = None
    """A built-in plan by model type: llama, mistral, qwen2, qwen3, gpt2 (default: from model.config.model_type)."""
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")

    @field_validator("vocab_parallel_lm_head")
    @classmethod
    def _vocab(cls, v):
        if v:
            raise ValueError("vocab_parallel_lm_head=true is not implemented yet: the lm_head and embeddings are "
                             "replicated on every tensor-parallel rank; remove the key")
        return v

    @field_validator("replace_with_kernel_inject", "keep_module_on_host")
    @classmethod
    def _inference_only(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name}=true is an inference option (zerospeed.init_inference); remove it "
                             "from a training config")
        return v

    @property
    def size(self) -> int:
        """The tensor-parallel size (1 when off)."""
        return max(1, self.autotp_size)


def tp_batch_problems(raw: tuple, world: int, tp: int) -> list[str]:
    """Batch-triple problems under tensor parallelism. raw: (train_batch_size, micro, accumulation) as given
    (None if absent). zerospeed counts data-parallel ranks (world / tp) as Megatron and FSDP do; DeepSpeed's
    AutoTP counts every rank, so a given train_batch_size means tp times fewer accumulation steps there. To
    rule out a silent change of meaning, train_batch_size under tp > 1 is accepted only with both other
    values and equal to micro x accumulation x (world / tp)."""
    tb, mb, ga = raw
    dp = world // tp
    if tb is None or tp <= 1:
        return []
    if mb is not None and ga is not None:
        if tb == mb * ga * dp:
            return []
        if tb == mb * ga * world:
            return [f"train_batch_size={tb} counts all {world} ranks (DeepSpeed's AutoTP convention: micro {mb} x "
                    f"accumulation {ga} x world {world}); zerospeed counts the {dp} data-parallel ranks only (the "
                    f"{tp} ranks of a tensor-parallel group see the same samples): set train_batch_size={mb * ga * dp}"]
        return []  # resolve_batch reports the mismatch with the data-parallel numbers
    return [f"train_batch_size={tb} with tensor_parallel.autotp_size={tp}: DeepSpeed's AutoTP divides it by all "
            f"{world} ranks, zerospeed by the {dp} data-parallel ranks, so the derived "
            f"{'gradient_accumulation_steps' if mb is not None else 'micro-batch size'} would differ by {tp}x. "
            "Give train_micro_batch_size_per_gpu and gradient_accumulation_steps (train_batch_size is then "
            f"their product x {dp}), or all three"]

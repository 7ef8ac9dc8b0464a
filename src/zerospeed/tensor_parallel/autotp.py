"""AutoTP: shard an unmodified model's linear layers over the tensor-parallel group by a `TPPlan`.

Each `nn.Linear` / HF `Conv1D` whose weight name a rule matches is replaced, in place and under the
same name, by a `ColumnParallelLinear` or `RowParallelLinear` holding this rank's shard; everything else
(embeddings, norms, lm_head) stays whole on every rank (replicated). Attention modules whose head counts
are stored as attributes get their local counts (`TPPlan.attention_fixups`); HF Llama-family attention
reshapes with -1 heads and needs none. Sizes that do not split into whole heads are refused before any
layer is touched.
"""
from __future__ import annotations

from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear, SharedInput, tensor_parallel_layers
from .plan import TPPlan

__all__ = ["apply_tensor_parallel", "check_divisible"]


def check_divisible(model: nn.Module, tp: int) -> None:
    """Raise ValueError if the model's HF config has attention heads, key/value heads or an MLP width that
    `tp` does not divide (a head is never split across ranks), naming the field and the numbers."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    checks = [("num_attention_heads", heads, "the query heads (q_proj / c_attn)"),
              ("num_key_value_heads", getattr(cfg, "num_key_value_heads", None), "the key/value heads (k_proj, v_proj)"),
              ("intermediate_size", getattr(cfg, "intermediate_size", None), "the MLP width (gate/up/down_proj)"),
              ("n_inner", getattr(cfg, "n_inner", None), "the MLP width (c_fc, c_proj)")]
    for field, value, what in checks:
        if value is not None and int(value) % tp:
            raise ValueError(f"model.config.{field}={value} is not divisible by the tensor-parallel size {tp}: "
                             f"{what} are split whole over the ranks; choose a tp size that divides {value}")


def apply_tensor_parallel(model: nn.Module, plan: TPPlan, *, group, tp: int, rank: int) -> list[str]:
    """Replace the layers `plan` names with tensor-parallel ones holding shard `rank` of `tp` (collectives
    over `group`). Returns the replaced module names. The model must hold full (unsharded) weights, equal
    on every rank of `group`. Raises ValueError (sizes that do not divide, naming them; a plan that
    matches no layer, listing the model's linear layers) before changing anything; TypeError for a
    matched module that is not a linear layer."""
    if any(True for _ in tensor_parallel_layers(model)):
        raise ValueError("the model already has tensor-parallel layers (tp_model_init or AutoTP ran before); "
                         "apply tensor parallelism once")
    check_divisible(model, tp)
    todo = []
    linear = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            linear.append(name)
            rule = plan.rule_for(f"{name}.weight")
            if rule is not None and rule.partition_type != "skip":
                todo.append((name, module, rule))
    if not todo:
        shown = ", ".join(linear[:8]) + (" ..." if len(linear) > 8 else "")
        raise ValueError(f"the tensor-parallel plan ({plan.source}) matches none of the model's linear layers "
                         f"({shown or 'none found'}); write tensor_parallel.partition_config layer_specs whose "
                         "patterns match their weight names, e.g. '.*\\\\.q_proj\\\\.weight$'")
    for name, module, rule in todo:  # check every shard divides before replacing any
        cls = ColumnParallelLinear if rule.partition_type == "column" else RowParallelLinear
        from .layers import _full_module_parts
        w, _, transposed, *_ = _full_module_parts(module)
        dim = (1 if transposed else 0) if cls is ColumnParallelLinear else (0 if transposed else 1)
        if w.shape[dim] % (rule.blocks * tp):
            raise ValueError(f"{name}.weight {tuple(w.shape)}: dimension {dim} ({w.shape[dim]}) does not split into "
                             f"{rule.blocks} block(s) x tensor-parallel size {tp}; choose a tp size that divides it")
    for name, module, rule in todo:
        cls = ColumnParallelLinear if rule.partition_type == "column" else RowParallelLinear
        new = cls.from_module(module, group=group, tp=tp, rank=rank, blocks=rule.blocks, name=name)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for m in model.modules():
        if type(m).__name__ in plan.attention_fixups:
            _localize_heads(m, tp)
    _share_inputs(model, group)
    return [n for n, _, _ in todo]


def _share_inputs(model: nn.Module, group) -> None:
    """Give each module with two or more column-parallel children one `SharedInput` (Megatron's f once)."""
    for parent in model.modules():
        cols = [c for c in parent.children() if isinstance(c, ColumnParallelLinear)]
        if len(cols) >= 2:
            shared = SharedInput(group)
            shared.attach(parent)
            for c in cols:
                c.shared_input = shared


def _localize_heads(attn: nn.Module, tp: int) -> None:
    """GPT-2 attention: c_attn's output is split at `split_size` into q, k, v and viewed as heads: both
    become this rank's share."""
    for attr in ("split_size", "num_heads"):
        if hasattr(attn, attr):
            setattr(attn, attr, getattr(attn, attr) // tp)

"""int8 weight-only quantization for serving (`init_inference(model, dtype=torch.int8)`).

Every linear layer's weight (`nn.Linear`, HF `Conv1D`, the tensor-parallel shards), every embedding
table and the fused experts of transformers' MoE blocks (per expert, `Int8Experts`) become int8 with one symmetric scale per output channel (per row of an embedding, per vocabulary
entry of a tied lm_head): w ~= q * s, s = max|w_row| / 127, q = round(w / s) in [-127, 127] (LLM.int8()'s
vector-wise quantization without the outlier split: Dettmers et al. 2022, §3.2). A tied embedding and
lm_head share one int8 table. Norms, biases and position tables stay in the float dtype.

The matmul runs as torch's `_weight_int8pack_mm` (int8 weights x bf16 activations, dequantized inside the
kernel: on this CPU it reads the int8 weights at ~4x fewer bytes than fp32) where the device has it, else as
a float matmul of the dequantized weight. Activations are rounded to bf16 for that matmul only; the layer's
output is in its input's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Matmul", "Int8Linear", "Int8Embedding", "Int8Experts", "check_quantizable", "quantize_int8",
           "quantize_rows", "select_kernel", "weight_bytes"]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, cols], scale float32 [rows]) with weight ~= q * scale[:, None], symmetric per row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()  # a Conv1D's w is a view
    return q, scale


class Int8Matmul(nn.Module):
    """y = x @ W^T for an int8 weight W [out, in] with per-row scales: x [..., in] -> y [..., out] in x's
    dtype. Buffers: `qweight` int8 [out, in], `scale` float32 [out] (and its bf16 copy for the kernel)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, *, transposed: bool = False) -> "Int8Matmul":
        """From a float weight [out, in] (`transposed`: HF Conv1D's [in, out])."""
        return cls(*quantize_rows(weight.t() if transposed else weight))

    packed = True  # torch's int8 x bf16 kernel runs on this device (set by `select_kernel`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.packed:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, self.scale_bf16)
            return y.to(x.dtype).reshape(*shape[:-1], -1)
        y = F.linear(x2, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y.reshape(*shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"int8 weight {tuple(self.qweight.shape)}, per-row scale"


class Int8Linear(nn.Module):
    """An `nn.Linear` / `Conv1D` with an int8 weight: x [..., in] -> x W^T + b [..., out]."""

    def __init__(self, matmul: Int8Matmul, bias: torch.Tensor | None):
        super().__init__()
        self.matmul = matmul
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = matmul.qweight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Int8Embedding(nn.Module):
    """An `nn.Embedding` with an int8 table [num, dim] and a scale per row: ids [...] -> [..., dim] in `dtype`."""

    def __init__(self, matmul: Int8Matmul, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.table = matmul  # shared with a tied lm_head
        self.dtype, self.padding_idx = dtype, padding_idx
        self.num_embeddings, self.embedding_dim = matmul.qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.table.qweight).to(self.dtype)
        return rows * self.table.scale[ids].unsqueeze(-1).to(self.dtype)


class Int8Experts(nn.Module):
    """The fused experts of a MoE block (transformers' `gate_up_proj` [L, 2I, H] / `down_proj` [L, H, I] module, or
    AutoEP's `ExpertParallelExperts` holding L of E experts) with int8 weights: per expert an `Int8Matmul` for
    gate|up [2I, H] and one for down [H, I], each row with its own scale. `forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`: each expert runs once on exactly its tokens
    (`moe.dropless.dropless_experts`, over the source's expert group when it had one)."""

    def __init__(self, source: nn.Module):
        super().__init__()
        self.gate_up = nn.ModuleList(Int8Matmul.from_weight(w) for w in source.gate_up_proj.detach().unbind(0))
        self.down = nn.ModuleList(Int8Matmul.from_weight(w) for w in source.down_proj.detach().unbind(0))
        self.act_fn, self.num_experts = source.act_fn, source.num_experts
        self.num_local_experts = len(self.gate_up)
        self.ep_size, self.ep_rank = getattr(source, "ep_size", 1), getattr(source, "ep_rank", 0)
        self.ep_group, self.logger = getattr(source, "ep_group", None), getattr(source, "logger", None)

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[i](x).chunk(2, dim=-1)
        return self.down[i](self.act_fn(gate) * up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from functools import partial

        from ..moe.dropless import dropless_experts

        index = top_k_index.t()
        index = torch.where(index < self.num_experts, index, -1)  # transformers' "no expert" index E
        experts = [partial(self._expert, i) for i in range(self.num_local_experts)]
        return dropless_experts(hidden_states, index, top_k_weights.t(), experts, self.num_experts, self.ep_group,
                                self.ep_size, self.logger)

    def extra_repr(self) -> str:
        first = self.ep_rank * self.num_local_experts
        return f"int8 experts {first}..{first + self.num_local_experts - 1} of {self.num_experts}"


def _is_fused_experts(m: nn.Module) -> bool:
    from ..moe.autoep import ExpertParallelExperts, fused_experts_problem

    return isinstance(m, ExpertParallelExperts) or fused_experts_problem(m) is None


def check_quantizable(model: nn.Module) -> None:
    """Raise ValueError, before any change, when `model` has weights int8 would leave in float: a 3-D weight
    outside a supported fused-experts module (naming the module types and why they are not supported)."""
    from ..moe.autoep import fused_experts_problem

    bad = {}
    for name, module in model.named_modules():
        if any(p.dim() >= 3 for p in module.parameters(recurse=False)) and not _is_fused_experts(module):
            bad.setdefault(type(module).__name__, fused_experts_problem(module))
    if bad:
        shown = "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))
        raise ValueError(f"dtype=torch.int8 quantizes linear layers, embeddings and transformers' fused experts; the "
                         f"model has 3-D weights it would leave in float ({shown}). Serve it with dtype=torch.bfloat16 "
                         "or torch.float32")


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
                                         and m.weight.dim() == 2)


def quantize_int8(model: nn.Module, *, min_rows: int = 64) -> list[str]:
    """Quantize `model` in place: linear layers, tensor-parallel shards and embedding tables with at least
    `min_rows` rows (position tables below that stay float). Weights shared between an embedding and a
    linear layer (a tied lm_head) become one int8 table. Returns the names of the quantized modules."""
    from ..tensor_parallel.layers import _ParallelLinear
    from .vocab import _VocabParallel

    done: list[str] = []
    shared: dict[int, Int8Matmul] = {}  # id(float weight) -> its int8 table
    todo = [(n, m) for n, m in model.named_modules() if n]
    for name, module in todo:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if getattr(module, "gate_up_proj", None) is not None and _is_fused_experts(module):
            setattr(parent, child, Int8Experts(module))
            done.append(name)
            continue
        if isinstance(module, _ParallelLinear):
            if module.matmul_impl is None:
                module.matmul_impl = Int8Matmul.from_weight(module.weight, transposed=module.transposed)
                del module.weight
                done.append(name)
            continue
        if isinstance(module, _VocabParallel):  # a tied embedding / lm_head pair shares one int8 table
            module.int8 = shared.setdefault(id(module.weight), Int8Matmul.from_weight(module.weight))
            module.int8_dtype = module.weight.dtype
            del module.weight
            done.append(name)
            continue
        if isinstance(module, nn.Embedding) and module.num_embeddings >= min_rows:
            table = shared.setdefault(id(module.weight), Int8Matmul.from_weight(module.weight))
            setattr(parent, child, Int8Embedding(table, module.weight.dtype, module.padding_idx))
            done.append(name)
        elif _is_linear(module):
            transposed = not isinstance(module, nn.Linear)
            key = id(module.weight)
            table = shared.get(key) if not transposed else None
            if table is None:
                table = Int8Matmul.from_weight(module.weight, transposed=transposed)
                shared[key] = table
            setattr(parent, child, Int8Linear(table, module.bias))
            done.append(name)
    return done


def select_kernel(model: nn.Module) -> bool:
    """Probe once whether `torch._weight_int8pack_mm` runs on the device of `model`'s int8 weights and set
    every `Int8Matmul.packed` accordingly (no probing inside forward: a compiled step must not branch on
    exceptions). Returns the choice."""
    mats = [m for m in model.modules() if isinstance(m, Int8Matmul)]
    if not mats:
        return False
    device = mats[0].qweight.device
    try:
        torch._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16, device=device),
                                  torch.ones(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=torch.bfloat16, device=device))
        ok = True
    except (RuntimeError, NotImplementedError):
        ok = False
    for m in mats:
        m.packed = ok
    return ok


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model`, each storage counted once (tied tables once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total

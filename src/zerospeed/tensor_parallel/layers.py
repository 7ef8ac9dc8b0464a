"""Tensor-parallel linear layers over plain local shards (Megatron-LM, Shoeybi et al. 2019, §3).

A column-parallel layer holds a slice of the output features, a row-parallel one a slice of the input
features; an MLP or attention block is column -> (local nonlinearity / heads) -> row, with one all-reduce
in the forward (the row layer's output) and one in the backward (the column layer's input gradient):
Megatron's conjugate operators f (identity forward, all-reduce backward) and g (all-reduce forward,
identity backward), here `copy_to_tensor_parallel` and `reduce_from_tensor_parallel`.

The shards are ordinary `nn.Parameter`s of the local shape, under the original names (`weight`, `bias`)
and in the original orientation (`nn.Linear`: [out, in]; HF's GPT-2 `Conv1D`: [in, out]), so ZeRO,
optimizers and checkpoints see plain tensors. Where each one sits in the full tensor is a `ShardSpec`
kept by the layer (`layer.shard_specs`), never on the parameter. DTensor
(`torch.distributed.tensor.parallel`) is not used: ZeRO flattens parameters into buckets and
partitions, which DTensors do not support.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.ops import all_reduce

__all__ = ["ShardSpec", "ColumnParallelLinear", "RowParallelLinear", "copy_to_tensor_parallel",
           "reduce_from_tensor_parallel", "shard_tensor", "unshard_tensors", "tensor_parallel_layers"]


@dataclass(frozen=True)
class ShardSpec:
    """Where a local shard sits in its full tensor: dimension `dim` of the full tensor is viewed as
    [blocks, n] (a fused projection: GPT-2's qkv has blocks=3, a fused gate_up blocks=2), and rank r holds
    rows [r*n/tp, (r+1)*n/tp) of every block, concatenated in block order. `tp` ranks in all."""

    dim: int
    tp: int
    rank: int
    blocks: int = 1

    def check(self, full_shape, name: str = "tensor") -> None:
        """Raise ValueError unless dimension `dim` of `full_shape` splits into blocks x tp equal parts."""
        size = full_shape[self.dim]
        if size % (self.blocks * self.tp):
            what = f"{self.blocks} fused blocks x " if self.blocks > 1 else ""
            raise ValueError(f"{name}: dimension {self.dim} of shape {tuple(full_shape)} has {size} elements, not "
                             f"divisible by {what}tensor-parallel size {self.tp}; choose a tp size that divides it")


def shard_tensor(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of `full` (a new contiguous tensor). Raises ValueError if it does not divide."""
    spec.check(full.shape)
    parts = full.chunk(spec.blocks, dim=spec.dim)
    return torch.cat([p.chunk(spec.tp, dim=spec.dim)[spec.rank] for p in parts], dim=spec.dim).contiguous()


def unshard_tensors(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard (`shards[r]` from rank r), inverse of `shard_tensor`."""
    per_rank = [s.chunk(spec.blocks, dim=spec.dim) for s in shards]
    return torch.cat([torch.cat([per_rank[r][b] for r in range(len(shards))], dim=spec.dim)
                      for b in range(spec.blocks)], dim=spec.dim)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward; all-reduce (sum) of the input gradient over the group backward."""

    @staticmethod
    def forward(ctx, x, group, logger):
        ctx.group, ctx.logger = group, logger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), group=ctx.group, logger=ctx.logger), None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group, logger):
        return all_reduce(x.contiguous(), group=group, logger=logger)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group, logger=None) -> torch.Tensor:
    """Megatron's f on `x` [..., features]: the same tensor forward, its gradient summed over `group` backward."""
    return _CopyToTensorParallel.apply(x, group, logger)


def reduce_from_tensor_parallel(x: torch.Tensor, group, logger=None) -> torch.Tensor:
    """Megatron's g on partial sums `x` [..., features]: summed over `group` forward (one all-reduce of
    x.numel() elements, counted by `logger`), the gradient passed through backward. Inside `torch.compile`
    without autograd (a compiled decode step) it is `comm.traced.traced_all_reduce`, which the compiler
    traces into the graph (the eager one would split the graph at every layer; not counted by `logger`)."""
    if not torch.is_grad_enabled() and torch.compiler.is_compiling():
        from ..comm.traced import traced_all_reduce

        return traced_all_reduce(x, group)
    return _ReduceFromTensorParallel.apply(x, group, logger)


class _ParallelLinear(nn.Module):
    """Shared by the two layouts: a sharded `nn.Linear` ([out, in], y = x W^T + b) or GPT-2 `Conv1D`
    ([in, out], y = x W + b), built from the full module by `from_module`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool, group,
                 specs: dict[str, ShardSpec | None], in_features: int, out_features: int, name: str = "",
                 full_shapes: dict[str, tuple] | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bias.requires_grad)
        self.transposed, self.group, self.name = transposed, group, name
        self.logger = None  # the engine's CommsLogger, set by zerospeed.initialize
        self.in_features, self.out_features = in_features, out_features  # the full layer's
        self.shard_specs = {k: v for k, v in specs.items() if k != "bias" or bias is not None}
        # the full (unsharded) shape of each parameter: what checkpoints and save_16bit_model write
        self.full_shapes = dict(full_shapes or {})
        # a replacement for `x @ W^T` (inference's int8 weights: `weight` is then removed), or None
        self.matmul_impl: nn.Module | None = None

    sharded_input = False  # row-parallel: the weight is split by input features and the bias stays whole

    @classmethod
    def from_module(cls, module: nn.Module, *, group, tp: int, rank: int, blocks: int = 1, name: str = ""):
        """Shard a full `nn.Linear` / `Conv1D`: by output features for a column layer (the bias too; `blocks`
        fused projections, each split), by input features for a row layer (the bias stays whole, spec None).
        Raises ValueError if the dimension does not split, TypeError for another module type."""
        w, b, transposed, n_in, n_out = _full_module_parts(module)
        dim = (0 if transposed else 1) if cls.sharded_input else (1 if transposed else 0)
        spec = ShardSpec(dim=dim, tp=tp, rank=rank, blocks=blocks)
        spec.check(w.shape, f"{name or type(module).__name__}.weight")
        bspec = None if cls.sharded_input else ShardSpec(dim=0, tp=tp, rank=rank, blocks=blocks)
        with torch.no_grad():
            weight = shard_tensor(w.detach(), spec).requires_grad_(w.requires_grad)
            bias = None if b is None else (b.detach().clone() if bspec is None else shard_tensor(b.detach(), bspec))
            if bias is not None:
                bias.requires_grad_(b.requires_grad)
        return cls(weight, bias, transposed=transposed, group=group, specs={"weight": spec, "bias": bspec},
                   in_features=n_in, out_features=n_out, name=name, full_shapes=_shapes(w, b))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul_impl is not None:
            return self.matmul_impl(x)
        return x @ self.weight if self.transposed else x @ self.weight.t()

    def extra_repr(self) -> str:
        local = tuple(self.weight.shape) if "weight" in self._parameters else "replaced by matmul_impl"
        return (f"in_features={self.in_features}, out_features={self.out_features} (full), "
                f"local weight {local}, tp={next(iter(self.shard_specs.values())).tp}")


def _shapes(w: torch.Tensor, b: torch.Tensor | None) -> dict[str, tuple]:
    return {"weight": tuple(w.shape), **({} if b is None else {"bias": tuple(b.shape)})}


def _full_module_parts(module: nn.Module):
    """(weight, bias, transposed, in_features, out_features) of an nn.Linear or a HF Conv1D."""
    w = module.weight
    if isinstance(module, nn.Linear):
        return w, module.bias, False, w.shape[1], w.shape[0]
    if type(module).__name__ == "Conv1D" and w.dim() == 2:  # transformers.pytorch_utils.Conv1D: [in, out]
        return w, module.bias, True, w.shape[0], w.shape[1]
    raise TypeError(f"tensor parallelism shards nn.Linear and HF Conv1D layers, not {type(module).__name__}")


class SharedInput:
    """Megatron's f applied once for sibling column layers that read the same tensor (HF Llama's q/k/v_proj
    under self_attn, gate/up_proj under mlp): a forward pre-hook on their parent module (`attach`) applies
    f to the parent's input and remembers the result weakly; a column layer whose input *is* that tensor
    uses it as it is, so backward all-reduces the summed input gradient once per block (Megatron's 2
    backward all-reduces per transformer layer instead of 3 + 2). A layer fed anything else (a
    cross-attention's encoder states) applies its own f: never a missing reduction."""

    def __init__(self, group, logger=None):
        self.group, self.logger, self.ref = group, logger, None

    def attach(self, parent: nn.Module):
        return parent.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.ref = None
        if not torch.is_grad_enabled():
            return None
        if args and torch.is_tensor(args[0]):
            x = args[0]
            if not x.requires_grad:
                return None
            y = copy_to_tensor_parallel(x, self.group, self.logger)
            self.ref = weakref.ref(y)  # alive while the parent's forward holds it: no activation kept
            return (y, *args[1:]), kwargs
        key = "hidden_states" if torch.is_tensor(kwargs.get("hidden_states")) else None
        if key is None or not kwargs[key].requires_grad:
            return None
        y = copy_to_tensor_parallel(kwargs[key], self.group, self.logger)
        self.ref = weakref.ref(y)
        return args, {**kwargs, key: y}

    def holds(self, x: torch.Tensor) -> bool:
        """True if `x` is the tensor f was applied to in the current forward of the parent."""
        return self.ref is not None and self.ref() is x


class ColumnParallelLinear(_ParallelLinear):
    """Output features split over the tensor-parallel group: input [..., in] (full, replicated),
    output [..., out/tp] (this rank's features; for fused blocks, its part of each block). Backward
    all-reduces the input gradient over the group (Megatron's f), once per input tensor however many
    column layers read it."""

    shared_input: SharedInput | None = None  # set by apply_tensor_parallel for sibling column layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_input
        if shared is None or not shared.holds(x):
            x = copy_to_tensor_parallel(x, self.group, self.logger)
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias



class RowParallelLinear(_ParallelLinear):
    """Input features split over the tensor-parallel group: input [..., in/tp] (this rank's part, as a
    column-parallel layer produced it), output [..., out] (full, all-reduced: Megatron's g); the bias is
    replicated and added once, after the reduction."""

    sharded_input = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel(self._matmul(x), self.group, self.logger)
        return y if self.bias is None else y + self.bias



def tensor_parallel_layers(module: nn.Module):
    """Yield (qualified name, layer) for every tensor-parallel layer inside `module`."""
    for name, m in module.named_modules():
        if isinstance(m, _ParallelLinear):
            yield name, m


def shard_pieces(spec: ShardSpec, full_shape, start: int, end: int) -> list[tuple[int, int, int]]:
    """Where elements [start, end) of a flattened local shard lie in the flattened full tensor: a list of
    (local offset, full offset, length) runs, in local order, covering [start, end) exactly.

    The shard of `full_shape` (dimension `spec.dim` cut into blocks x tp parts, `shard_tensor`) is, per index
    of the dimensions before `dim` and per block, one contiguous run of (size / (blocks x tp)) x inner
    elements in both tensors: a dim-0 shard without fused blocks is a single run (Megatron's column-parallel
    [out, in] weight), a dim-1 shard one run per row (row-parallel). Pure."""
    full_shape = tuple(full_shape)
    spec.check(full_shape)
    inner = 1
    for s in full_shape[spec.dim + 1:]:
        inner *= s
    size = full_shape[spec.dim]
    per_block = size // spec.blocks
    m = per_block // spec.tp  # indices per rank per block
    run = m * inner  # elements of one run
    out = []
    if run == 0 or end <= start:
        return out
    for r in range(start // run, (end - 1) // run + 1):
        outer, block = divmod(r, spec.blocks)
        full_run = (outer * size + block * per_block + spec.rank * m) * inner
        lo, hi = max(start, r * run), min(end, (r + 1) * run)
        out.append((lo, full_run + lo - r * run, hi - lo))
    return out

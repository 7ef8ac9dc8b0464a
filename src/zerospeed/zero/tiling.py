"""Memory-centric tiling of very wide linear layers: DeepSpeed's `TiledLinear` and `TiledLinearReturnBias`.

ZeRO-Infinity (Rajbhandari et al. 2021, §5.1.3, "memory-centric tiling") splits one huge operator into
tiles that run one after another, so that under ZeRO-3 only one tile's parameters are gathered at a
time: the working memory of the layer becomes that of a tile, and a layer larger than a device's memory
still trains. `TiledLinear(in_features, out_features, in_splits=I, out_splits=O)` holds I x O
`linear_cls` tiles in `linears[out_id][in_id]`; tile (o, i) maps input columns `in_parts[i]:in_parts[i+1]`
to output rows `out_parts[o]:out_parts[o+1]` (`zerospeed.utils.partition.partition_uniform`, so the tile
shapes and parameter names are DeepSpeed 0.19.8's and checkpoints of either load in the other).

Under ZeRO-3 every tile is a gather unit of its own (`zero.stage3_units`), also inside a transformer block
that is itself a unit: the block's own parameters are gathered with the block, each tile at its own
forward (and again at its backward). With activation checkpointing of the block, its recomputation
gathers every tile of the block before the block's backward releases them one by one, so tiling then
bounds the forward's working memory, not the backward's (as in DeepSpeed).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..utils.partition import partition_uniform

__all__ = ["TiledLinear", "TiledLinearReturnBias", "TilingError", "split_tensor_along_last_dim"]


class TilingError(ValueError, RuntimeError):
    """Bad `TiledLinear` arguments or input. A ValueError (the caller's input) and a RuntimeError, the type
    DeepSpeed raises for the same cases, so either `except` catches it."""


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int],
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """`torch.split(tensor, partitions, dim=-1)`: chunks of sizes `partitions` (elements of the last
    dimension; they sum to `tensor.shape[-1]`), views unless `contiguous_split_chunks`."""
    chunks = torch.split(tensor, list(partitions), dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class TiledLinear(nn.Module):
    """A drop-in `nn.Linear(in_features, out_features, bias)` computed as in_splits x out_splits tiles.

    forward(input_): input_ `[..., in_features]` (or, with `input_is_already_split`, a sequence of
    `in_splits` tensors `[..., in_parts[i+1] - in_parts[i]]`) -> `[..., out_features]` (or, with
    `combine_out_splits=False`, the list of `out_splits` outputs `[..., out_parts[o+1] - out_parts[o]]`).
    Output o is the sum over i of tile (o, i)'s output; only the last input split's tile of each row
    has a bias, so the bias is added once. linear_cls(in, out, bias=..., **kwargs) builds a tile (any
    Linear-like class). init_linear: an `nn.Linear` whose weight `[out_features, in_features]` and
    bias are copied in (`copy_params_from`).

    Raises TilingError (a ValueError and RuntimeError) if in_splits is not in [1, in_features] or
    out_splits not in [1, out_features], or if a pre-split input has the wrong number of chunks.
    DeepSpeed's `deepspeed.zero.TiledLinear` (runtime/zero/tiling.py), same signature and semantics.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: nn.Module | None = None, **kwargs: Any):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise TilingError(f"TiledLinear: in_splits={in_splits} must be in [1, in_features={in_features}]: "
                              f"each input tile needs at least one input feature")
        if not 1 <= out_splits <= out_features:
            raise TilingError(f"TiledLinear: out_splits={out_splits} must be in [1, out_features={out_features}]: "
                              f"each output tile needs at least one output feature")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)
        self.linears = nn.ModuleList()
        for o in range(out_splits):
            row = nn.ModuleList()
            for i in range(in_splits):
                row.append(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                      bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def tiles(self) -> list[nn.Module]:
        """The tile modules, row by row (`linears[o][i]`, o outer)."""
        return [t for row in self.linears for t in row]

    def forward(self, input_):
        if self.in_splits > 1 and not self.input_is_already_split:
            sizes = [self.in_parts[i + 1] - self.in_parts[i] for i in range(self.in_splits)]
            if input_.shape[-1] != self.in_features:
                raise TilingError(f"TiledLinear: input's last dimension is {input_.shape[-1]}, expected "
                                  f"in_features={self.in_features}")
            inputs = self._split_global_input(input_, sizes)
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise TilingError(f"TiledLinear(input_is_already_split=True): got {len(inputs)} input chunks, "
                                  f"expected in_splits={self.in_splits}")
        else:
            inputs = [input_]
        outputs = [None] * self.out_splits
        for o in range(self.out_splits):
            for i in range(self.in_splits):
                outputs[o] = self._reduce_local_output(in_id=i, out_id=o, current_out=outputs[o],
                                                       new_out=self.linears[o][i](inputs[i]))
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        """The input chunks along the last dimension (override for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """Sum tile (out_id, in_id)'s output into its row's (the first one is cloned: an in-place add to a
        view would break autograd)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        """The rows' outputs joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy `other.weight` `[out_features, in_features]` (and `other.bias` `[out_features]`, which must
        exist exactly when this layer has a bias) into the tiles. Under ZeRO-3 a collective: every rank
        calls it and data-parallel rank 0's values are kept (`GatheredParameters(modifier_rank=0)`).
        Raises TilingError on a shape or bias mismatch."""
        from .stage3_context import GatheredParameters

        w = getattr(other, "weight", None)
        if w is None or tuple(w.shape) != (self.out_features, self.in_features):
            raise TilingError(f"TiledLinear.copy_params_from: need a weight of shape "
                              f"({self.out_features}, {self.in_features}), got "
                              f"{None if w is None else tuple(w.shape)}")
        b = getattr(other, "bias", None)
        if (b is not None) != self.use_bias or (b is not None and tuple(b.shape) != (self.out_features,)):
            raise TilingError(f"TiledLinear.copy_params_from: this layer has bias={self.use_bias} "
                              f"(shape ({self.out_features},)); the source's bias is "
                              f"{None if b is None else tuple(b.shape)}")
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                local = self.linears[o][i]
                with GatheredParameters(local.weight, modifier_rank=0):
                    local.weight.copy_(w[r0:r1, self.in_parts[i]:self.in_parts[i + 1]])
                if local.bias is not None:
                    with GatheredParameters(local.bias, modifier_rank=0):
                        local.bias.copy_(b[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """`TiledLinear` over tiles that return `(output, bias)` (Megatron-LM's `ColumnParallelLinear(...,
    skip_bias_add=True)` style): forward returns `(output [..., out_features], bias [out_features] or
    None)`, the outputs summed and joined as in `TiledLinear`, the biases joined (not added)."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TilingError(f"TiledLinearReturnBias: tile ({out_id}, {in_id}) returned {type(new_out).__name__}, "
                              f"expected (output, bias)")
        old, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        return super()._reduce_local_output(in_id, out_id, old, tensor), (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)

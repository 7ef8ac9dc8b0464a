"""Dropless expert computation for `drop_tokens=False` (beyond DeepSpeed): the experts run on exactly the
tokens routed to them.

DeepSpeed keeps the capacity layout for `drop_tokens=False`: every expert's buffer is padded to the largest
load over the expert-parallel group (C = max load), so E x C rows are exchanged and computed however uneven
the routing. Here the kept routes are packed expert by expert (R = k x S rows at most, no padding), the
per-expert counts are exchanged first (an all-to-all of E integers), and the rows move with a variable-size
all-to-all (`all_to_all_single` with split sizes, as MegaBlocks, Gale et al. 2023 §3, computes dropless
MoE); each local expert runs once on the rows all source ranks sent it, and the outputs go back the same
way. Outputs equal the padded layout's up to the order of summing a token's k > 2 routes.

On the host in bf16/fp16, each expert's rows are padded with zero rows to a multiple of 32 (`ROW_MULTIPLE`)
before it runs, and its output cut back: oneDNN, which runs those GEMMs on CPUs, builds and caches a kernel per
shape (its primitive cache, ideep's computation cache, 1024 entries each), so a row count that changes every
step costs a kernel build per expert and pass and a cache entry that stays. Measured (GPT small with 3 MoE
layers of 8 experts, top-2, cf 1.25, ep 2, bf16, 1 thread per rank): the resident set grew by ~30 MiB a step
without end (943 -> 2142 MiB over 40 steps; DeepSpeed, whose padded capacity layout has one shape, stayed at 1.1
GiB), and with the padding stopped at 1.29 GiB by step 10, the step 0.93-0.98x the time. The real rows meet the
same products (bit-identical in the unit test; a GEMM of another row count may sum them in another order) and
the zero rows add no gradient (their output's gradient is zero). fp32 (MKL's GEMM, no per-shape cache) and accelerators are not padded.

Shapes: S tokens, M model size, E experts, L = E / ep_size local experts, k routes per token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.ops import all_to_all_single

__all__ = ["AllToAll", "dropless_experts", "ROW_MULTIPLE"]

#: an expert's rows are padded to a multiple of this on the host in 2-byte floats (see the module docstring)
ROW_MULTIPLE = 32


def _row_multiple(x: Tensor) -> int:
    """`ROW_MULTIPLE` for a bf16/fp16 tensor on the host (oneDNN's per-shape kernels), else 1."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return 1  # (profiling.peak.is_accelerator says the same; moe may not import profiling)
    on_accelerator = torch.accelerator.is_available() and x.device.type == torch.accelerator.current_accelerator().type
    return 1 if on_accelerator else ROW_MULTIPLE


def _run_expert(expert: nn.Module, inp: Tensor, multiple: int, check, what: str) -> Tensor:
    """expert(inp) [n, M] -> its output [n, M'], inp padded with zero rows to a multiple of `multiple` first and the
    output cut back to n rows."""
    n = inp.shape[0]
    extra = -n % multiple
    x = torch.nn.functional.pad(inp, (0, 0, 0, extra)) if extra else inp
    out = expert(x)
    out = out[0] if isinstance(out, tuple) else out
    if check is not None:
        check(out, x, what)
    return out[:n] if extra else out


class AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 over `group`: rows `send[j]` to rank j and `recv[i]` from rank i, or equal chunks
    when both are None; its gradient is the all-to-all with the two split lists swapped (equal chunks: the same
    exchange, a permutation of chunks that is its own inverse)."""

    @staticmethod
    def forward(ctx, group, logger, send: list[int] | None, recv: list[int] | None, x: Tensor) -> Tensor:
        ctx.group, ctx.logger, ctx.send, ctx.recv = group, logger, send, recv
        out = torch.empty_like(x) if recv is None else x.new_empty((sum(recv), *x.shape[1:]))
        return all_to_all_single(out, x.contiguous(), group=group, logger=logger, output_split_sizes=recv,
                                 input_split_sizes=send)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = torch.empty_like(grad) if ctx.send is None else grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        all_to_all_single(out, grad.contiguous(), group=ctx.group, logger=ctx.logger, output_split_sizes=ctx.send,
                          input_split_sizes=ctx.recv)
        return None, None, None, None, out


def _rows_by_local_expert(per_source: Tensor) -> list[Tensor]:
    """per_source [ep, L] rows each source rank sent for each local expert, laid out source-major then
    expert -> for each local expert the indices of its rows in that layout."""
    ep, num_local = per_source.shape
    flat = per_source.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, num_local).tolist()
    counts = per_source.tolist()
    return [torch.cat([torch.arange(starts[i][e], starts[i][e] + counts[i][e]) for i in range(ep)])
            for e in range(num_local)]


@torch.compiler.disable  # data-dependent by nature (the counts leave the device): a compiled caller runs it eagerly
def dropless_experts(tokens: Tensor, experts_idx: Tensor, weights: Tensor, experts: nn.ModuleList, num_experts: int,
                     ep_group: dist.ProcessGroup | None, ep_size: int, logger=None, check=None) -> Tensor:
    """tokens [S, M], experts_idx [k, S] (the expert of each route, -1 where not kept), weights [k, S] fp32 ->
    [S, M] (tokens.dtype): sum over a token's kept routes of weight x its expert's output. experts: this
    rank's L = E / ep_size experts (global ids ep_rank x L + i). Collective over `ep_group` when ep_size > 1
    (two all-to-alls forward, two backward, plus one of the E counts). check(out, inp, what): validates an
    expert's output shape (raises ValueError)."""
    num_tokens, model_dim = tokens.shape
    flat = experts_idx.reshape(-1).long()
    routes = (flat >= 0).nonzero().squeeze(1)
    order = routes[torch.argsort(flat[routes], stable=True)]  # kept routes, expert by expert
    token_of = order % num_tokens
    packed = tokens.index_select(0, token_of)  # [R, M]
    counts = torch.bincount(flat[order], minlength=num_experts)  # [E] rows per expert, this rank's tokens
    num_local = num_experts // ep_size
    if ep_size > 1:
        received_counts = torch.empty_like(counts)
        all_to_all_single(received_counts, counts, group=ep_group)  # from source i: its rows per local expert
        send = counts.view(ep_size, num_local).sum(1).tolist()
        recv = received_counts.view(ep_size, num_local).sum(1).tolist()
        packed = AllToAll.apply(ep_group, logger, send, recv, packed)
        per_source = received_counts.view(ep_size, num_local)
    else:
        per_source = counts.view(1, num_experts)
    rows = _rows_by_local_expert(per_source)
    # one gather into expert-major order, each expert a contiguous slice of it (a gather per expert would cost a
    # zero-filled [R, M] gradient per expert in backward; the split's backward is one concatenation)
    perm = torch.cat(rows)
    grouped = packed.index_select(0, perm).split([len(r) for r in rows])
    multiple = _row_multiple(packed)
    outputs = [_run_expert(expert, inp, multiple, check, f"expert {i} ({type(expert).__name__})")
               for i, (inp, expert) in enumerate(zip(grouped, experts))]
    back = torch.cat(outputs).index_select(0, torch.argsort(perm))  # the received layout again
    if ep_size > 1:
        back = AllToAll.apply(ep_group, logger, recv, send, back)
    weighted = back.float() * weights.reshape(-1)[order].unsqueeze(1)
    return weighted.new_zeros(num_tokens, model_dim).index_add(0, token_of, weighted).to(tokens.dtype)

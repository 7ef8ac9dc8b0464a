"""moe.dropless: in bf16/fp16 on the host each expert's rows are padded to a multiple of ROW_MULTIPLE (oneDNN builds
and caches a GEMM kernel per row count), with the outputs and every gradient those of the unpadded computation;
fp32 is left alone. One process, no expert-parallel group."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.moe import dropless
from zerospeed.moe.dropless import ROW_MULTIPLE, dropless_experts

S, M, E, K = 200, 16, 4, 2


class _Recording(nn.Module):
    """A two-layer expert that records the row count of every input it sees."""

    def __init__(self, dtype):
        super().__init__()
        self.up, self.down = nn.Linear(M, 2 * M).to(dtype), nn.Linear(2 * M, M).to(dtype)
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _run(dtype, seed, experts):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(S, M, generator=g).to(dtype).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).t().contiguous()  # [K, S] distinct
    idx[0, :7] = -1  # a few dropped routes
    weights = torch.rand(K, S, generator=g)
    out = dropless_experts(tokens, idx, weights, experts, E, None, 1)
    out.float().pow(2).sum().backward()
    return out, tokens.grad


def _experts(dtype):
    torch.manual_seed(0)
    return nn.ModuleList([_Recording(dtype) for _ in range(E)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_byte_experts_see_padded_row_counts_and_give_the_unpadded_values(dtype, monkeypatch):
    padded = _experts(dtype)
    out, dx = _run(dtype, 1, padded)
    seen = [r for e in padded for r in e.rows]
    assert seen and all(r % ROW_MULTIPLE == 0 for r in seen), seen
    monkeypatch.setattr(dropless, "ROW_MULTIPLE", 1)
    plain = _experts(dtype)
    ref_out, ref_dx = _run(dtype, 1, plain)
    assert any(r % ROW_MULTIPLE for e in plain for r in e.rows)  # the routing does give ragged counts
    # the same products per real row; a GEMM of another row count may sum in another order: bf16/fp16 rounding
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    for a, b in zip(padded.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=5e-2, rtol=2e-2)


def test_padding_bounds_the_distinct_row_counts():
    """50 routings: every count the experts see is one of ceil(max / ROW_MULTIPLE) values."""
    experts = _experts(torch.bfloat16)
    for seed in range(50):
        _run(torch.bfloat16, seed, experts)
    seen = {r for e in experts for r in e.rows}
    assert len(seen) <= -(-S * K // ROW_MULTIPLE) and all(r % ROW_MULTIPLE == 0 for r in seen), sorted(seen)


def test_fp32_experts_are_not_padded():
    experts = _experts(torch.float32)
    _run(torch.float32, 1, experts)
    assert any(r % ROW_MULTIPLE for e in experts for r in e.rows)

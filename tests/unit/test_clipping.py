"""`zero.clipping`: `sum_of_squares` (the global gradient norm's building block) and `clip_and_norm` (every stage's norm and clipping)."""
import math

import torch

import pytest

from zerospeed.zero.clipping import clip_and_norm, sum_of_squares


def test_sum_of_squares_of_a_strided_partition_matches_fp64_to_1e6():
    torch.manual_seed(0)
    flat = torch.randn(2 * 1_500_000)
    part = flat.view(2, 1_500_000)[:, :750_000]  # a ZeRO 1-2 partition: a strided [K, S] view
    other = torch.randn(333, 7)
    exact = float((part.double() ** 2).sum() + (other.double() ** 2).sum())
    got = sum_of_squares([part, other])
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert abs(float(got) / exact - 1) < 1e-6
    # one fp32 norm over the same 1.5M elements is 20x+ further off: the reason for the blocks
    single = float(torch.linalg.vector_norm(part).double() ** 2 + torch.linalg.vector_norm(other).double() ** 2)
    assert abs(single / exact - 1) > 20 * abs(float(got) / exact - 1)


def test_sum_of_squares_propagates_inf_and_nan_and_is_zero_for_nothing():
    g = torch.ones(200_000)
    g[123_456] = float("inf")
    assert math.isinf(float(sum_of_squares([g])))
    g[5] = float("nan")
    assert math.isnan(float(sum_of_squares([g])))
    assert float(sum_of_squares([])) == 0.0 and float(sum_of_squares([torch.zeros(0)])) == 0.0


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e3])
def test_clip_and_norm_without_a_group_matches_torch_clip_grad_norm(max_norm):
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(40, 30), (30,), (7, 3, 5)]]
    for p in params:
        p.grad = torch.randn_like(p) * 0.3
    ref = [p.grad.clone() for p in params]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(ref_params, ref):
        p.grad = g
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_params, max_norm if max_norm > 0 else float("inf")))
    norm = clip_and_norm([p.grad for p in params], max_norm)
    assert abs(norm / ref_norm - 1) < 1e-6
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    if max_norm == 0.5:  # clipping was active: the clipped gradient has norm max_norm
        assert abs(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))) - 0.5) < 1e-5


def test_clip_and_norm_returns_a_nonfinite_norm_and_leaves_the_gradients():
    g = [torch.ones(10), torch.full((4,), 2.0)]
    g[1][2] = float("nan")
    before = [t.clone() for t in g]
    assert math.isnan(clip_and_norm(g, 1.0))
    for t, b in zip(g, before):
        torch.testing.assert_close(t, b, equal_nan=True)
    assert clip_and_norm([], 1.0) == 0.0

"""`optim.clipping.sum_of_squares`: the global gradient norm's building block at ZeRO stages 1-3."""
import math

import torch

from zerospeed.optim.clipping import sum_of_squares


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

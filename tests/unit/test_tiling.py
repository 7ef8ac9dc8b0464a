"""TiledLinear without processes: the same function as nn.Linear (values and gradients), DeepSpeed 0.19.8's
tile shapes and parameter names, errors, and its tiles as (nested) ZeRO-3 gather units."""
import pytest
import torch
from torch import nn

from zerospeed.zero import TiledLinear, TiledLinearReturnBias
from zerospeed.zero.stage3_units import ROOT, plan_units
from zerospeed.zero.tiling import TilingError

SPLITS = [(1, 1), (3, 1), (1, 4), (3, 2), (7, 5)]


@pytest.mark.parametrize("in_splits,out_splits", SPLITS)
@pytest.mark.parametrize("bias", [True, False])
def test_equals_linear_in_values_and_gradients(in_splits, out_splits, bias):
    torch.manual_seed(0)
    ref = nn.Linear(19, 13, bias=bias, dtype=torch.float64)
    tiled = TiledLinear(19, 13, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=ref,
                        dtype=torch.float64)
    assert len(tiled.tiles()) == in_splits * out_splits
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randn(2, 5, 19, dtype=torch.float64, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y, yt = ref(x), tiled(xt)
    assert yt.shape == (2, 5, 13)
    torch.testing.assert_close(yt, y, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    yt.backward(g)
    torch.testing.assert_close(xt.grad, x.grad, rtol=1e-12, atol=1e-12)
    for o in range(out_splits):  # each tile's gradient is its block of the full weight's gradient
        r = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(in_splits):
            c = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            t = tiled.linears[o][i]
            torch.testing.assert_close(t.weight.grad, ref.weight.grad[r, c], rtol=1e-12, atol=1e-12)
            assert (t.bias is not None) == (bias and i == in_splits - 1)  # the bias is added once per row
            if t.bias is not None:
                torch.testing.assert_close(t.bias.grad, ref.bias.grad[r], rtol=1e-12, atol=1e-12)


def test_split_input_and_split_output():
    torch.manual_seed(0)
    ref = nn.Linear(10, 6)
    tiled = TiledLinear(10, 6, in_splits=3, out_splits=2, init_linear=ref, input_is_already_split=True,
                        combine_out_splits=False)
    x = torch.randn(4, 10)
    parts = torch.split(x, [4, 3, 3], dim=-1)  # partition_uniform(10, 3) = [0, 4, 7, 10]
    out = tiled(parts)
    assert [o.shape[-1] for o in out] == [3, 3]
    torch.testing.assert_close(torch.cat(out, -1), ref(x))
    with pytest.raises(TilingError, match="got 2 input chunks, expected in_splits=3"):
        tiled(parts[:2])


def test_return_bias_variant_joins_biases():
    class LinearReturnBias(nn.Linear):  # Megatron's skip_bias_add: (x W^T, b)
        def forward(self, x):
            return nn.functional.linear(x, self.weight), self.bias

    torch.manual_seed(0)
    ref = nn.Linear(8, 6)
    tiled = TiledLinearReturnBias(8, 6, in_splits=2, out_splits=3, linear_cls=LinearReturnBias, init_linear=ref)
    x = torch.randn(3, 8)
    y, b = tiled(x)
    torch.testing.assert_close(y + b, ref(x))
    torch.testing.assert_close(b, ref.bias)


def test_errors_name_the_bad_numbers():
    with pytest.raises(TilingError, match=r"in_splits=0 must be in \[1, in_features=4\]"):
        TiledLinear(4, 4, in_splits=0)
    with pytest.raises(RuntimeError, match=r"out_splits=5 must be in \[1, out_features=4\]"):  # DeepSpeed's type
        TiledLinear(4, 4, out_splits=5)
    with pytest.raises(TilingError, match=r"need a weight of shape \(4, 3\), got \(3, 4\)"):
        TiledLinear(3, 4, init_linear=nn.Linear(4, 3))
    with pytest.raises(TilingError, match="this layer has bias=False"):
        TiledLinear(3, 4, bias=False, init_linear=nn.Linear(3, 4))
    with pytest.raises(TilingError, match="last dimension is 5, expected in_features=4"):
        TiledLinear(4, 4, in_splits=2)(torch.randn(2, 5))


def test_same_tiles_and_names_as_deepspeed():
    tiling = pytest.importorskip("deepspeed.runtime.zero.tiling")  # comparison only: not a dependency
    for in_f, out_f, i, o, bias in [(19, 13, 3, 2, True), (10, 7, 4, 7, False), (5, 9, 5, 1, True)]:
        ours = TiledLinear(in_f, out_f, bias=bias, in_splits=i, out_splits=o)
        theirs = tiling.TiledLinear(in_f, out_f, bias=bias, in_splits=i, out_splits=o)
        assert ours.in_parts == theirs.in_parts and ours.out_parts == theirs.out_parts
        mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert mine == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
        ours.load_state_dict(theirs.state_dict())  # a DeepSpeed TiledLinear checkpoint loads as is
        x = torch.randn(3, in_f)
        torch.testing.assert_close(ours(x), theirs(x))


class TiledBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = TiledLinear(d, 4 * d, in_splits=2, out_splits=2)
        self.out = nn.Linear(4 * d, d)


class TiledNet(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(16, d)
        self.blocks = nn.ModuleList([TiledBlock(d) for _ in range(2)])
        self.head = TiledLinear(d, 16, in_splits=2, bias=False)  # one row of 2 tiles, at the root


def test_tiles_are_gather_units_nested_in_their_block():
    model = TiledNet()
    plans = {p.name: p for p in plan_units(model)}
    tiles = [f"blocks.{b}.fc.linears.{o}.{i}" for b in range(2) for o in range(2) for i in range(2)]
    assert set(plans) == {ROOT, "blocks.0", "blocks.1", *tiles, "head.linears.0.0", "head.linears.0.1"}
    assert plans[ROOT].params == ("emb.weight",)
    assert plans["blocks.0"].params == ("blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.out.weight",
                                        "blocks.0.out.bias")  # the block keeps all but its tiles
    assert plans["blocks.1.fc.linears.1.1"].params == ("blocks.1.fc.linears.1.1.weight", "blocks.1.fc.linears.1.1.bias")
    assert plans["blocks.1.fc.linears.1.0"].params == ("blocks.1.fc.linears.1.0.weight",)  # bias: last column only
    assert sum(p.numel for p in plans.values()) == sum(p.numel() for p in model.parameters())
